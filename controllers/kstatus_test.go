package controllers

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// The status the operator writes reads right to kstatus, the logic Flux's
// health checks and kubectl-style waits use (Argo CD runs its own Lua
// health checks instead: config/argocd/resource_customizations/outbox.dev/OutboxRelay/health.lua): InProgress while rolling
// out (including a roll with no generation change, as a Secret rotation
// makes), Failed when stalled, Current when ready.
func TestStatusReadsRightToKstatus(t *testing.T) {
	t.Parallel()
	deploy := func(gen, observed, replicas, updated, ready int32) *appsv1.Deployment {
		return &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Generation: int64(gen)},
			Status: appsv1.DeploymentStatus{
				ObservedGeneration: int64(observed), Replicas: replicas, UpdatedReplicas: updated,
				ReadyReplicas: ready, AvailableReplicas: ready,
			},
		}
	}
	for name, tc := range map[string]struct {
		replicas int32
		deploy   *appsv1.Deployment
		prob     *problem
		want     status.Status
	}{
		"ready":                          {2, deploy(2, 2, 2, 2, 2), nil, status.CurrentStatus},
		"template roll, surge":           {2, deploy(3, 3, 3, 1, 3), nil, status.InProgressStatus},
		"template not yet observed":      {2, deploy(3, 2, 2, 2, 2), nil, status.InProgressStatus},
		"scaling up":                     {3, deploy(2, 2, 2, 2, 2), nil, status.InProgressStatus},
		"no deployment yet":              {1, nil, nil, status.InProgressStatus},
		"pods not ready":                 {1, deploy(1, 1, 1, 1, 0), nil, status.InProgressStatus},
		"invalid spec":                   {1, nil, &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: "bad"}, status.FailedStatus},
		"secret missing":                 {1, deploy(1, 1, 1, 1, 1), &problem{reason: outboxv1alpha1.ReasonSecretNotFound, message: "gone"}, status.FailedStatus},
		"scaled to zero, pods gone":      {0, deploy(1, 1, 0, 0, 0), nil, status.CurrentStatus},
		"scaled to zero, pods remaining": {0, deploy(1, 1, 1, 1, 1), nil, status.InProgressStatus},
		"rolled out, then pods unready":  {1, completed(deploy(1, 1, 1, 1, 0)), nil, status.InProgressStatus},
	} {
		relay := unitRelay()
		relay.Spec.Replicas = ptr.To(tc.replicas)
		relay.Status = computeStatus(relay, tc.deploy, tc.prob, observation{})
		obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(relay)
		require.NoError(t, err)
		res, err := status.Compute(&unstructured.Unstructured{Object: obj})
		require.NoError(t, err, name)
		require.Equal(t, tc.want, res.Status, "%s: %s", name, res.Message)
	}
}

// completed gives d the Progressing condition of a rollout that completed,
// which the deployment controller leaves as it is when pods turn unready.
func completed(d *appsv1.Deployment) *appsv1.Deployment {
	d.Status.Conditions = []appsv1.DeploymentCondition{{Type: appsv1.DeploymentProgressing, Status: "True", Reason: newReplicaSetAvailable}}
	return d
}

// Pods that turn unready after their rollout completed (the broker down)
// are not a rollout: Progressing says the rollout is complete. A relay
// stalled (NotPublishing) whose replicas then turn unready, as the relay's
// readiness does after --stall-timeout, stays Stalled (kstatus Failed),
// with no "rows still flow", also while it scales up; and replicas that
// no template rollout explains being unready for longer than the
// Deployment's progress deadline are a stall too. Before, Progressing and
// Reconciling said a rollout was under way, for good, and Stalled turned
// False saying rows still flowed. Replicas that start (a first rollout,
// or a resume, which leaves the Deployment's Progressing reason as it was)
// are no stall within the deadline, however long rows have waited.
func TestUnreadyPodsAfterARolloutAreNoRollout(t *testing.T) {
	t.Parallel()
	d := func(reason string, desired int32, unavailableFor time.Duration) *appsv1.Deployment {
		return &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Generation: 1}, Status: appsv1.DeploymentStatus{
			ObservedGeneration: 1, Replicas: desired, UpdatedReplicas: desired,
			Conditions: []appsv1.DeploymentCondition{
				{Type: appsv1.DeploymentProgressing, Status: "True", Reason: reason},
				{Type: appsv1.DeploymentAvailable, Status: "False", Reason: "MinimumReplicasUnavailable",
					LastTransitionTime: metav1.NewTime(time.Now().Add(-unavailableFor))},
			},
		}}
	}
	scaling := d(newReplicaSetAvailable, 2, time.Minute)
	scaling.Generation = 2 // spec.replicas 2 → 3, not yet observed
	waiting := observation{backlog: &outboxv1alpha1.BacklogStatus{Pending: 10, OldestAge: metav1.Duration{Duration: 10 * time.Minute},
		PublishedPerMinute: ptr.To[int64](0), ObservedAt: metav1.Now()}}
	stalled := []metav1.Condition{{Type: outboxv1alpha1.ConditionStalled, Status: metav1.ConditionTrue, Reason: outboxv1alpha1.ReasonNotPublishing}}
	for name, tc := range map[string]struct {
		deploy                            *appsv1.Deployment
		before                            []metav1.Condition
		replicas                          int32
		want                              status.Status
		progressing, stalled, reconciling string
	}{
		"stalled, then unready":          {d(newReplicaSetAvailable, 2, time.Minute), stalled, 2, status.FailedStatus, "False/RolloutComplete", "True/NoReadyReplicas", "False/NoReadyReplicas"},
		"stalled, then a scale-up":       {scaling, stalled, 3, status.FailedStatus, "True/RollingOut", "True/NoReadyReplicas", "False/NoReadyReplicas"},
		"resumed, pods starting":         {d(newReplicaSetAvailable, 2, time.Minute), nil, 2, status.InProgressStatus, "False/RolloutComplete", "False/AsExpected", "True/DeploymentUnavailable"},
		"resumed, unready past deadline": {d(newReplicaSetAvailable, 2, 11*time.Minute), nil, 2, status.FailedStatus, "False/RolloutComplete", "True/NoReadyReplicas", "False/NoReadyReplicas"},
		"first rollout starting":         {d("ReplicaSetUpdated", 2, 11*time.Minute), nil, 2, status.InProgressStatus, "True/RollingOut", "False/AsExpected", "True/RollingOut"},
		"stalled, then a rollout":        {d("ReplicaSetUpdated", 2, time.Minute), stalled, 2, status.InProgressStatus, "True/RollingOut", "False/AsExpected", "True/RollingOut"},
		// Nothing flows with no replica asked for; before, Stalled said rows still flowed.
		"scaled to zero, rows waiting": {d(newReplicaSetAvailable, 0, 0), nil, 0, status.InProgressStatus, "False/RolloutComplete", "False/AsExpected", "False/RolloutComplete"},
	} {
		relay := unitRelay()
		relay.Spec.Replicas = ptr.To(tc.replicas)
		relay.Status.Conditions = tc.before
		relay.Status = computeStatus(relay, tc.deploy, nil, waiting)
		for typ, want := range map[string]string{outboxv1alpha1.ConditionProgressing: tc.progressing,
			outboxv1alpha1.ConditionStalled: tc.stalled, outboxv1alpha1.ConditionReconciling: tc.reconciling} {
			c := meta.FindStatusCondition(relay.Status.Conditions, typ)
			require.Equal(t, want, string(c.Status)+"/"+c.Reason, "%s: %s", name, typ)
			require.NotContains(t, c.Message, "rows still flow", name)
		}
		obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(relay)
		require.NoError(t, err)
		res, err := status.Compute(&unstructured.Unstructured{Object: obj})
		require.NoError(t, err, name)
		require.Equal(t, tc.want, res.Status, "%s: %s", name, res.Message)
	}
}

