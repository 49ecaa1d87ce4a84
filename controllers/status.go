package controllers

import (
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// problem is why a relay cannot run as specified: it becomes the Ready reason.
type problem struct {
	reason, message string
	// requeue: a dependency may appear without an event we watch.
	requeue bool
}

// computeStatus derives a relay's status from its spec, the Deployment as
// observed (nil when there is none) and the problem that stopped the
// reconcile, if any. Conditions keep their transition times when unchanged.
func computeStatus(relay *outboxv1alpha1.OutboxRelay, deploy *appsv1.Deployment, prob *problem) outboxv1alpha1.OutboxRelayStatus {
	st := *relay.Status.DeepCopy()
	desired := desiredReplicas(relay)
	st.ObservedGeneration = relay.Generation
	st.Selector = metav1.FormatLabelSelector(&metav1.LabelSelector{MatchLabels: selectorLabels(relay)})
	st.TopicCount = int32(len(relay.Spec.Topics))
	st.Replicas, st.ReadyReplicas = 0, 0
	if deploy != nil {
		st.Replicas, st.ReadyReplicas = deploy.Status.Replicas, deploy.Status.ReadyReplicas
	}
	st.Ready = fmt.Sprintf("%d/%d", st.ReadyReplicas, desired)

	set := func(typ string, status metav1.ConditionStatus, reason, msg string) {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{
			Type: typ, Status: status, Reason: reason, Message: msg, ObservedGeneration: relay.Generation,
		})
	}
	if prob != nil {
		set(outboxv1alpha1.ConditionReady, metav1.ConditionFalse, prob.reason, prob.message)
		set(outboxv1alpha1.ConditionProgressing, metav1.ConditionFalse, prob.reason, "the operator cannot apply this generation: "+prob.message)
		set(outboxv1alpha1.ConditionDegraded, metav1.ConditionTrue, prob.reason, prob.message)
		set(outboxv1alpha1.ConditionReconciling, metav1.ConditionFalse, prob.reason, "stalled: "+prob.message)
		set(outboxv1alpha1.ConditionStalled, metav1.ConditionTrue, prob.reason, prob.message)
		return st
	}

	switch {
	case relay.Spec.Suspend || desired == 0:
		// No pods by request is the desired state: Ready once they are gone,
		// so GitOps tools judge a suspended relay healthy, not progressing.
		reason, msg := outboxv1alpha1.ReasonScaledToZero, "spec.replicas is 0: the relay runs no pods"
		if relay.Spec.Suspend {
			reason, msg = outboxv1alpha1.ReasonSuspended, "spec.suspend is true: the relay runs no pods"
		}
		status := metav1.ConditionTrue
		if deploy != nil && deploy.Status.Replicas > 0 {
			status, msg = metav1.ConditionFalse, msg+" (stopping the running ones)"
		}
		set(outboxv1alpha1.ConditionReady, status, reason, msg)
	case st.ReadyReplicas >= desired:
		set(outboxv1alpha1.ConditionReady, metav1.ConditionTrue, outboxv1alpha1.ReasonAvailable,
			fmt.Sprintf("%d of %d replicas ready", st.ReadyReplicas, desired))
	default:
		set(outboxv1alpha1.ConditionReady, metav1.ConditionFalse, outboxv1alpha1.ReasonDeploymentUnavailable,
			fmt.Sprintf("%d of %d replicas ready", st.ReadyReplicas, desired))
	}

	if rolledOut(deploy, desired) {
		set(outboxv1alpha1.ConditionProgressing, metav1.ConditionFalse, outboxv1alpha1.ReasonRolloutComplete,
			fmt.Sprintf("%d replicas run the current pod template", desired))
	} else {
		set(outboxv1alpha1.ConditionProgressing, metav1.ConditionTrue, outboxv1alpha1.ReasonRollingOut,
			"the Deployment is rolling out or scaling to the current spec")
	}

	stalled := false
	if c := deploymentCondition(deploy, appsv1.DeploymentProgressing); c != nil &&
		c.Status == corev1.ConditionFalse && c.Reason == "ProgressDeadlineExceeded" {
		stalled = true
		set(outboxv1alpha1.ConditionDegraded, metav1.ConditionTrue, outboxv1alpha1.ReasonProgressDeadlineExceeded, c.Message)
		set(outboxv1alpha1.ConditionStalled, metav1.ConditionTrue, outboxv1alpha1.ReasonProgressDeadlineExceeded, c.Message)
	} else {
		set(outboxv1alpha1.ConditionDegraded, metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "nothing is degraded")
		set(outboxv1alpha1.ConditionStalled, metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "nothing is stalled")
	}

	// kstatus reads Reconciling: True until the current template runs on
	// every desired replica and they are ready (a Secret-triggered roll
	// changes no generation, so observedGeneration alone cannot show it).
	switch ready := st.ReadyReplicas >= desired; {
	case stalled:
		set(outboxv1alpha1.ConditionReconciling, metav1.ConditionFalse, outboxv1alpha1.ReasonProgressDeadlineExceeded, "stalled")
	case !rolledOut(deploy, desired):
		set(outboxv1alpha1.ConditionReconciling, metav1.ConditionTrue, outboxv1alpha1.ReasonRollingOut,
			"the Deployment is rolling out or scaling to the current spec")
	case !ready && desired > 0:
		set(outboxv1alpha1.ConditionReconciling, metav1.ConditionTrue, outboxv1alpha1.ReasonDeploymentUnavailable,
			fmt.Sprintf("%d of %d replicas ready", st.ReadyReplicas, desired))
	default:
		set(outboxv1alpha1.ConditionReconciling, metav1.ConditionFalse, outboxv1alpha1.ReasonRolloutComplete, "the relay matches its spec")
	}
	return st
}

// rolledOut is the Deployment's own notion of a complete rollout: it has
// seen its latest spec and every replica is updated and available.
func rolledOut(d *appsv1.Deployment, desired int32) bool {
	if d == nil {
		return false
	}
	s := d.Status
	return s.ObservedGeneration >= d.Generation &&
		s.UpdatedReplicas == desired && s.Replicas == desired && s.AvailableReplicas == desired
}

func deploymentCondition(d *appsv1.Deployment, typ appsv1.DeploymentConditionType) *appsv1.DeploymentCondition {
	if d == nil {
		return nil
	}
	for i := range d.Status.Conditions {
		if d.Status.Conditions[i].Type == typ {
			return &d.Status.Conditions[i]
		}
	}
	return nil
}

// recordProblem emits a Warning event when the relay newly has a problem (or
// a new generation still has it), so events do not repeat on every resync.
func (r *OutboxRelayReconciler) recordProblem(before, after *outboxv1alpha1.OutboxRelay, prob *problem) {
	if prob == nil || r.Recorder == nil {
		return
	}
	old := meta.FindStatusCondition(before.Status.Conditions, outboxv1alpha1.ConditionReady)
	if old != nil && old.Reason == prob.reason && old.Message == prob.message &&
		before.Status.ObservedGeneration == after.Generation {
		return
	}
	r.Recorder.Eventf(after, nil, corev1.EventTypeWarning, prob.reason, "Reconcile", "%s", prob.message)
}
