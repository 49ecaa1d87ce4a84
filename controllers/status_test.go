package controllers

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
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

	// A new generation that raised the threshold past the last reading's
	// oldest row: the old verdict does not carry over. Before, Lagging
	// stayed True, quoting the old threshold, for as long as reads failed.
	raised := relay(metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, 20*time.Second)
	raised.Status.Backlog.OldestAge = metav1.Duration{Duration: 5 * time.Minute}
	raised.Generation, raised.Status.Conditions[0].ObservedGeneration = 2, 1
	raised.Spec.LagThreshold = "1h"
	require.Equal(t, verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogUnavailable, failed.err}, lagging(raised, failed, 1, now))
	raised.Spec.LagThreshold = "2m"
	require.Equal(t, metav1.ConditionTrue, lagging(raised, failed, 1, now).status, "still past the new threshold")

	v = lagging(relay(metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, outboxv1alpha1.DefaultLagThreshold), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogUnavailable, failed.err}, v, "its last reading is as old as the threshold")

	// Found flowing, with its oldest row 10 s old: no row can be past the
	// threshold (1 min) until 50 s after that reading. Before, one failed
	// read made it Unknown at once (Argo CD: Degraded).
	flowing := func(observed time.Duration) *outboxv1alpha1.OutboxRelay {
		o := relay(metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing, observed)
		o.Status.Backlog.OldestAge = metav1.Duration{Duration: 10 * time.Second}
		o.Status.Conditions[0].Message = "oldest waiting row 10s old"
		return o
	}
	v = lagging(flowing(15*time.Second), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing, "oldest waiting row 10s old" + readingFailed + failed.err}, v)
	v = lagging(flowing(50*time.Second), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogUnavailable, failed.err}, v, "a row may have passed the threshold since")
	// With writer deletes the events wait in the slot, not the table: a
	// slot found unread 20 s before that reading may have been unread for
	// the threshold by now.
	unread := flowing(45 * time.Second)
	unread.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication, WriterDeletes: true}
	unread.Status.Backlog.OldestAge = metav1.Duration{}
	unread.Status.Backlog.Slot = &outboxv1alpha1.SlotStatus{Name: "s", Exists: true, InactiveSince: ptr.To(metav1.NewTime(now.Add(-65 * time.Second)))}
	require.Equal(t, outboxv1alpha1.ReasonBacklogUnavailable, lagging(unread, failed, 1, now).reason)
	unread.Status.Backlog.Slot.Active, unread.Status.Backlog.Slot.InactiveSince = true, nil
	require.Equal(t, outboxv1alpha1.ReasonFlowing, lagging(unread, failed, 1, now).reason, "a slot found streamed")
	retargeted := failed
	retargeted.retargeted = true
	v = lagging(flowing(time.Second), retargeted, 1, now)
	require.Equal(t, outboxv1alpha1.ReasonBacklogUnavailable, v.reason, "a reading of another table vouches for nothing")
}

// A failed read is measured against this manager's last good reading,
// not against status.backlog, whose observedAt an unchanged reading keeps
// for minutes. Before, an idle relay read every 15 s, its status showing a
// reading 3 min old, went Unknown (Argo CD: Degraded) at the first failed
// read, and a lagging one Ready.
func TestAFailedReadIsMeasuredAgainstTheLastReading(t *testing.T) {
	t.Parallel()
	now := time.Now()
	stored := func(status metav1.ConditionStatus, reason string) *outboxv1alpha1.OutboxRelay {
		return &outboxv1alpha1.OutboxRelay{Status: outboxv1alpha1.OutboxRelayStatus{
			Backlog:    &outboxv1alpha1.BacklogStatus{ObservedAt: metav1.NewTime(now.Add(-3 * time.Minute))},
			Conditions: []metav1.Condition{{Type: outboxv1alpha1.ConditionLagging, Status: status, Reason: reason, Message: "m"}},
		}}
	}
	failed := observation{err: "timeout reading the backlog",
		backlog: &outboxv1alpha1.BacklogStatus{ObservedAt: metav1.NewTime(now.Add(-15 * time.Second))}}
	v := lagging(stored(metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing, "m" + readingFailed + failed.err}, v)
	v = lagging(stored(metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing), failed, 1, now)
	require.Equal(t, verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, "m" + readingFailed + failed.err}, v)
	failed.backlog = nil // no reading by this manager: status's is the last
	require.Equal(t, metav1.ConditionUnknown, lagging(stored(metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing), failed, 1, now).status)
}

