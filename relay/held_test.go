package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
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

// A `relay redrive` issued while a batch tries the row (its cause fixed
// meanwhile) stands when that batch fails and holds the row again: the
// batch's try may have come before the fix. The interleaving is fixed by
// the writer, which holds the batch's publish until the redrive is in.
// (Before, the batch's hold, committed after the redrive, set the retry an
// interval ahead again, and the redrive was lost.)
func TestRedriveWhileABatchTriesTheRowStands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(1, 1, "E")
	table := outbox.Table{Name: "outbox"}
	refused := func(msgs []kafka.Message) error {
		werrs := make(kafka.WriteErrors, len(msgs))
		for i := range werrs {
			werrs[i] = kafka.InvalidRecord
		}
		return werrs
	}
	var calls atomic.Int32
	entered, open := make(chan struct{}), make(chan struct{})
	w := writerFunc(func(ctx context.Context, msgs ...kafka.Message) error {
		switch calls.Add(1) {
		case 1:
			return refused(msgs)
		case 2: // the try the redrive races: it began before the fix
			close(entered)
			select {
			case <-open:
			case <-ctx.Done():
				return ctx.Err()
			}
			return refused(msgs)
		}
		return nil // the cause is fixed
	})
	cfg := f.Config()
	cfg.HeldRetryInterval = time.Hour
	run(t, cfg, w)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_held WHERE id = 1 AND reason = 'refused' AND attempts = 1`) == 1
	}, 20*time.Second, 20*time.Millisecond, "the row is held")

	n, err := relay.Redrive(ctx, f.Pool, table, relay.HeldFilter{IDs: []int64{1}})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the redriven row is tried again")
	}
	n, err = relay.Redrive(ctx, f.Pool, table, relay.HeldFilter{IDs: []int64{1}}) // the cause is fixed meanwhile
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	close(open)
	require.Eventually(t, func() bool { return f.Unpublished() == 0 }, 30*time.Second, 20*time.Millisecond,
		"the second redrive stands, and the row goes out within seconds, not after HeldRetryInterval: %d tries", calls.Load())
	require.Equal(t, int32(3), calls.Load())
	require.Eventually(t, func() bool { return f.Count(`SELECT count(*) FROM outbox_held`) == 0 }, 10*time.Second, 20*time.Millisecond)
}

// A relay whose role may read the held table but not write it keeps its
// holds in memory, and says which privileges are missing and the GRANT.
// Before, it recorded holds anyway: each failed, rolled back its batch
// after the batch's other rows went out, and they went out again at every
// reload of the holds (every 5 s), without end.
func TestHeldTableWithoutPrivilegesKeepsHoldsInMemory(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big'),
		       (gen_random_uuid(), 'Order', 'ok', 'E', '{}', 'ok')`)
	role := fmt.Sprintf("heldro_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN; GRANT SELECT, UPDATE ON outbox TO ` + role + `; GRANT SELECT ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	cfg := f.Config()
	cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	run(t, cfg, nil)
	// The held rows reload every 5 s: two reloads, without a second copy.
	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], 1, 30*time.Second, 12*time.Second)
	require.NoError(t, err)
	require.Len(t, msgs, 1, "the row beside the held one goes out once")
	require.Equal(t, 1, f.Unpublished(), "the large row is held")
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox_held`))
	require.Contains(t, logs.String(), `missing="INSERT, UPDATE, DELETE"`)
	require.Contains(t, logs.String(), `GRANT SELECT, INSERT, UPDATE, DELETE ON \"outbox_held\" TO <the relay's role>`)
}

