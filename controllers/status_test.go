package controllers

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// One failed reading does not turn a relay found lagging into one whose
// flow is unknown (and so Ready): it stays lagging while its last reading
// is younger than the threshold, and is Unknown after that, as a relay
// never found lagging is at once.
func TestLaggingOutlivesAFailedReading(t *testing.T) {
	t.Parallel()
	now := time.Now()
	failed := observation{err: "timeout reading the backlog"}
	relay := func(status metav1.ConditionStatus, reason string, observed time.Duration) *outboxv1alpha1.OutboxRelay {
		return &outboxv1alpha1.OutboxRelay{Status: outboxv1alpha1.OutboxRelayStatus{
			Backlog: &outboxv1alpha1.BacklogStatus{Pending: 500, ObservedAt: metav1.NewTime(now.Add(-observed))},
			Conditions: []metav1.Condition{{Type: outboxv1alpha1.ConditionLagging, Status: status, Reason: reason,
				Message: "oldest waiting row 5m0s old"}},
		}}
	}
	v := lagging(relay(metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, 20*time.Second), failed, 1, now)
	require.Equal(t, metav1.ConditionTrue, v.status)
	require.Equal(t, outboxv1alpha1.ReasonNotPublishing, v.reason)
	require.Equal(t, "oldest waiting row 5m0s old"+readingFailed+failed.err, v.message)
	again := relay(v.status, v.reason, 30*time.Second)
	again.Status.Conditions[0].Message = v.message
	require.Equal(t, v, lagging(again, failed, 1, now), "a second failure does not grow the message")

	v = lagging(relay(metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, defaultLagThreshold), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogUnavailable, failed.err}, v, "its last reading is as old as the threshold")

	v = lagging(relay(metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing, 20*time.Second), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogUnavailable, failed.err}, v, "flowing: nothing to keep")
}
