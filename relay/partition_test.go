package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// partitioned replaces the fixture's outbox with the partitioned DDL (day
// partitions: today's in UTC and two more) and returns today's start.
func partitioned(t *testing.T, f *outboxtest.Fixture) time.Time {
	t.Helper()
	f.Exec(`DROP TABLE outbox`)
	f.Exec(outbox.PartitionedSchemaDDL(outbox.Table{Name: "outbox"}, outbox.PartitionDay, 2))
	var today time.Time
	require.NoError(t, f.Pool.QueryRow(context.Background(),
		`SELECT date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'`).Scan(&today))
	return today
}

// oldAndNewPartitions makes f's outbox partitioned with two partitions
// only: outbox_old, the day up to end (in from now, by the server's
// clock), and outbox_new, the three days from end. It returns end.
func oldAndNewPartitions(t *testing.T, f *outboxtest.Fixture, in time.Duration) time.Time {
	t.Helper()
	partitioned(t, f)
	f.Exec(`DO $$ DECLARE p regclass; BEGIN
		FOR p IN SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = 'outbox'::regclass LOOP
			EXECUTE 'DROP TABLE ' || p; END LOOP; END $$`)
	var end time.Time
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT now() + $1::float8 * interval '1 second'`, in.Seconds()).Scan(&end))
	lit := func(t time.Time) string { return t.UTC().Format("'2006-01-02 15:04:05.999999+00'") }
	f.Exec(`CREATE TABLE outbox_old PARTITION OF outbox FOR VALUES FROM (` + lit(end.Add(-24*time.Hour)) + `) TO (` + lit(end) + `)`)
	f.Exec(`CREATE TABLE outbox_new PARTITION OF outbox FOR VALUES FROM (` + lit(end) + `) TO (` + lit(end.Add(72*time.Hour)) + `)`)
	return end
}

// addDay attaches the partition name for the day that starts at from.
func addDay(f *outboxtest.Fixture, name string, from time.Time) {
	lit := func(t time.Time) string { return t.UTC().Format("'2006-01-02 15:04:05+00'") }
	f.Exec(fmt.Sprintf(`CREATE TABLE %s PARTITION OF outbox FOR VALUES FROM (%s) TO (%s)`, name, lit(from), lit(from.Add(24*time.Hour))))
}

// insertAt inserts n rows of eventType created at at, published then or
// not, with their event ids as the writer records them.
func insertAt(f *outboxtest.Fixture, n, keys int, at time.Time, published bool, eventType string) {
	f.Exec(`WITH r AS (
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at, published_at)
		SELECT gen_random_uuid(), 'Order', 'order-' || (g % $2), $3, jsonb_build_object('seq', g), 'order-' || (g % $2),
		       $4, CASE WHEN $5 THEN $4::timestamptz END
		FROM generate_series(1, $1) g
		RETURNING event_id, created_at)
		INSERT INTO outbox_event_ids SELECT event_id, created_at, '\x00' FROM r`, n, keys, eventType, at, published)
}

// attached reports whether table name is a partition of the outbox, and
// not one pending detach (its rows are out of the table's then).
func attached(t *testing.T, f *outboxtest.Fixture, name string) bool {
	t.Helper()
	return f.Count(`SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox'::regclass AND inhrelid = to_regclass($1) AND NOT inhdetachpending`, name) == 1
}

// A range-partitioned outbox drains in both ordering modes: rows in three
// partitions, ids out of created_at order, every event once and every key in
// id order; a row committed late behind the cursor; then --on-publish delete.
func TestPartitionedTableDrains(t *testing.T) {
	eachMode(t, 4, []string{"E"}, func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
		today := partitioned(t, f)
		addDay(f, "outbox_d1", today.Add(-24*time.Hour))
		addDay(f, "outbox_d2", today.Add(-48*time.Hour))
		f.Insert(1000, 30, "E")                                     // today
		insertAt(f, 1000, 30, today.Add(-36*time.Hour), false, "E") // newer ids, older rows
		insertAt(f, 1000, 30, today.Add(-12*time.Hour), false, "E")
		require.Equal(t, 1000, f.Count(`SELECT count(*) FROM outbox_d2`))

		cfg.FullRescanInterval = 2 * time.Second
		x := run(t, cfg, nil)
		ctx := context.Background()
		late, err := f.Pool.Begin(ctx)
		require.NoError(t, err)
		defer late.Rollback(ctx)
		_, err = late.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
			VALUES (gen_random_uuid(), 'Order', 'late', 'E', '{"late":true}', 'late', $1)`, today.Add(-30*time.Hour))
		require.NoError(t, err)
		f.Insert(200, 30, "E") // newer ids, committed first and published
		f.WaitDrained(0, 60*time.Second)
		require.NoError(t, late.Commit(ctx))
		f.WaitDrained(0, 30*time.Second)
		want, ids := f.EventIDs(""), idsByEvent(t, f)
		require.Len(t, want, 3201)

		counts, msgs := outboxtest.Deliveries(t, len(want), f.Topics["E"])
		outboxtest.RequireExactlyOnce(t, want, counts)
		violations, keys := orderViolations(t, msgs, ids)
		require.Zero(t, violations, "rows of a key out of id order")
		require.Equal(t, 31, keys)
		require.Equal(t, 0, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL OR published_at < created_at`))
		x.Stop(t)

		// Marking touches only the partitions a batch's rows are in.
		plan := explain(t, f, relay.NewSQL(outbox.Table{Name: "outbox"}, relay.WithPartitions()).Mark,
			[]int64{1, 2}, today.Add(-36*time.Hour), today.Add(-36*time.Hour), []time.Time{today.Add(-36 * time.Hour), today.Add(-36 * time.Hour)})
		require.Contains(t, plan, "outbox_d2")
		require.NotContains(t, plan, "outbox_d1")
		require.NotContains(t, plan, "outbox_p")

		// Delete on publish: the new rows go, the marked ones stay.
		marked := f.Count(`SELECT count(*) FROM outbox`)
		insertAt(f, 300, 30, today.Add(-40*time.Hour), false, "E")
		f.Insert(300, 30, "E")
		fresh := f.EventIDs("WHERE published_at IS NULL")
		require.Len(t, fresh, 600)
		cfg.OnPublish = relay.OnPublishDelete
		run(t, cfg, nil)
		require.Eventually(t, func() bool { return f.Count(`SELECT count(*) FROM outbox`) == marked }, 60*time.Second, 20*time.Millisecond)
		counts, _ = outboxtest.Deliveries(t, len(want)+len(fresh), f.Topics["E"])
		for id := range fresh {
			require.Equal(t, 1, counts[id], "event %s", id)
		}
	})
}

