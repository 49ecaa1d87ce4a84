package controllers

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// This file is the autoscaler's arithmetic: pure functions of the spec, the
// backlog and the replicas running. The observer keeps the recommendation
// history the scale-down stabilization needs.

// recommendation is one count the autoscaler asked for.
type recommendation struct {
	at       time.Time
	replicas int32
}

// autoscaleBounds are minReplicas and maxReplicas with their defaults.
func autoscaleBounds(as *outboxv1alpha1.AutoscalingSpec) (lo, hi int32) {
	lo, hi = ptr.Deref(as.MinReplicas, outboxv1alpha1.DefaultMinReplicas), as.MaxReplicas
	return lo, max(hi, lo)
}

// recommendReplicas is the count the backlog asks for, before
// stabilization: the most any target asks for (pendingPerReplica: one
// replica per that many waiting rows; oldestAge: base, the count that ran
// when b was read, times oldest age / target, as a HorizontalPodAutoscaler
// scales on a ratio, and as it does, base itself while the ratio is within
// ageTolerance of 1), at least one while a row waits or a row is held,
// within the bounds. Without a reading it keeps the running count. floor
// is the fewest the relay needs whatever the backlog says (keepOne).
func recommendReplicas(as *outboxv1alpha1.AutoscalingSpec, b *outboxv1alpha1.BacklogStatus, running, base, floor int32) int32 {
	lo, hi := autoscaleBounds(as)
	lo = max(lo, floor)
	if b == nil {
		return min(max(running, lo), hi)
	}
	want := int32(0)
	if as.PendingPerReplica != nil && *as.PendingPerReplica > 0 {
		want = clampInt32(ceilDiv(b.Pending, *as.PendingPerReplica))
	}
	if target, err := time.ParseDuration(as.OldestAge); err == nil && target > 0 && b.Pending > 0 {
		ratio := b.OldestAge.Seconds() / target.Seconds()
		if math.Abs(ratio-1) <= ageTolerance {
			ratio = 1
		}
		want = max(want, clampInt32(int64(math.Ceil(float64(max(base, 1))*ratio))))
	}
	if b.Pending > 0 || heldForARelay(b.Held) > 0 {
		want = max(want, 1)
	}
	return min(max(want, lo), hi)
}

// ageTolerance is how far the oldest age may be from its target, as a
// fraction of it, before the age asks for another count: a
// HorizontalPodAutoscaler's default. Without it an age a little over its
// target, which more replicas do not lower (one streaming pod, one hot
// key), asked for one more replica at every reading, up to the maximum.
const ageTolerance = 0.1

// heldForARelay counts the held rows that only a running relay releases:
// it retries them (a refused or too-large row, once the topic takes it; an
// invalid one fixed by hand) and `relay redrive` runs in its pods; the rows
// blocked behind them follow. An unroutable row waits for the topic map,
// which no pod changes.
func heldForARelay(h outboxv1alpha1.HeldRows) int64 {
	return h.Invalid + h.TooLarge + h.Refused + h.Blocked
}

// keepOne is the floor of an autoscaled relay's count whatever its backlog
// says: one pod while the backlog cannot be read (unreadable: an operator
// that cannot see the table must not keep a relay at zero on a stale
// "nothing waits"), and one while the relay streams from a replication
// slot, which holds back the database's WAL while no pod reads it, beyond
// spec.capture.maxRetainedWAL, which only a streaming pod enforces.
func keepOne(relay *outboxv1alpha1.OutboxRelay, unreadable bool) int32 {
	if unreadable || streams(relay) {
		return 1
	}
	return 0
}

// stabilized is the count to run given the recommendations of the
// stabilization window (the newest is rec): up at once, down only to the
// highest count the window asked for. young: the history does not cover
// the window yet, so the running count still counts as asked for.
func stabilized(window []recommendation, rec, running int32, young bool) int32 {
	if rec >= running {
		return rec
	}
	highest := rec
	for _, r := range window {
		highest = max(highest, r.replicas)
	}
	if young {
		highest = max(highest, running)
	}
	return min(highest, running)
}

// scaleDownWindow is spec.autoscaling.scaleDownStabilization.
func scaleDownWindow(as *outboxv1alpha1.AutoscalingSpec) time.Duration {
	if d, err := time.ParseDuration(as.ScaleDownStabilization); err == nil && d >= 0 {
		return d
	}
	return outboxv1alpha1.DefaultScaleDownStabilization
}

// scaleMessage says why the autoscaler changed the count, for the event:
// "scaled 1 → 3: 12,400 rows waiting, oldest 48s".
func scaleMessage(from, to int32, b *outboxv1alpha1.BacklogStatus) string {
	if b == nil {
		return fmt.Sprintf("scaled %d → %d: the backlog has not been read", from, to)
	}
	approx := ""
	if b.Estimated {
		approx = "about "
	}
	msg := fmt.Sprintf("scaled %d → %d: %s%s rows waiting, oldest %s", from, to, approx, groupDigits(b.Pending), b.OldestAge.Duration)
	if from > to {
		msg += " (the highest count asked for in the stabilization window)"
	}
	return msg
}

// groupDigits writes n with thousands separators: 12400 → "12,400".
func groupDigits(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := n < 0
	if neg {
		s = s[1:]
	}
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if neg {
		s = "-" + s
	}
	return s
}

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }

func clampInt32(n int64) int32 {
	return int32(min(max(n, 0), math.MaxInt32))
}
