package relay

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// numBuckets is how many key-hash buckets a table's keys are spread over in
// OrderingPartitionKey mode (bucketSQL). Every replica must use the same number.
const numBuckets = 64

// byKey is OrderingPartitionKey: each replica publishes the keys of the
// key-hash buckets it owns, through advisory locks on its membership
// session, which also runs its claim transactions. Session locks free
// themselves when the session ends, so a dead replica's buckets pass to the
// others; and a replica whose session is gone cannot commit a batch either,
// so two replicas never publish one key at once (docs/ordering.md). A row
// that cannot go out stops the later rows of its key in the batch, and its
// key stays out of claims for a while, so no row of a key ever overtakes an
// older one.
type byKey struct {
	r           *Relay
	mine        []int32
	fairShare   int
	nextBalance time.Time
	blocked     map[string]time.Time // keys whose next row cannot be published yet
	keyBackoff  map[string]time.Duration
	firstStop   map[string]int // per batch: the index of each key's first stopped row
}

func newByKey(r *Relay) *byKey {
	return &byKey{r: r, blocked: map[string]time.Time{}, keyBackoff: map[string]time.Duration{}, firstStop: map[string]int{}}
}

func (k *byKey) prepare(ctx context.Context, now time.Time) (beginner, error) {
	clear(k.firstStop)
	fenced, err := k.r.fenced(ctx, now)
	if err != nil || fenced {
		return nil, err
	}
	if !now.Before(k.nextBalance) {
		if err := k.rebalance(ctx); err != nil {
			k.r.leave()
			return nil, err
		}
		k.nextBalance = now.Add(time.Second)
		if len(k.mine) < k.fairShare {
			k.nextBalance = now.Add(100 * time.Millisecond)
		}
	}
	if len(k.mine) == 0 {
		return nil, nil // every bucket is taken by other replicas
	}
	return k.r.member.conn, nil
}

func (k *byKey) claim(ctx context.Context, tx pgx.Tx, from int64, held []int64, _, keys []string) (pgx.Rows, error) {
	return tx.Query(ctx, k.r.sql.ClaimBuckets, from, held, keys, k.mine, k.r.cfg.BatchSize, k.r.cfg.MaxBatchBytes)
}

func (k *byKey) stop(x row, i int, until time.Time) {
	if _, ok := k.firstStop[x.partitionKey]; !ok {
		k.firstStop[x.partitionKey] = i
	}
	if until.IsZero() {
		return
	}
	if prev, ok := k.blocked[x.partitionKey]; !ok || until.After(prev) {
		k.blocked[x.partitionKey] = until
	}
}

func (k *byKey) stopped(x row, i int) bool {
	j, ok := k.firstStop[x.partitionKey]
	return ok && j < i
}

func (k *byKey) failed(x row, i int, now time.Time) {
	if k.stopped(x, i) {
		return
	}
	d := min(max(2*k.keyBackoff[x.partitionKey], 100*time.Millisecond), k.r.cfg.MaxBackoff)
	k.keyBackoff[x.partitionKey] = d
	k.stop(x, i, now.Add(jitter(d)))
}

func (k *byKey) sent(x row) { delete(k.keyBackoff, x.partitionKey) }

// backOff: only when Kafka failed everything; otherwise only the failed
// keys wait and the rest flows.
func (k *byKey) backOff(failed, sent int) bool { return failed > 0 && failed == sent }

// waiting returns the mapped types whose topic is available, and the keys
// blocked now (dropping expired ones; their rows are behind the cursor).
func (k *byKey) waiting(now time.Time) ([]string, []string) {
	keys := make([]string, 0, len(k.blocked))
	for key, until := range k.blocked {
		if now.After(until) {
			delete(k.blocked, key)
			k.r.cur.rescanSoon()
			continue
		}
		keys = append(keys, key)
	}
	k.r.m.blockedKeys.Set(float64(len(keys)))
	return k.r.availableTypes(now), keys
}

func (k *byKey) left() {
	k.mine = nil
	k.r.m.buckets.Set(0)
}

// rebalance keeps this replica at ceil(numBuckets / live replicas) buckets:
// it releases extras (only between batches, so none is in flight) and takes
// free ones.
func (k *byKey) rebalance(ctx context.Context) error {
	m := k.r.member
	bucketClass := m.class | 1
	members, err := m.holders(ctx, OrderingPartitionKey)
	if err != nil {
		return fmt.Errorf("count replicas of %s: %w", k.r.table, err)
	}
	members = max(members, 1)
	share := (numBuckets + members - 1) / members
	k.fairShare = share
	for len(k.mine) > share {
		b := k.mine[len(k.mine)-1]
		if _, err := m.conn.Exec(ctx, `SELECT pg_advisory_unlock($1::int4, $2::int4)`, bucketClass, b); err != nil {
			return fmt.Errorf("release bucket %d: %w", b, err)
		}
		k.mine = k.mine[:len(k.mine)-1]
	}
	if len(k.mine) < share {
		rows, err := m.conn.Query(ctx, `SELECT b FROM generate_series(0, $2::int4 - 1) b
			WHERE NOT EXISTS (SELECT 1 FROM pg_locks
				WHERE locktype = 'advisory' AND granted AND objsubid = 2
				  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
				  AND classid::bigint = $1 AND objid::bigint = b)`, int64(uint32(bucketClass)), numBuckets)
		if err != nil {
			return fmt.Errorf("find free buckets of %s: %w", k.r.table, err)
		}
		free, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return fmt.Errorf("find free buckets of %s: %w", k.r.table, err)
		}
		gained := false
		for _, b := range free {
			if len(k.mine) >= share {
				break
			}
			var ok bool
			if err := m.conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1::int4, $2::int4)`, bucketClass, b).Scan(&ok); err != nil {
				return fmt.Errorf("take bucket %d: %w", b, err)
			}
			if ok {
				k.mine = append(k.mine, b)
				gained = true
			}
		}
		slices.Sort(k.mine)
		if gained {
			k.r.cur.rescanSoon() // the new buckets' rows may lie behind the cursor
		}
	}
	k.r.m.buckets.Set(float64(len(k.mine)))
	return nil
}
