package controllers

import (
	"cmp"
	"fmt"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// problem is why a relay cannot run as specified: it becomes the Ready reason.
type problem struct {
	reason, message string
	// requeue: a dependency may appear without an event we watch.
	requeue bool
}

// observation is what the operator knows of the backlog: the status built
// from the last successful read (nil before one), and why the last read
// failed ("" when it did not).
type observation struct {
	backlog *outboxv1alpha1.BacklogStatus
	err     string
	// notRead says why the operator does not read the backlog by choice.
	notRead string
	// retargeted: the spec now names another table or database, not read
	// yet; status.backlog is the old one's.
	retargeted bool
}

// tokenLoginsOff is Lagging's message for a relay whose backlog the
// operator does not read because reading it would send a token of the
// operator's own cloud identity to a host the OutboxRelay names.
const tokenLoginsOff = "the operator does not read the backlog of a relay with spec.database.auth: it would log in with a token of its own cloud identity at the host the DSN names, which whoever may create an OutboxRelay chooses; the manager's --database-token-logins allows it. The relay pods' metrics show the backlog"

// lagThreshold is spec.lagThreshold.
func lagThreshold(relay *outboxv1alpha1.OutboxRelay) time.Duration {
	if d, err := time.ParseDuration(relay.Spec.LagThreshold); err == nil && d > 0 {
		return d
	}
	return outboxv1alpha1.DefaultLagThreshold
}

// slotUnreadSince reports whether relay, with writer deletes, found its
// slot unread by any relay pod in reading b since at least threshold
// before now: its events may have waited in the WAL that long.
func slotUnreadSince(relay *outboxv1alpha1.OutboxRelay, b *outboxv1alpha1.BacklogStatus, now time.Time, threshold time.Duration) bool {
	c := relay.Spec.Capture
	if c == nil || !c.WriterDeletes || b == nil || b.Slot == nil || !b.Slot.Exists || b.Slot.Active {
		return false
	}
	since := b.ObservedAt.Time
	if b.Slot.InactiveSince != nil {
		since = b.Slot.InactiveSince.Time
	}
	return now.Sub(since) >= threshold
}

// readingFailed joins a lagging relay's last reading and the latest
// reading's failure in Lagging's message.
const readingFailed = "; the latest reading failed: "

// lagging is the Lagging condition for an observation: Unknown without a
// current reading (none yet, or the last read failed: an earlier sample
// cannot vouch for the flow now, unless it found the relay lagging less
// than the threshold ago, or found its oldest row young enough that no row
// can have passed the threshold since), True when the oldest
// waiting row is older than the threshold, with the reason that best says
// why: no ready replica, nothing published in the last minute, or too slow.
func lagging(relay *outboxv1alpha1.OutboxRelay, obs observation, ready int32, now time.Time) verdict {
	threshold := lagThreshold(relay)
	b := obs.backlog
	// last is the latest good reading: this manager's (kept through a
	// failed read), else the one status holds. Status keeps an unchanged
	// reading's observedAt for minutes (withObservedAt), so it is the
	// older of the two; before, a failed read was measured against it, and
	// an idle relay read every 15 s went Unknown at the first failure.
	last := b
	if last == nil {
		last = relay.Status.Backlog
	}
	prev := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
	switch {
	case obs.notRead != "":
		return verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogNotRead, obs.notRead}
	case b == nil && obs.err == "":
		// Not read yet by this manager, just started or newly leader: the
		// verdict of the reading status holds stands, as it was, until this
		// manager's first read ends (a read has a deadline). Before, it was
		// Unknown meanwhile: a restart wrote every relay's status twice,
		// and called a stalled relay Ready until its first reading. Only
		// a reading that a running manager would still be showing counts
		// (it renews observedAt within backlogRenewal), not one of a relay
		// paused or left unobserved for longer.
		if prev != nil && prev.Status != metav1.ConditionUnknown && !obs.retargeted &&
			prev.ObservedGeneration == relay.Generation && readingCurrent(relay, relay.Status.Backlog, now) {
			return verdict{prev.Status, prev.Reason, prev.Message}
		}
		return verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonObserving, "the operator has not read the backlog yet"}
	case obs.err != "":
		// A relay found lagging stays so while its last reading is younger
		// than the threshold: one failed read (a timeout, most likely when
		// the database is overloaded) must not call a stalled relay Ready
		// until the next reading says it is stalled again.
		// Under a new generation (a threshold raised, say), only while the
		// last reading's oldest row, or its unread slot, is still past
		// this generation's threshold.
		if prev != nil && !obs.retargeted &&
			prev.Status == metav1.ConditionTrue && last != nil && now.Sub(last.ObservedAt.Time) < threshold &&
			(prev.ObservedGeneration == relay.Generation ||
				last.OldestAge.Duration+now.Sub(last.ObservedAt.Time) >= threshold || slotUnreadSince(relay, last, now, threshold)) {
			msg, _, _ := strings.Cut(prev.Message, readingFailed)
			return verdict{metav1.ConditionTrue, prev.Reason, msg + readingFailed + obs.err}
		}
		// A relay found flowing stays so while no row can have waited past
		// the threshold since: a row waiting now was that old then, or has
		// come since; with writer deletes, while a slot found unread has
		// not been so for the threshold (NotStreaming, above). Before, one
		// failed read made it Unknown at once, which Argo CD's health
		// check reads as Degraded.
		if prev != nil && !obs.retargeted &&
			prev.Status == metav1.ConditionFalse && last != nil &&
			last.OldestAge.Duration+now.Sub(last.ObservedAt.Time) < threshold &&
			!slotUnreadSince(relay, last, now, threshold) {
			msg, _, _ := strings.Cut(prev.Message, readingFailed)
			return verdict{metav1.ConditionFalse, prev.Reason, msg + readingFailed + obs.err}
		}
		return verdict{metav1.ConditionUnknown, outboxv1alpha1.ReasonBacklogUnavailable, obs.err}
	}
	approx := ""
	if b.Estimated {
		approx = "about "
	}
	published := "the publish rate is not known yet"
	if b.PublishedPerMinute != nil {
		published = groupDigits(*b.PublishedPerMinute) + " published in the last minute"
	}
	msg := fmt.Sprintf("oldest waiting row %s old (threshold %s); %s%s rows waiting, %s, %d ready replicas",
		b.OldestAge.Duration, threshold, approx, groupDigits(b.Pending), published, ready)
	if s := b.Slot; s != nil && !streams(relay) {
		retained := "WAL"
		if s.RetainedWAL != nil {
			retained = s.RetainedWAL.String() + " of WAL"
		}
		msg += fmt.Sprintf("; replication slot %s, left by logical replication, holds back %s that no relay gives up: "+
			"once no events written with writer deletes wait in it (status.backlog.slot.confirmedLag near zero), drop it with SELECT pg_drop_replication_slot('%s')",
			s.Name, retained, s.Name)
	}
	if c := relay.Spec.Capture; c != nil && c.WriterDeletes && b.Slot != nil && b.Slot.Exists && !b.Slot.Active &&
		(b.Slot.InactiveSince == nil || now.Sub(b.Slot.InactiveSince.Time) > threshold) {
		// The writers deleted their rows: the table shows no backlog, and
		// whatever they wrote since the slot's confirmed position waits in
		// its WAL with nobody reading it, for longer than the threshold (a
		// rollout or a standby's takeover leaves it unread for seconds).
		lag := "an unknown amount of WAL"
		if b.Slot.ConfirmedLag != nil {
			lag = b.Slot.ConfirmedLag.String() + " of WAL"
		}
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNotStreaming, fmt.Sprintf(
			"with writer deletes the events wait in replication slot %s, and no relay pod streams from it (%s not confirmed); %d ready replicas",
			b.Slot.Name, lag, ready)}
	}
	// A relay found lagging flows again once its oldest row is a tenth
	// under the threshold: a backlog whose age saw-tooths across the
	// threshold does not flip Lagging (and Ready, and its events) at
	// every reading.
	stillLagging := prev != nil && prev.Status == metav1.ConditionTrue
	if stillLagging && b.OldestAge.Duration <= threshold {
		msg += fmt.Sprintf("; lagging until the oldest row is under %s", threshold-threshold/lagHysteresis)
	}
	switch {
	case b.OldestAge.Duration <= threshold && !(stillLagging && b.OldestAge.Duration > threshold-threshold/lagHysteresis):
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonFlowing, msg}
	case ready == 0:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNoReadyReplicas, msg}
	case b.PublishedPerMinute != nil && *b.PublishedPerMinute == 0:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, msg}
	default:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonFallingBehind, msg}
	}
}

