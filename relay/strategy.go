package relay

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// claimer is what every ordering mode decides in each batch: which rows
// to claim, and whether transient failures make the whole loop back off.
// unordered (OrderingNone) and byKey (OrderingPartitionKey) implement it,
// each built with its claim statement and limits. What only partition-key
// mode does (its buckets, and a lane per key and topic that a row which
// cannot go out stops) is byKey's alone; the cycle calls it through
// Relay.lanes, nil in OrderingNone.
type claimer interface {
	// claim runs the mode's claim statement from id from with filter f.
	// Partition-key mode leaves f.held empty: a held row stops its lane,
	// and the lane, not the row, stays out of claims, so that a lane never
	// flows past its held row.
	claim(ctx context.Context, tx pgx.Tx, from int64, f claimFilter) (pgx.Rows, error)
	// backOff says whether transient failures of failed rows sent, in a
	// batch of which Kafka settled (acknowledged, or refused for good)
	// settled rows, make the whole loop back off (rather than only their
	// keys).
	backOff(failed, settled int) bool
}

// claimLimits bound one claim: rows, and payload and headers bytes.
type claimLimits struct{ rows, bytes int }

// beginner starts a transaction: the pool, or the membership session.
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// useSQL makes sql the relay's statements, the ordering mode's claim among
// them: the start-up check rebuilds them once it knows the table's columns
// and partitioning. Partition-key mode keeps its lanes and buckets.
func (r *Relay) useSQL(sql SQL) {
	r.sql = sql
	switch c := r.claimer.(type) {
	case unordered:
		c.sql = sql.Claim
		r.claimer = c
	case *byKey:
		c.sql = sql.ClaimBuckets
	}
}

// newModes builds r's ordering mode from r's statements and settings: the
// claimer, and in partition-key mode the lanes (nil otherwise).
func newModes(r *Relay) (claimer, *byKey) {
	limits := claimLimits{rows: r.cfg.BatchSize, bytes: r.cfg.MaxBatchBytes}
	if r.cfg.Ordering != OrderingPartitionKey {
		return unordered{sql: r.sql.Claim, limits: limits}, nil
	}
	k := newByKey(byKeyDeps{
		sql: r.sql.ClaimBuckets, limits: limits, topics: r.cfg.Topics, mapped: r.types, maxBackoff: r.cfg.MaxBackoff,
		member: r.member, cur: &r.cur, m: r.m, table: r.table,
	})
	return k, k
}
