package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// The PodMonitor is handled as an unstructured object: the Prometheus
// Operator's API types would be a heavy dependency for one small object. It
// is not watched either, because a watch on a kind the cluster does not
// serve keeps the controller from starting; a PodMonitor deleted or edited
// by hand is written again on the relay's first pass after
// podMonitorRecheck.
//
// +kubebuilder:rbac:groups=monitoring.coreos.com,resources=podmonitors,verbs=get;create;patch;delete

// podMonitorGVK is the Prometheus Operator's PodMonitor.
var podMonitorGVK = schema.GroupVersionKind{Group: "monitoring.coreos.com", Version: "v1", Kind: "PodMonitor"}

// podMonitorRecheck is how long a PodMonitor found as wanted is taken to be
// so. The client reads PodMonitors from the API server, uncached (the
// cluster may serve no such kind), and every backlog reading wakes its
// relay: reading it at each pass would cost the API server a request per
// relay every 15 s. A PodMonitor deleted or changed by hand is put right
// within this, or at once when the relay's spec changes.
const podMonitorRecheck = 5 * time.Minute

// podMonitorProblemRecheck is how long a PodMonitor the cluster serves no
// kind for, the operator may not write (or delete), or whose name another
// object holds, is taken to stay so: each try
// costs a request, and for a kind the cluster does not serve a discovery
// of the API server's groups too, which a thousand relays would otherwise
// repeat at every backlog reading. A CRD installed or a role widened is
// seen within this, or at once when the relay's spec changes.
const podMonitorProblemRecheck = time.Minute

// podMonitorSeen is a relay's PodMonitor as ensurePodMonitor last left it.
type podMonitorSeen struct {
	uid  types.UID // the relay's: one made again under its name is another
	hash string    // the PodMonitor's spec-hash annotation; podMonitorOff for one to delete
	at   time.Time
	// reason and message are the Monitoring condition's when the
	// PodMonitor could not be made (no CRD, forbidden), for the relay's
	// generation; empty when made.
	reason, message string
	generation      int64
}

// podMonitorOff is podMonitorSeen's hash for a relay whose PodMonitor is to
// be deleted, which the operator may not delete.
const podMonitorOff = "off"

// recent reports whether last, a problem, still stands for seen: the same
// relay and wish, the same generation, tried less than
// podMonitorProblemRecheck ago.
func (last podMonitorSeen) recent(seen podMonitorSeen) bool {
	return last.reason != "" && last.uid == seen.uid && last.hash == seen.hash && last.generation == seen.generation &&
		time.Since(last.at) < podMonitorProblemRecheck
}

// relayJob is the job label the PodMonitor gives every relay's series.
const relayJob = "outbox-relay"

func newPodMonitor() *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(podMonitorGVK)
	return u
}

// relayPodMonitor is the PodMonitor that scrapes a relay's pods: the metrics
// port, job="outbox-relay" (the value of the pods' app.kubernetes.io/name) and
// outboxrelay=<name>, the labels config/prometheus and config/grafana use.
// extra are the labels the Prometheus that should scrape it selects
// PodMonitors by (--relay-podmonitor-labels); the relay's own labels win.
func relayPodMonitor(relay *outboxv1alpha1.OutboxRelay, extra map[string]string) *unstructured.Unstructured {
	selector := map[string]any{}
	for k, v := range selectorLabels(relay) {
		selector[k] = v
	}
	spec := map[string]any{
		"jobLabel": labelName,
		"selector": map[string]any{"matchLabels": selector},
		"podMetricsEndpoints": []any{map[string]any{
			"port": "metrics",
			"path": "/metrics",
			"relabelings": []any{map[string]any{
				"action":       "replace",
				"sourceLabels": []any{"__meta_kubernetes_pod_label_app_kubernetes_io_instance"},
				"targetLabel":  "outboxrelay",
			}},
		}},
	}
	u := newPodMonitor()
	u.SetNamespace(relay.Namespace)
	u.SetName(childName(relay))
	labels := maps.Clone(extra)
	if labels == nil {
		labels = map[string]string{}
	}
	maps.Copy(labels, commonLabels(relay))
	u.SetLabels(labels)
	u.SetAnnotations(map[string]string{specHashAnnotation: hashOf(spec)})
	u.Object["spec"] = spec
	return u
}

// podMonitorOwned is what of a PodMonitor the operator owns: its spec,
// whose live hash tells a hand edit of it (the spec-hash annotation only
// tells a change of what the relay wants).
func podMonitorOwned(u *unstructured.Unstructured) any { return u.Object["spec"] }