// A held table made before redriven_at existed keeps working: `relay
// redrive` releases its rows, a relay whose role may not alter the table
// says so and records its holds as before, and a relay that may adds the
// column at start-up.
func TestHeldTableFromBeforeRedrivenAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Exec(`ALTER TABLE outbox_held DROP COLUMN redriven_at`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
	role := fmt.Sprintf("held_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN; GRANT SELECT, UPDATE ON outbox TO ` + role +
		`; GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	redrivenAt := func() int {
		return f.Count(`SELECT count(*) FROM pg_attribute WHERE attrelid = 'outbox_held'::regclass AND attname = 'redriven_at' AND NOT attisdropped`)
	}

	cfg := f.Config()
	cfg.HeldRetryInterval = time.Hour
	cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_held WHERE id = 1 AND attempts = 1`) == 1
	}, 20*time.Second, 20*time.Millisecond, "the hold is recorded")
	require.Contains(t, logs.String(), "cannot add redriven_at to the held table")
	require.Contains(t, logs.String(), "ADD COLUMN IF NOT EXISTS redriven_at", "the log gives the fix")
	require.Zero(t, redrivenAt())
	n, err := relay.Redrive(ctx, f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{IDs: []int64{1}})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_held WHERE id = 1 AND attempts = 2`) == 1
	}, 20*time.Second, 20*time.Millisecond, "the redrive released the row, and it was tried again")
	x.Stop(t)

	// Check runs again while a dependency cannot be reached: the ALTER,
	// whose lock would queue the other replicas' holds, is tried once.
	var again lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&again, nil))
	r, err := relay.New(cfg)
	require.NoError(t, err)
	defer r.Close()
	require.NoError(t, r.Check(ctx))
	require.NoError(t, r.Check(ctx))
	require.Equal(t, 1, strings.Count(again.String(), "cannot add redriven_at to the held table"), "tried once per process")

	cfg.DSN, cfg.Logger = f.DSN, nil // the table's owner
	run(t, cfg, nil)
	require.Equal(t, 1, redrivenAt(), "added at start-up")
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
	// A record of an event whose id row 3 has now: the table's ids started
	// over since (TRUNCATE … RESTART IDENTITY, the table made again).
	// Before, it held row 3 back until its retry, an hour.
	f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		VALUES (3, gen_random_uuid()::text, 'E', 'refused', 'x', now() + interval '1 hour')`)
	x := run(t, f.Config(), nil)
	f.WaitDrained(1, 30*time.Second)
	require.Eventually(t, func() bool {
		held, err := relay.ListHeld(ctx, f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{All: true}, 10)
		return err == nil && len(held) == 1 && held[0].ID == 2
	}, 20*time.Second, 200*time.Millisecond, "rows 1 (published), 99 (gone) and 3 (another event's) are swept; 2 stays held")
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND id = 2`), "a row another replica holds is left alone")
	_ = x
}

// A hold recorded over a record of another event under the same id (the
// table's ids started over since) is the new event's: its id, type and
// first attempt, counted from one. Before, it kept the earlier event's id
// and attempts.
func TestHoldOverAnotherEventsRecordStartsAfresh(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	run(t, f.Config(), nil)
	f.Insert(1, 1, "E")
	f.WaitDrained(0, 30*time.Second) // the loop runs: past its start-up sweep of the held table
	f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, attempts, first_attempt, retry_at)
		VALUES (2, gen_random_uuid()::text, 'Old', 'refused', 'x', 5, now() - interval '1 day', now() - interval '1 hour')`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`) // id 2
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_held h JOIN outbox o USING (id)
			WHERE h.event_id = o.event_id::text AND h.event_type = 'E' AND h.reason = 'too_large'`) == 1
	}, 30*time.Second, 50*time.Millisecond, "the hold is the new row's")
	require.Equal(t, 1, f.Count(`SELECT attempts FROM outbox_held WHERE id = 2`))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_held WHERE id = 2 AND first_attempt > now() - interval '1 minute'`))
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

// Selectors of different kinds narrow each other and those of one kind
// add up, as `relay redrive --reason refused --type OrderConfirmed` reads:
// the refused rows of that type. Before, any row matching any selector was
// released: every refused row, and every row of the type whatever its
// reason. No selector selects nothing.
func TestHeldFiltersNarrowByEachKind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1)
	table := outbox.Table{Name: "outbox"}
	for _, r := range []struct {
		id            int64
		reason, type_ string
	}{{1, relay.HeldRefused, "A"}, {2, relay.HeldRefused, "B"}, {3, relay.HeldTooLarge, "B"}, {4, relay.HeldInvalidRow, "A"}} {
		f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
			VALUES ($1, gen_random_uuid(), $2, $3, 'e', now() + interval '1 hour')`, r.id, r.type_, r.reason)
	}
	ids := func(filter relay.HeldFilter) []int64 {
		rows, err := relay.ListHeld(ctx, f.Pool, table, filter, 10)
		require.NoError(t, err)
		var out []int64
		for _, r := range rows {
			out = append(out, r.ID)
		}
		return out
	}
	require.Equal(t, []int64{2}, ids(relay.HeldFilter{Reasons: []string{relay.HeldRefused}, Types: []string{"B"}}))
	require.Equal(t, []int64{1, 2}, ids(relay.HeldFilter{Reasons: []string{relay.HeldRefused}}))
	require.Equal(t, []int64{1, 2, 4}, ids(relay.HeldFilter{Reasons: []string{relay.HeldRefused, relay.HeldInvalidRow}}))
	require.Equal(t, []int64{3}, ids(relay.HeldFilter{IDs: []int64{1, 3}, Types: []string{"B"}}))
	require.Empty(t, ids(relay.HeldFilter{IDs: []int64{1}, Reasons: []string{relay.HeldTooLarge}}))
	require.Empty(t, ids(relay.HeldFilter{}))
	require.Equal(t, []int64{1, 2, 3, 4}, ids(relay.HeldFilter{All: true}))

	n, err := relay.Redrive(ctx, f.Pool, table, relay.HeldFilter{Reasons: []string{relay.HeldRefused}, Types: []string{"A"}})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_held WHERE retry_at <= now() AND id = 1`))
	n, err = relay.Redrive(ctx, f.Pool, table, relay.HeldFilter{})
	require.NoError(t, err)
	require.Zero(t, n, "no selector releases nothing")
}

// A held table dropped while the relay runs (or a privilege on it revoked)
// refuses the records of the rows a batch holds: the batch commits without
// them, its other rows marked, and each goes out once; the hold stays in
// memory. Before, the batch rolled back after Kafka acknowledged its other
// rows, which went out again with the next claim, at every retry of the
// held row. Re-created, the table takes the records again.
func TestAHeldTableThatRefusesRecordsLosesThemNotTheBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1)
	topic := f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Topics["E"] = topic
	cfg := f.Config()
	cfg.HeldRetryInterval = 2 * time.Second
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool { return x.R.Ready() == nil }, 30*time.Second, 50*time.Millisecond)
	f.Exec(`DROP TABLE outbox_held`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'Order', 'k' || g, 'E',
		       CASE WHEN g = 1 THEN jsonb_build_object('pad', repeat('y', 5000)) ELSE '{}'::jsonb END, 'k' || g
		FROM generate_series(1, 11) g`)
	f.WaitDrained(1, 30*time.Second)
	// Over two retries of the held row, with new rows claimed beside it.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		f.Insert(2, 2, "E")
		f.WaitDrained(1, 30*time.Second)
	}
	want := f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`)
	got := readTopics(t, []string{testenv.Broker().Addr()}, want, topic)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.eventID]++
	}
	require.Len(t, seen, want)
	for id, n := range seen {
		require.Equal(t, 1, n, "event %s went out %d times", id, n)
	}
	require.Equal(t, 1, f.Unpublished(), "the large row stays held")

	f.Exec(outbox.HeldDDL(outbox.Table{Name: "outbox"}))
	require.Eventually(t, func() bool {
		held, err := relay.ListHeld(ctx, f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{All: true}, 10)
		return err == nil && len(held) == 1 && held[0].Reason == relay.HeldTooLarge
	}, 20*time.Second, 100*time.Millisecond, "recorded again once the table is back")
}

// A held table another session is making (its transaction not ended) makes
// the relay's own CREATE wait; a lock wait that ran out is waited out as
// the check's other transient failures are, and the next check records
// holds in the table. Before, any failure to create the table, a
// transient one too, left the relay keeping its holds in memory for as
// long as it ran.
func TestHeldTableCheckWaitsOutATransientFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(`DROP TABLE outbox_held`)
	other, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx) //nolint:errcheck // committed below
	_, err = other.Exec(ctx, outbox.HeldDDL(outbox.Table{Name: "outbox"}))
	require.NoError(t, err)
	cfg := f.Config()
	sep := "?"
	if strings.Contains(cfg.DSN, "?") {
		sep = "&"
	}
	cfg.DSN += sep + "options=-c%20lock_timeout%3D300"
	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	var unreachable *relay.UnreachableError
	require.ErrorAs(t, r.Check(ctx), &unreachable)
	require.NoError(t, other.Commit(ctx))
	require.NoError(t, r.Check(ctx))
	require.True(t, relay.HoldsRecorded(r), "holds go to the table")
}

// A restarted relay reads its holds before its first claim, also when the
// sweep of the held table's stale records waits (here on a lock): the
// sweep comes after the load. Before, it came first and took the load's
// time, and the relay tried its held row again at once.
func TestHoldsLoadBeforeTheHeldTableSweeps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(2, 1, "E") // ids 1 and 2
	f.Exec(`UPDATE outbox SET published_at = now() WHERE id = 1`)
	f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		SELECT id, event_id, event_type, 'refused', 'refused', now() + interval '1 hour' FROM outbox`)
	stale, err := f.Pool.Begin(ctx) // keeps the record of published row 1 from the sweep
	require.NoError(t, err)
	defer stale.Rollback(ctx) //nolint:errcheck // only holds the lock
	_, err = stale.Exec(ctx, `SELECT 1 FROM outbox_held WHERE id = 1 FOR UPDATE`)
	require.NoError(t, err)
	run(t, f.Config(), nil)
	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], 1, 8*time.Second, 8*time.Second) // past the sweep's 4 s
	require.NoError(t, err)
	require.Empty(t, msgs, "the held row waits for its retry_at")
	require.Equal(t, 1, f.Count(`SELECT attempts FROM outbox_held WHERE id = 2`))
}
