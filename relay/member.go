package relay

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// Advisory-lock keys of the membership locks, one per ordering mode. Every
// live replica holds its mode's key shared, so replicas of one mode count
// each other and see a replica of the other mode.
var modeKeys = map[Ordering]int32{OrderingNone: 1, OrderingPartitionKey: 2}

// member is this replica's membership session on the table. It holds the
// shared lock of the replica's ordering mode for as long as the session
// lives (a crashed replica's lock goes with its connection), and in
// partition-key mode it also holds the bucket locks and runs the claims.
//
// Two modes never claim from one table at once: a replica joins (takes its
// lock) before it looks for the other mode, and does not claim while it
// sees one. Of two replicas of different modes, the one that looks second
// always sees the first; both stop when they start together, and say so.
type member struct {
	conn      *pgx.Conn
	class     int32 // lock class of the table's membership locks
	mode      Ordering
	nextCheck time.Time
	conflict  int // replicas of the other mode seen at the last check
}

// join connects the membership session and takes the mode's lock.
func (r *Relay) join(ctx context.Context) error {
	m := r.member
	if m.conn != nil && !m.conn.IsClosed() {
		return nil
	}
	m.conn = nil
	conn, err := r.connect(ctx)
	if err != nil {
		return fmt.Errorf("connect membership session: %w", err)
	}
	oid, err := tableOID(ctx, conn, r.table)
	if err != nil {
		conn.Close(ctx)
		return err
	}
	// Lock classes derive from the table's oid: replicas of one table
	// meet, replicas of different tables never do.
	m.class = int32(oid&0x1fffffff) << 1
	// A replica that stops working but keeps its connection (frozen,
	// partitioned) would keep its locks forever: the server ends a session
	// left idle longer than the loop ever leaves it.
	timeout := 2*max(r.cfg.PollInterval, r.cfg.MaxBackoff) + r.cfg.PublishTimeout + 10*time.Second
	if _, err := conn.Exec(ctx, sqlSetSession, "idle_session_timeout", strconv.FormatInt(timeout.Milliseconds(), 10)); err != nil {
		conn.Close(ctx)
		return fmt.Errorf("set idle_session_timeout on the membership session: %w", err)
	}
	if _, err := conn.Exec(ctx, sqlLockShared, m.class, modeKeys[m.mode]); err != nil {
		conn.Close(ctx)
		return fmt.Errorf("join the replicas of %s: %w", r.table, err)
	}
	m.conn = conn
	m.nextCheck = time.Time{}
	return nil
}

// holders counts the live replicas holding mode's membership lock.
func (m *member) holders(ctx context.Context, mode Ordering) (int, error) {
	var n int
	err := m.conn.QueryRow(ctx, sqlLockHolders, int64(uint32(m.class)), int64(modeKeys[mode])).Scan(&n)
	return n, err
}

// fenced joins if needed and, at most once a second, looks for replicas of
// the other ordering mode. It reports whether this replica must not claim.
func (r *Relay) fenced(ctx context.Context, now time.Time) (bool, error) {
	if err := r.join(ctx); err != nil {
		return false, err
	}
	m := r.member
	if now.Before(m.nextCheck) {
		return m.conflict > 0, nil
	}
	other := OrderingPartitionKey
	if m.mode == OrderingPartitionKey {
		other = OrderingNone
	}
	n, err := m.holders(ctx, other)
	if err != nil {
		r.leave()
		return false, fmt.Errorf("look for %s replicas on %s: %w", other, r.table, err)
	}
	m.nextCheck = now.Add(time.Second)
	if n > 0 && m.conflict == 0 {
		r.log.Error("a replica of the other ordering mode is live on this table; not claiming until it is gone",
			"ordering", m.mode, "other_ordering", other, "other_replicas", n)
	}
	if n == 0 && m.conflict > 0 {
		r.log.Info("no replica of the other ordering mode is left; claiming again", "ordering", m.mode)
	}
	m.conflict = n
	msg := ""
	if n > 0 {
		msg = fmt.Sprintf("%d replica(s) with ordering %s are live on table %s; this %s replica does not claim until they are gone", n, other, r.table, m.mode)
	}
	r.health.setModeConflict(msg)
	r.m.stalled.WithLabelValues(StallModeConflict).Set(boolGauge(n > 0))
	return n > 0, nil
}

// leave closes the membership session; its locks and any open transaction go with it.
func (r *Relay) leave() {
	if c := r.member.conn; c != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = c.Close(ctx)
	}
	r.member.conn = nil
	if r.lanes != nil {
		r.lanes.left()
	}
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