// Lagging speaks of the flow of events; kstatus of the spec being carried
// out. A relay whose rows still flow, however late, is InProgress (Ready is
// False); one whose ready replicas publish nothing while rows wait is
// Failed (Stalled); a suspended one is Current whatever waits; a backlog
// the operator cannot read changes nothing kstatus reads.
func TestLaggingReadsRightToKstatus(t *testing.T) {
	t.Parallel()
	ready := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Generation: 1},
		Status:     appsv1.DeploymentStatus{ObservedGeneration: 1, Replicas: 1, UpdatedReplicas: 1, ReadyReplicas: 1, AvailableReplicas: 1},
	}
	stopped := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Generation: 1}, Status: appsv1.DeploymentStatus{ObservedGeneration: 1}}
	backlog := func(age time.Duration, perMinute int64) *outboxv1alpha1.BacklogStatus {
		return &outboxv1alpha1.BacklogStatus{Pending: 10, OldestAge: metav1.Duration{Duration: age},
			PublishedPerMinute: ptr.To(perMinute), ObservedAt: metav1.Now()}
	}
	slot := func(active bool) observation {
		b := backlog(0, 0)
		b.Pending, b.Slot = 0, &outboxv1alpha1.SlotStatus{Name: "outbox_orders_outbox", Exists: true, Active: active, ConfirmedLag: ptr.To(resource.MustParse("12Mi"))}
		return observation{backlog: b}
	}
	for name, tc := range map[string]struct {
		suspend       bool
		deploy        *appsv1.Deployment
		obs           observation
		want          status.Status
		lagging       string
		writerDeletes bool
	}{
		// With writer deletes the table shows no backlog: the slot does.
		"writer deletes, streaming":     {false, ready, slot(true), status.CurrentStatus, "False/Flowing", true},
		"writer deletes, not streaming": {false, stopped, slot(false), status.InProgressStatus, "True/NotStreaming", true},
		"flowing":                       {false, ready, observation{backlog: backlog(time.Second, 600)}, status.CurrentStatus, "False/Flowing", false},
		"falling behind":                {false, ready, observation{backlog: backlog(5*time.Minute, 600)}, status.InProgressStatus, "True/FallingBehind", false},
		"not publishing":                {false, ready, observation{backlog: backlog(5*time.Minute, 0)}, status.FailedStatus, "True/NotPublishing", false},
		"suspended, waiting":            {true, stopped, observation{backlog: backlog(5*time.Minute, 0)}, status.CurrentStatus, "True/NoReadyReplicas", false},
		"backlog unreadable":            {false, ready, observation{err: "cannot reach PostgreSQL"}, status.CurrentStatus, "Unknown/BacklogUnavailable", false},
		"not read yet":                  {false, ready, observation{}, status.CurrentStatus, "Unknown/Observing", false},
	} {
		relay := unitRelay()
		relay.Spec.Replicas, relay.Spec.Suspend = ptr.To[int32](1), tc.suspend
		if tc.writerDeletes {
			relay.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication, WriterDeletes: true}
		}
		relay.Status = computeStatus(relay, tc.deploy, nil, tc.obs)
		c := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
		require.Equal(t, tc.lagging, string(c.Status)+"/"+c.Reason, name)
		obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(relay)
		require.NoError(t, err)
		res, err := status.Compute(&unstructured.Unstructured{Object: obj})
		require.NoError(t, err, name)
		require.Equal(t, tc.want, res.Status, "%s: %s", name, res.Message)
	}
}