// lagHysteresis: a lagging relay flows again once its oldest row is
// 1/lagHysteresis of the threshold under it.
const lagHysteresis = 10

// backlogRenewal is how long unchanged backlog numbers keep their
// observedAt: an idle relay's status is then rewritten every few minutes,
// not at every reading.
const backlogRenewal = 5 * time.Minute

// readingCurrent reports whether reading b (nil: none) is one a manager
// that reads the backlog would still be showing: observed less than
// backlogRenewal plus lagThreshold before now. An older one neither
// vouches for the flow nor stays in status and the gauges.
func readingCurrent(relay *outboxv1alpha1.OutboxRelay, b *outboxv1alpha1.BacklogStatus, now time.Time) bool {
	return b != nil && now.Sub(b.ObservedAt.Time) < backlogRenewal+lagThreshold(relay)
}

// statusRefresh is how long a status whose backlog numbers moved only a
// little (the age of the oldest row, a tenth of the pending rows or of the
// publish rate, or backlogSmallMove) is left as it is: a thousand relays would otherwise patch
// their status at every reading, all the time, because ages grow. The
// operator's metrics carry every reading; anything that changes a
// condition's status or reason is written at once.
const statusRefresh = time.Minute

// settled reports whether new differs from old only in what statusRefresh
// lets wait, and old's backlog was observed less than statusRefresh before now.
func settled(old, new outboxv1alpha1.OutboxRelayStatus, now time.Time) bool {
	if old.Backlog == nil || new.Backlog == nil || now.Sub(old.Backlog.ObservedAt.Time) >= statusRefresh ||
		!backlogClose(*old.Backlog, *new.Backlog) {
		return false
	}
	n := *new.DeepCopy()
	n.Backlog = old.Backlog
	for i, c := range n.Conditions {
		if o := meta.FindStatusCondition(old.Conditions, c.Type); o != nil && o.Status == c.Status && o.Reason == c.Reason &&
			o.ObservedGeneration == c.ObservedGeneration {
			n.Conditions[i] = *o // the message carries the numbers
		}
	}
	return equality.Semantic.DeepEqual(old, n)
}

