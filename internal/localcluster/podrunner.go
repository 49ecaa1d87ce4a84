package localcluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// RunnerOptions configure the pod runner.
type RunnerOptions struct {
	// Commands maps a container command (its first element, e.g. "/relay")
	// to a local binary. Containers with other commands are not run.
	Commands map[string]string
	// LogDir receives one log file per process.
	LogDir string
	// Log is the runner's own log; nil discards.
	Log *slog.Logger
}

// Runner is the local pod runner: a development and test stand-in for the
// Deployment controller and the kubelet. For every Deployment controlled by
// an OutboxRelay it keeps spec.replicas local processes running from the pod
// template, rolls them when the template changes (start new, wait until
// ready, then stop old, within maxSurge/maxUnavailable), restarts crashed
// ones, and writes the Deployment's status as the Deployment controller
// would. With no garbage collector running locally, it also stops the
// processes of a Deployment whose OutboxRelay is gone.
type Runner struct {
	opts    RunnerOptions
	log     *slog.Logger
	mgr     ctrl.Manager
	client  client.Client
	wake    chan event.TypedGenericEvent[*appsv1.Deployment]
	started chan struct{}

	mu   sync.Mutex
	sets map[types.NamespacedName][]*pod
	seq  int

	// live holds every process started and not yet exited, terminating
	// ones included, so StopAll leaves nothing behind.
	liveMu sync.Mutex
	live   map[*process]struct{}
}

// NewRunner creates a runner talking to the API server at cfg.
func NewRunner(cfg *rest.Config, opts RunnerOptions) (*Runner, error) {
	r := &Runner{
		opts:    opts,
		log:     opts.Log,
		wake:    make(chan event.TypedGenericEvent[*appsv1.Deployment], 256),
		started: make(chan struct{}),
		sets:    map[types.NamespacedName][]*pod{},
		live:    map[*process]struct{}{},
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 Scheme(),
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
	})
	if err != nil {
		return nil, fmt.Errorf("pod runner manager: %w", err)
	}
	r.mgr, r.client = mgr, mgr.GetClient()
	err = ctrl.NewControllerManagedBy(mgr).
		Named("local-pod-runner").
		For(&appsv1.Deployment{}).
		Watches(&outboxv1alpha1.OutboxRelay{}, handler.EnqueueRequestsFromMapFunc(r.deploymentsOfRelay)).
		WatchesRawSource(source.Channel(r.wake, &handler.TypedEnqueueRequestForObject[*appsv1.Deployment]{})).
		Complete(r)
	if err != nil {
		return nil, err
	}
	if err := mgr.Add(startedSignal(r.started)); err != nil {
		return nil, err
	}
	return r, nil
}

type startedSignal chan struct{}

func (s startedSignal) Start(ctx context.Context) error { close(s); <-ctx.Done(); return nil }

// Run runs the runner until ctx ends, then stops every process it started.
func (r *Runner) Run(ctx context.Context) error {
	defer r.StopAll()
	return r.mgr.Start(ctx)
}

// WaitStarted waits until the runner's caches are synced.
func (r *Runner) WaitStarted(ctx context.Context) error {
	select {
	case <-r.started:
		if !r.mgr.GetCache().WaitForCacheSync(ctx) {
			return errors.New("pod runner caches did not sync")
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(60 * time.Second):
		return errors.New("pod runner did not start within 60s")
	}
}

// deploymentsOfRelay maps an OutboxRelay event to the Deployments it controls.
func (r *Runner) deploymentsOfRelay(ctx context.Context, o client.Object) []reconcile.Request {
	var list appsv1.DeploymentList
	if err := r.client.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		return nil
	}
	var out []reconcile.Request
	for _, d := range list.Items {
		if ref := metav1.GetControllerOf(&d); ref != nil && ref.Kind == "OutboxRelay" && ref.Name == o.GetName() {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&d)})
		}
	}
	// The Deployment may already be gone from the cache: reconcile by name too.
	out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: o.GetName() + "-relay"}})
	return out
}

// poke asks for a reconcile of a Deployment (a process changed state).
func (r *Runner) poke(key types.NamespacedName) func() {
	return func() {
		d := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}
		select {
		case r.wake <- event.TypedGenericEvent[*appsv1.Deployment]{Object: d}:
		default: // a reconcile is queued anyway
		}
	}
}

