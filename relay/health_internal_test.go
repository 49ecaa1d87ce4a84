package relay

import (
	"testing"
	"time"
)

// An idle relay sleeping its poll interval (up to an hour) is not wedged:
// the liveness probe must not restart it while it waits.
func TestIdleSleepIsNotWedged(t *testing.T) {
	t0 := time.Now()
	h := newHealth(10*time.Second, 45*time.Second, t0)
	h.iteration(t0)
	h.idleUntil(t0.Add(5 * time.Minute)) // --poll-interval 5m, empty table
	if _, wedged := h.stalls(t0.Add(4 * time.Minute))[StallLoopWedged]; wedged {
		t.Fatal("a relay sleeping its poll interval was called wedged")
	}
	// After the sleep ended, a loop that does not move is wedged.
	if _, wedged := h.stalls(t0.Add(5*time.Minute + 46*time.Second))[StallLoopWedged]; !wedged {
		t.Fatal("a loop that did not move after its sleep ended was not called wedged")
	}
}

// The relay's record size accounting is kafka-go's, so the batches the
// writer cuts at a topic's budget are the ones the broker measures.
func TestRecordSizeMatchesVarintLengths(t *testing.T) {
	for _, c := range []struct{ n, want int }{{0, 1}, {63, 1}, {64, 2}, {8191, 2}, {8192, 3}} {
		if got := varintSize(c.n); got != c.want {
			t.Errorf("varintSize(%d) = %d, want %d", c.n, got, c.want)
		}
	}
	ts := newTopicState(false)
	if b := ts.budget("t"); b >= defaultMaxRecordBytes-recordBatchOverhead || b <= 0 {
		t.Errorf("budget %d does not keep the batch header out of the limit %d", b, defaultMaxRecordBytes)
	}
	if newTopicState(true).budget("t") >= ts.budget("t") {
		t.Error("a compressing writer must keep a margin for the codec's framing")
	}
}
