package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/internal/testenv"
)

func scheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	return s, outboxv1alpha1.AddToScheme(s)
}

// runManagerChild is the operator's manager (what cmd/manager runs), in its
// own process so its RSS is the manager's alone.
func runManagerChild(ctx context.Context, kubeconfig string) error {
	ctrl.SetLogger(logr.Discard())
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	// As ctrl.GetConfig, which cmd/manager uses: no client-side rate limit
	// (the API server's priority and fairness applies), not client-go's 5 QPS.
	if cfg.QPS == 0 {
		cfg.QPS = -1
	}
	s, err := scheme()
	if err != nil {
		return err
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: s, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0"})
	if err != nil {
		return err
	}
	r := &controllers.OutboxRelayReconciler{Client: mgr.GetClient(), Recorder: mgr.GetEventRecorder("outbox-operator"), RelayImage: "example.test/outbox-relay:bench"}
	if err := r.SetupWithManager(ctx, mgr); err != nil {
		return err
	}
	return mgr.Start(ctx)
}

// runFootprint measures scenario 6's operator part: the manager reconciling
// o.relays OutboxRelays (each with its Secret) in envtest while this process
// plays the kubelets (every Deployment's status set to all replicas ready),
// until every OutboxRelay is Ready; and the manager process's RSS then. The
// relay's RSS is measured in the latency scenario.
func runFootprint(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	reps, err := repeat(&options{reps: min(o.reps, 1)}, func(int) (map[string]float64, error) { return operatorRun(ctx, o, e) })
	if err != nil {
		return err
	}
	rep.add("footprint", fmt.Sprintf("relays=%d", o.relays), map[string]any{"relays": o.relays}, reps)
	return nil
}

func operatorRun(ctx context.Context, o *options, e *benchEnv) (map[string]float64, error) {
	logf("starting kube-apiserver and etcd (envtest)")
	kube, err := testenv.StartKube(filepath.Join(e.work, "kube"))
	if err != nil {
		return nil, err
	}
	defer kube.Close() //nolint:errcheck // best effort at the end
	kubeconfig := filepath.Join(e.work, "kubeconfig")
	if err := kube.WriteKubeconfig(kubeconfig); err != nil {
		return nil, err
	}
	s, err := scheme()
	if err != nil {
		return nil, err
	}
	c, err := client.New(kube.Config, client.Options{Scheme: s})
	if err != nil {
		return nil, err
	}
	const ns = "bench"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	out := &syncBuffer{}
	mgr := exec.Command(self, "-manager-child", kubeconfig)
	mgr.Stdout, mgr.Stderr = out, out
	mgr.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := mgr.Start(); err != nil {
		return nil, err
	}
	exited := make(chan struct{})
	go func() { _ = mgr.Wait(); close(exited) }()
	defer func() {
		_ = mgr.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = mgr.Process.Kill()
			<-exited
		}
	}()

	start := time.Now()
	// Create the Secrets and OutboxRelays from 8 clients, as an apply of many files would.
	var wg sync.WaitGroup
	errs := make(chan error, o.relays)
	work := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				name := fmt.Sprintf("relay-%03d", i)
				sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-dsn"},
					StringData: map[string]string{"dsn": "postgres://relay@db/" + name}}
				r := &outboxv1alpha1.OutboxRelay{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
					Spec: outboxv1alpha1.OutboxRelaySpec{
						DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: sec.Name},
						Topics:       map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders.confirmed"},
						Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"kafka.example:9092"}},
					}}
				if err := c.Create(ctx, sec); err != nil {
					errs <- err
					continue
				}
				if err := c.Create(ctx, r); err != nil {
					errs <- err
				}
			}
		}()
	}
	for i := range o.relays {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		return nil, fmt.Errorf("create OutboxRelays: %w", err)
	}
	created := time.Since(start)
	logf("created %d OutboxRelays and Secrets in %s", o.relays, created.Round(time.Millisecond))

	// Play the kubelets until every OutboxRelay is Ready.
	deadline := time.Now().Add(5 * time.Minute)
	var ready int
	for {
		select {
		case <-exited:
			return nil, fmt.Errorf("manager exited: %s", lastLines(out.String(), 10))
		default:
		}
		if err := markDeploymentsReady(ctx, c, ns); err != nil {
			return nil, err
		}
		var list outboxv1alpha1.OutboxRelayList
		if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return nil, err
		}
		ready = 0
		for _, r := range list.Items {
			cond := meta.FindStatusCondition(r.Status.Conditions, outboxv1alpha1.ConditionReady)
			if cond != nil && cond.Status == metav1.ConditionTrue && cond.ObservedGeneration == r.Generation {
				ready++
			}
		}
		if ready == o.relays {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("only %d of %d OutboxRelays Ready after 5 minutes", ready, o.relays)
		}
		time.Sleep(250 * time.Millisecond)
	}
	readyAfter := time.Since(start)
	time.Sleep(2 * time.Second) // let the post-Ready reconciles settle before reading memory
	rss, hwm, err := memKiB(mgr.Process.Pid)
	if err != nil {
		return nil, err
	}
	cpu, _ := cpuSeconds(mgr.Process.Pid)
	logf("operator: %d OutboxRelays Ready in %s; manager RSS %.1f MiB (peak %.1f)", o.relays, readyAfter.Round(time.Millisecond), rss/1024, hwm/1024)
	return map[string]float64{
		"created_s":            created.Seconds(),
		"ready_s":              readyAfter.Seconds(),
		"manager_rss_mib":      rss / 1024,
		"manager_peak_rss_mib": hwm / 1024,
		"manager_cpu_s":        cpu,
	}, nil
}

// markDeploymentsReady does what the Deployment controller and kubelets
// would: report every replica of each Deployment's current template ready.
func markDeploymentsReady(ctx context.Context, c client.Client, ns string) error {
	var list appsv1.DeploymentList
	if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return err
	}
	for i := range list.Items {
		d := &list.Items[i]
		want := int32(1)
		if d.Spec.Replicas != nil {
			want = *d.Spec.Replicas
		}
		if d.Status.ObservedGeneration == d.Generation && d.Status.ReadyReplicas == want && d.Status.UpdatedReplicas == want {
			continue
		}
		d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: want, UpdatedReplicas: want,
			ReadyReplicas: want, AvailableReplicas: want}
		if err := c.Status().Update(ctx, d); err != nil && !isConflict(err) {
			return fmt.Errorf("set status of Deployment %s: %w", d.Name, err)
		}
	}
	return nil
}

func isConflict(err error) bool {
	type statusErr interface{ Status() metav1.Status }
	if se, ok := err.(statusErr); ok {
		return se.Status().Code == 409
	}
	return false
}
