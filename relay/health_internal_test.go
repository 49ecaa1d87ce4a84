package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relayconfig"
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

// The wedged limit outlasts one statement of the relay's sessions (30 s,
// which a stream's own queries may take) by the stall timeout, at the
// least settings too. Before, it was a batch's deadline plus the stall
// timeout: 30 s at the least stall timeout and a 10 s publish timeout, and
// the kubelet restarted a relay one statement kept waiting.
func TestWedgedLimitOutlastsAStatement(t *testing.T) {
	t.Parallel()
	for _, publish := range []time.Duration{relayconfig.MinPublishTimeout, 10 * time.Second, time.Minute} {
		cfg := Config{Settings: Settings{PublishTimeout: publish, StallTimeout: relayconfig.MinStallTimeout}}
		require.GreaterOrEqual(t, wedgedAfter(cfg), statementTimeout+relayconfig.MinStallTimeout, "publish timeout %s", publish)
		require.GreaterOrEqual(t, wedgedAfter(cfg), batchDeadline(cfg)+relayconfig.MinStallTimeout, "publish timeout %s", publish)
	}
}