// Reconcile brings a Deployment's processes to its spec and writes its status.
func (r *Runner) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	var d appsv1.Deployment
	if err := r.client.Get(ctx, req.NamespacedName, &d); err != nil {
		if apierrors.IsNotFound(err) {
			r.stop(req.NamespacedName, "deployment deleted")
			return reconcile.Result{}, nil
		}
		return reconcile.Result{}, err
	}
	owner := metav1.GetControllerOf(&d)
	if owner == nil || owner.Kind != "OutboxRelay" {
		return reconcile.Result{}, nil // not a relay Deployment: not ours to run
	}
	if d.DeletionTimestamp != nil {
		r.stop(req.NamespacedName, "deployment being deleted")
		return reconcile.Result{}, nil
	}
	// No garbage collector runs locally: a Deployment whose OutboxRelay is
	// gone would be deleted by it, so its pods stop.
	var relay outboxv1alpha1.OutboxRelay
	err := r.client.Get(ctx, types.NamespacedName{Namespace: d.Namespace, Name: owner.Name}, &relay)
	if apierrors.IsNotFound(err) || (err == nil && (relay.UID != owner.UID || relay.DeletionTimestamp != nil)) {
		r.stop(req.NamespacedName, "owner OutboxRelay deleted")
		return reconcile.Result{}, nil
	}
	if err != nil {
		return reconcile.Result{}, err
	}

	status := r.sync(ctx, &d)
	if !equality.Semantic.DeepEqual(d.Status, status) {
		d.Status = status
		if err := r.client.Status().Update(ctx, &d); err != nil {
			if apierrors.IsConflict(err) {
				return reconcile.Result{Requeue: true}, nil
			}
			return reconcile.Result{}, fmt.Errorf("update status of deployment %s: %w", req, err)
		}
	}
	// Crash restarts and readiness changes also poke; this is the safety net.
	return reconcile.Result{RequeueAfter: 2 * time.Second}, nil
}

