package relay_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// insertLarge inserts n rows of one key with payloads of about size bytes,
// in one transaction (so commit order is id order).
func insertLarge(f *outboxtest.Fixture, n, size int) {
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'Order', 'o1', 'E', jsonb_build_object('i', i, 'pad', repeat('x', ` + strconv.Itoa(size) + `)), 'o1'
		FROM generate_series(1, ` + strconv.Itoa(n) + `) AS i`)
}

// deliveredInOrder consumes n messages of topic and requires them to be the
// table's rows once each, in id order.
func deliveredInOrder(t *testing.T, f *outboxtest.Fixture, topic string, n int) {
	t.Helper()
	var order []string
	for _, m := range testenv.Broker().Consume(t, topic, n, 60*time.Second) {
		order = append(order, header(m, relay.HeaderEventID))
	}
	require.Equal(t, eventIDs(t, f, "id"), order, "each row once, in id order")
}

// A batch cut by the byte budget locked more rows than it returned: the
// rest stay locked until it commits. The next claim must not run beside
// that commit, or it skips them and publishes the rows after them first
// (they would wait for a floor scan, out of order).
func TestBudgetCutBatchesKeepIDOrder(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	const n = 400
	insertLarge(f, n, 12<<10)
	cfg := f.Config()
	cfg.BatchSize = 50
	cfg.MaxBatchBytes = 64 << 10 // about five of the rows
	run(t, cfg, nil)
	f.WaitDrained(0, 60*time.Second)
	deliveredInOrder(t, f, f.Topics["E"], n)
}

// The same for a streaming relay: the rows of a streamed chunk that its
// byte budget cut are published by the stream, in commit order, not left
// to the next sweep.
func TestLogicalReplicationBudgetCutBatchesKeepCommitOrder(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	cfg.BatchSize = 50
	cfg.MaxBatchBytes = 64 << 10
	cfg.FullRescanInterval = time.Hour // no sweep delivers what the stream skipped
	startStreaming(t, cfg)
	const n = 300
	insertLarge(f, n, 12<<10)
	f.WaitDrained(0, 30*time.Second)
	deliveredInOrder(t, f, f.Topics["E"], n)
}