// backlogSmallMove is how far pending rows (or rows published a minute)
// may move and still count as a small move whatever their size: a busy
// relay that keeps up finds a few rows waiting at one reading and none at
// the next, and a thousand such relays must not patch their status at
// every reading.
const backlogSmallMove = 50

// backlogClose reports whether b moved only a little from a: pending rows,
// publish rate and each count of held rows within a tenth or
// backlogSmallMove, whatever the age of the oldest row. Held rows that
// appear or are all gone are no small move; a count that grows steadily
// (unroutable rows of a busy type, rows blocked behind one key) is, or
// such a relay would patch its status at every reading.
func backlogClose(a, b outboxv1alpha1.BacklogStatus) bool {
	near := func(x, y int64) bool {
		d := x - y
		d = max(d, -d)
		return d <= backlogSmallMove || 10*d <= max(x, y)
	}
	heldNear := func(x, y int64) bool { return (x == 0) == (y == 0) && near(x, y) }
	ha, hb := a.Held, b.Held
	if !heldNear(ha.Unroutable, hb.Unroutable) || !heldNear(ha.Invalid, hb.Invalid) || !heldNear(ha.TooLarge, hb.TooLarge) ||
		!heldNear(ha.Refused, hb.Refused) || !heldNear(ha.Blocked, hb.Blocked) {
		return false
	}
	if a.Estimated != b.Estimated || !near(a.Pending, b.Pending) ||
		(a.PublishedPerMinute == nil) != (b.PublishedPerMinute == nil) {
		return false
	}
	return a.PublishedPerMinute == nil || near(*a.PublishedPerMinute, *b.PublishedPerMinute)
}

