package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// pruneKey is the advisory-lock key (in the table's membership lock class)
// whose holder prunes; the other replicas wait their turn.
const pruneKey = 3

// pruneEvery is how often a replica tries to become the pruner, and how long
// the pruner rests after a pass that found nothing more to delete.
const pruneEvery = 10 * time.Second

// pruneLoop deletes published rows older than KeepPublishedFor (on a
// partitioned table: whole partitions, see prunePartitions). Exactly one
// replica of a table prunes at a time (a session advisory lock on its own
// connection), in transactions of at most PruneBatchSize rows with
// PrunePause between them. It only deletes rows whose published_at is set
// and skips rows another transaction holds, so it never touches an
// unpublished row and never waits on a claim or a writer.
func (r *Relay) pruneLoop(ctx context.Context) {
	for ctx.Err() == nil {
		if err := r.prune(ctx); err != nil && ctx.Err() == nil {
			r.log.Warn("pruning failed; retrying", "err", err, "in", pruneEvery)
		}
		sleep(ctx, jitter(pruneEvery))
	}
}

// prune holds the prune lock for as long as pruning keeps finding rows.
func (r *Relay) prune(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect pruning session: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var oid uint32
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1)::oid`, r.table.Quoted()).Scan(&oid); err != nil || oid == 0 {
		return fmt.Errorf("resolve table %s: %v", r.table, err)
	}
	var mine bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1::int4, $2::int4)`, int32(oid&0x1fffffff)<<1, pruneKey).Scan(&mine); err != nil {
		return fmt.Errorf("take the prune lock of %s: %w", r.table, err)
	}
	if !mine {
		return nil // another replica prunes
	}
	if r.shape.partitioned {
		return r.prunePartitions(ctx, conn, oid)
	}
	var after int64
	for ctx.Err() == nil {
		start := time.Now()
		var n, last int64
		if err := conn.QueryRow(ctx, r.sql.Prune, after, r.cfg.KeepPublishedFor.Seconds(), r.cfg.PruneBatchSize).Scan(&n, &last); err != nil {
			return fmt.Errorf("prune %s: %w", r.table, err)
		}
		r.m.pruneDuration.Observe(time.Since(start).Seconds())
		r.m.pruned.Add(float64(n))
		if n == 0 {
			if after == 0 {
				return nil // nothing old enough
			}
			after = 0 // rows skipped (held by others) are looked at again
			sleep(ctx, jitter(pruneEvery))
			continue
		}
		after = last
		sleep(ctx, r.cfg.PrunePause)
	}
	return nil
}
