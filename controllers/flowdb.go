package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync/atomic"
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

// connIdleTime is how long an observer connection may idle before it is closed.
const connIdleTime = time.Minute

// database is what the DSNs of one database (host, port and name) share:
// the cap on reads in flight, and how many pools reach it.
type database struct {
	sem   *semaphore.Weighted
	pools atomic.Int32
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
		group = &database{sem: semaphore.NewWeighted(n)}
		o.databases[name] = group
	}
	// A database reached by one DSN keeps its pool's idle connections;
	// reached by several, each connection closes after its read, so the
	// connections open to it never exceed the reads in flight (the cap).
	cfg.AfterRelease = func(*pgx.Conn) bool { return group.pools.Load() <= 1 }
	pool, err := pgxpool.NewWithConfig(context.WithoutCancel(ctx), cfg)
	if err != nil {
		return nil, err
	}
	if group.pools.Add(1) == 2 {
		for _, other := range o.dbs {
			if other.db == group {
				other.pool.Reset() // its idle connections go; those in use close on release
			}
		}
	}
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
		db.db.pools.Add(-1)
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
		// Not the first caller's context: its cancellation must not fail the others.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), backlogQueryTimeout+time.Second)
		defer cancel()
		if err := db.db.sem.Acquire(rctx, 1); err != nil {
			return backlogSample{}, fmt.Errorf("wait for a connection to read the backlog of %s: %w", q.table, err)
		}
		defer db.db.sem.Release(1)
		o.queries.Add(1)
		s, err := observeBacklog(rctx, db.pool, q, bound)
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