func explain(t *testing.T, f *outboxtest.Fixture, sql string, args ...any) string {
	t.Helper()
	rows, err := f.Pool.Query(context.Background(), "EXPLAIN "+sql, args...)
	require.NoError(t, err)
	defer rows.Close()
	var plan string
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan += line + "\n"
	}
	require.NoError(t, rows.Err())
	return plan
}

// Two rows of a partitioned outbox under one id (its primary key there is
// the id with created_at: an id given explicitly, or a partition attached
// again after the ids started over): a batch that published one of them,
// the other locked elsewhere meanwhile and created between the batch's
// rows, marks only the one it published, and the other goes out once
// free. Before, the mark by id and the batch's created_at range reached
// the other too, which then counted as published without reaching Kafka.
func TestPartitionedMarkReachesOnlyThePublishedRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	today := partitioned(t, f)
	insertAt(f, 1, 1, today.Add(time.Hour), false, "E")
	var id int64
	require.NoError(t, f.Pool.QueryRow(ctx, `SELECT id FROM outbox`).Scan(&id))
	insertAt(f, 1, 1, today.Add(3*time.Hour), false, "E") // the batch's other row, created later
	insertTwin(f, id, today.Add(2*time.Hour))
	want := f.EventIDs("")
	require.Len(t, want, 3)
	locker, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer locker.Rollback(ctx)
	_, err = locker.Exec(ctx, `SELECT 1 FROM outbox WHERE aggregate_id = 'twin' FOR UPDATE`)
	require.NoError(t, err)

	run(t, cfg, nil)
	_, _ = outboxtest.Deliveries(t, 2, f.Topics["E"]) // the two the batch claimed
	require.NoError(t, locker.Rollback(ctx))          // a mark that reached the twin waited for this
	f.WaitDrained(0, 30*time.Second)
	counts, _ := outboxtest.Deliveries(t, 3, f.Topics["E"])
	outboxtest.RequireAtLeastOnce(t, want, counts)
}

// In partition-key mode a row another session holds locked stops its key
// even when a row of the same id (its twin, of another key) is claimed:
// its key's later row waits until it is free, and then goes out after it.
// Before, the claim told locked rows by id alone, so the twin it locked hid
// the row held elsewhere, which was not fenced, and its key's later row
// went out first.
func TestPartitionedRowLockedElsewhereStopsItsKeyBesideItsTwin(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	cfg.Ordering = relay.OrderingPartitionKey
	today := partitioned(t, f)
	insertAt(f, 1, 1, today.Add(time.Hour), false, "E") // key order-0's first row
	var id int64
	require.NoError(t, f.Pool.QueryRow(ctx, `SELECT id FROM outbox`).Scan(&id))
	insertAt(f, 1, 1, today.Add(3*time.Hour), false, "E") // its second row, a later id
	insertTwin(f, id, today.Add(2*time.Hour))
	want := f.EventIDs("")
	locker, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer locker.Rollback(ctx)
	_, err = locker.Exec(ctx, `SELECT 1 FROM outbox WHERE id = $1 AND aggregate_id <> 'twin' FOR UPDATE`, id)
	require.NoError(t, err)

	run(t, cfg, nil)
	require.True(t, eventually(20*time.Second, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE aggregate_id = 'twin' AND published_at IS NOT NULL`) == 1
	}), "the twin, of a key of its own, goes out")
	require.Never(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE aggregate_id = 'order-0' AND published_at IS NOT NULL`) > 0
	}, 2*time.Second, 50*time.Millisecond, "the key's later row waits for the row held elsewhere")
	require.NoError(t, locker.Rollback(ctx))
	f.WaitDrained(0, 30*time.Second)
	counts, _ := outboxtest.Deliveries(t, 3, f.Topics["E"])
	outboxtest.RequireAtLeastOnce(t, want, counts)
	violations, _ := orderViolations(t, testenv.Broker().Consume(t, f.Topics["E"], 3, 30*time.Second), idsByEvent(t, f))
	require.Zero(t, violations, "the key's rows in id order")
}