// withObservedAt is b, keeping the observedAt of old when old has the
// same numbers and was observed less than backlogRenewal before.
func withObservedAt(old, b *outboxv1alpha1.BacklogStatus) *outboxv1alpha1.BacklogStatus {
	if old == nil || b.ObservedAt.Sub(old.ObservedAt.Time) >= backlogRenewal {
		return b
	}
	same := *b
	same.ObservedAt = old.ObservedAt
	if !equality.Semantic.DeepEqual(*old, same) {
		return b
	}
	return &same
}

// computeStatus derives a relay's status from its spec, the Deployment as
// observed (nil when there is none), the problem that stopped the reconcile,
// if any, and the backlog observation. Conditions keep their transition
// times when unchanged. desiredReplicas reads status.desiredReplicas for an
// autoscaled relay, so Reconcile sets it first.
func computeStatus(relay *outboxv1alpha1.OutboxRelay, deploy *appsv1.Deployment, prob *problem, obs observation) outboxv1alpha1.OutboxRelayStatus {
	st := *relay.Status.DeepCopy()
	desired := desiredReplicas(relay)
	st.DesiredReplicas = desired
	switch {
	case obs.backlog != nil:
		st.Backlog = withObservedAt(relay.Status.Backlog, obs.backlog)
	case obs.notRead != "":
		st.Backlog = nil // an earlier reading (before an upgrade) would stand in status and the gauges for good
	case obs.retargeted:
		st.Backlog = nil // the old table's numbers, or the old database's
	case prob != nil:
		// The problem stopped the observer (a Secret missing, a spec no pod
		// is built from): the last reading would stand in status and the
		// gauges, unchanged at every pass, until the problem is solved,
		// while Lagging says the backlog is not read.
		st.Backlog = nil
	}
	if obs.err != "" && !readingCurrent(relay, cmp.Or(obs.backlog, relay.Status.Backlog), time.Now()) {
		// Reads have failed since: the last reading (this manager's, or a
		// previous manager's in status) would stand in the columns and the
		// gauges, which alerts judge, for as long as they fail.
		st.Backlog = nil
	}
	st.ObservedGeneration = relay.Generation
	st.Selector = metav1.FormatLabelSelector(&metav1.LabelSelector{MatchLabels: selectorLabels(relay)})
	st.TopicCount = int32(len(relay.Spec.Topics))
	st.Replicas, st.ReadyReplicas = 0, 0
	if deploy != nil {
		st.Replicas, st.ReadyReplicas = deploy.Status.Replicas, deploy.Status.ReadyReplicas
	}
	st.Ready = fmt.Sprintf("%d/%d", st.ReadyReplicas, desired)

	now := time.Now()
	f := facts{relay: relay, deploy: deploy, obs: obs, desired: desired, ready: st.ReadyReplicas, rolledOut: rolledOut(deploy, desired),
		unreadyPastDeadline: unavailablePastDeadline(deploy, now)}
	f.lag = lagging(relay, obs, st.ReadyReplicas, now)
	if prob != nil && obs.backlog == nil {
		// A problem found before the backlog is read stops the reads; one
		// found writing the children (a name conflict, a spec the API
		// server refuses) leaves them going, and Lagging says what they say.
		f.lag = verdict{metav1.ConditionUnknown, prob.reason, "the backlog is not read: " + prob.message}
	}
	// Lagging speaks for the flow of events: Ready does not claim all is well
	// while rows wait past the threshold, and Degraded says a human is
	// needed; a suspended relay is expected to fall behind.
	f.lagging = f.lag.status == metav1.ConditionTrue && !relay.Spec.Suspend
	if c := deploymentCondition(deploy, appsv1.DeploymentProgressing); c != nil &&
		c.Status == corev1.ConditionFalse && c.Reason == "ProgressDeadlineExceeded" {
		f.deadline = c.Message
	}
	if c := deploymentCondition(deploy, appsv1.DeploymentReplicaFailure); c != nil && c.Status == corev1.ConditionTrue {
		f.replicaFailure = c.Message
	}
	for _, c := range conditionRules {
		var v verdict
		if prob != nil && c.onProblem != nil {
			v = c.onProblem(prob)
		} else {
			v = c.rule(&f)
		}
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{
			Type: c.typ, Status: v.status, Reason: v.reason, Message: v.message, ObservedGeneration: relay.Generation,
		})
	}
	return st
}

