package relay

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// numBuckets is how many key-hash buckets a table's keys are spread over in
// OrderingPartitionKey mode. Every replica must use the same number.
const numBuckets = 64

// bucketSQL is the bucket of a row, computed the same way in every replica.
const bucketSQL = `(hashtext(partition_key) & 63)`

// owner holds the advisory locks of the buckets this replica publishes, on
// the one session that also runs its claim transactions. Session locks free
// themselves when the session ends, so a dead replica's buckets pass to the
// others; and a replica whose session is gone cannot commit a batch either,
// so two replicas never publish one key at once (docs/ordering.md).
type owner struct {
	conn        *pgx.Conn
	memberClass int32 // shared lock held by every live replica of the table
	bucketClass int32 // exclusive lock per bucket
	mine        []int32
	nextBalance time.Time
}

// ensureOwner connects the owner session if needed and rebalances buckets
// at most once a second (more often while under the fair share).
func (r *Relay) ensureOwner(ctx context.Context, now time.Time) error {
	o := &r.own
	if o.conn == nil || o.conn.IsClosed() {
		o.mine = nil
		conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
		if err != nil {
			return fmt.Errorf("connect ordering session: %w", err)
		}
		var oid uint32
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1)::oid`, r.table.Quoted()).Scan(&oid); err != nil || oid == 0 {
			conn.Close(ctx)
			return fmt.Errorf("resolve table %s: %v", r.table, err)
		}
		// Lock classes derive from the table's oid: replicas of one table
		// meet, replicas of different tables never do.
		o.memberClass = int32(oid&0x1fffffff) << 1
		o.bucketClass = o.memberClass | 1
		// A replica that stops working but keeps its connection (frozen,
		// partitioned) would keep its buckets forever: the server ends an
		// owner session left idle longer than the loop ever leaves it.
		// (idle_session_timeout exists from PostgreSQL 14 on.)
		timeout := 2*max(r.cfg.PollInterval, r.cfg.MaxBackoff) + 10*time.Second
		if _, err := conn.Exec(ctx, `SELECT set_config('idle_session_timeout', $1, false)
			WHERE current_setting('server_version_num')::int >= 140000`, strconv.FormatInt(timeout.Milliseconds(), 10)); err != nil {
			conn.Close(ctx)
			return fmt.Errorf("set idle_session_timeout on the ordering session: %w", err)
		}
		if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock_shared($1::int4, 0)`, o.memberClass); err != nil {
			conn.Close(ctx)
			return fmt.Errorf("join the replicas of %s: %w", r.table, err)
		}
		o.conn = conn
		o.nextBalance = time.Time{}
	}
	if now.Before(o.nextBalance) {
		return nil
	}
	if err := r.rebalance(ctx); err != nil {
		r.dropOwner()
		return err
	}
	o.nextBalance = now.Add(time.Second)
	if len(o.mine) < r.fairShare {
		o.nextBalance = now.Add(100 * time.Millisecond)
	}
	return nil
}

// rebalance keeps this replica at ceil(numBuckets / live replicas) buckets:
// it releases extras (only between batches, so none is in flight) and takes
// free ones.
func (r *Relay) rebalance(ctx context.Context) error {
	o := &r.own
	var members int
	err := o.conn.QueryRow(ctx, `SELECT count(DISTINCT pid) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND objsubid = 2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = $1 AND objid::bigint = 0`, int64(uint32(o.memberClass))).Scan(&members)
	if err != nil {
		return fmt.Errorf("count replicas of %s: %w", r.table, err)
	}
	members = max(members, 1)
	share := (numBuckets + members - 1) / members
	r.fairShare = share
	for len(o.mine) > share {
		b := o.mine[len(o.mine)-1]
		if _, err := o.conn.Exec(ctx, `SELECT pg_advisory_unlock($1::int4, $2::int4)`, o.bucketClass, b); err != nil {
			return fmt.Errorf("release bucket %d: %w", b, err)
		}
		o.mine = o.mine[:len(o.mine)-1]
	}
	if len(o.mine) < share {
		rows, err := o.conn.Query(ctx, `SELECT b FROM generate_series(0, $2::int4 - 1) b
			WHERE NOT EXISTS (SELECT 1 FROM pg_locks
				WHERE locktype = 'advisory' AND granted AND objsubid = 2
				  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
				  AND classid::bigint = $1 AND objid::bigint = b)`, int64(uint32(o.bucketClass)), numBuckets)
		if err != nil {
			return fmt.Errorf("find free buckets of %s: %w", r.table, err)
		}
		free, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return fmt.Errorf("find free buckets of %s: %w", r.table, err)
		}
		gained := false
		for _, b := range free {
			if len(o.mine) >= share {
				break
			}
			var ok bool
			if err := o.conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1::int4, $2::int4)`, o.bucketClass, b).Scan(&ok); err != nil {
				return fmt.Errorf("take bucket %d: %w", b, err)
			}
			if ok {
				o.mine = append(o.mine, b)
				gained = true
			}
		}
		slices.Sort(o.mine)
		if gained {
			// The new buckets' rows may lie behind the cursor.
			r.rescanSoon()
		}
	}
	r.m.buckets.Set(float64(len(o.mine)))
	return nil
}

// dropOwner closes the owner session; its locks and any open transaction go with it.
func (r *Relay) dropOwner() {
	if r.own.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = r.own.conn.Close(ctx)
	}
	r.own.conn = nil
	r.own.mine = nil
	r.m.buckets.Set(0)
}

// blockKey keeps a key's rows out of claims until the given time, so a row
// that cannot be published now is not overtaken by the later rows of its key.
func (r *Relay) blockKey(key string, until time.Time) {
	if prev, ok := r.blockedKeys[key]; !ok || until.After(prev) {
		r.blockedKeys[key] = until
	}
}

// blockedKeyList returns the keys blocked now, dropping expired ones.
func (r *Relay) blockedKeyList(now time.Time) []string {
	keys := make([]string, 0, len(r.blockedKeys))
	for k, until := range r.blockedKeys {
		if now.After(until) {
			delete(r.blockedKeys, k)
			r.rescanSoon() // the key's rows are behind the cursor
			continue
		}
		keys = append(keys, k)
	}
	r.m.blockedKeys.Set(float64(len(keys)))
	return keys
}

// rescanSoon makes the next claim scan the index from the start.
func (r *Relay) rescanSoon() { r.nextFull = time.Time{} }