// insertTwin inserts a row of event type E and key "twin" with the id of
// another row, created at at, as a partition attached again after the ids
// started over would hold it.
func insertTwin(f *outboxtest.Fixture, id int64, at time.Time) {
	f.Exec(`WITH r AS (
		INSERT INTO outbox (id, event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
		OVERRIDING SYSTEM VALUE
		VALUES ($1, gen_random_uuid(), 'Order', 'twin', 'E', '{"twin": true}', 'twin', $2)
		RETURNING event_id, created_at)
		INSERT INTO outbox_event_ids SELECT event_id, created_at, '\x00' FROM r`, id, at)
}

// modeFixture is a fixture with a topic for event type E and the config of
// a relay in mode: none or partition-key ordering, or logical-replication.
func modeFixture(t *testing.T, mode string) (*outboxtest.Fixture, relay.Config) {
	if mode == "logical-replication" {
		return captureFixture(t, 1, "E")
	}
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	if mode == "partition-key" {
		cfg.Ordering = relay.OrderingPartitionKey
	}
	return f, cfg
}

// Two rows of one id in one claim (the id with created_at is the primary
// key): each goes out once, the second in a later claim, in either
// ordering and when streaming. Before, both went out in one batch, whose
// mark by id and created_at kept one created_at per id: the other row
// stayed unpublished and went out again.
func TestPartitionedTwinsInOneClaimGoOutOnceEach(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"none", "partition-key", "logical-replication"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f, cfg := modeFixture(t, mode)
			today := partitioned(t, f)
			insertAt(f, 1, 1, today.Add(time.Hour), false, "E")
			var id int64
			require.NoError(t, f.Pool.QueryRow(ctx, `SELECT id FROM outbox`).Scan(&id))
			insertTwin(f, id, today.Add(2*time.Hour))
			insertAt(f, 1, 1, today.Add(3*time.Hour), false, "E")
			want := f.EventIDs("")
			require.Len(t, want, 3)

			run(t, cfg, nil)
			f.WaitDrained(0, 30*time.Second)
			counts, _ := outboxtest.Deliveries(t, 3, f.Topics["E"])
			outboxtest.RequireExactlyOnce(t, want, counts)
		})
	}
}

// With --notify on a partitioned outbox, a notifying writer's event is
// claimed at once.
func TestPartitionedTableNotify(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	partitioned(t, f)
	cfg := f.Config()
	cfg.PollInterval = 30 * time.Second
	cfg.Notify = true
	run(t, cfg, nil)
	time.Sleep(6 * time.Second) // idle: the wait between empty claims has grown to seconds

	w, err := outbox.NewWriter("outbox", outbox.WithNotify())
	require.NoError(t, err)
	ctx := context.Background()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NoError(t, w.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order",
		AggregateID: "o1", EventType: "E", Payload: []byte(`{}`), PartitionKey: "o1"}))
	require.NoError(t, tx.Commit(ctx))
	start := time.Now()
	require.Eventually(t, func() bool { return f.Unpublished() == 0 }, 5*time.Second, 2*time.Millisecond)
	require.Less(t, time.Since(start), time.Second, "the notification woke the relay")
}