// facts are what the conditions are derived from.
type facts struct {
	relay     *outboxv1alpha1.OutboxRelay
	deploy    *appsv1.Deployment
	obs       observation
	desired   int32
	ready     int32
	rolledOut bool
	// unreadyPastDeadline: no template rollout is under way, and the
	// Deployment has lacked its available replicas for longer than its
	// progress deadline (unavailablePastDeadline).
	unreadyPastDeadline bool
	lag                 verdict // the Lagging condition
	lagging             bool    // Lagging True, and not suspended
	deadline            string  // the Deployment's ProgressDeadlineExceeded message, if any
	// replicaFailure is the Deployment's ReplicaFailure message, if any:
	// its ReplicaSet cannot create pods, which no waiting fixes.
	replicaFailure string
}

// verdict is one condition's status, reason and message.
type verdict struct {
	status          metav1.ConditionStatus
	reason, message string
}

// conditionRules are the conditions of an OutboxRelay, in the order they
// are derived: each a rule over the facts, and what it says instead when a
// problem stopped the reconcile (nil: the rule covers it).
var conditionRules = []struct {
	typ       string
	rule      func(f *facts) verdict
	onProblem func(p *problem) verdict
}{
	{outboxv1alpha1.ConditionLagging, func(f *facts) verdict { return f.lag }, nil},
	{outboxv1alpha1.ConditionReady, readyRule, func(p *problem) verdict {
		return verdict{metav1.ConditionFalse, p.reason, p.message}
	}},
	{outboxv1alpha1.ConditionProgressing, progressingRule, func(p *problem) verdict {
		return verdict{metav1.ConditionFalse, p.reason, "the operator cannot apply this generation: " + p.message}
	}},
	{outboxv1alpha1.ConditionDegraded, degradedRule, func(p *problem) verdict {
		return verdict{metav1.ConditionTrue, p.reason, p.message}
	}},
	{outboxv1alpha1.ConditionStalled, stalledRule, func(p *problem) verdict {
		return verdict{metav1.ConditionTrue, p.reason, p.message}
	}},
	{outboxv1alpha1.ConditionReconciling, reconcilingRule, func(p *problem) verdict {
		return verdict{metav1.ConditionFalse, p.reason, "stalled: " + p.message}
	}},
}

// readyRule: no pods by request is the desired state, Ready once they are
// gone, so GitOps tools judge a suspended relay healthy, not progressing;
// otherwise Ready when the desired replicas are ready and rows do not wait
// past the threshold.
func readyRule(f *facts) verdict {
	relay := f.relay
	switch {
	case relay.Spec.Suspend || (f.desired == 0 && !f.lagging):
		reason, msg := outboxv1alpha1.ReasonScaledToZero, "spec.replicas is 0: the relay runs no pods"
		switch {
		case relay.Spec.Suspend:
			reason, msg = outboxv1alpha1.ReasonSuspended, "spec.suspend is true: the relay runs no pods"
		case relay.Spec.Autoscaling != nil && f.obs.backlog == nil:
			msg = "autoscaled to zero: the backlog is not read yet"
		case relay.Spec.Autoscaling != nil:
			msg = "autoscaled to zero: no row waits"
		}
		if f.deploy != nil && f.deploy.Status.Replicas > 0 {
			return verdict{metav1.ConditionFalse, reason, msg + " (stopping the running ones)"}
		}
		return verdict{metav1.ConditionTrue, reason, msg}
	case f.ready >= f.desired && f.lagging:
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonLagging, f.lag.message}
	case f.ready >= f.desired:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonAvailable, fmt.Sprintf("%d of %d replicas ready", f.ready, f.desired)}
	case f.replicaFailure != "":
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonReplicaFailure,
			fmt.Sprintf("%d of %d replicas ready; the Deployment cannot create pods: %s", f.ready, f.desired, f.replicaFailure)}
	default:
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonDeploymentUnavailable, fmt.Sprintf("%d of %d replicas ready", f.ready, f.desired)}
	}
}

func progressingRule(f *facts) verdict {
	if f.rolledOut {
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonRolloutComplete, fmt.Sprintf("%d replicas run the current pod template", f.desired)}
	}
	return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonRollingOut, "the Deployment is rolling out or scaling to the current spec"}
}

