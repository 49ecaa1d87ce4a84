package controllers

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
)

var outboxTable = outbox.Table{Name: "outbox"}

// observerPool is a pool with the observer's own session settings.
func observerPool(t testing.TB, dsn string) *pgxpool.Pool {
	pool, err := newBacklogPool(context.Background(), flowTarget{dsn: dsn, interval: flowInterval})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// Up to the bound the counts are exact; beyond it the estimate adds the
// ids issued after the last row read.
func TestBacklogQueryCountsAndEstimates(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	insertRows(t, db, 6, "OrderConfirmed", time.Minute)
	insertRows(t, db, 3, "Unmapped", time.Hour)
	insertRows(t, db, 19, "OrderConfirmed", 0) // ids 1..28
	obs := observerPool(t, dsn)
	relay, _ := minimalRelay("ns", "r")

	s, err := observeBacklog(context.Background(), obs, backlogQuery{table: outboxTable}, 100)
	require.NoError(t, err)
	b := backlogStatus(relay, &s)
	require.False(t, b.Estimated)
	require.Equal(t, int64(25), b.Pending)
	require.Equal(t, outboxv1alpha1.HeldRows{Unroutable: 3}, b.Held)
	require.InDelta(t, time.Minute.Seconds(), b.OldestAge.Seconds(), 3, "the oldest pending row, not the older held ones")

	s, err = observeBacklog(context.Background(), obs, backlogQuery{table: outboxTable}, 10)
	require.NoError(t, err)
	b = backlogStatus(relay, &s)
	require.True(t, b.Estimated)
	require.Equal(t, int64(7+18), b.Pending, "7 pending among ids 1..10, and 18 ids after id 10")
	require.Equal(t, int64(3), b.Held.Unroutable)

	publishAll(t, db)
	s, err = observeBacklog(context.Background(), obs, backlogQuery{table: outboxTable}, 10)
	require.NoError(t, err)
	b = backlogStatus(relay, &s)
	require.Equal(t, outboxv1alpha1.BacklogStatus{ObservedAt: b.ObservedAt}, *b)
	require.True(t, s.tracked)
	require.GreaterOrEqual(t, s.updated, int64(0))
}

// A missing table is reported in PostgreSQL's words; a connection failure
// without naming the host, user or database.
func TestBacklogErrorsSayWhatIsSafe(t *testing.T) {
	t.Parallel()
	dsn, _ := outboxDB(t)
	_, err := observeBacklog(context.Background(), observerPool(t, dsn), backlogQuery{table: outbox.Table{Name: "missing"}}, 10)
	require.Error(t, err)
	require.Equal(t, `PostgreSQL refused the backlog query: relation "missing" does not exist (SQLSTATE 42P01)`, backlogError(err, "dsn"))

	pool, err := newBacklogPool(context.Background(), flowTarget{dsn: "postgres://secretuser:pw@127.0.0.1:1/secretdb?connect_timeout=1", interval: flowInterval})
	require.NoError(t, err)
	defer pool.Close()
	_, err = observeBacklog(context.Background(), pool, backlogQuery{table: outboxTable}, 10)
	require.Error(t, err)
	msg := backlogError(err, "orders-dsn")
	require.Equal(t, "cannot reach PostgreSQL with the DSN in Secret orders-dsn (the operator's log has the error)", msg)
	_, err = newBacklogPool(context.Background(), flowTarget{dsn: "postgres://%zz", interval: flowInterval})
	require.Equal(t, "the DSN in Secret orders-dsn cannot be parsed", backlogError(err, "orders-dsn"))
}

// The backlog query walks the partial index in id order, stops at the
// bound and groups without sorting, also on statistics taken while the
// table was nearly drained.
func TestBacklogQueryPlanStopsAtTheBound(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	ctx := context.Background()
	insertRows(t, db, 20000, "OrderConfirmed", 0)
	publishAll(t, db)
	_, err := db.Exec(ctx, `VACUUM ANALYZE outbox`)
	require.NoError(t, err)
	insertRows(t, db, 30000, "OrderConfirmed", 0) // statistics now say "nearly nothing waits"
	for _, byKey := range []bool{false, true} {
		plan := explain(t, observerPool(t, dsn), 10000, byKey)
		require.Contains(t, plan, "Index Scan using ix_outbox_unpublished on outbox")
		require.NotContains(t, plan, "Seq Scan on outbox")
		require.NotContains(t, plan, "Bitmap")
		require.NotContains(t, plan, "Sort", "the grouping hashes: a sort planned for one row spills to disk")
		require.Contains(t, plan, "rows=10000 ", "the scan stops at the bound")
	}
}

// explain runs the backlog query under EXPLAIN ANALYZE and returns the plan text.
func explain(t testing.TB, pool *pgxpool.Pool, bound int64, byKey bool) string {
	var lines []string
	q := backlogQuery{table: outboxTable, withHeld: true, topics: map[string]string{"OrderConfirmed": "orders"}, byKey: byKey}
	rows, err := pool.Query(context.Background(), "EXPLAIN (ANALYZE, BUFFERS) "+BacklogSQL(outboxTable, true, byKey), q.args(bound)...)
	require.NoError(t, err)
	for rows.Next() {
		var l string
		require.NoError(t, rows.Scan(&l))
		lines = append(lines, l)
	}
	require.NoError(t, rows.Err())
	return strings.Join(lines, "\n")
}

// BenchmarkBacklogQuery measures one backlog read at 10k and 1M waiting
// rows (docs/operator.md names it):
//
//	go test ./controllers -run '^$' -bench BacklogQuery -benchtime 20x
func BenchmarkBacklogQuery(b *testing.B) {
	for _, waiting := range []int{10_000, 1_000_000} {
		b.Run(fmt.Sprintf("waiting=%d", waiting), func(b *testing.B) {
			dsn, db := outboxDBTB(b)
			ctx := context.Background()
			for left := waiting; left > 0; left -= 100_000 {
				_, err := db.Exec(ctx, `INSERT INTO outbox
                    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
                    SELECT gen_random_uuid(), 'Order', 'o' || i, 'OrderConfirmed', '{"order":"o-1","total":"12.50"}'::jsonb, 'k' || i
                    FROM generate_series(1, $1) i`, min(left, 100_000))
				require.NoError(b, err)
			}
			_, err := db.Exec(ctx, `VACUUM ANALYZE outbox`)
			require.NoError(b, err)
			pool := observerPool(b, dsn)
			relay, _ := minimalRelay("ns", "r")
			// As the observers ask: with the held table (the shipped DDL has it) and a topic map.
			q := backlogQuery{table: outboxTable, withHeld: true, topics: map[string]string{"OrderConfirmed": "orders.confirmed"}}
			s, err := observeBacklog(ctx, pool, q, outboxv1alpha1.BacklogBound) // warm the cache
			require.NoError(b, err)
			st := backlogStatus(relay, &s)
			b.Logf("pending %d (estimated %v)", st.Pending, st.Estimated)
			b.Logf("plan:\n%s", explain(b, pool, outboxv1alpha1.BacklogBound, false))
			b.ResetTimer()
			for range b.N {
				if _, err := observeBacklog(ctx, pool, q, outboxv1alpha1.BacklogBound); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// On a partitioned table PostgreSQL counts updates on the leaf partitions,
// never on the parent: the publish rate is read from the leaves. Updated
// and deleted rows are counted apart: pruning's deletes of rows published
// long ago are no publishing of a relay that marks.
func TestBacklogCountsUpdatesOfPartitions(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `DROP TABLE outbox`)
	require.NoError(t, err)
	_, err = db.Exec(ctx, outbox.PartitionedSchemaDDL(outboxTable, outbox.PartitionDay, 1))
	require.NoError(t, err)
	insertRows(t, db, 20, "OrderConfirmed", 0)
	obs := observerPool(t, dsn)
	before, err := observeBacklog(ctx, obs, backlogQuery{table: outboxTable}, 100)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `UPDATE outbox SET published_at = now()`)
	require.NoError(t, err)
	var after backlogSample
	require.Eventually(t, func() bool { // statistics reach other sessions within a second or so
		after, err = observeBacklog(ctx, obs, backlogQuery{table: outboxTable}, 100)
		return err == nil && after.updated-before.updated == 20 // a backend flushes its counts within about 10 s of going idle
	}, 30*time.Second, 200*time.Millisecond, "updates %d then %d (%v)", before.updated, after.updated, err)
	require.Equal(t, before.deleted, after.deleted)
	_, err = db.Exec(ctx, `DELETE FROM outbox WHERE id <= 5`)
	require.NoError(t, err)
	pruned := after
	require.Eventually(t, func() bool {
		pruned, err = observeBacklog(ctx, obs, backlogQuery{table: outboxTable}, 100)
		return err == nil && pruned.deleted-after.deleted == 5
	}, 30*time.Second, 200*time.Millisecond, "deletes %d then %d (%v)", after.deleted, pruned.deleted, err)
	require.Equal(t, after.updated, pruned.updated, "a delete is no update")
}

// Rows the relays recorded in the held table count by their reason, not as
// pending, and do not age the backlog; in PartitionKey ordering the later
// rows of a held row's key on its topic are blocked, not pending. Without
// the held table the same read still works, and finds out that it is missing.
func TestBacklogCountsHeldRowsApart(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	ctx := context.Background()
	insertRows(t, db, 4, "OrderConfirmed", time.Hour) // ids 1..4, keys k1..k4, an hour old
	insertRows(t, db, 2, "OrderConfirmed", 0)         // ids 5, 6: keys k1, k2, new
	_, err := db.Exec(ctx, `INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
        SELECT id, event_id::text, event_type, r, 'x', now() + interval '1 hour'
        FROM outbox JOIN (VALUES (1, 'too_large'), (2, 'refused'), (3, 'invalid_row')) v(i, r) ON v.i = outbox.id`)
	require.NoError(t, err)
	obs := observerPool(t, dsn)
	relay, _ := minimalRelay("ns", "r")
	q := backlogQuery{table: outboxTable, withHeld: true, topics: map[string]string{"OrderConfirmed": "orders.confirmed"}}

	s, err := observeBacklog(ctx, obs, q, 100)
	require.NoError(t, err)
	require.True(t, s.heldTable)
	b := backlogStatus(relay, &s)
	require.Equal(t, outboxv1alpha1.HeldRows{TooLarge: 1, Refused: 1, Invalid: 1}, b.Held)
	require.Equal(t, int64(3), b.Pending, "ids 4, 5 and 6")
	require.InDelta(t, time.Hour.Seconds(), b.OldestAge.Seconds(), 5)

	q.byKey = true
	s, err = observeBacklog(ctx, obs, q, 100)
	require.NoError(t, err)
	b = backlogStatus(relay, &s)
	require.Equal(t, outboxv1alpha1.HeldRows{TooLarge: 1, Refused: 1, Invalid: 1, Blocked: 2}, b.Held, "ids 5 and 6 wait behind 1 and 2")
	require.Equal(t, int64(1), b.Pending, "id 4")

	_, err = db.Exec(ctx, `DELETE FROM outbox WHERE id = 4`)
	require.NoError(t, err)
	s, err = observeBacklog(ctx, obs, q, 100)
	require.NoError(t, err)
	b = backlogStatus(relay, &s)
	require.Zero(t, b.Pending)
	require.Zero(t, b.OldestAge.Duration, "held rows alone do not age the backlog: no scale-up, no NotPublishing")

	_, err = db.Exec(ctx, `DROP TABLE outbox_held`)
	require.NoError(t, err)
	q.withHeld = false
	s, err = observeBacklog(ctx, obs, q, 100)
	require.NoError(t, err)
	require.False(t, s.heldTable)
	require.Equal(t, int64(5), backlogStatus(relay, &s).Pending, "without the held table the relays' holds are not known")
}

// The backlog statement, with and without the held table, prepares against
// the shipped DDL, plain and partitioned.
func TestBacklogStatementPreparesOnTheShippedDDL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	table := outbox.Table{Schema: "app", Name: "outbox"}
	for name, ddl := range map[string]string{
		"plain":       outbox.SchemaDDL(table),
		"partitioned": outbox.PartitionedSchemaDDL(table, outbox.PartitionDay, 1),
	} {
		_, db := outboxDB(t)
		_, err := db.Exec(ctx, ddl)
		require.NoError(t, err, name)
		for i, withHeld := range []bool{false, true} {
			for j, byKey := range []bool{false, true} {
				conn, err := db.Acquire(ctx)
				require.NoError(t, err)
				_, err = conn.Conn().Prepare(ctx, fmt.Sprintf("backlog%d%d", i, j), BacklogSQL(table, withHeld, byKey))
				conn.Release()
				require.NoError(t, err, "%s table, held table %v, by key %v", name, withHeld, byKey)
			}
		}
	}
}