// Retention on a partitioned outbox drops whole partitions whose range ended
// longer ago than --keep-published-for, only when every row in them is
// published: a partition holding one unpublished row stays, with its row,
// until that row is published. The event ids of dropped ranges go too.
func TestPartitionRetentionDropsOnlyFullyPublishedPartitions(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	today := partitioned(t, f)
	addDay(f, "outbox_d1", today.Add(-24*time.Hour))
	addDay(f, "outbox_d2", today.Add(-48*time.Hour))
	addDay(f, "outbox_d3", today.Add(-72*time.Hour))
	insertAt(f, 300, 10, today.Add(-36*time.Hour), true, "E") // d2: all published
	insertAt(f, 300, 10, today.Add(-12*time.Hour), true, "E") // d1: published, but …
	insertAt(f, 1, 1, today.Add(-10*time.Hour), false, "Unmapped")
	// … one row the relay cannot publish (held: its type is not mapped).
	// d3: empty. An event id older than every partition (its partition was
	// dropped by hand) and one in d1's range.
	f.Exec(`INSERT INTO outbox_event_ids VALUES (gen_random_uuid(), $1, '\x00')`, today.Add(-240*time.Hour))
	f.Insert(500, 10, "E") // today: published by the relay
	ctx := context.Background()
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	for range 5 {
		tx, err := f.Pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, w.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order",
			AggregateID: "o1", EventType: "E", Payload: []byte(`{}`), PartitionKey: "o1"}))
		require.NoError(t, tx.Commit(ctx))
	}
	idsIn := func(from, to time.Time) int {
		return f.Count(`SELECT count(*) FROM outbox_event_ids WHERE created_at >= $1 AND created_at < $2`, from, to)
	}

	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	cfg.PrunePause = time.Millisecond
	x := run(t, cfg, nil)
	pruned := func() (rows, partitions float64) {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_rows_total"),
			outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total")
	}
	require.Eventually(t, func() bool { _, p := pruned(); return p == 2 }, 30*time.Second, 50*time.Millisecond)
	rows, _ := pruned()
	require.Equal(t, float64(300), rows)
	require.False(t, attached(t, f, "outbox_d2"))
	require.Zero(t, f.Count(`SELECT count(*) FROM pg_class WHERE relname IN ('outbox_d2', 'outbox_d3')`), "dropped, not just detached")
	require.True(t, attached(t, f, "outbox_d1"), "a partition with an unpublished row stays")
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_d1 WHERE published_at IS NULL`))
	require.Equal(t, 301, f.Count(`SELECT count(*) FROM outbox_d1`))
	require.Eventually(t, func() bool { return idsIn(time.Time{}, today.Add(-24*time.Hour)) == 0 }, 10*time.Second, 50*time.Millisecond,
		"the event ids of dropped ranges are deleted")
	require.Equal(t, 301, idsIn(today.Add(-24*time.Hour), today))
	require.Equal(t, 5, idsIn(today, today.Add(72*time.Hour)))
	f.WaitDrained(1, 30*time.Second)
	require.Equal(t, 505, f.Count(`SELECT count(*) FROM outbox WHERE created_at >= $1`, today), "today's rows are published and kept")

	// Once its last row is published, the next pass drops d1 too.
	f.Exec(`UPDATE outbox SET published_at = now() WHERE event_type = 'Unmapped'`)
	require.Eventually(t, func() bool { _, p := pruned(); return p == 3 }, 30*time.Second, 100*time.Millisecond)
	rows, _ = pruned()
	require.Equal(t, float64(601), rows)
	require.Zero(t, f.Count(`SELECT count(*) FROM pg_class WHERE relname = 'outbox_d1'`))
	require.Eventually(t, func() bool { return idsIn(time.Time{}, today) == 0 }, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, 505, f.Count(`SELECT count(*) FROM outbox`))
	counts, _ := outboxtest.Deliveries(t, 505, f.Topics["E"])
	require.Len(t, counts, 505)
}

// A writer whose transaction began inside an old partition's range commits
// a row into it while the pruner detaches it: the detach waits for the
// writer, the check after it finds the row, and the partition is attached
// again; the row is published, and the partition dropped after that.
func TestPartitionDetachedWithALateRowIsAttachedAgain(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	today := partitioned(t, f)
	addDay(f, "outbox_d2", today.Add(-48*time.Hour))
	insertAt(f, 100, 10, today.Add(-36*time.Hour), true, "E")

	ctx := context.Background()
	writer, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	var late string
	require.NoError(t, writer.QueryRow(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
		VALUES (gen_random_uuid(), 'Order', 'late', 'E', '{"late":true}', 'late', $1) RETURNING event_id::text`,
		today.Add(-30*time.Hour)).Scan(&late))

	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	cfg.FullRescanInterval = time.Second
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'ALTER TABLE%DETACH PARTITION%' AND wait_event_type = 'Lock'`) > 0
	}, 30*time.Second, 20*time.Millisecond, "the detach waits for the writer")
	require.NoError(t, writer.Commit(ctx))

	msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 60*time.Second)
	require.Len(t, msgs, 1)
	require.Equal(t, late, testenv.Header(msgs[0], relay.HeaderEventID), "the late row was published, not dropped")
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total") == 1
	}, 60*time.Second, 100*time.Millisecond)
	require.Equal(t, float64(101), outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_rows_total"))
	require.False(t, attached(t, f, "outbox_d2"))
}

// Retention needs a table partitioned by RANGE (created_at); the relay
// refuses another partitioning at start-up with retention on, and runs on it
// without.
func TestPartitionedStartupChecks(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(`DROP TABLE outbox`)
	f.Exec(`CREATE TABLE outbox (
		id bigint GENERATED ALWAYS AS IDENTITY, event_id uuid NOT NULL, aggregate_type text NOT NULL,
		aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, partition_key text NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz, PRIMARY KEY (id)) PARTITION BY RANGE (id)`)
	f.Exec(`CREATE TABLE outbox_1 PARTITION OF outbox FOR VALUES FROM (MINVALUE) TO (MAXVALUE)`)
	f.Exec(`CREATE INDEX ix_outbox_unpublished ON outbox (id) WHERE published_at IS NULL`)
	cfg := f.Config()
	cfg.KeepPublishedFor = time.Hour
	_, err := outboxtest.RunRelay(cfg, nil)
	require.ErrorContains(t, err, "not by RANGE (created_at)")
	f.Insert(10, 2, "E")
	run(t, f.Config(), nil)
	f.WaitDrained(0, 30*time.Second)
}

// A detach left pending (its wait timed out) and tables a pruner detached
// but did not get to drop (it died) are finished by the next pass: dropped
// when all their rows are published, attached again when one is not.
func TestPartitionPrunerFinishesInterruptedDetaches(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	unpublished := interruptedDetaches(t, f)

	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	cfg.FullRescanInterval = time.Second
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total") == 2
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, float64(150), outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_rows_total"))
	require.Zero(t, f.Count(`SELECT count(*) FROM pg_class WHERE relname IN ('outbox_d2', 'outbox_d3')`))
	require.True(t, attached(t, f, "outbox_d4"), "the table with an unpublished row is a partition again")
	counts, _ := outboxtest.Deliveries(t, 1, f.Topics["E"])
	outboxtest.RequireExactlyOnce(t, unpublished, counts)
}

// A longer retention than the one a pruner detached under, or a DEFAULT
// partition made since, does not strand what it left: each table is
// settled whatever its age, here attached again (none is old enough to
// drop), and the row waiting there is published. (Before, the pass passed
// them by, and the row was in no partition, neither claimed nor counted.)
func TestPartitionsADetachLeftAreSettledUnderALongerRetention(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		defaultToo bool
	}{{"longer retention", false}, {"and a DEFAULT partition", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 1, "E")
			unpublished := interruptedDetaches(t, f)
			if tc.defaultToo {
				f.Exec(`CREATE TABLE outbox_default PARTITION OF outbox DEFAULT`)
			}
			cfg := f.Config()
			cfg.KeepPublishedFor = 30 * 24 * time.Hour
			x := run(t, cfg, nil)
			require.Eventually(t, func() bool {
				return attached(t, f, "outbox_d2") && attached(t, f, "outbox_d3") && attached(t, f, "outbox_d4")
			}, 30*time.Second, 50*time.Millisecond, "every table a pruner left is a partition again")
			f.WaitDrained(0, 30*time.Second)
			require.Equal(t, 171, f.Count(`SELECT count(*) FROM outbox`), "nothing dropped")
			require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total"))
			counts, _ := outboxtest.Deliveries(t, 1, f.Topics["E"])
			outboxtest.RequireExactlyOnce(t, unpublished, counts)
		})
	}
}

// With retention off nothing drops what a pruner detached, or began to,
// and did not drop: the relay attaches every such table again, published
// rows and all, and publishes what waits there. (Before, those rows were
// in no partition of the table, stranded.)
func TestPartitionsADetachLeftAreAttachedAgainWithRetentionOff(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	unpublished := interruptedDetaches(t, f)
	x := run(t, f.Config(), nil)
	require.Eventually(t, func() bool {
		return attached(t, f, "outbox_d2") && attached(t, f, "outbox_d3") && attached(t, f, "outbox_d4")
	}, 30*time.Second, 50*time.Millisecond, "every table a pruner left is a partition again")
	require.Zero(t, f.Count(`SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox'::regclass AND inhdetachpending`))
	f.WaitDrained(0, 30*time.Second)
	require.Equal(t, 171, f.Count(`SELECT count(*) FROM outbox`), "nothing dropped")
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total"))
	counts, _ := outboxtest.Deliveries(t, 1, f.Topics["E"])
	outboxtest.RequireExactlyOnce(t, unpublished, counts)
}