// With writer deletes, a slot no relay pod streams from is NotStreaming
// only once the operator's readings have found it so for longer than the
// threshold: a rollout or a standby's takeover leaves it unread for
// seconds. Before, one such reading made Lagging True (and Argo CD's
// health Degraded) at every deploy. The readings carry when the run of
// inactive ones began, and a reading that finds a relay streaming ends it.
func TestNotStreamingOnlyPastTheThreshold(t *testing.T) {
	t.Parallel()
	o, key, done := observedRelay()
	start := time.Now().Add(-5 * time.Minute).Truncate(time.Second)
	read := func(at time.Duration, active bool) *outboxv1alpha1.SlotStatus {
		s := &backlogSample{at: start.Add(at), slot: &outboxv1alpha1.SlotStatus{Name: "s", Exists: true, Active: active}}
		o.record(key, done, s, "", false)
		return s.slot
	}
	require.Nil(t, read(0, true).InactiveSince)
	require.Equal(t, start.Add(time.Minute), read(time.Minute, false).InactiveSince.Time)
	require.Equal(t, start.Add(time.Minute), read(2*time.Minute, false).InactiveSince.Time, "the run of inactive readings began then")
	require.Nil(t, read(3*time.Minute, true).InactiveSince)
	require.Equal(t, start.Add(4*time.Minute), read(4*time.Minute, false).InactiveSince.Time, "a new run")

	// A reading shared by two relays: each has its own run, and recording
	// one's changes nothing the other holds (their reconciles read it
	// without the lock).
	other := types.NamespacedName{Namespace: "shop", Name: "refunds"}
	otherDone := make(chan struct{})
	o.relays[other] = &relayFlow{done: otherDone, target: flowTarget{interval: 15 * time.Second}}
	shared := backlogSample{at: start.Add(5 * time.Minute), slot: &outboxv1alpha1.SlotStatus{Name: "s", Exists: true}}
	mine, theirs := shared, shared
	o.record(key, done, &mine, "", false)
	o.record(other, otherDone, &theirs, "", false)
	require.Equal(t, start.Add(4*time.Minute), mine.slot.InactiveSince.Time, "this relay's run")
	require.Equal(t, start.Add(5*time.Minute), theirs.slot.InactiveSince.Time, "the other relay's run began with this reading")
	require.Nil(t, shared.slot.InactiveSince, "the shared reading is left as it was read")

	relay := unitRelay()
	relay.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication, WriterDeletes: true}
	now := time.Now()
	obs := func(inactiveFor time.Duration) observation {
		return observation{backlog: &outboxv1alpha1.BacklogStatus{ObservedAt: metav1.NewTime(now), PublishedPerMinute: ptr.To[int64](0),
			Slot: &outboxv1alpha1.SlotStatus{Name: "s", Exists: true, InactiveSince: ptr.To(metav1.NewTime(now.Add(-inactiveFor)))}}}
	}
	v := lagging(relay, obs(10*time.Second), 0, now)
	require.Equal(t, metav1.ConditionFalse, v.status, "unread for 10 s: %s", v.message)
	v = lagging(relay, obs(outboxv1alpha1.DefaultLagThreshold+time.Second), 0, now)
	require.Equal(t, metav1.ConditionTrue, v.status)
	require.Equal(t, outboxv1alpha1.ReasonNotStreaming, v.reason)
}

// A relay found lagging flows again only once its oldest row is a tenth
// under the threshold, so a backlog whose age saw-tooths across the
// threshold does not flip Lagging, Ready and Argo CD's health at every
// reading; one not lagging turns so only past the threshold.
func TestLaggingHasHysteresis(t *testing.T) {
	t.Parallel()
	now := time.Now()
	relay := func(lagging bool) *outboxv1alpha1.OutboxRelay {
		r := unitRelay()
		if lagging {
			r.Status.Conditions = []metav1.Condition{{Type: outboxv1alpha1.ConditionLagging, Status: metav1.ConditionTrue,
				Reason: outboxv1alpha1.ReasonFallingBehind}}
		}
		return r
	}
	obs := func(age time.Duration) observation {
		return observation{backlog: &outboxv1alpha1.BacklogStatus{Pending: 10, OldestAge: metav1.Duration{Duration: age},
			PublishedPerMinute: ptr.To[int64](600), ObservedAt: metav1.NewTime(now)}}
	}
	for _, tc := range []struct {
		lagging bool
		age     time.Duration
		want    metav1.ConditionStatus
	}{
		{false, 59 * time.Second, metav1.ConditionFalse},
		{false, 61 * time.Second, metav1.ConditionTrue},
		{true, 61 * time.Second, metav1.ConditionTrue},
		{true, 57 * time.Second, metav1.ConditionTrue}, // within a tenth under the threshold
		{true, 53 * time.Second, metav1.ConditionFalse},
	} {
		v := lagging(relay(tc.lagging), obs(tc.age), 1, now)
		require.Equal(t, tc.want, v.status, "lagging before: %v, oldest row %s: %s", tc.lagging, tc.age, v.message)
	}
}

