package controllers

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

func TestRecommendReplicas(t *testing.T) {
	t.Parallel()
	perRow := &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](0), MaxReplicas: 10, PendingPerReplica: ptr.To[int64](1000)}
	byAge := &outboxv1alpha1.AutoscalingSpec{MaxReplicas: 10, OldestAge: "10s"}
	both := &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](2), MaxReplicas: 6, PendingPerReplica: ptr.To[int64](1000), OldestAge: "10s"}
	backlog := func(pending int64, age time.Duration) *outboxv1alpha1.BacklogStatus {
		return &outboxv1alpha1.BacklogStatus{Pending: pending, OldestAge: metav1.Duration{Duration: age}}
	}
	for name, tc := range map[string]struct {
		as         *outboxv1alpha1.AutoscalingSpec
		b          *outboxv1alpha1.BacklogStatus
		running    int32
		want       int32
		unreadable bool
	}{
		"idle, min 0":                      {perRow, backlog(0, 0), 3, 0, false},
		"one row wakes a replica":          {perRow, backlog(1, 0), 0, 1, false},
		"12,400 rows at 1000 per replica":  {perRow, backlog(12400, time.Second), 1, 10, false},
		"3,000 rows at 1000 per replica":   {perRow, backlog(3000, time.Second), 1, 3, false},
		"no reading yet keeps the running": {perRow, nil, 4, 4, false},
		"no reading yet keeps zero":        {perRow, nil, 0, 0, false},
		"unreadable never keeps zero":      {perRow, nil, 0, 1, true},
		"unreadable after a stale 0 wakes": {perRow, backlog(0, 0), 0, 1, true},
		"48s against 10s with one replica": {byAge, backlog(5, 48*time.Second), 1, 5, false},
		"age under target, rows wait":      {byAge, backlog(5, 2*time.Second), 4, 1, false},
		"age: min 1 by default":            {byAge, backlog(0, 0), 3, 1, false},
		"both: the higher, within the max": {both, backlog(2500, 40*time.Second), 2, 6, false},
		"both: the min":                    {both, backlog(0, 0), 4, 2, false},
	} {
		floor := int32(0)
		if tc.unreadable {
			floor = 1
		}
		require.Equal(t, tc.want, recommendReplicas(tc.as, tc.b, tc.running, tc.running, floor), name)
	}

	// Held rows keep one replica at min 0, as only a running relay retries
	// them and runs `relay redrive`; unroutable ones do not.
	held := func(h outboxv1alpha1.HeldRows) *outboxv1alpha1.BacklogStatus {
		b := backlog(0, 0)
		b.Held = h
		return b
	}
	for _, h := range []outboxv1alpha1.HeldRows{{Refused: 5}, {TooLarge: 1}, {Invalid: 2}, {Blocked: 3}} {
		require.Equal(t, int32(1), recommendReplicas(perRow, held(h), 0, 0, 0), "%+v", h)
	}
	require.Equal(t, int32(0), recommendReplicas(perRow, held(outboxv1alpha1.HeldRows{Unroutable: 7}), 2, 2, 0))

	// A streaming relay keeps one pod at min 0: with none its slot holds back WAL without bound.
	lr := unitRelay()
	lr.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication}
	require.Equal(t, int32(1), recommendReplicas(perRow, backlog(0, 0), 1, 1, keepOne(lr, false)))
	require.Equal(t, int32(0), recommendReplicas(perRow, backlog(0, 0), 1, 1, keepOne(unitRelay(), false)))
	require.Equal(t, int32(1), keepOne(unitRelay(), true))

	// An age within a tenth of its target keeps the count (a
	// HorizontalPodAutoscaler's tolerance): one over it asked for one more
	// replica at every reading, up to the maximum.
	require.Equal(t, int32(4), recommendReplicas(byAge, backlog(5, 10500*time.Millisecond), 4, 4, 0))
	require.Equal(t, int32(4), recommendReplicas(byAge, backlog(5, 9500*time.Millisecond), 4, 4, 0))
	require.Equal(t, int32(5), recommendReplicas(byAge, backlog(5, 12*time.Second), 4, 4, 0))
}

func TestStabilized(t *testing.T) {
	t.Parallel()
	now := time.Now()
	recs := func(counts ...int32) []recommendation {
		out := make([]recommendation, len(counts))
		for i, n := range counts {
			out[i] = recommendation{at: now.Add(time.Duration(i-len(counts)) * 15 * time.Second), replicas: n}
		}
		return out
	}
	require.Equal(t, int32(8), stabilized(recs(2, 8), 8, 3, false), "up at once")
	require.Equal(t, int32(5), stabilized(recs(5, 2, 1), 1, 6, false), "down to the window's highest")
	require.Equal(t, int32(1), stabilized(recs(1, 1), 1, 6, false), "down when the window asked for no more")
	require.Equal(t, int32(6), stabilized(recs(1), 1, 6, true), "a history shorter than the window keeps the running count")
	require.Equal(t, int32(0), stabilized(recs(0, 0), 0, 1, false), "to zero")
}