// degradedRule: a human is needed when the Deployment missed its progress
// deadline or cannot create its pods, or rows wait past the threshold.
func degradedRule(f *facts) verdict {
	switch {
	case f.deadline != "":
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonProgressDeadlineExceeded, f.deadline}
	case f.replicaFailure != "":
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonReplicaFailure, "the Deployment cannot create pods: " + f.replicaFailure}
	case f.lagging:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonLagging, f.lag.message}
	}
	return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "nothing is degraded"}
}

// stalledRule: a relay whose ready replicas publish nothing while rows wait
// past the threshold is Stalled (kstatus: Failed): it runs as specified
// and moves nothing, and waiting will not fix it. With no replica ready
// and rows waiting, it is Stalled when no template rollout is under way
// and either it was stalled already (NotPublishing: the relay's readiness
// fails once it has published nothing for --stall-timeout), or the
// Deployment has lacked its available replicas for longer than its
// progress deadline, the Deployment's own measure of a rollout that
// failed, which a scale or a resume does not apply (before, such a relay
// turned Stalled False, saying rows still flowed). Lagging while rows
// still flow, or while replicas start, leaves Stalled False: Ready False
// makes kstatus say InProgress.
func stalledRule(f *facts) verdict {
	noneReady := f.lagging && f.lag.reason == outboxv1alpha1.ReasonNoReadyReplicas && f.desired > 0
	switch {
	case f.deadline != "":
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonProgressDeadlineExceeded, f.deadline}
	case f.lagging && f.lag.reason == outboxv1alpha1.ReasonNotPublishing:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNotPublishing, f.lag.message}
	case noneReady && templateSettled(f.deploy) && stalledBefore(f.relay):
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNoReadyReplicas, f.lag.message + "; its replicas published nothing, then turned unready"}
	case noneReady && f.unreadyPastDeadline:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonNoReadyReplicas, f.lag.message + "; none has been ready for longer than the Deployment's progress deadline"}
	case noneReady:
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "no replica is ready yet"}
	case f.lagging && f.desired == 0:
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "no replica is asked for: rows wait until one runs"}
	case f.lagging:
		return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "rows still flow"}
	}
	return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected, "nothing is stalled"}
}

// stalledBefore reports whether the status relay carries says it was
// stalled with rows waiting: NotPublishing, or NoReadyReplicas after it.
func stalledBefore(relay *outboxv1alpha1.OutboxRelay) bool {
	c := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionStalled)
	return c != nil && c.Status == metav1.ConditionTrue &&
		(c.Reason == outboxv1alpha1.ReasonNotPublishing || c.Reason == outboxv1alpha1.ReasonNoReadyReplicas)
}

// templateSettled reports whether no rollout of a pod template is under
// way: the Deployment's Progressing reason is still that of its last
// complete rollout. A scale (spec.replicas, a resume, the autoscaler)
// leaves it so; a new template changes it.
func templateSettled(d *appsv1.Deployment) bool {
	c := deploymentCondition(d, appsv1.DeploymentProgressing)
	return c != nil && c.Status == corev1.ConditionTrue && c.Reason == newReplicaSetAvailable
}

// unavailablePastDeadline reports whether, with no template rollout under
// way, the Deployment has said for longer than its progress deadline that
// it lacks its minimum of available replicas (Available False).
func unavailablePastDeadline(d *appsv1.Deployment, now time.Time) bool {
	if !templateSettled(d) {
		return false
	}
	c := deploymentCondition(d, appsv1.DeploymentAvailable)
	deadline := time.Duration(ptr.Deref(d.Spec.ProgressDeadlineSeconds, defaultProgressDeadlineSeconds)) * time.Second
	return c != nil && c.Status == corev1.ConditionFalse && now.Sub(c.LastTransitionTime.Time) > deadline
}

// defaultProgressDeadlineSeconds is a Deployment's progressDeadlineSeconds
// when it sets none (the API server's default).
const defaultProgressDeadlineSeconds = 600