// With retention off, a detach that no pruner began (a DBA's, or a
// partition manager's, left pending) is left to whoever began it, while
// what a pruner left is attached again.
func TestPartitionsADetachSomeoneElseBeganIsLeftAlone(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	today := partitioned(t, f)
	// The pass goes in range order: it meets the pending detach first, so
	// once the later table is attached again it has passed it.
	addDay(f, "outbox_d2", today.Add(-72*time.Hour))
	addDay(f, "outbox_d3", today.Add(-48*time.Hour))
	detachTimedOut(t, f, "outbox_d2")
	markDetaching(t, f, "outbox_d3")
	f.Exec(`ALTER TABLE outbox DETACH PARTITION outbox_d3`)
	run(t, f.Config(), nil)
	require.Eventually(t, func() bool { return attached(t, f, "outbox_d3") }, 30*time.Second, 50*time.Millisecond,
		"the table a pruner left is a partition again")
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_inherits WHERE inhrelid = 'outbox_d2'::regclass AND inhdetachpending`),
		"a detach no pruner began stays pending")
}

// A pruner's detach that times out before it begins leaves the partition
// attached, and without the pruner's mark: marked, a detach someone else
// began later, and left pending, would be taken for the pruner's and
// undone with retention off. The next pass detaches and drops it.
func TestPartitionDetachThatNeverBeganLeavesNoMark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	today := partitioned(t, f)
	addDay(f, "outbox_d2", today.Add(-48*time.Hour))
	insertAt(f, 10, 2, today.Add(-36*time.Hour), true, "E")
	lock, err := f.Pool.Begin(ctx) // the detach's first lock wait times out behind it
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(context.Background()) })
	_, err = lock.Exec(ctx, `LOCK TABLE ONLY outbox IN SHARE UPDATE EXCLUSIVE MODE`)
	require.NoError(t, err)
	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "pruning failed") }, 30*time.Second, 20*time.Millisecond,
		"the detach times out")
	require.Contains(t, logs.String(), "outbox_d2")
	require.True(t, attached(t, f, "outbox_d2"))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_class WHERE oid = 'outbox_d2'::regclass AND obj_description(oid, 'pg_class') IS NULL`),
		"no mark is left on the partition")
	require.NoError(t, lock.Rollback(ctx))
	require.Eventually(t, func() bool { return outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total") == 1 },
		40*time.Second, 50*time.Millisecond, "the next pass drops it")
}

// interruptedDetaches leaves f's partitioned outbox as interrupted pruners
// leave it: outbox_d2 pending detach (its wait timed out), outbox_d3 and
// outbox_d4 marked and detached (the pruner died before the drop); every
// row published but one in outbox_d4, whose event id it returns (as a set).
func interruptedDetaches(t *testing.T, f *outboxtest.Fixture) map[string]bool {
	t.Helper()
	today := partitioned(t, f)
	for i, name := range []string{"outbox_d2", "outbox_d3", "outbox_d4"} {
		addDay(f, name, today.Add(-time.Duration(24*(i+2))*time.Hour))
	}
	insertAt(f, 100, 10, today.Add(-36*time.Hour), true, "E") // d2
	insertAt(f, 50, 10, today.Add(-60*time.Hour), true, "E")  // d3
	insertAt(f, 20, 10, today.Add(-84*time.Hour), true, "E")  // d4 …
	insertAt(f, 1, 1, today.Add(-84*time.Hour), false, "E")   // … and a row to publish
	unpublished := f.EventIDs("WHERE published_at IS NULL")

	// d2: marked by a pruner whose DETACH … CONCURRENTLY timed out.
	markDetaching(t, f, "outbox_d2")
	detachTimedOut(t, f, "outbox_d2")
	// d3, d4: marked and detached by a pruner that died before the drop.
	for _, name := range []string{"outbox_d3", "outbox_d4"} {
		markDetaching(t, f, name)
		f.Exec(`ALTER TABLE outbox DETACH PARTITION ` + name)
	}
	return unpublished
}

