package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"

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

// sharedDB is one DSN's pool and what its readers share.
type sharedDB struct {
	key  string // a digest of the DSN: the DSN itself is never a map key that could be logged
	pool *pgxpool.Pool
	sem  *semaphore.Weighted // the database's: shared with every DSN of the same database
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
	database := cc.Host + ":" + strconv.Itoa(int(cc.Port)) + "/" + cc.Database
	sem := o.sems[database]
	if sem == nil {
		sem = semaphore.NewWeighted(n)
		o.sems[database] = sem
	}
	pool, err := pgxpool.NewWithConfig(context.WithoutCancel(ctx), cfg)
	if err != nil {
		return nil, err
	}
	db := &sharedDB{key: k, pool: pool, sem: sem, refs: 1, recent: map[string]recentRead{}}
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
		if err := db.sem.Acquire(rctx, 1); err != nil {
			return backlogSample{}, fmt.Errorf("wait for a connection to read the backlog of %s: %w", q.table, err)
		}
		defer db.sem.Release(1)
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