// sync starts, restarts and stops processes one step toward the spec and
// returns the status to report.
func (r *Runner) sync(ctx context.Context, d *appsv1.Deployment) appsv1.DeploymentStatus {
	key := client.ObjectKeyFromObject(d)
	r.mu.Lock()
	defer r.mu.Unlock()
	pods := r.sets[key]
	now := time.Now()
	desired := int(ptr.Deref(d.Spec.Replicas, 1))
	rev := templateHash(&d.Spec.Template)
	surge, unavailable := rollingParams(d, desired)
	grace := time.Duration(ptr.Deref(d.Spec.Template.Spec.TerminationGracePeriodSeconds, 30)) * time.Second

	// Crashed processes restart in place, with a back-off (1s doubling to
	// 30s, reset after 30s of running) like the kubelet's CrashLoopBackOff.
	for _, p := range pods {
		if p.proc != nil && p.proc.HasExited() {
			ran := now.Sub(p.proc.started)
			r.log.Warn("relay process exited; restarting", "pod", p.name, "pid", p.proc.Pid(),
				"exit", p.proc.Cmd.ProcessState.String(), "ran", ran.Round(time.Millisecond), "log", p.proc.logPath)
			if ran > 30*time.Second {
				p.restarts = 0
			}
			backoff := min(time.Second<<min(p.restarts, 5), 30*time.Second)
			p.restartAt = now.Add(backoff)
			p.restarts++
			time.AfterFunc(backoff, r.poke(key))
			p.proc = nil
		}
	}

	var newPods, oldPods []*pod
	for _, p := range pods {
		if p.revision == rev {
			newPods = append(newPods, p)
		} else {
			oldPods = append(oldPods, p)
		}
	}
	recreate := d.Spec.Strategy.Type == appsv1.RecreateDeploymentStrategyType
	stop := func(p *pod, why string) {
		if p.proc != nil {
			r.log.Info("stopping relay process", "pod", p.name, "pid", p.proc.Pid(), "why", why)
			p.proc.terminate(grace)
		}
	}

	// Old pods: the not-ready ones go at once; ready ones as far as
	// maxUnavailable allows (all of them under Recreate).
	readyCount := func(ps []*pod) int {
		n := 0
		for _, p := range ps {
			if p.ready() {
				n++
			}
		}
		return n
	}
	var keepOld []*pod
	budget := readyCount(newPods) + readyCount(oldPods) - (desired - unavailable)
	for _, p := range oldPods {
		switch {
		case recreate || !p.ready():
			stop(p, "old pod template")
		case budget > 0:
			budget--
			stop(p, "old pod template, replaced")
		default:
			keepOld = append(keepOld, p)
		}
	}
	oldPods = keepOld

	// New pods: scale down extras (not-ready and youngest first) or start
	// missing ones within maxSurge.
	if len(newPods) > desired {
		sort.SliceStable(newPods, func(i, j int) bool {
			if newPods[i].ready() != newPods[j].ready() {
				return newPods[i].ready()
			}
			return newPods[i].name < newPods[j].name
		})
		for _, p := range newPods[desired:] {
			stop(p, "scaled down")
		}
		newPods = newPods[:desired]
	}
	if recreate && len(oldPods) > 0 {
		surge = -len(oldPods) // wait for the old ones to go
	}
	for n := min(desired-len(newPods), desired+surge-len(newPods)-len(oldPods)); n > 0; n-- {
		r.seq++
		newPods = append(newPods, &pod{name: fmt.Sprintf("%s-%s-%d", d.Name, rev[:8], r.seq), revision: rev, template: *d.Spec.Template.DeepCopy()})
	}
	for _, p := range newPods {
		if p.proc != nil || now.Before(p.restartAt) {
			continue
		}
		proc, err := r.startProcess(ctx, d.Namespace, p, r.poke(key))
		if err != nil {
			if p.lastErr == nil || p.lastErr.Error() != err.Error() {
				r.log.Error("cannot start relay process", "pod", p.name, "err", err)
			}
			p.lastErr = err
			p.restartAt = now.Add(time.Second)
			continue
		}
		p.lastErr = nil
		r.log.Info("started relay process", "pod", p.name, "pid", proc.Pid(), "metrics", proc.Addr, "log", proc.logPath)
		p.proc = proc
	}
	r.sets[key] = append(slices.Clone(newPods), oldPods...)

	// Status as the Deployment controller reports it (minReadySeconds 0:
	// available means ready).
	ready := readyCount(newPods) + readyCount(oldPods)
	st := appsv1.DeploymentStatus{
		ObservedGeneration:  d.Generation,
		Replicas:            int32(len(newPods) + len(oldPods)),
		UpdatedReplicas:     int32(len(newPods)),
		ReadyReplicas:       int32(ready),
		AvailableReplicas:   int32(ready),
		UnavailableReplicas: int32(max(0, desired-ready)),
	}
	complete := len(newPods) == desired && len(oldPods) == 0 && readyCount(newPods) == desired
	rsName := d.Name + "-" + rev[:10]
	avail := condition(appsv1.DeploymentAvailable, ready >= desired-unavailable,
		"MinimumReplicasAvailable", "Deployment has minimum availability.",
		"MinimumReplicasUnavailable", "Deployment does not have minimum availability.")
	prog := appsv1.DeploymentCondition{Type: appsv1.DeploymentProgressing, Status: corev1.ConditionTrue,
		Reason: "ReplicaSetUpdated", Message: fmt.Sprintf("ReplicaSet %q is progressing.", rsName)}
	if complete {
		prog.Reason, prog.Message = "NewReplicaSetAvailable", fmt.Sprintf("ReplicaSet %q has successfully progressed.", rsName)
	}
	st.Conditions = []appsv1.DeploymentCondition{
		keepTimes(d.Status.Conditions, avail, now),
		keepTimes(d.Status.Conditions, prog, now),
	}
	return st
}

func condition(typ appsv1.DeploymentConditionType, ok bool, trueReason, trueMsg, falseReason, falseMsg string) appsv1.DeploymentCondition {
	if ok {
		return appsv1.DeploymentCondition{Type: typ, Status: corev1.ConditionTrue, Reason: trueReason, Message: trueMsg}
	}
	return appsv1.DeploymentCondition{Type: typ, Status: corev1.ConditionFalse, Reason: falseReason, Message: falseMsg}
}