// markDetaching comments partition name as a pruner does before it
// detaches it.
func markDetaching(t *testing.T, f *outboxtest.Fixture, name string) {
	t.Helper()
	var parent uint32
	var bound string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT 'outbox'::regclass::oid, pg_get_expr(relpartbound, oid) FROM pg_class WHERE oid = $1::regclass`,
		name).Scan(&parent, &bound))
	f.Exec(fmt.Sprintf(`COMMENT ON TABLE %s IS 'outbox relay: detaching from %d: %s'`, name, parent, strings.ReplaceAll(bound, "'", "''")))
}

// detachTimedOut leaves partition name detach pending: a DETACH …
// CONCURRENTLY that timed out waiting for a reader.
func detachTimedOut(t *testing.T, f *outboxtest.Fixture, name string) {
	t.Helper()
	ctx := context.Background()
	reader, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = reader.Exec(ctx, `SELECT count(*) FROM outbox`)
	require.NoError(t, err)
	conn, err := f.Pool.Acquire(ctx)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `SET lock_timeout = '300ms'`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `ALTER TABLE outbox DETACH PARTITION `+name+` CONCURRENTLY`)
	require.ErrorContains(t, err, "lock timeout")
	conn.Release()
	require.NoError(t, reader.Commit(ctx))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_inherits WHERE inhrelid = $1::regclass AND inhdetachpending`, name))
}