// ensurePodMonitor writes the PodMonitor spec.monitoring.podMonitor asks
// for, or deletes the one the relay owns when it no longer asks, and reports
// it in the Monitoring condition. A cluster without the PodMonitor CRD, or a
// role without the permission, is a condition, not an error: the relay
// itself needs no PodMonitor, and its status must still be written.
func (r *OutboxRelayReconciler) ensurePodMonitor(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) error {
	set := func(status metav1.ConditionStatus, reason, msg string) {
		meta.SetStatusCondition(&relay.Status.Conditions, metav1.Condition{Type: outboxv1alpha1.ConditionMonitoring,
			Status: status, Reason: reason, Message: msg, ObservedGeneration: relay.Generation})
	}
	if relay.Spec.Monitoring == nil || !relay.Spec.Monitoring.PodMonitor {
		key := client.ObjectKeyFromObject(relay)
		// Only a relay that asked before can own one: others cost no request.
		if meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionMonitoring) == nil {
			r.podMonitors.Delete(key)
			return nil
		}
		off := podMonitorSeen{uid: relay.UID, hash: podMonitorOff, generation: relay.Generation}
		if v, ok := r.podMonitors.Load(key); ok && v.(podMonitorSeen).recent(off) {
			last := v.(podMonitorSeen)
			set(metav1.ConditionFalse, last.reason, last.message)
			return nil
		}
		r.podMonitors.Delete(key)
		err := r.deletePodMonitor(ctx, relay)
		switch {
		case apierrors.IsForbidden(err), podMonitorRefused(err):
			off.at, off.reason = time.Now(), outboxv1alpha1.ReasonPodMonitorForbidden
			if podMonitorRefused(err) {
				off.reason = outboxv1alpha1.ReasonPodMonitorRefused
			}
			off.message = fmt.Sprintf("spec.monitoring.podMonitor is off but the operator may not delete PodMonitor %s: %v", childName(relay), err)
			r.podMonitors.Store(key, off)
			set(metav1.ConditionFalse, off.reason, off.message)
			return nil
		case err != nil:
			return err
		}
		meta.RemoveStatusCondition(&relay.Status.Conditions, outboxv1alpha1.ConditionMonitoring)
		return nil
	}
	want := relayPodMonitor(relay, r.PodMonitorLabels)
	key := client.ObjectKeyFromObject(relay)
	ready := func() {
		// Whether a Prometheus scrapes it is its podMonitorSelector's say,
		// which the operator cannot read: the condition names the labels.
		set(metav1.ConditionTrue, outboxv1alpha1.ReasonPodMonitorReady,
			fmt.Sprintf("PodMonitor %s selects the relay pods (job=%q, outboxrelay=%q); a Prometheus whose podMonitorSelector matches its labels %s scrapes them",
				childName(relay), relayJob, relay.Name, labels.Set(want.GetLabels())))
	}
	seen := podMonitorSeen{uid: relay.UID, hash: want.GetAnnotations()[specHashAnnotation], generation: relay.Generation}
	if v, ok := r.podMonitors.Load(key); ok {
		last := v.(podMonitorSeen)
		switch {
		case last.uid != seen.uid || last.hash != seen.hash || last.generation != seen.generation:
		case last.reason == "" && time.Since(last.at) < podMonitorRecheck:
			ready()
			return nil
		case last.recent(seen):
			set(metav1.ConditionFalse, last.reason, last.message)
			return nil
		}
	}
	r.podMonitors.Delete(key)
	_, err := ensure(ctx, r.Client, r.APIReader, relay, want, newPodMonitor(), nil, podMonitorOwned,
		func(cur, want *unstructured.Unstructured) { cur.Object["spec"] = want.Object["spec"] })
	var conflict *conflictError
	switch {
	case err == nil:
		seen.at = time.Now()
		r.podMonitors.Store(key, seen)
		ready()
	case meta.IsNoMatchError(err):
		seen.at, seen.reason = time.Now(), outboxv1alpha1.ReasonPodMonitorCRDMissing
		seen.message = "spec.monitoring.podMonitor: the cluster serves no PodMonitor (monitoring.coreos.com/v1); install the Prometheus Operator's CRDs"
		r.podMonitors.Store(key, seen)
		set(metav1.ConditionFalse, seen.reason, seen.message)
	case apierrors.IsForbidden(err):
		seen.at, seen.reason = time.Now(), outboxv1alpha1.ReasonPodMonitorForbidden
		seen.message = "spec.monitoring.podMonitor: the API server forbids the operator's PodMonitor (" + err.Error() + "); if its role does not allow PodMonitors " +
			"(get, create, patch, delete on podmonitors.monitoring.coreos.com), apply the role of this operator version; a policy or quota that answers 403 says so above"
		r.podMonitors.Store(key, seen)
		set(metav1.ConditionFalse, seen.reason, seen.message)
	case errors.As(err, &conflict):
		seen.at, seen.reason = time.Now(), outboxv1alpha1.ReasonResourceConflict
		seen.message = fmt.Sprintf("PodMonitor %s exists and is not controlled by this OutboxRelay; it is left alone", childName(relay))
		r.podMonitors.Store(key, seen)
		set(metav1.ConditionFalse, seen.reason, seen.message)
	case podMonitorRefused(err):
		seen.at, seen.reason = time.Now(), outboxv1alpha1.ReasonPodMonitorRefused
		seen.message = fmt.Sprintf("the API server refused PodMonitor %s: %v", childName(relay), err)
		r.podMonitors.Store(key, seen)
		set(metav1.ConditionFalse, seen.reason, seen.message)
	default:
		return err
	}
	return nil
}

// podMonitorRefused reports whether err is the API server's refusal of a
// PodMonitor that trying again does not mend (an admission policy or
// webhook denying it, an invalid field): a condition, tried again after
// podMonitorProblemRecheck. Other errors (the API server unavailable, a
// timeout) are returned, and the pass is retried.
func podMonitorRefused(err error) bool {
	return apierrors.IsBadRequest(err) || apierrors.IsInvalid(err)
}

// deletePodMonitor deletes the relay's PodMonitor if the relay controls it.
func (r *OutboxRelayReconciler) deletePodMonitor(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) error {
	cur := newPodMonitor()
	err := r.Get(ctx, client.ObjectKey{Namespace: relay.Namespace, Name: childName(relay)}, cur)
	switch {
	case apierrors.IsNotFound(err), meta.IsNoMatchError(err):
		return nil
	case err != nil:
		return fmt.Errorf("get PodMonitor %s: %w", childName(relay), err)
	case !metav1.IsControlledBy(cur, relay):
		return nil
	}
	if err := r.Delete(ctx, cur, client.Preconditions{UID: ptr.To(cur.GetUID())}); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("delete PodMonitor %s: %w", childName(relay), err)
	}
	return nil
}
