package relay

import (
	"fmt"
	"sync"
	"time"
)

// Reasons the relay is stalled (outbox_relay_stalled{reason}); each one
// fails /readyz, and loop_wedged also fails /healthz.
const (
	// StallBatchFailing: no batch has completed (claim, publish or commit
	// errors) for longer than the stall timeout.
	StallBatchFailing = "batch_failing"
	// StallNoProgress: claims keep returning rows but none has been
	// published for longer than the stall timeout.
	StallNoProgress = "no_progress"
	// StallRowsWaiting: rows this replica could claim have waited longer
	// than the stall timeout and it published nothing in that time.
	StallRowsWaiting = "rows_waiting"
	// StallModeConflict: a replica of the other ordering mode is live on
	// the table, so this one does not claim.
	StallModeConflict = "mode_conflict"
	// StallLoopWedged: the loop has not started an iteration for longer
	// than a batch can take, after its last deliberate sleep ended.
	StallLoopWedged = "loop_wedged"
)

var stallReasons = []string{StallBatchFailing, StallNoProgress, StallRowsWaiting, StallModeConflict, StallLoopWedged}

// health is the loop's progress as the probes and the stall gauge see it.
type health struct {
	mu            sync.Mutex
	timeout       time.Duration // the stall timeout
	wedgedAfter   time.Duration
	lastIteration time.Time
	idleEnd       time.Time // the end of the loop's current deliberate sleep (poll interval, backoff)
	failingSince  time.Time // zero while batches complete
	lastErr       error
	lastProgress  time.Time // a batch published rows, or found nothing to claim
	lastPublished time.Time
	oldestWaiting time.Duration // of the rows this replica could claim
	modeConflict  string
}

func newHealth(timeout, wedgedAfter time.Duration, now time.Time) *health {
	return &health{timeout: timeout, wedgedAfter: wedgedAfter, lastIteration: now, lastProgress: now, lastPublished: now}
}

// idleUntil records that the loop sleeps on purpose until until: an idle
// relay polling every hour is not wedged while it waits for the hour.
func (h *health) idleUntil(until time.Time) {
	h.mu.Lock()
	h.idleEnd = until
	h.mu.Unlock()
}

func (h *health) iteration(now time.Time) {
	h.mu.Lock()
	h.lastIteration = now
	h.mu.Unlock()
}

// batchDone records a completed batch: claimed rows were claimed, published published.
func (h *health) batchDone(now time.Time, claimed, published int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failingSince, h.lastErr = time.Time{}, nil
	if published > 0 {
		h.lastPublished = now
	}
	if published > 0 || claimed == 0 {
		h.lastProgress = now
	}
}

// idle records that there is nothing to claim or publish now: progress,
// as an empty claim is, which leaves a failure in progress as it is.
func (h *health) idle(now time.Time) {
	h.mu.Lock()
	h.lastProgress = now
	h.mu.Unlock()
}

func (h *health) batchFailed(now time.Time, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failingSince.IsZero() {
		h.failingSince = now
	}
	h.lastErr = err
}

func (h *health) setOldestWaiting(d time.Duration) {
	h.mu.Lock()
	h.oldestWaiting = d
	h.mu.Unlock()
}

func (h *health) setModeConflict(msg string) {
	h.mu.Lock()
	h.modeConflict = msg
	h.mu.Unlock()
}

// stalls returns each stall reason that holds now, with what it means.
func (h *health) stalls(now time.Time) map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string]string{}
	if h.modeConflict != "" {
		out[StallModeConflict] = h.modeConflict
	}
	if !h.failingSince.IsZero() && now.Sub(h.failingSince) > h.timeout {
		out[StallBatchFailing] = fmt.Sprintf("no batch has completed for %s", now.Sub(h.failingSince).Round(time.Second))
	}
	if d := now.Sub(h.lastProgress); d > h.timeout && h.modeConflict == "" {
		out[StallNoProgress] = fmt.Sprintf("claimed rows but published none for %s", d.Round(time.Second))
	}
	if d := now.Sub(h.lastPublished); h.oldestWaiting > h.timeout && d > h.timeout && h.modeConflict == "" {
		out[StallRowsWaiting] = fmt.Sprintf("a row has waited %s and nothing was published for %s",
			h.oldestWaiting.Round(time.Second), d.Round(time.Second))
	}
	// The loop moved last when its iteration began or its sleep ended.
	if d := now.Sub(later(h.lastIteration, h.idleEnd)); d > h.wedgedAfter {
		out[StallLoopWedged] = fmt.Sprintf("the loop has not moved for %s", d.Round(time.Second))
	}
	return out
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