// Bounds of '-infinity' and 'infinity', legal for a timestamptz range
// partition, read as MINVALUE and MAXVALUE: the pruner drops the old
// partitions beside them and deletes the event ids of the dropped ranges.
// (Before, reading such a bound failed every pass, and nothing was dropped.)
func TestPartitionRetentionReadsInfiniteBounds(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	today := partitioned(t, f)
	addDay(f, "outbox_d2", today.Add(-48*time.Hour))
	lit := func(t time.Time) string { return t.UTC().Format("'2006-01-02 15:04:05+00'") }
	f.Exec(`CREATE TABLE outbox_past PARTITION OF outbox FOR VALUES FROM ('-infinity') TO (` + lit(today.Add(-48*time.Hour)) + `)`)
	f.Exec(`CREATE TABLE outbox_future PARTITION OF outbox FOR VALUES FROM (` + lit(today.Add(72*time.Hour)) + `) TO ('infinity')`)
	insertAt(f, 50, 5, today.Add(-36*time.Hour), true, "E")
	insertAt(f, 10, 5, today.Add(-100*time.Hour), true, "E")
	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	cfg.PrunePause = time.Millisecond
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total") == 2
	}, 30*time.Second, 50*time.Millisecond, "the old partitions are dropped")
	require.Zero(t, f.Count(`SELECT count(*) FROM pg_class WHERE relname IN ('outbox_d2', 'outbox_past')`))
	require.True(t, attached(t, f, "outbox_future"), "a partition up to 'infinity' is never old")
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_event_ids WHERE created_at < $1`, today) == 0
	}, 10*time.Second, 50*time.Millisecond, "the event ids of the dropped ranges are deleted")
}

// With writer deletes the table stays empty, so an old partition holds no
// unpublished row though its events may still be in the slot only (the
// stream lags: Kafka is down). The pruner keeps it until the slot has
// confirmed past every transaction that could have written into it: a row
// of it the stream must put back (its type is unmapped) then finds its
// partition, and the rows behind it go out. (Before, the partition was
// dropped, the put-back failed for ever, and nothing behind it went out.)
func TestPartitionRetentionWaitsForTheSlot(t *testing.T) {
	t.Parallel()
	f, cfg, _ := writerDeletesFixture(t, "E")
	today := partitioned(t, f)
	addDay(f, "outbox_d2", today.Add(-48*time.Hour))
	startStreaming(t, cfg).Stop(t) // makes the slot
	waitSlotIdle(t, f)
	f.Exec(`BEGIN;
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'o1', 'E', '{"n": 1}', 'o1');
		DELETE FROM outbox WHERE event_type = 'E';
		COMMIT`)
	f.Exec(`BEGIN;
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
		VALUES (gen_random_uuid(), 'Order', 'o2', 'Unmapped', '{"n": 2}', 'o2', ` +
		today.Add(-36*time.Hour).UTC().Format("'2006-01-02 15:04:05+00'") + `);
		DELETE FROM outbox WHERE event_type = 'Unmapped';
		COMMIT`)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`))

	cfg.KeepPublishedFor = time.Minute
	cfg.PrunePause = time.Millisecond
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	x := run(t, cfg, stuckWriter{}) // Kafka is down: the stream stays before o1
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), "waits for the replication slot") ||
			f.Count(`SELECT count(*) FROM pg_class WHERE relname = 'outbox_d2'`) == 0
	}, 30*time.Second, 50*time.Millisecond, "the pruner looks at d2")
	require.True(t, attached(t, f, "outbox_d2"), "d2 is kept while the slot holds rows that may belong to it:\n%s", &logs)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_partition_drop_delay_seconds", "reason", "slot") > 24*3600-60
	}, 30*time.Second, 50*time.Millisecond, "the gauge says how long d2's drop is overdue, and why")
	x.Stop(t)
	waitSlotIdle(t, f)

	f.Exec(`BEGIN;
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'o3', 'E', '{"n": 3}', 'o3');
		DELETE FROM outbox WHERE event_type = 'E';
		COMMIT`)
	cfg.Logger = nil
	run(t, cfg, nil) // Kafka is back
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 2, 60*time.Second)
	require.Len(t, msgs, 2)
	require.Equal(t, []string{"o1", "o3"}, []string{string(msgs[0].Key), string(msgs[1].Key)})
	requireSlotConfirmedPastNow(t, f)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_d2 WHERE event_type = 'Unmapped' AND published_at IS NULL`),
		"the unmapped row is back in its partition, which stays")
	require.True(t, attached(t, f, "outbox_d2"))
}

// A partition old enough to drop waits for a transaction that began before
// its range ended (here one left idle in transaction), and
// outbox_relay_partition_drop_delay_seconds{reason="transactions"} says
// for how long its drop is overdue, so an alert can tell; once the
// transaction ends the partition is dropped and the gauge is 0 again.
// (Before, only a log line, written once, said so.)
func TestPartitionDropHeldByATransactionIsMeasured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const keep = time.Minute
	f := outboxtest.NewFixture(t, 1, "E")
	// Begun before the partitions are made, so it began before the old
	// one's range ends however long the DDL takes; it locks nothing the
	// DDL waits for.
	idle, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer idle.Rollback(ctx) //nolint:errcheck // ended below
	_, err = idle.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	oldAndNewPartitions(t, f, 2*time.Second)

	cfg := f.Config()
	cfg.KeepPublishedFor = keep
	x := run(t, cfg, nil)
	delay := func(reason string) float64 {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_partition_drop_delay_seconds", "reason", reason)
	}
	require.Zero(t, delay("transactions"))
	var first float64
	require.Eventually(t, func() bool { first = delay("transactions"); return first > 0 },
		keep+time.Minute, 100*time.Millisecond, "once the partition is old, its drop waits for the open transaction")
	require.True(t, attached(t, f, "outbox_old"))
	require.Zero(t, delay("slot"), "the table has no slot")
	require.Eventually(t, func() bool { return delay("transactions") > first }, 30*time.Second, 100*time.Millisecond,
		"the delay grows while the transaction stays open")
	require.True(t, attached(t, f, "outbox_old"))

	require.NoError(t, idle.Rollback(ctx))
	require.Eventually(t, func() bool {
		return delay("transactions") == 0 && outboxtest.MetricValue(t, x.Reg, "outbox_relay_pruned_partitions_total") == 1
	}, 40*time.Second, 100*time.Millisecond, "the transaction ended: the partition is dropped, and nothing waits")
	require.Zero(t, f.Count(`SELECT count(*) FROM pg_class WHERE relname = 'outbox_old'`))
}

// Beside a DEFAULT partition no partition is dropped (none can be
// detached concurrently): the drop-delay gauge says how long the oldest
// one is overdue, with reason default_partition, so the alert on it fires.
// Before, the gauge read 0 for such a table, however old its partitions.
func TestPartitionDropBesideADefaultPartitionIsMeasured(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	oldAndNewPartitions(t, f, -2*time.Hour) // the old partition's range ended two hours ago
	f.Exec(`CREATE TABLE outbox_default PARTITION OF outbox DEFAULT`)
	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	x := run(t, cfg, nil)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_partition_drop_delay_seconds", "reason", "default_partition") > time.Hour.Seconds()
	}, 30*time.Second, 100*time.Millisecond, "its drop is over an hour overdue")
	require.True(t, attached(t, f, "outbox_old"), "and it is not dropped")
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_partition_drop_delay_seconds", "reason", "transactions"))
}

// gatedWriter holds its first write until open is closed, and closes
// entered when that write begins.
type gatedWriter struct {
	w       relay.MessageWriter
	once    sync.Once
	entered chan struct{}
	open    chan struct{}
}

func (g *gatedWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	first := false
	g.once.Do(func() { first = true; close(g.entered) })
	if first {
		select {
		case <-g.open:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.w.WriteMessages(ctx, msgs...)
}

// A row is committed into an old partition after the pruner looked for
// unpublished rows in it, and a claim locks it before the detach begins
// and marks it after: the detach pending hides the partition from the
// mark. A writer whose transaction began before the partition's range
// ended is waited for before the partition is looked at, so its row is
// published once and the partition kept until then (before, the mark
// updated nothing, the partition was attached again, and the row was
// published twice). A writer that sets created_at itself is not; the
// mark that updates fewer rows than were published fails its batch,
// which says so, rather than committing as if it had marked them.
func TestPartitionDetachDoesNotHideARowFromItsMark(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		beganBefore bool
	}{{"writer began before the range ended", true}, {"writer set created_at", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			const keep = time.Minute
			f := outboxtest.NewFixture(t, 1, "E")
			// The old partition's range ends 2 s from now, or ended before
			// the retention (a minute, the least) began.
			in := 2 * time.Second
			if !tc.beganBefore {
				in = -62 * time.Second
			}
			end := oldAndNewPartitions(t, f, in)
			lit := func(t time.Time) string { return t.UTC().Format("'2006-01-02 15:04:05.999999+00'") }
			insert := `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
				VALUES (gen_random_uuid(), 'Order', 'late', 'E', '{}', 'late') RETURNING event_id::text`
			if !tc.beganBefore {
				insert = `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
					VALUES (gen_random_uuid(), 'Order', 'late', 'E', '{}', 'late', ` + lit(end.Add(-time.Second)) + `) RETURNING event_id::text`
			}
			writer, err := f.Pool.Begin(ctx)
			require.NoError(t, err)
			defer writer.Rollback(ctx)
			var late string
			require.NoError(t, writer.QueryRow(ctx, insert).Scan(&late))
			<-time.After(time.Until(end.Add(keep)) + time.Second) // the partition is old
			// A transaction that began after the range ended holds the
			// pruner between its look for unpublished rows and the detach.
			lock, err := f.Pool.Begin(ctx)
			require.NoError(t, err)
			defer lock.Rollback(ctx)
			_, err = lock.Exec(ctx, `LOCK TABLE outbox_old IN SHARE UPDATE EXCLUSIVE MODE`)
			require.NoError(t, err)

			cfg := f.Config()
			cfg.KeepPublishedFor = keep
			var logs lockedBuffer
			cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			// The writer knows the test's new topic before the relay runs: a
			// first publish that failed on it would leave the row to the
			// pruner's look after the detach, not to the mark.
			kw := newKafkaWriter(t)
			kw.Transport = &kafka.Transport{}
			require.Eventually(t, func() bool {
				md, err := (&kafka.Client{Addr: kw.Addr, Transport: kw.Transport}).Metadata(ctx, &kafka.MetadataRequest{Topics: []string{f.Topics["E"]}})
				return err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) > 0
			}, 30*time.Second, 100*time.Millisecond, "the writer knows the topic")
			w := &gatedWriter{w: kw, entered: make(chan struct{}), open: make(chan struct{})}
			run(t, cfg, w)
			require.Eventually(t, func() bool {
				return f.Count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND backend_xid IS NULL
					AND (query LIKE 'COMMENT ON TABLE%' OR query LIKE 'ALTER TABLE%DETACH%')`) > 0 ||
					strings.Contains(logs.String(), "waits for the transactions that may have begun before its range ended")
			}, 30*time.Second, 20*time.Millisecond, "the pruner looked at the partition")
			require.NoError(t, writer.Commit(ctx))
			select {
			case <-w.entered: // a claim holds the row, publishing it
			case <-time.After(30 * time.Second):
				t.Fatal("the row is claimed")
			}
			require.NoError(t, lock.Rollback(ctx))
			pending := func() bool {
				return f.Count(`SELECT count(*) FROM pg_inherits WHERE inhrelid = 'outbox_old'::regclass AND inhdetachpending`) == 1
			}
			if tc.beganBefore {
				for deadline := time.Now().Add(3 * time.Second); !pending() && time.Now().Before(deadline); {
					<-time.After(20 * time.Millisecond) // the detach would begin now, were it not held
				}
			} else {
				// Nothing holds the detach: it goes pending while the claim
				// holds the row (on a loaded machine, more than 3 s later).
				require.Eventually(t, pending, 30*time.Second, 20*time.Millisecond, "the detach begins while the row is claimed")
			}
			close(w.open)
			require.Eventually(t, func() bool {
				return f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1::uuid AND published_at IS NOT NULL`, late) == 1
			}, 60*time.Second, 50*time.Millisecond, "the row is published")
			got, err := testenv.Broker().ConsumeErr(f.Topics["E"], 1, 20*time.Second, 3*time.Second)
			require.NoError(t, err)
			if tc.beganBefore {
				require.Len(t, got, 1, "published once:\n%s", &logs)
				require.NotContains(t, logs.String(), "attached it again")
			} else {
				require.Contains(t, logs.String(), "rows published, but the mark changed", "the batch whose mark missed its row failed")
			}
		})
	}
}

// An old partition kept because a row of it is not published (here of a
// type the topic map lacks) is measured with reason unpublished, so the
// alert on the gauge fires; one whose drop fails (a lock wait that ran
// out) with reason failing, and the failed pass is counted. Before, both
// left the gauge at 0 while the table grew.
func TestPartitionKeptByAnUnpublishedRowIsMeasured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	end := oldAndNewPartitions(t, f, -2*time.Hour)
	addDay(f, "outbox_older", end.Add(-48*time.Hour))
	insertAt(f, 1, 1, end.Add(-time.Hour), false, "Unmapped")
	insertAt(f, 3, 1, end.Add(-time.Hour), true, "E")
	insertAt(f, 3, 1, end.Add(-30*time.Hour), true, "E")
	migration, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer migration.Rollback(ctx) //nolint:errcheck // only holds the lock
	// The older partition's detach waits for this lock.
	_, err = migration.Exec(ctx, `LOCK TABLE outbox_older IN SHARE MODE`)
	require.NoError(t, err)
	cfg := f.Config()
	cfg.KeepPublishedFor = time.Minute
	x := run(t, cfg, nil)
	delay := func(reason string) float64 {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_partition_drop_delay_seconds", "reason", reason)
	}
	require.Eventually(t, func() bool {
		return delay("unpublished") > time.Hour.Seconds() && delay("failing") > time.Hour.Seconds() &&
			outboxtest.MetricValue(t, x.Reg, "outbox_relay_prune_errors_total") > 0
	}, 60*time.Second, 100*time.Millisecond, "both drops are over an hour overdue, and the failed pass counted")
	require.True(t, attached(t, f, "outbox_old"), "neither is dropped")
	require.True(t, attached(t, f, "outbox_older"))
}
