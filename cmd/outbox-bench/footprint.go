package main

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/internal/devproc"
	"github.com/outbox-relay/outbox-operator/internal/localcluster"
	"github.com/outbox-relay/outbox-operator/internal/testenv"
)

// runFootprint measures the operator's footprint: the manager binary
// reconciling o.relays OutboxRelays (each with its Secret) in envtest while
// this process plays the kubelets (every Deployment's status set to all
// replicas ready), until every OutboxRelay is Ready; and the manager
// process's RSS then. The relay's RSS is measured in the latency scenario.
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
	c, err := client.New(kube.Config, client.Options{Scheme: localcluster.Scheme()})
	if err != nil {
		return nil, err
	}
	const ns = "bench"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		return nil, err
	}
	// The manager binary as users run it, in its own process so its RSS is
	// the manager's alone; error-level logs only, so logging does not weigh
	// on the measurement.
	logPath := filepath.Join(e.work, "manager.log")
	mgr, err := devproc.StartManager(e.managerBin, kubeconfig, logPath, "--zap-log-level=error")
	if err != nil {
		return nil, err
	}
	defer mgr.Stop(30 * time.Second)
	if err := mgr.WaitReady(ctx, 60*time.Second); err != nil {
		return nil, fmt.Errorf("manager: %w; see %s", err, logPath)
	}

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
		if mgr.HasExited() {
			return nil, fmt.Errorf("manager exited: %s", mgr.Tail(10))
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
	rss, hwm, err := memKiB(mgr.Pid())
	if err != nil {
		return nil, err
	}
	cpu, _ := cpuSeconds(mgr.Pid())
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
		if err := c.Status().Update(ctx, d); err != nil && !apierrors.IsConflict(err) {
			return fmt.Errorf("set status of Deployment %s: %w", d.Name, err)
		}
	}
	return nil
}