// A relay whose spec now names another table (or database) shows nothing
// of the old one's backlog: not in status, not as a reason to stay
// Lagging, until the new one is read. Before, a new table that could not
// be read yet (not created) kept the old table's numbers in status and
// the gauges, under the new generation.
func TestRetargetedRelayDropsTheOldBacklog(t *testing.T) {
	t.Parallel()
	key := types.NamespacedName{Namespace: "shop", Name: "orders"}
	o := NewFlowObserver()
	orders, err := outbox.ParseTable("orders_outbox")
	require.NoError(t, err)
	refunds, err := outbox.ParseTable("refunds_outbox")
	require.NoError(t, err)
	target := flowTarget{dsn: fakeDSN, auth: dbAuth{method: relayconfig.DatabaseAuthPassword}, table: orders, interval: 15 * time.Second}
	o.Observe(key, target)
	o.record(key, o.relays[key].done, &backlogSample{at: time.Now()}, "", false)
	require.False(t, o.Observe(key, target).retargeted)

	target.table = refunds
	view := o.Observe(key, target)
	require.True(t, view.retargeted)
	require.Nil(t, view.sample)
	o.record(key, o.relays[key].done, &backlogSample{}, `relation "refunds_outbox" does not exist`, false)
	view = o.Observe(key, target)
	require.True(t, view.retargeted, "until a read of the new table succeeds")

	relay := unitRelay()
	relay.Status.Backlog = &outboxv1alpha1.BacklogStatus{Pending: 500, OldestAge: metav1.Duration{Duration: 5 * time.Minute},
		ObservedAt: metav1.NewTime(time.Now().Add(-5 * time.Second))}
	relay.Status.Conditions = []metav1.Condition{{Type: outboxv1alpha1.ConditionLagging, Status: metav1.ConditionTrue,
		Reason: outboxv1alpha1.ReasonFallingBehind, Message: "oldest waiting row 5m0s old"}}
	st := computeStatus(relay, nil, nil, observation{err: view.lastErr, retargeted: view.retargeted})
	require.Nil(t, st.Backlog, "the old table's backlog")
	lagging := meta.FindStatusCondition(st.Conditions, outboxv1alpha1.ConditionLagging)
	require.Equal(t, metav1.ConditionUnknown, lagging.Status, lagging.Message)
	require.Equal(t, outboxv1alpha1.ReasonBacklogUnavailable, lagging.Reason)

	o.record(key, o.relays[key].done, &backlogSample{at: time.Now()}, "", false)
	require.False(t, o.Observe(key, target).retargeted)
}

// A DSN whose password (or user) rotated, as Vault's database secrets do
// every hour, reads the same table: the observer reconnects, and what it
// read stands. Before, each rotation dropped the backlog from status and
// the gauges, and Lagging went Unknown until the next reading. Another
// host or database is another target.
func TestRotatedCredentialsKeepTheReading(t *testing.T) {
	t.Parallel()
	key := types.NamespacedName{Namespace: "shop", Name: "orders"}
	o := NewFlowObserver()
	t.Cleanup(func() { o.Forget(key) })
	table, err := outbox.ParseTable("outbox")
	require.NoError(t, err)
	target := flowTarget{dsn: fakeDSN, auth: dbAuth{method: relayconfig.DatabaseAuthPassword}, table: table, interval: 15 * time.Second}
	o.Observe(key, target)
	o.record(key, o.relays[key].done, &backlogSample{at: time.Now(), read: 7}, "", false)

	target.dsn = "postgres://relay-v2:rotated@db.example:5432/orders"
	view := o.Observe(key, target)
	require.False(t, view.retargeted, "the same database")
	require.NotNil(t, view.sample, "the reading stands")
	require.Equal(t, target.dsn, o.relays[key].target.dsn, "the observer reads with the new credentials")

	target.dsn = "postgres://relay-v2:again@db.example:5432/orders?sslmode=require"
	require.False(t, o.Observe(key, target).retargeted, "TLS settings changed: the same database")

	target.dsn = "postgres://relay-v2:again@db.example:5432/orders?search_path=billing"
	require.True(t, o.Observe(key, target).retargeted, "another search_path: maybe another table")
	o.record(key, o.relays[key].done, &backlogSample{at: time.Now(), read: 7}, "", false)

	target.dsn = "postgres://relay-v2:rotated@db.example:5432/refunds?search_path=billing"
	view = o.Observe(key, target)
	require.True(t, view.retargeted, "another database")
	require.Nil(t, view.sample)
}

