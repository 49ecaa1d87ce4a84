package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/semaphore"
)

// This file is how the backlog observers reach the databases: one pool per
// distinct DSN, shared by every OutboxRelay that uses it, and a cap on the
// reads in flight per database (host, port and database name), so a thousand
// OutboxRelays on one PostgreSQL server hold as many of its connections as a
// handful do. Reads of one table with the same question are shared too.

// DefaultConnsPerDatabase is the manager's --backlog-connections-per-database
// default: how many backlog reads may run at once on one database.
const DefaultConnsPerDatabase = 2

// sessionExit is how long a closed connection's server session is given to
// end before another one starts in its place: PostgreSQL ends it after the
// client has gone, and without the pause (measured here, on 2 busy cores)
// the database listed one session more than the cap now and then.
const sessionExit = 5 * time.Millisecond

// connIdleTime is how long an observer connection may idle before it is closed.
const connIdleTime = time.Minute

// database is what the DSNs of one database (host, port and name) share:
// the cap on reads in flight and on open connections, and its pools.
type database struct {
	cap int
	sem *semaphore.Weighted

	mu    sync.Mutex
	pools []*pgxpool.Pool
}

// open counts the connections open to the database, across its pools.
func (d *database) open() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, p := range d.pools {
		n += int(p.Stat().TotalConns())
	}
	return n
}

// makeRoom closes an idle connection of another pool than self when the
// database has as many connections open as its cap: a read (which holds
// one of the cap's turns) is about to open one. With reads capped at the
// cap, a connection beyond the reads in flight is idle somewhere.
func (d *database) makeRoom(ctx context.Context, self *pgxpool.Pool) {
	if d.open() < d.cap {
		return
	}
	d.mu.Lock()
	pools := append([]*pgxpool.Pool(nil), d.pools...)
	d.mu.Unlock()
	for _, p := range pools {
		if p == self {
			continue
		}
		idle := p.AcquireAllIdle(ctx)
		for i, c := range idle {
			if i == 0 {
				_ = c.Conn().Close(ctx) // released closed: the pool drops it
			}
			c.Release()
		}
		if len(idle) > 0 {
			time.Sleep(sessionExit)
			return
		}
	}
}

// sharedDB is one DSN's pool and what its readers share.
type sharedDB struct {
	key  string // a digest of the DSN: the DSN itself is never a map key that could be logged
	pool *pgxpool.Pool
	db   *database
	refs int
	// recent are the latest readings by question (readKey), for readers of
	// the same table to share; guarded by FlowObserver.mu.
	recent map[string]recentRead
}

type recentRead struct {
	at time.Time
	s  backlogSample
}

// errNoTurn: the database's backlog reads were all busy for the whole wait.
var errNoTurn = errors.New("no turn to read within the interval")

// dsnKey is a digest of dsn, the key of its shared pool.
func dsnKey(dsn string) string {
	sum := sha256.Sum256([]byte(dsn))
	return hex.EncodeToString(sum[:16])
}

// acquire returns dsn's shared pool, opening it (lazily: no connection yet)
// on first use. An unparsable DSN is errDSNUnparsable.
func (o *FlowObserver) acquire(ctx context.Context, dsn string) (*sharedDB, error) {
	k := dsnKey(dsn)
	o.mu.Lock()
	defer o.mu.Unlock()
	if db := o.dbs[k]; db != nil {
		db.refs++
		return db, nil
	}
	cfg, err := backlogPoolConfig(dsn)
	if err != nil {
		return nil, err
	}
	n := int64(max(o.ConnsPerDatabase, 1))
	if o.ConnsPerDatabase <= 0 {
		n = DefaultConnsPerDatabase
	}
	cfg.MaxConns = int32(n)
	cc := cfg.ConnConfig
	name := cc.Host + ":" + strconv.Itoa(int(cc.Port)) + "/" + cc.Database
	group := o.databases[name]
	if group == nil {
		group = &database{cap: int(n), sem: semaphore.NewWeighted(n)}
		o.databases[name] = group
	}
	// The connections open to the database stay within its cap, across the
	// pools of its DSNs: one is opened only after another pool's idle one
	// made room, and one is kept after its read only within the cap (read).
	var pool *pgxpool.Pool
	cfg.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
		group.makeRoom(ctx, pool)
		return nil
	}
	pool, err = pgxpool.NewWithConfig(context.WithoutCancel(ctx), cfg)
	if err != nil {
		return nil, err
	}
	group.mu.Lock()
	group.pools = append(group.pools, pool)
	group.mu.Unlock()
	db := &sharedDB{key: k, pool: pool, db: group, refs: 1, recent: map[string]recentRead{}}
	o.dbs[k] = db
	return db, nil
}

// release drops one reference to db, closing its pool after the last.
func (o *FlowObserver) release(db *sharedDB) {
	o.mu.Lock()
	db.refs--
	last := db.refs == 0
	if last {
		delete(o.dbs, db.key)
		g := db.db
		g.mu.Lock()
		g.pools = slices.DeleteFunc(g.pools, func(p *pgxpool.Pool) bool { return p == db.pool })
		g.mu.Unlock()
	}
	o.mu.Unlock()
	if last {
		db.pool.Close()
	}
}

// read answers q on db: a reading of the same question taken within fresh
// is shared, so is one in flight, and at most the database's cap of reads
// run at once (waiting for a turn counts in the read's deadline).
func (o *FlowObserver) read(ctx context.Context, db *sharedDB, q backlogQuery, bound int64, fresh time.Duration) (backlogSample, error) {
	rk := db.key + "|" + q.key(bound)
	o.mu.Lock()
	if r, ok := db.recent[rk]; ok && time.Since(r.at) < fresh {
		o.mu.Unlock()
		return r.s, nil
	}
	o.mu.Unlock()
	v, err, _ := o.flight.Do(rk, func() (any, error) {
		// Not the first caller's context: its cancellation must not fail
		// the others. Waiting for a turn may take up to an interval (a
		// thousand relays read at a manager start); the read itself then
		// has its own deadline.
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), max(2*fresh, backlogQueryTimeout))
		defer cancel()
		if err := db.db.sem.Acquire(wctx, 1); err != nil {
			return backlogSample{}, fmt.Errorf("read the backlog of %s: %w", q.table, errNoTurn)
		}
		defer db.db.sem.Release(1)
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), backlogQueryTimeout+time.Second)
		defer cancel()
		o.queries.Add(1)
		conn, err := db.pool.Acquire(rctx)
		if err != nil {
			return backlogSample{}, fmt.Errorf("read the backlog of %s: %w", q.table, err)
		}
		s, err := observeBacklog(rctx, conn, q, bound)
		if db.db.open() > db.db.cap {
			// Closed before this read's turn passes on: released, the
			// pool would close it only in the background, after the next
			// read may have connected.
			_ = conn.Conn().Close(rctx)
			time.Sleep(sessionExit)
		}
		conn.Release()
		if err != nil {
			return s, err
		}
		o.mu.Lock()
		for k, r := range db.recent { // questions no one asked for a while
			if time.Since(r.at) > 10*time.Minute {
				delete(db.recent, k)
			}
		}
		db.recent[rk] = recentRead{at: s.at, s: s}
		o.mu.Unlock()
		return s, nil
	})
	return v.(backlogSample), err
}
