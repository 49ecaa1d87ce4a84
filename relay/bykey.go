package relay

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// numBuckets is how many key-hash buckets a table's keys are spread over in
// OrderingPartitionKey mode (bucketSQL). Every replica must use the same number.
const numBuckets = 64

// byKey is OrderingPartitionKey: each replica publishes the keys of the
// key-hash buckets it owns, through advisory locks on its membership
// session, which also runs its claim transactions. Session locks free
// themselves when the session ends, so a dead replica's buckets pass to the
// others; and a replica whose session is gone cannot commit a batch either,
// so two replicas never publish one key at once (docs/ordering.md).
//
// Order is kept per key within each topic (a lane): that is the order a
// consumer of a topic sees, and Kafka keeps no order between topics. A row
// that cannot go out stops the later rows of its lane in the batch, and the
// lane stays out of claims for a while, so no row overtakes an older one of
// its key on its topic; the key's rows on other topics flow.
type byKey struct {
	byKeyDeps
	mine        []int32
	fairShare   int
	nextBalance time.Time
	blocked     map[lane]time.Time // lanes whose next row cannot be published yet
	// heldElsewhere are lanes of rows held by another replica, or before a
	// restart (read from the held table), with the key's bucket: only
	// those of this replica's buckets are left out of its claims, so a
	// bucket taken over later is blocked at once, and a claim does not
	// carry the pairs of every replica's holds.
	heldElsewhere map[lane]heldLane
	laneBackoff   map[lane]time.Duration
	firstStop     map[lane]int    // per batch: the index of each lane's first stopped row
	gauged        map[string]bool // topics with a blocked-keys series
}

// lane is the unit of order in partition-key mode: a partition key on one
// topic. Rows of an unmapped event type have no topic; each such type is a
// lane of its own (topic is unmappedLane + the type), so a type missing
// from the map holds back only the key's rows of that type.
type lane struct{ key, topic string }

// unmappedLane prefixes the topic of an unmapped type's lane; no topic name
// can start with it (topic names are [a-zA-Z0-9._-]).
const unmappedLane = "\x00"

// byKeyDeps are what partition-key mode is built with.
type byKeyDeps struct {
	sql        string // SQL.ClaimBuckets
	limits     claimLimits
	topics     map[string]string // event type → topic
	mapped     []string          // the mapped event types, sorted
	maxBackoff time.Duration     // a failing lane's longest wait
	member     *member           // the membership session: bucket locks, claims
	cur        *cursor           // rescans when lanes reopen or buckets are gained
	m          *metrics
	table      outbox.Table
}

func newByKey(d byKeyDeps) *byKey {
	return &byKey{byKeyDeps: d, blocked: map[lane]time.Time{}, heldElsewhere: map[lane]heldLane{}, laneBackoff: map[lane]time.Duration{}, firstStop: map[lane]int{}, gauged: map[string]bool{}}
}

// laneOf is x's lane.
func (k *byKey) laneOf(x row) lane { return laneOf(k.topics, x) }

// laneOf is x's lane under the topic map topics.
func laneOf(topics map[string]string, x row) lane {
	if t, ok := topics[x.eventType]; ok {
		return lane{x.partitionKey, t}
	}
	return lane{x.partitionKey, unmappedLane + x.eventType}
}

// types are the event types whose rows travel in l.
func (k *byKey) types(l lane) []string {
	if t, ok := strings.CutPrefix(l.topic, unmappedLane); ok {
		return []string{t}
	}
	var ts []string
	for _, et := range k.mapped {
		if k.topics[et] == l.topic {
			ts = append(ts, et)
		}
	}
	return ts
}

