package relay

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// A prune statement reads the old rows and one batch past them, not the
// rows kept after them: before, looking for a batch of rows to delete, it
// read every kept row (20,000 here) at each pass, the whole table once the
// old rows were gone.
func TestPruneReadsTheOldRowsAndOneBatch(t *testing.T) {
	ctx := context.Background()
	_, pool := outboxDB(t)
	insert := func(n int, age string) {
		_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at, published_at)
			SELECT gen_random_uuid(), 'Order', 'o', 'E', '{}', 'k', now() - $2::interval, now() - $2::interval FROM generate_series(1, $1)`, n, age)
		require.NoError(t, err)
	}
	insert(3, "2 hours")
	insert(20000, "0 seconds")
	_, err := pool.Exec(ctx, `ANALYZE outbox`)
	require.NoError(t, err)
	prune := NewSQL(outbox.Table{Name: "outbox"}).Prune
	// pass reads the plan of a prune (rolled back), then prunes.
	pass := func(after int64) (deleted, old int64, read float64) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		var plan string
		require.NoError(t, tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+prune, after, 3600.0, 1000).Scan(&plan))
		require.NoError(t, tx.Rollback(ctx))
		var nodes []struct{ Plan planNode }
		require.NoError(t, json.Unmarshal([]byte(plan), &nodes))
		var last int64
		require.NoError(t, pool.QueryRow(ctx, prune, after, 3600.0, 1000).Scan(&deleted, &last, &old))
		return deleted, old, nodes[0].Plan.rowsRead("outbox")
	}
	deleted, old, read := pass(indexStart)
	require.Equal(t, int64(3), deleted)
	require.Equal(t, int64(3), old)
	require.LessOrEqual(t, read, 1100.0, "the old rows and a batch")
	deleted, old, read = pass(indexStart)
	require.Zero(t, deleted)
	require.Zero(t, old, "past the old rows: the walk ends")
	require.LessOrEqual(t, read, 1100.0, "one batch, not the kept rows")
}

// planNode is a node of EXPLAIN (ANALYZE, FORMAT JSON).
type planNode struct {
	Relation string     `json:"Relation Name"`
	Rows     float64    `json:"Actual Rows"`
	Loops    float64    `json:"Actual Loops"`
	Removed  float64    `json:"Rows Removed by Filter"`
	Plans    []planNode `json:"Plans"`
}

// rowsRead sums the rows the plan's scans of table read: returned, and
// removed by their filter.
func (n planNode) rowsRead(table string) float64 {
	sum := 0.0
	if n.Relation == table {
		sum += n.Rows*n.Loops + n.Removed
	}
	for _, c := range n.Plans {
		sum += c.rowsRead(table)
	}
	return sum
}

// A walk goes on through a batch of old rows it cannot delete (a backlog
// not yet published) to the old published rows after it, and stops past
// the old rows; each pass then looks at tailBatches more batches, from
// where the last pass's look ended (and as many as its walk from the head
// took, so the look gains on the head however fast rows age), so old rows
// whose ids come after young ones (ids given by hand, in ranges) are
// reached in turn, at a bounded cost per pass.
func TestPruneWalksThroughOldRowsAndTheRestInTurn(t *testing.T) {
	ctx := context.Background()
	dsn, pool := outboxDB(t)
	insert := func(from, to int, age string, published bool) {
		_, err := pool.Exec(ctx, `INSERT INTO outbox (id, event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at, published_at)
			OVERRIDING SYSTEM VALUE SELECT g, gen_random_uuid(), 'Order', 'o', 'E', '{}', 'k', now() - $3::interval, CASE WHEN $4 THEN now() - $3::interval END
			FROM generate_series($1::bigint, $2::bigint) g`, from, to, age, published)
		require.NoError(t, err)
	}
	insert(1, 3, "2 hours", true)
	insert(4, 1503, "2 hours", false) // more than a batch, old, not published
	insert(1504, 1506, "2 hours", true)
	insert(1507, 13506, "0 seconds", true) // twelve batches of young rows
	insert(20001, 20003, "2 hours", true)  // old rows after them
	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": "t"},
		KeepPublishedFor: time.Hour, PrunePause: time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	require.NoError(t, r.Check(ctx))
	pr := r.newPruner()
	left := func(from, to int) (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE id BETWEEN $1 AND $2`, from, to).Scan(&n))
		return n
	}
	conn, err := pr.connect(ctx)
	require.NoError(t, err)
	defer conn.Close(ctx)
	n, err := pr.pruneTail(ctx, conn, 2506, tailBatches)
	require.NoError(t, err)
	require.Zero(t, n, "ten batches on: not yet at the old rows after the young ones")
	require.Equal(t, int64(12506), pr.tail)
	n, err = pr.pruneTail(ctx, conn, 2506, tailBatches)
	require.NoError(t, err)
	require.Equal(t, int64(3), n, "the next pass's look reaches them")
	require.Equal(t, int64(indexStart), pr.tail, "and, at the table's end, starts again from its head")

	require.NoError(t, pr.prune(ctx))
	require.Zero(t, left(1, 3))
	require.Zero(t, left(1504, 1506), "past the batch of old unpublished rows")
	require.Equal(t, 1500, left(4, 1503), "never an unpublished row")
	require.Equal(t, 12000, left(1507, 13506))
}
