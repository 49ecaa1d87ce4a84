package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// A held row is recorded in the held table (reason, error, attempts), a
// restarted relay keeps holding it without trying it early, `relay redrive`
// releases it once the cause is fixed, and its record goes once it is
// published. A row larger than every topic takes is held from its size in
// SQL, its payload never read. The relay creates the held table itself.
func TestHeldRowsAreRecordedSurviveRestartsAndRedrive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Exec(`DROP TABLE outbox_held`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
	f.Insert(20, 5, "E")
	table := outbox.Table{Name: "outbox"}
	cfg := f.Config()
	cfg.HeldRetryInterval = time.Hour
	x := run(t, cfg, nil)
	f.WaitDrained(1, 30*time.Second)
	var held []relay.HeldRow
	require.Eventually(t, func() bool {
		var err error
		held, err = relay.ListHeld(ctx, f.Pool, table, relay.HeldFilter{All: true}, 10)
		return err == nil && len(held) == 1
	}, 10*time.Second, 50*time.Millisecond)
	h := held[0]
	require.Equal(t, int64(1), h.ID)
	require.Equal(t, relay.HeldTooLarge, h.Reason)
	require.Equal(t, "E", h.EventType)
	require.Equal(t, 1, h.Attempts)
	require.Contains(t, h.Error, "held without reading them", "decided from the size in SQL")
	require.WithinDuration(t, time.Now().Add(time.Hour), h.RetryAt, time.Minute)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge) == 1
	}, 10*time.Second, 50*time.Millisecond)

	// A restart does not forget it, nor try it before its time.
	x.Stop(t)
	x = run(t, cfg, nil)
	f.Insert(5, 5, "E")
	f.WaitDrained(1, 30*time.Second)
	require.Never(t, func() bool { // over a stats round and more
		held, err := relay.ListHeld(ctx, f.Pool, table, relay.HeldFilter{Reasons: []string{relay.HeldTooLarge}}, 10)
		return err != nil || len(held) != 1 || held[0].Attempts != 1
	}, 6*time.Second, 100*time.Millisecond, "held once, not tried again before retry_at")
	require.Equal(t, 1.0, outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge))

	// Filters select by id, reason or type; nothing matches another type.
	none, err := relay.ListHeld(ctx, f.Pool, table, relay.HeldFilter{Types: []string{"Other"}}, 10)
	require.NoError(t, err)
	require.Empty(t, none)

	// The cause is fixed (the row made smaller), and the row released.
	f.Exec(`UPDATE outbox SET payload = '{"small":true}' WHERE id = 1`)
	n, err := relay.Redrive(ctx, f.Pool, table, relay.HeldFilter{IDs: []int64{1}})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	f.WaitDrained(0, 20*time.Second)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_held`) == 0
	}, 10*time.Second, 50*time.Millisecond, "the record goes with the published row")
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge) == 0
	}, 10*time.Second, 50*time.Millisecond)
}

// A record another replica left for a row that was published since (or
// deleted by hand) is swept, so status and `relay held` show only rows that
// still wait.
func TestStaleHeldRecordsAreSwept(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(3, 3, "E")
	f.Exec(`UPDATE outbox SET published_at = now() WHERE id = 1`)
	f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		SELECT id, event_id::text, event_type, 'refused', 'x', now() + interval '1 hour' FROM outbox WHERE id IN (1, 2)`)
	f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at) VALUES (99, 'gone', 'E', 'refused', 'x', now())`)
	x := run(t, f.Config(), nil)
	f.WaitDrained(1, 30*time.Second)
	require.Eventually(t, func() bool {
		held, err := relay.ListHeld(ctx, f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{All: true}, 10)
		return err == nil && len(held) == 1 && held[0].ID == 2
	}, 20*time.Second, 200*time.Millisecond, "rows 1 (published) and 99 (gone) are swept; 2 stays held")
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND id = 2`), "a row another replica holds is left alone")
	_ = x
}

// In partition-key mode a held row keeps its key's later rows on its topic
// back (across a restart too), and `relay redrive` releases the whole lane
// at once, the held row first.
func TestRedriveReleasesAHeldLaneInOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'k')`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'Order', 'o' || i, 'E', '{}', CASE WHEN i <= 5 THEN 'k' ELSE 'other' END
		FROM generate_series(1, 10) i`)
	cfg := f.Config()
	cfg.Ordering = relay.OrderingPartitionKey
	cfg.HeldRetryInterval = time.Hour
	x := run(t, cfg, nil)
	f.WaitDrained(6, 30*time.Second)
	require.Eventually(t, func() bool { return f.Count(`SELECT count(*) FROM outbox_held WHERE id = 1 AND attempts = 1`) == 1 },
		10*time.Second, 20*time.Millisecond)
	x.Stop(t)
	run(t, cfg, nil) // a restart does not let the lane flow past its held row
	require.Never(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND partition_key = 'k'`) > 0
	}, 8*time.Second, 50*time.Millisecond, "the key's rows wait behind its held row")
	require.Equal(t, 6, f.Unpublished())
	require.Equal(t, 1, f.Count(`SELECT attempts FROM outbox_held WHERE id = 1`),
		"a restarted relay does not try a held row before its retry time")

	f.Exec(`UPDATE outbox SET payload = '{"small":true}' WHERE id = 1`)
	n, err := relay.Redrive(ctx, f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{Reasons: []string{relay.HeldTooLarge}})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	f.WaitDrained(0, 20*time.Second)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox o WHERE partition_key = 'k' AND id > 1
		AND published_at < (SELECT published_at FROM outbox WHERE id = 1)`), "the held row went first")
}

// outbox_relay_rows_held follows the held table on an idle replica too: a
// row a DBA fixed (published, its record deleted) leaves the gauge at the
// next reload, with no batch to follow (before, it stayed, and the alert on
// it kept firing).
func TestRowsHeldGaugeFollowsTheHeldTableWhileIdle(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'k')`)
	cfg := f.Config()
	cfg.HeldRetryInterval = time.Hour
	x := run(t, cfg, nil)
	held := func() float64 {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge)
	}
	require.Eventually(t, func() bool { return held() == 1 }, 20*time.Second, 20*time.Millisecond)
	f.Exec(`UPDATE outbox SET published_at = now() WHERE id = 1`)
	f.Exec(`DELETE FROM outbox_held WHERE id = 1`)
	require.Eventually(t, func() bool { return held() == 0 }, 20*time.Second, 50*time.Millisecond,
		"the next reload of the held table drops the row from the gauge")
}