// A Deployment whose ReplicaSet cannot create pods (a service account that
// does not exist, a ResourceQuota, a Pod Security refusal) makes the relay
// Degraded with the Deployment's reason at once. Before, it said "nothing
// is degraded" until the progress deadline (10 minutes by default), and
// that reason never reached the status.
func TestAReplicaFailureIsDegradedAtOnce(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	relay.Spec.Replicas = ptr.To[int32](1)
	deploy := &appsv1.Deployment{Status: appsv1.DeploymentStatus{Conditions: []appsv1.DeploymentCondition{{
		Type: appsv1.DeploymentReplicaFailure, Status: corev1.ConditionTrue, Reason: "FailedCreate",
		Message: `pods "orders-relay-5d9c-" is forbidden: error looking up service account shop/typo: serviceaccount "typo" not found`,
	}}}}
	st := computeStatus(relay, deploy, nil, observation{})
	degraded := meta.FindStatusCondition(st.Conditions, outboxv1alpha1.ConditionDegraded)
	require.Equal(t, metav1.ConditionTrue, degraded.Status, degraded.Message)
	require.Equal(t, outboxv1alpha1.ReasonReplicaFailure, degraded.Reason)
	require.Contains(t, degraded.Message, `serviceaccount "typo" not found`)
	ready := meta.FindStatusCondition(st.Conditions, outboxv1alpha1.ConditionReady)
	require.Equal(t, metav1.ConditionFalse, ready.Status)
	require.Equal(t, outboxv1alpha1.ReasonReplicaFailure, ready.Reason)
	require.Contains(t, ready.Message, "0 of 1 replicas ready; the Deployment cannot create pods")

	// Once pods are created the condition goes, and so does the verdict.
	deploy.Status.Conditions[0].Status = corev1.ConditionFalse
	st = computeStatus(relay, deploy, nil, observation{})
	require.False(t, meta.IsStatusConditionTrue(st.Conditions, outboxv1alpha1.ConditionDegraded))
}

// A relay whose slot nobody streams from reads the same numbers at every
// reading: its status keeps the stored observedAt, as an idle relay's does,
// and is not rewritten. Before, the start of the inactive run kept the
// reading's fraction of a second, which the stored status (to the second)
// never equalled.
func TestAnInactiveSlotKeepsTheStoredObservedAt(t *testing.T) {
	t.Parallel()
	o, key, done := observedRelay()
	relay := unitRelay()
	first := time.Now().Add(-time.Minute).Truncate(time.Second).Add(400 * time.Millisecond)
	reading := func(at time.Time) *outboxv1alpha1.BacklogStatus {
		s := &backlogSample{at: at, slot: &outboxv1alpha1.SlotStatus{Name: "s", Exists: true}}
		o.record(key, done, s, "", false)
		return backlogStatus(relay, s)
	}
	raw, err := json.Marshal(reading(first))
	require.NoError(t, err)
	var stored outboxv1alpha1.BacklogStatus
	require.NoError(t, json.Unmarshal(raw, &stored))
	next := reading(first.Add(20 * time.Second))
	require.Equal(t, stored.ObservedAt, withObservedAt(&stored, next).ObservedAt)
}

// observedRelay is a flow observer with one relay, shop/orders, read every
// 15 s: record takes its readings with done.
func observedRelay() (o *FlowObserver, key types.NamespacedName, done chan struct{}) {
	key = types.NamespacedName{Namespace: "shop", Name: "orders"}
	o, done = NewFlowObserver(), make(chan struct{})
	o.relays[key] = &relayFlow{done: done, target: flowTarget{interval: 15 * time.Second}}
	return o, key, done
}

// The publish rate counts what the relay does to a row it published:
// marks (updates) in Mark mode, deletes in Delete mode. Pruning deletes
// rows published long ago: before, a relay that had stopped publishing
// while its pruner deleted read as FallingBehind ("N published in the
// last minute"), never NotPublishing.
func TestPublishRateCountsWhatTheRelayDoes(t *testing.T) {
	t.Parallel()
	o, key, done := observedRelay()
	start := time.Now()
	read := func(at time.Duration, updated, deleted int64) *int64 {
		s := &backlogSample{at: start.Add(at), tracked: true, updated: updated, deleted: deleted}
		o.record(key, done, s, "", false)
		return s.perMinute
	}
	read(0, 100, 50)
	require.Equal(t, int64(0), *read(time.Minute, 100, 650), "Mark: pruning's deletes are no publishing")
	require.Equal(t, int64(30), *read(2*time.Minute, 130, 650))

	o.Observe(key, flowTarget{interval: 15 * time.Second, deletes: true})
	require.Nil(t, read(3*time.Minute, 130, 650), "another counter: the rate starts again")
	require.Equal(t, int64(40), *read(4*time.Minute, 130, 690), "Delete: the deletes")
}