// prepare runs before each batch of a replica that may claim: it starts
// the batch's lanes afresh and rebalances the buckets when due. It returns
// the membership session to claim on, or nil when this replica owns no
// bucket now; after an error the caller leaves (the session is suspect).
func (k *byKey) prepare(ctx context.Context, now time.Time) (beginner, error) {
	clear(k.firstStop)
	if !now.Before(k.nextBalance) {
		if err := k.rebalance(ctx); err != nil {
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
	return k.member.conn, nil
}

func (k *byKey) claim(ctx context.Context, tx pgx.Tx, from int64, f claimFilter) (pgx.Rows, error) {
	return tx.Query(ctx, k.sql, from, f.held, f.keys, f.keyTypes, k.mine, k.limits.rows, k.limits.bytes, f.largest, f.types)
}

// stop says that row i of the batch cannot go out now; its lane's rows are
// not claimed again before until (zero: only this batch waits).
func (k *byKey) stop(x row, i int, until time.Time) {
	l := k.laneOf(x)
	// The earliest stop counts: admit may stop a later row (an invalid one)
	// before the publish learns that an earlier row failed.
	if j, ok := k.firstStop[l]; !ok || i < j {
		k.firstStop[l] = i
	}
	if until.IsZero() {
		return
	}
	if prev, ok := k.blocked[l]; !ok || until.After(prev) {
		k.blocked[l] = until
	}
}

// stopped reports whether row i must wait for an older row of its lane.
func (k *byKey) stopped(x row, i int) bool {
	j, ok := k.firstStop[k.laneOf(x)]
	return ok && j < i
}

// failed records a transient failure of row i: its lane waits, longer
// each time, up to maxBackoff.
func (k *byKey) failed(x row, i int, now time.Time) {
	if k.stopped(x, i) {
		return
	}
	k.stop(x, i, now.Add(jitter(k.backoff(k.laneOf(x)))))
}

// backoff is lane l's next wait: 100 ms, doubling each time, up to
// maxBackoff, until a row of the lane is sent.
func (k *byKey) backoff(l lane) time.Duration {
	d := min(max(2*k.laneBackoff[l], 100*time.Millisecond), k.maxBackoff)
	k.laneBackoff[l] = d
	return d
}

// fence stops the lanes of the rows the claim could not lock because
// another session holds them (fenced, in id order), each at its place
// among the claimed rows (rows, in id order): the lane's claimed rows
// after it are not sent in this batch, and the lane stays out of claims
// for a backoff, as after a transient failure. Such a lock lasts as long
// as the other session's transaction, whose end the relay cannot see: the
// lane is tried again soon at first (100 ms), then less often, at most
// maxBackoff apart, the longest its rows wait once the lock is gone; each
// try is one claim, so a lock held for minutes costs a claim every
// maxBackoff. It returns the rows of the lanes fenced afresh (not waiting
// after a fence or a failure already), worth a log line.
func (k *byKey) fence(rows, fenced []row, now time.Time) (afresh []row) {
	done := map[lane]bool{}
	for _, x := range fenced {
		l := k.laneOf(x)
		if done[l] {
			continue // the lane's oldest fenced row stops it
		}
		done[l] = true
		if k.laneBackoff[l] == 0 {
			afresh = append(afresh, x)
		}
		// rows[i] is the first claimed row after it: a stop at i-1 stops
		// the lane's rows from there on, none before it.
		i, _ := slices.BinarySearchFunc(rows, x.id, func(y row, id int64) int { return cmp.Compare(y.id, id) })
		k.stop(x, i-1, now.Add(jitter(k.backoff(l))))
	}
	return afresh
}

// sent records that row i was acknowledged: its lane's backoff starts over.
func (k *byKey) sent(x row) { delete(k.laneBackoff, k.laneOf(x)) }

// released says that a held row of key and event type was released
// before its retry time (`relay redrive`): its lane may be claimed at once.
func (k *byKey) released(key, eventType string) {
	l := k.laneOf(row{partitionKey: key, eventType: eventType})
	delete(k.blocked, l)
	delete(k.heldElsewhere, l)
}

// heldLane is a lane held elsewhere until a time, in a key bucket.
type heldLane struct {
	until  time.Time
	bucket int32
}

// heldUntil blocks the lane of a row of key and event type, in bucket,
// held until then by another replica, or before this one restarted, while
// the bucket is this replica's: its key's later rows wait behind it, and
// it is not tried before its retry time.
func (k *byKey) heldUntil(key, eventType string, bucket int32, until time.Time) {
	l := k.laneOf(row{partitionKey: key, eventType: eventType})
	if prev, ok := k.heldElsewhere[l]; !ok || until.After(prev.until) {
		k.heldElsewhere[l] = heldLane{until: until, bucket: bucket}
	}
}

// backOff: only when Kafka failed rows and settled none; otherwise only the
// failed lanes wait and the rest flows.
func (k *byKey) backOff(failed, settled int) bool { return failed > 0 && settled == 0 }

// holdBack adds to f the (key, type) pairs of the lanes blocked now
// (dropping expired ones; their rows are behind the cursor). Call it before
// the cursor picks where to start: an expiring lane moves the cursor back.
func (k *byKey) holdBack(f *claimFilter, now time.Time) {
	f.buckets = slices.Clone(k.mine) // read by the stats loop too
	perTopic := map[string]int{}
	for l, until := range k.blocked {
		if now.After(until) {
			delete(k.blocked, l)
			k.cur.rescanSoon()
			continue
		}
		perTopic[l.topic]++
		for _, et := range k.types(l) {
			f.keys, f.keyTypes = append(f.keys, l.key), append(f.keyTypes, et)
		}
	}
	for l, h := range k.heldElsewhere {
		if now.After(h.until) {
			delete(k.heldElsewhere, l)
			k.cur.rescanSoon()
			continue
		}
		if _, dup := k.blocked[l]; dup || !slices.Contains(k.mine, h.bucket) {
			continue
		}
		perTopic[l.topic]++
		for _, et := range k.types(l) {
			f.keys, f.keyTypes = append(f.keys, l.key), append(f.keyTypes, et)
		}
	}
	k.gaugeBlocked(perTopic)
}

// gaugeBlocked sets outbox_relay_ordering_blocked_keys{topic}, dropping the
// series of topics that no longer hold keys back.
func (k *byKey) gaugeBlocked(perTopic map[string]int) {
	now := map[string]bool{}
	for topic, n := range perTopic {
		if t, ok := strings.CutPrefix(topic, unmappedLane); ok {
			topic = "unmapped:" + t
		}
		now[topic] = true
		k.m.blockedKeys.WithLabelValues(topic).Set(float64(n))
	}
	for topic := range k.gauged {
		if !now[topic] {
			k.m.blockedKeys.DeleteLabelValues(topic)
		}
	}
	k.gauged = now
}

// left runs when the membership session is gone, and its bucket locks with it.
func (k *byKey) left() {
	k.mine = nil
	k.m.buckets.Set(0)
}

// rebalance keeps this replica at ceil(numBuckets / live replicas) buckets:
// it releases extras (only between batches, so none is in flight) and takes
// free ones.
func (k *byKey) rebalance(ctx context.Context) error {
	m := k.member
	bucketClass := m.class | 1
	members, err := m.holders(ctx, OrderingPartitionKey)
	if err != nil {
		return fmt.Errorf("count replicas of %s: %w", k.table, err)
	}
	members = max(members, 1)
	share := (numBuckets + members - 1) / members
	k.fairShare = share
	for len(k.mine) > share {
		b := k.mine[len(k.mine)-1]
		if _, err := m.conn.Exec(ctx, sqlUnlock, bucketClass, b); err != nil {
			return fmt.Errorf("release bucket %d: %w", b, err)
		}
		k.mine = k.mine[:len(k.mine)-1]
	}
	if len(k.mine) < share {
		rows, err := m.conn.Query(ctx, sqlFreeLocks, int64(uint32(bucketClass)), numBuckets)
		if err != nil {
			return fmt.Errorf("find free buckets of %s: %w", k.table, err)
		}
		free, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return fmt.Errorf("find free buckets of %s: %w", k.table, err)
		}
		gained := false
		for _, b := range free {
			if len(k.mine) >= share {
				break
			}
			var ok bool
			if err := m.conn.QueryRow(ctx, sqlTryLock, bucketClass, b).Scan(&ok); err != nil {
				return fmt.Errorf("take bucket %d: %w", b, err)
			}
			if ok {
				k.mine = append(k.mine, b)
				gained = true
			}
		}
		slices.Sort(k.mine)
		if gained {
			k.cur.rescanSoon() // the new buckets' rows may lie behind the cursor
		}
	}
	k.m.buckets.Set(float64(len(k.mine)))
	return nil
}