// reconcilingRule: kstatus reads Reconciling True until the current
// template runs on every desired replica and they are ready (a
// Secret-triggered roll changes no generation, so observedGeneration alone
// cannot show it).
func reconcilingRule(f *facts) verdict {
	if v := stalledRule(f); v.status == metav1.ConditionTrue {
		return verdict{metav1.ConditionFalse, v.reason, "stalled"}
	}
	switch {
	case !f.rolledOut:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonRollingOut, "the Deployment is rolling out or scaling to the current spec"}
	case f.ready < f.desired && f.desired > 0:
		return verdict{metav1.ConditionTrue, outboxv1alpha1.ReasonDeploymentUnavailable, fmt.Sprintf("%d of %d replicas ready", f.ready, f.desired)}
	}
	return verdict{metav1.ConditionFalse, outboxv1alpha1.ReasonRolloutComplete, "the relay matches its spec"}
}

// rolledOut is the Deployment's own notion of a complete rollout: it has
// seen its latest spec, every replica runs the current template, and each
// is available, or was when the rollout completed: the Deployment's
// Progressing condition stays NewReplicaSetAvailable when pods turn
// unready later (the broker down), which is no rollout; Ready and Stalled
// say that. Before, such pods read as a rollout under way, for good.
func rolledOut(d *appsv1.Deployment, desired int32) bool {
	if d == nil {
		return false
	}
	s := d.Status
	if s.ObservedGeneration < d.Generation || s.UpdatedReplicas != desired || s.Replicas != desired {
		return false
	}
	return s.AvailableReplicas == desired || templateSettled(d)
}

// newReplicaSetAvailable is the reason of a Deployment's Progressing
// condition once its rollout completed (the deployment controller's
// NewRSAvailableReason).
const newReplicaSetAvailable = "NewReplicaSetAvailable"

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

// recordEvents emits a Warning event when the relay newly has a problem (or
// a new generation still has it), so events do not repeat on every resync;
// a Warning when Lagging turns True and a Normal one when it turns back to
// False; and a Normal event for each change of replicas the autoscaler made.
func (r *OutboxRelayReconciler) recordEvents(before, after *outboxv1alpha1.OutboxRelay, current, written *appsv1.Deployment, prob *problem) {
	if r.Recorder == nil {
		return
	}
	if prob != nil {
		old := meta.FindStatusCondition(before.Status.Conditions, outboxv1alpha1.ConditionReady)
		if old == nil || old.Reason != prob.reason || old.Message != prob.message ||
			before.Status.ObservedGeneration != after.Generation {
			r.Recorder.Eventf(after, nil, corev1.EventTypeWarning, prob.reason, "Reconcile", "%s", prob.message)
		}
	}
	was := meta.FindStatusCondition(before.Status.Conditions, outboxv1alpha1.ConditionLagging)
	now := meta.FindStatusCondition(after.Status.Conditions, outboxv1alpha1.ConditionLagging)
	switch {
	case now == nil:
	case now.Status == metav1.ConditionTrue && (was == nil || was.Status != metav1.ConditionTrue):
		r.Recorder.Eventf(after, nil, corev1.EventTypeWarning, outboxv1alpha1.ReasonLagging, "ObserveBacklog", "%s: %s", now.Reason, now.Message)
	case now.Status == metav1.ConditionFalse && was != nil && was.Status == metav1.ConditionTrue:
		r.Recorder.Eventf(after, nil, corev1.EventTypeNormal, outboxv1alpha1.ReasonCaughtUp, "ObserveBacklog", "%s", now.Message)
	}
	r.recordScaled(after, current, written)
}

// recordScaled emits ScaledUp or ScaledDown when the autoscaler changed the
// replicas of the Deployment this pass wrote.
func (r *OutboxRelayReconciler) recordScaled(after *outboxv1alpha1.OutboxRelay, current, written *appsv1.Deployment) {
	if r.Recorder == nil {
		return
	}
	if after.Spec.Autoscaling != nil && !after.Spec.Suspend && current != nil && written != nil && current.Spec.Replicas != nil &&
		written.Spec.Replicas != nil && *current.Spec.Replicas != *written.Spec.Replicas {
		from, to := *current.Spec.Replicas, *written.Spec.Replicas
		reason := outboxv1alpha1.ReasonScaledUp
		if to < from {
			reason = outboxv1alpha1.ReasonScaledDown
		}
		r.Recorder.Eventf(after, nil, corev1.EventTypeNormal, reason, "Scale", "%s", scaleMessage(from, to, after.Status.Backlog))
	}
}
