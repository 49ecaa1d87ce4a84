package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// With --notify, a row stored by a notifying writer is claimed at once,
// not at the end of the idle relay's (long, backed-off) poll wait.
func TestNotifyWakesTheRelay(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	cfg.PollInterval = 30 * time.Second
	cfg.Notify = true
	run(t, cfg, nil)
	// Idle for 6 s: the wait between empty claims has grown to seconds.
	time.Sleep(6 * time.Second)

	w, err := outbox.NewWriter("outbox", outbox.WithNotify())
	require.NoError(t, err)
	for range 3 {
		ctx := context.Background()
		tx, err := f.Pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, w.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order",
			AggregateID: "o1", EventType: "E", Payload: []byte(`{}`), PartitionKey: "o1"}))
		require.NoError(t, tx.Commit(ctx))
		start := time.Now()
		require.Eventually(t, func() bool { return f.Unpublished() == 0 }, 5*time.Second, 2*time.Millisecond)
		took := time.Since(start)
		t.Logf("stored to published: %s", took)
		require.Less(t, took, time.Second, "the notification woke the relay")
		time.Sleep(3 * time.Second) // idle again
	}
}