// keepTimes sets the condition's times: unchanged conditions keep theirs, so
// a status with nothing new is equal to the stored one and not written.
func keepTimes(old []appsv1.DeploymentCondition, c appsv1.DeploymentCondition, now time.Time) appsv1.DeploymentCondition {
	t := metav1.NewTime(now.Truncate(time.Second))
	c.LastUpdateTime, c.LastTransitionTime = t, t
	for _, o := range old {
		if o.Type != c.Type {
			continue
		}
		if o.Status == c.Status {
			c.LastTransitionTime = o.LastTransitionTime
			if o.Reason == c.Reason && o.Message == c.Message {
				c.LastUpdateTime = o.LastUpdateTime
			}
		}
	}
	return c
}

// rollingParams resolves maxSurge and maxUnavailable (defaults 25% each;
// surge rounds up, unavailable down; both zero is not allowed, surge wins).
func rollingParams(d *appsv1.Deployment, desired int) (surge, unavailable int) {
	ms, mu := intstr.FromString("25%"), intstr.FromString("25%")
	if ru := d.Spec.Strategy.RollingUpdate; ru != nil {
		if ru.MaxSurge != nil {
			ms = *ru.MaxSurge
		}
		if ru.MaxUnavailable != nil {
			mu = *ru.MaxUnavailable
		}
	}
	surge, _ = intstr.GetScaledValueFromIntOrPercent(&ms, desired, true)
	unavailable, _ = intstr.GetScaledValueFromIntOrPercent(&mu, desired, false)
	if surge == 0 && unavailable == 0 {
		surge = 1
	}
	return surge, unavailable
}

// templateHash identifies a pod template, as pod-template-hash does.
func templateHash(t *corev1.PodTemplateSpec) string {
	b, _ := json.Marshal(t)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// stop terminates every process of a Deployment.
func (r *Runner) stop(key types.NamespacedName, why string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	pods := r.sets[key]
	if len(pods) == 0 {
		return
	}
	for _, p := range pods {
		if p.proc != nil {
			r.log.Info("stopping relay process", "pod", p.name, "pid", p.proc.Pid(), "why", why)
			p.proc.terminate(time.Duration(ptr.Deref(p.template.Spec.TerminationGracePeriodSeconds, 30)) * time.Second)
		}
	}
	delete(r.sets, key)
}

// StopAll terminates every process the runner started and waits until they
// are gone (SIGKILL after 15s at the latest: the stack is going away).
func (r *Runner) StopAll() {
	r.mu.Lock()
	clear(r.sets)
	r.mu.Unlock()
	r.liveMu.Lock()
	var procs []*process
	for p := range r.live {
		procs = append(procs, p)
	}
	r.liveMu.Unlock()
	for _, p := range procs {
		p.terminate(15 * time.Second)
	}
	for _, p := range procs {
		<-p.Exited()
	}
}

// Pod describes one replica the runner runs.
type Pod struct {
	// Name is the pod's name (Deployment name, template hash, sequence).
	Name string
	// Revision is the hash of the pod template it runs.
	Revision string
	// PID is the process id, 0 while waiting to restart.
	PID int
	// MetricsAddr serves /metrics, /healthz and /readyz.
	MetricsAddr string
	// Ready is the last readiness probe's answer.
	Ready bool
	// Restarts counts crashes.
	Restarts int
	// Env is the resolved environment (NAME=value).
	Env []string
	// LogPath is the process's output.
	LogPath string
}

// Pods lists the replicas of a Deployment, terminating ones excluded.
func (r *Runner) Pods(namespace, deployment string) []Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Pod
	for _, p := range r.sets[types.NamespacedName{Namespace: namespace, Name: deployment}] {
		x := Pod{Name: p.name, Revision: p.revision, Restarts: p.restarts, Ready: p.ready()}
		if p.proc != nil {
			x.PID, x.MetricsAddr, x.LogPath = p.proc.Pid(), p.proc.Addr, p.proc.logPath
			x.Env = slices.Clone(p.proc.env)
		}
		out = append(out, x)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
