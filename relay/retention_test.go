package relay_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// With OnPublishDelete an acknowledged row is deleted in the claim
// transaction: the table ends empty and every event reached Kafka once.
func TestDeleteOnPublish(t *testing.T) {
	eachMode(t, 2, []string{"E"}, func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
		const n = 3000
		f.Insert(n, 50, "E")
		want := f.EventIDs("")
		cfg.OnPublish = relay.OnPublishDelete
		run(t, cfg, nil)
		require.Eventually(t, func() bool { return f.Count(`SELECT count(*) FROM outbox`) == 0 }, 60*time.Second, 20*time.Millisecond)
		counts, _ := outboxtest.Deliveries(t, n, f.Topics["E"])
		outboxtest.RequireExactlyOnce(t, want, counts)
	})
}

// Writers, two relays and pruning together: pruning deletes published rows
// only (every event still reaches Kafka) while claims and writers go on.
func TestPruningDeletesOnlyPublishedRows(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 2, "E")
	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	cfg.PruneBatchSize = 50
	cfg.PrunePause = time.Millisecond
	a := run(t, cfg, nil)
	b := run(t, cfg, nil)

	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var written atomic.Int64
	wg.Add(2)
	go func() { // writers
		defer wg.Done()
		for ctx.Err() == nil {
			// Not under ctx: a cancelled insert could commit without being counted.
			if err := outboxtest.InsertRows(context.Background(), f.Pool, 50, 20, "E"); err != nil {
				t.Errorf("insert: %v", err)
				return
			}
			written.Add(50)
			time.Sleep(10 * time.Millisecond)
		}
	}()
	go func() { // age what is published, so the pruner always has work
		defer wg.Done()
		for ctx.Err() == nil {
			_, _ = f.Pool.Exec(ctx, `UPDATE outbox SET published_at = published_at - interval '1 hour'
				WHERE published_at > now() - interval '1 hour'`)
			time.Sleep(50 * time.Millisecond)
		}
	}()
	// Run until pruning has worked through a good many rows beside the writers and relays.
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, a.Reg, "outbox_relay_pruned_rows_total")+
			outboxtest.MetricValue(t, b.Reg, "outbox_relay_pruned_rows_total") >= 5000
	}, 60*time.Second, 100*time.Millisecond)
	stop()
	wg.Wait()
	f.WaitDrained(0, 60*time.Second)

	n := int(written.Load())
	prunedA := outboxtest.MetricValue(t, a.Reg, "outbox_relay_pruned_rows_total")
	prunedB := outboxtest.MetricValue(t, b.Reg, "outbox_relay_pruned_rows_total")
	t.Logf("wrote %d rows; pruned %0.f + %0.f", n, prunedA, prunedB)
	counts, _ := outboxtest.Deliveries(t, n, f.Topics["E"])
	require.Len(t, counts, n, "every written event reached Kafka: no unpublished row was pruned")
}
