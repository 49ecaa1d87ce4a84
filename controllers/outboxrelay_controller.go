package controllers

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// LeaderElectionID names, by default (the manager's --leader-election-id),
// the Lease the managers elect their leader with. The installs grant get
// and update on this Lease alone (config/rbac/leader_election_role.yaml;
// the chart's leaderElection.id names another).
const LeaderElectionID = "outbox-operator.outbox.dev"

// statusConflictRetry is how soon a pass whose status patch found a newer
// OutboxRelay than it read runs again, from the cache, which has it by then.
const statusConflictRetry = time.Second

// secretRetryInterval is how soon a relay waiting for a Secret, or for the
// API server to take a child it refused (ChildRefused), is looked at again.
const secretRetryInterval = 30 * time.Second

// secretDueMargin is how long after its first Secret entry expires a relay
// is looked at again: the pass must find the entry expired, or a rotation
// waits a whole refresh interval more.
const secretDueMargin = time.Second

// OutboxRelayReconciler turns an OutboxRelay into a relay Deployment, a
// metrics Service and (with more than one replica) a PodDisruptionBudget.
type OutboxRelayReconciler struct {
	client.Client
	// APIReader reads the referenced Secrets straight from the API server, so
	// no Secret data is cached. SetupWithManager sets it to the manager's
	// API reader when it is nil.
	APIReader client.Reader
	// Recorder records events on OutboxRelays.
	Recorder events.EventRecorder
	// RelayImage is the relay image for OutboxRelays that name none.
	RelayImage string
	// PodMonitorLabels are added to each relay's PodMonitor: those the
	// cluster's Prometheus selects PodMonitors by (kube-prometheus-stack's
	// release=<name>, say). The relay's own labels win.
	PodMonitorLabels map[string]string
	// AllowedImages are the prefixes an OutboxRelay's spec.image must start
	// with; empty admits RelayImage's repository, AnyImage any image.
	// RelayImage is always allowed.
	AllowedImages []string
	// SecretRefreshInterval is how long what the operator read of a
	// referenced Secret is used before it reads the Secret again: the
	// longest a change of it takes to roll the relay's pods
	// (DefaultSecretRefreshInterval when zero).
	SecretRefreshInterval time.Duration
	// DigestKeySecret is the Secret, in the operator's own namespace, that
	// keeps the key of the digests the relays' Deployments record of the
	// values their pods read (digestKey): the operator fills it when it is
	// empty. Zero: the key lives as long as the process, and a restart
	// rolls, once, each relay one of whose Secrets was written (a label
	// will do) since its pods last rolled.
	DigestKeySecret types.NamespacedName
	// Flow reads the relays' backlogs; nil reads none (no Lagging, and
	// autoscaled relays keep their running count).
	Flow *FlowObserver
	// DatabaseTokenLogins lets the backlog reads of relays with a token
	// method (spec.database.auth) log in with the operator's own cloud
	// identity (the manager's --database-token-logins). Off, those relays'
	// backlogs are not read (Lagging Unknown, BacklogNotRead): whoever may
	// create an OutboxRelay names the host, and with sslmode=require or a
	// CA of their own could have the operator send them its token.
	DatabaseTokenLogins bool
	// Metrics are the per-relay gauges; nil reports none.
	Metrics *Metrics

	secrets    *secretCache // made by SetupWithManager
	configMaps *secretCache // the referenced ConfigMaps, kept as the Secrets are
	digest     *digestKey   // keys the digests of both, read from DigestKeySecret
	// podMonitors are the PodMonitors written or found as wanted lately
	// (ensurePodMonitor), by relay: types.NamespacedName to podMonitorSeen.
	podMonitors sync.Map
	// childProblems are the problems the latest writes of the children
	// found (ensureChildren), by relay: types.NamespacedName to
	// childProblemSeen.
	childProblems sync.Map
}