func TestScaleMessage(t *testing.T) {
	t.Parallel()
	b := &outboxv1alpha1.BacklogStatus{Pending: 12400, OldestAge: metav1.Duration{Duration: 48 * time.Second}}
	require.Equal(t, "scaled 1 → 3: 12,400 rows waiting, oldest 48s", scaleMessage(1, 3, b))
	b.Estimated, b.Pending = true, 1234567
	require.Equal(t, "scaled 3 → 10: about 1,234,567 rows waiting, oldest 48s", scaleMessage(3, 10, b))
	require.Equal(t, "0", groupDigits(0))
	require.Equal(t, "999", groupDigits(999))
	require.Equal(t, "1,000", groupDigits(1000))
}

// Unchanged numbers keep their observedAt for a while, so an idle relay's
// status is not rewritten at every reading; changed ones take the new time.
func TestObservedAtRenewal(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(d time.Duration, pending int64) *outboxv1alpha1.BacklogStatus {
		return &outboxv1alpha1.BacklogStatus{Pending: pending, ObservedAt: metav1.NewTime(t0.Add(d))}
	}
	require.Equal(t, t0, withObservedAt(at(0, 0), at(15*time.Second, 0)).ObservedAt.Time, "same numbers")
	require.Equal(t, t0.Add(15*time.Second), withObservedAt(at(0, 0), at(15*time.Second, 1)).ObservedAt.Time, "new numbers")
	require.Equal(t, t0.Add(5*time.Minute), withObservedAt(at(0, 0), at(5*time.Minute, 0)).ObservedAt.Time, "renewed")
	require.Equal(t, t0, withObservedAt(nil, at(0, 0)).ObservedAt.Time)
}

// While the backlog cannot be read, the autoscaler keeps the running count:
// the last reading that succeeded, however old, may ask for more replicas,
// never for fewer. Before, it scaled down on it once the window passed,
// while rows could pile up unseen.
func TestAutoscalerKeepsTheCountWhileTheBacklogCannotBeRead(t *testing.T) {
	t.Parallel()
	_, key, r, relay := autoscaledRelay("0s")
	eight := running(8)
	low := &outboxv1alpha1.BacklogStatus{Pending: 500}
	failing := "cannot reach PostgreSQL"
	require.Equal(t, int32(1), r.decideReplicas(key, relay, observation{backlog: low}, eight), "a current reading scales down")
	require.Equal(t, int32(8), r.decideReplicas(key, relay, observation{backlog: low, err: failing}, eight), "an old one does not")
	high := &outboxv1alpha1.BacklogStatus{Pending: 9500}
	require.Equal(t, int32(10), r.decideReplicas(key, relay, observation{backlog: high, err: failing}, eight), "it may ask for more")
}

// Autoscaling turned off and on again, or given a longer window, keeps the
// running count for the window, as when it first began. Before, the
// history from before let its first low recommendation scale 10 to 1.
func TestAutoscalingOnAgainStabilizesAnew(t *testing.T) {
	t.Parallel()
	o, key, r, relay := autoscaledRelay("5m")
	ten := running(10)
	low := observation{backlog: &outboxv1alpha1.BacklogStatus{Pending: 500}}
	longAgo := func() {
		o.relays[key].since, o.relays[key].window, o.relays[key].recs = time.Now().Add(-24*time.Hour), 5*time.Minute, nil
	}
	longAgo()
	require.Equal(t, int32(1), r.decideReplicas(key, relay, low, ten), "a history as long as the window: down at once")

	longAgo()
	off := relay.DeepCopy()
	off.Spec.Autoscaling, off.Spec.Replicas = nil, ptr.To[int32](10)
	require.Equal(t, int32(10), r.decideReplicas(key, off, observation{}, ten))
	require.Equal(t, int32(10), r.decideReplicas(key, relay, low, ten), "on again: the running count stays for the window")

	longAgo()
	longer := relay.DeepCopy()
	longer.Spec.Autoscaling.ScaleDownStabilization = "1h"
	require.Equal(t, int32(10), r.decideReplicas(key, longer, low, ten), "a longer window has no history that long yet")
}

// autoscaledRelay is an observed relay autoscaled from 1 to 10 replicas,
// one per 1000 pending rows, scaling down after window, and its reconciler.
func autoscaledRelay(window string) (*FlowObserver, types.NamespacedName, *OutboxRelayReconciler, *outboxv1alpha1.OutboxRelay) {
	o, key, _ := observedRelay()
	relay := unitRelay()
	relay.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](1), MaxReplicas: 10,
		PendingPerReplica: ptr.To[int64](1000), ScaleDownStabilization: window}
	return o, key, &OutboxRelayReconciler{Flow: o}, relay
}

// running is a Deployment asked to run n replicas.
func running(n int32) *appsv1.Deployment {
	return &appsv1.Deployment{Spec: appsv1.DeploymentSpec{Replicas: ptr.To(n)}}
}