// Least privilege: status is only patched; finalizers/update lets the owner
// references block the owner's deletion. Secrets: get only, of the Secrets
// an OutboxRelay references (secrets.go): no list or watch, so the install
// can read no Secret it is not pointed at and list none. The digest key
// Secret (DigestKeySecret) is granted apart, get and update of that one
// Secret in the operator's namespace (config/rbac/digest_key_role.yaml).
//
// +kubebuilder:rbac:groups=outbox.dev,resources=outboxrelays,verbs=get;list;watch
// +kubebuilder:rbac:groups=outbox.dev,resources=outboxrelays/status,verbs=patch
// +kubebuilder:rbac:groups=outbox.dev,resources=outboxrelays/finalizers,verbs=update
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile brings one OutboxRelay's children to the desired state and reports its status.
func (r *OutboxRelayReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	relay := &outboxv1alpha1.OutboxRelay{}
	if err := r.Get(ctx, req.NamespacedName, relay); err != nil {
		if apierrors.IsNotFound(err) {
			r.forget(req.NamespacedName)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !relay.DeletionTimestamp.IsZero() {
		r.forget(req.NamespacedName)
		return ctrl.Result{}, nil // owner references hand the children to the garbage collector
	}
	original := relay.DeepCopy()
	if relay.ReconciliationPaused() {
		r.unobserve(req.NamespacedName)
		return ctrl.Result{}, r.paused(ctx, relay, original)
	}
	meta.RemoveStatusCondition(&relay.Status.Conditions, outboxv1alpha1.ConditionReconciliationPaused)

	current, err := r.currentDeployment(ctx, relay)
	if err != nil {
		return ctrl.Result{}, err
	}
	settings, in, prob, err := r.inputs(ctx, relay, current)
	if err != nil {
		return ctrl.Result{}, err
	}
	obs := r.observe(req.NamespacedName, relay, in, prob)
	relay.Status.DesiredReplicas = r.decideReplicas(req.NamespacedName, relay, obs, current)
	var deploy *appsv1.Deployment
	if prob == nil {
		if deploy, prob, err = r.ensureChildren(ctx, relay, settings, in, current); err != nil {
			return ctrl.Result{}, err
		}
	}
	if prob != nil {
		deploy, prob = r.scaleDownOnly(ctx, relay, current, prob)
	}
	if deploy == nil { // children left as they are: report the Deployment that runs
		deploy = current
	}
	relay.Status = computeStatus(relay, deploy, prob, obs)
	r.Metrics.set(req.NamespacedName, relay) // every reading, also those the status lets wait
	if settled(original.Status, relay.Status, time.Now()) {
		relay.Status = *original.Status.DeepCopy() // small moves wait for statusRefresh; ensurePodMonitor may still set a condition
	}
	// A PodMonitor that failed is tried again (the error), but the status
	// is written first: the relay's own state does not wait for it.
	monitorErr := r.ensurePodMonitor(ctx, relay)
	if !equality.Semantic.DeepEqual(original.Status, relay.Status) {
		// Only over the status this pass started from: a pass that read
		// an OutboxRelay older than the API server's (its own last write
		// not in the cache yet) would otherwise reset the conditions'
		// transition times, send their events again, and leave out of its
		// patch what it found equal to the old copy.
		err := r.Status().Patch(ctx, relay, client.MergeFromWithOptions(original, client.MergeFromWithOptimisticLock{}))
		if apierrors.IsConflict(err) {
			r.recordScaled(relay, current, deploy)
			return ctrl.Result{RequeueAfter: statusConflictRetry}, monitorErr
		}
		if err != nil {
			return ctrl.Result{}, errors.Join(fmt.Errorf("write status of %s: %w", req.NamespacedName, err), monitorErr)
		}
	}
	r.recordEvents(original, relay, current, deploy, prob)
	if monitorErr != nil {
		return ctrl.Result{}, monitorErr
	}
	if prob != nil && prob.requeue {
		return ctrl.Result{RequeueAfter: min(secretRetryInterval, r.secrets.refresh)}, nil
	}
	// Without backlog readings to wake it, look again when the first of
	// its Secrets is due to be read again, so their changes still reach the
	// pods within the refresh interval and its fifth. Not after the refresh
	// interval itself: an entry is stretched by up to a fifth, and a pass
	// before its expiry reads nothing.
	if in.Due.IsZero() {
		return ctrl.Result{RequeueAfter: r.secrets.refresh}, nil
	}
	return ctrl.Result{RequeueAfter: max(time.Until(in.Due), 0) + secretDueMargin}, nil
}

// scaleDownOnly applies fewer replicas than run (spec.suspend, kubectl
// scale, the autoscaler) to the relay's Deployment while its children
// cannot be written as desired (a Secret missing, a template the API
// server refuses): an on-call's suspend stops the pods whatever else is
// wrong. Before, the replicas rode in the same write as the template, and
// status said 0 desired while every pod ran on. More replicas wait: new
// pods would start from a template the operator cannot bring up to date.
// It returns the Deployment it scaled (nil when it changed nothing) and
// the problem to report: a failed write (a policy refusing it, a cache
// behind the API server's copy) is added to a copy of prob's message and
// tried again soon. The status, which says what is wrong, is written all
// the same.
func (r *OutboxRelayReconciler) scaleDownOnly(ctx context.Context, relay *outboxv1alpha1.OutboxRelay, current *appsv1.Deployment, prob *problem) (*appsv1.Deployment, *problem) {
	want := desiredReplicas(relay)
	failed := func(what string, err error) *problem {
		p := *prob // the children's problem may be a cached one: it is not written
		p.message += fmt.Sprintf("; %s failed: %v", what, err)
		p.requeue = true
		return &p
	}
	if want < 2 {
		// The PodDisruptionBudget goes below two replicas, at every pass
		// (after a scale-down whose PDB delete failed, say).
		if err := r.ensurePDB(ctx, relay); err != nil {
			prob = failed("deleting the PodDisruptionBudget", err)
		}
	}
	if current == nil || !metav1.IsControlledBy(current, relay) || ptr.Deref(current.Spec.Replicas, 1) <= want {
		return nil, prob
	}
	// The cached copy may predate this pass's own write of the Deployment
	// (its Service or PDB failed after it): read it again.
	fresh := &appsv1.Deployment{}
	if err := r.APIReader.Get(ctx, client.ObjectKeyFromObject(current), fresh); err != nil {
		return nil, failed(fmt.Sprintf("reading Deployment %s to scale it down to %d replicas", current.Name, want), err)
	}
	if !metav1.IsControlledBy(fresh, relay) || ptr.Deref(fresh.Spec.Replicas, 1) <= want {
		return fresh, prob
	}
	d := fresh.DeepCopy()
	d.Spec.Replicas = ptr.To(want)
	if err := r.Patch(ctx, d, client.MergeFromWithOptions(fresh, client.MergeFromWithOptimisticLock{})); err != nil {
		return nil, failed(fmt.Sprintf("scaling Deployment %s down to %d replicas", d.Name, want), err)
	}
	return d, prob
}

// paused reports a relay whose reconciliation is disabled: only the
// ReconciliationPaused condition changes; the children, the other
// conditions and observedGeneration stay as the last reconcile left them.
func (r *OutboxRelayReconciler) paused(ctx context.Context, relay, original *outboxv1alpha1.OutboxRelay) error {
	meta.SetStatusCondition(&relay.Status.Conditions, metav1.Condition{
		Type: outboxv1alpha1.ConditionReconciliationPaused, Status: metav1.ConditionTrue,
		Reason: outboxv1alpha1.ReasonReconcileDisabled, ObservedGeneration: relay.Generation,
		Message: outboxv1alpha1.ReconcileAnnotation + ": " + outboxv1alpha1.ReconcileDisabled +
			": the operator changes nothing of this relay (its pods keep running as they are) until the annotation is removed",
	})
	if equality.Semantic.DeepEqual(original.Status, relay.Status) {
		return nil
	}
	if err := r.Status().Patch(ctx, relay, client.MergeFrom(original)); err != nil {
		return fmt.Errorf("write status of %s/%s: %w", relay.Namespace, relay.Name, err)
	}
	return nil
}

// reconcileToggled passes updates that add or remove ReconcileAnnotation:
// the For watch otherwise passes only spec (generation) changes.
var reconcileToggled = predicate.Funcs{
	UpdateFunc: func(e event.UpdateEvent) bool {
		return e.ObjectOld.GetAnnotations()[outboxv1alpha1.ReconcileAnnotation] != e.ObjectNew.GetAnnotations()[outboxv1alpha1.ReconcileAnnotation]
	},
	CreateFunc: func(event.CreateEvent) bool { return false }, DeleteFunc: func(event.DeleteEvent) bool { return false },
	GenericFunc: func(event.GenericEvent) bool { return false },
}

// forget stops observing a relay that is gone and drops its metrics.
func (r *OutboxRelayReconciler) forget(key types.NamespacedName) {
	r.unobserve(key)
	r.podMonitors.Delete(key)
	r.childProblems.Delete(key)
}

// unobserve stops reading a relay's backlog and drops its gauges: the
// relay is gone, or paused. A paused relay's readings would only wake
// passes that discard them, keep its DSN in memory (and, after a rotation,
// log in with the old password at every interval), and its gauges would
// stand at the values of the last pass before the pause, an alert on them
// firing for all of it; a manager started during the pause has neither.
// Resumed, its next pass observes it again.
func (r *OutboxRelayReconciler) unobserve(key types.NamespacedName) {
	if r.Flow != nil {
		r.Flow.Forget(key)
	}
	r.Metrics.delete(key)
}

// observe makes sure the relay's backlog is being read and returns the
// latest reading. A relay with a problem (no DSN to connect with, a spec
// no pod is built from) is not observed.
func (r *OutboxRelayReconciler) observe(key types.NamespacedName, relay *outboxv1alpha1.OutboxRelay, in secretInputs, prob *problem) observation {
	if r.Flow == nil {
		return observation{err: "this manager does not read backlogs"}
	}
	table, err := outbox.ParseTable(cmp.Or(relay.Spec.Table, outbox.DefaultTable))
	if prob != nil || err != nil {
		r.Flow.Forget(key)
		return observation{}
	}
	interval := outboxv1alpha1.DefaultBacklogInterval
	if b := relay.Spec.Backlog; b != nil {
		if d, err := time.ParseDuration(b.Interval); err == nil && d > 0 {
			interval = d
		}
	}
	auth, _ := databaseAuthOf(relay.Spec.Database) // checked with the spec: prob is nil
	if auth.token() && !r.DatabaseTokenLogins {
		r.Flow.Forget(key)
		return observation{notRead: tokenLoginsOff}
	}
	view := r.Flow.Observe(key, flowTarget{dsn: in.DSN, tls: in.DatabaseTLS, auth: auth, dsnSecret: relay.Spec.DSNSecretRef.Name, table: table, interval: interval,
		topics: relay.Spec.Topics, byKey: relay.Spec.Ordering == outboxv1alpha1.OrderingPartitionKey, streams: streams(relay), deletes: deletesPublished(relay)})
	if view.authFailed { // the Secret may hold a new password: read it again
		r.secrets.stale(types.NamespacedName{Namespace: relay.Namespace, Name: relay.Spec.DSNSecretRef.Name}, secretRetryInterval)
	}
	obs := observation{err: view.lastErr, retargeted: view.retargeted}
	if view.sample != nil {
		obs.backlog = backlogStatus(relay, view.sample)
	}
	return obs
}

// decideReplicas is the count the Deployment should run: the spec's, or
// with autoscaling the recommendation for the observed backlog, stabilized
// against the running count.
func (r *OutboxRelayReconciler) decideReplicas(key types.NamespacedName, relay *outboxv1alpha1.OutboxRelay, obs observation, current *appsv1.Deployment) int32 {
	as := relay.Spec.Autoscaling
	if as == nil || relay.Spec.Suspend {
		if r.Flow != nil {
			// Autoscaling turned on again starts a history of its own:
			// the recommendations from before, and the time since it
			// began, would let its first low one scale down at once.
			r.Flow.stopRecommending(key)
		}
		return desiredReplicas(relay)
	}
	running := int32(-1) // no Deployment yet: nothing to stabilize against
	if current != nil && current.Spec.Replicas != nil {
		running = *current.Spec.Replicas
	}
	// A backlog not read (failing, or by choice) gives no reason to run
	// none: with no pod running, no events would flow and nothing would tell.
	base := max(running, 0)
	if r.Flow != nil && obs.backlog != nil {
		base = r.Flow.ratioBase(key, base)
	}
	floor := keepOne(relay, obs.err != "" || obs.notRead != "")
	if obs.err != "" {
		// The latest read failed: the backlog in hand is the last that
		// read, however old, and may ask for more, never for fewer than
		// run (while it cannot be read, the running count stays).
		floor = max(floor, running)
	}
	rec := recommendReplicas(as, obs.backlog, max(running, 0), base, floor)
	if running < 0 || r.Flow == nil || obs.notRead != "" {
		return rec // nothing to stabilize against (a relay not read is not observed)
	}
	lo, hi := autoscaleBounds(as)
	return min(max(r.Flow.recommend(key, time.Now(), rec, running, scaleDownWindow(as)), lo), hi)
}

// SetupWithManager registers the controller and its watches. Secrets are
// not watched (secrets.go); build the manager with ManagerOptions so that no
// code path can start a Secret informer.
func (r *OutboxRelayReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if r.APIReader == nil {
		r.APIReader = mgr.GetAPIReader()
	}
	r.digest = &digestKey{secret: r.DigestKeySecret, reader: r.APIReader, writer: r.Client}
	r.secrets = newSecretCache(r.SecretRefreshInterval, r.Metrics.secretRead)
	r.configMaps = newConfigMapCache(r.SecretRefreshInterval)
	r.secrets.digest, r.configMaps.digest = r.digest, r.digest
	b := ctrl.NewControllerManagedBy(mgr).
		For(&outboxv1alpha1.OutboxRelay{}, builder.WithPredicates(predicate.Or(predicate.GenerationChangedPredicate{}, reconcileToggled))).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Named("outboxrelay")
	if r.Flow != nil {
		if err := mgr.Add(r.Flow); err != nil {
			return fmt.Errorf("add the backlog observer: %w", err)
		}
		b = b.WatchesRawSource(r.Flow.Source()) // each reading wakes its relay
	}
	return b.Complete(r)
}
