package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-operator/dbauth"
)

// This file is how the backlog observers reach the databases: the
// connections to one database (host, port and name) are shared by every
// OutboxRelay on it, whatever its DSN, and capped: a thousand OutboxRelays
// on one database hold as many of its connections as a handful do. The cap
// is per database, not per server: relays on many databases of one server
// (a database per tenant) hold up to the cap on each, while read more often
// than connIdleTime. Reads of one table with the same question are shared
// too.

// DefaultConnsPerDatabase is the manager's --backlog-connections-per-database
// default: how many connections the backlog reads hold to one database.
const DefaultConnsPerDatabase = 2

// connIdleTime is how long an observer connection may idle before it is closed.
const connIdleTime = time.Minute

// database is the connections to one database, across its DSNs: at most
// cap open, each kept for reuse by reads with the same DSN, and closed for
// a read with another DSN when the cap is reached. Reads take a turn first
// (turn), so there is always one to close then.
//
// A session costs the server a process, a login (TLS, SCRAM or a token)
// and a cold catalog cache, where a reading on an open one costs a
// statement. So turns go by DSN rather than first come first served: a
// connection that comes back goes with the turn to the oldest read of its
// DSN, and a read whose DSN's connection is busy waits for it rather than
// close another DSN's; a read passed over maxPassedOver times takes the next
// turn whatever it costs, so no DSN waits on the others for long.
type database struct {
	cap int

	mu      sync.Mutex
	reads   int                   // turns taken
	running map[string]int        // turns taken, by dsnKey
	queue   []*waiter             // reads waiting for a turn, oldest first
	open    int                   // connections open or being opened
	idle    map[string][]idleConn // by dsnKey
	// opened are closed when a connection of their dsnKey opens, for the
	// observers whose reading is almost due to take it then (FlowObserver.run).
	opened map[string]chan struct{}
	// failed is the last read's failure to reach the database (its
	// connection could not be made or was lost, or ran out its time), at
	// failedAt; nil once a read reaches it (the server answered, also with
	// a refusal). A read that found no turn while the reads before it
	// failed so reports that: the turns were slow because the database
	// is, and more connections would not help. What one DSN's settings
	// cause (TLS, a token, a password) is that DSN's, and not recorded.
	failed   error
	failedAt time.Time
}

// noteRead records how a read that had a turn ended: err nil (it read),
// a refusal (the server answered), or a failure to reach the database.
func (d *database) noteRead(err error) {
	var pgErr *pgconn.PgError
	var netErr net.Error
	var opErr *net.OpError
	// A statement canceled by statement_timeout (57014) was answered, by a
	// database too slow to read.
	timedOut := errors.As(err, &pgErr) && pgErr.Code == "57014"
	reached := err == nil || (errors.As(err, &pgErr) && !timedOut)
	own := errors.Is(err, dbauth.ErrNoToken) || errors.Is(err, dbauth.ErrPlainText) ||
		(errors.As(err, &opErr) && opErr.Op == "remote error") // the server refused this DSN's TLS
	unreachable := !reached && !own && (timedOut || errors.As(err, &netErr) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || pgconn.Timeout(err))
	if !reached && !unreachable {
		return // the DSN's own (TLS, a token): says nothing of the database
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if reached {
		d.failed = nil
		return
	}
	d.failed, d.failedAt = err, time.Now()
}

// failedWithin is the failure the database's last read that ended met
// reaching it, if it ended within the last window, else nil.
func (d *database) failedWithin(window time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.failed == nil || time.Since(d.failedAt) > window {
		return nil
	}
	return d.failed
}

// maxPassedOver is how many later reads may take a turn before a waiting read.
const maxPassedOver = 16

// waiter is a read waiting for a turn.
type waiter struct {
	key    string
	ready  chan struct{} // closed with the turn
	idle   idleConn      // key's idle connection, handed over with the turn
	passed int           // turns given to later reads meanwhile
}

func newDatabase(cap int) *database {
	return &database{cap: cap, running: map[string]int{}, idle: map[string][]idleConn{}, opened: map[string]chan struct{}{}}
}

// turn waits for a turn to read with key's DSN, and returns the DSN's idle
// connection that came with it, if any. A turn taken is given back with done.
func (d *database) turn(ctx context.Context, key string) (*pgx.Conn, error) {
	w := &waiter{key: key, ready: make(chan struct{})}
	d.mu.Lock()
	d.queue = append(d.queue, w)
	d.passLocked()
	d.mu.Unlock()
	select {
	case <-w.ready:
		return w.idle.conn, nil
	case <-ctx.Done():
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	select {
	case <-w.ready: // the turn came as the wait ended: it goes to the next
		if w.idle.conn != nil {
			d.idle[key] = append(d.idle[key], w.idle)
		}
		d.doneLocked(key)
	default:
		for i, q := range d.queue {
			if q == w {
				d.queue = append(d.queue[:i], d.queue[i+1:]...)
				break
			}
		}
	}
	return nil, ctx.Err()
}

// done gives back a turn taken for key's DSN, after its connection was put back.
func (d *database) done(key string) {
	d.mu.Lock()
	d.doneLocked(key)
	d.mu.Unlock()
}

func (d *database) doneLocked(key string) {
	d.reads--
	if d.running[key]--; d.running[key] == 0 {
		delete(d.running, key)
	}
	d.passLocked()
}

// passLocked gives the free turns to the waiting reads (nextLocked), each
// with its DSN's idle connection if there is one.
func (d *database) passLocked() {
	for d.reads < d.cap {
		next := d.nextLocked()
		if next < 0 {
			return
		}
		w := d.queue[next]
		for _, p := range d.queue[:next] {
			p.passed++
		}
		d.queue = append(d.queue[:next], d.queue[next+1:]...)
		if l := d.idle[w.key]; len(l) > 0 {
			w.idle = l[len(l)-1]
			d.idle[w.key] = l[:len(l)-1]
		}
		d.reads++
		d.running[w.key]++
		close(w.ready)
	}
}

// nextLocked is the index in queue of the read to give a free turn to, -1
// for none: the oldest passed over maxPassedOver times; else the oldest
// whose DSN has an idle connection; else the oldest that can connect
// without closing another DSN's connection, or whose DSN has no read
// running (it closes an idle connection of another DSN). The others wait
// for their DSN's connection in use, which comes to them next.
func (d *database) nextLocked() int {
	oldest := func(ok func(w *waiter) bool) int {
		for i, w := range d.queue {
			if ok(w) {
				return i
			}
		}
		return -1
	}
	for _, ok := range []func(w *waiter) bool{
		func(w *waiter) bool { return w.passed >= maxPassedOver },
		func(w *waiter) bool { return len(d.idle[w.key]) > 0 },
		func(w *waiter) bool { return d.open < d.cap || d.running[w.key] == 0 },
	} {
		if i := oldest(ok); i >= 0 {
			return i
		}
	}
	return -1
}

// sessionOpened is closed when the next connection of key's DSN opens.
func (d *database) sessionOpened(key string) <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	ch := d.opened[key]
	if ch == nil {
		ch = make(chan struct{})
		d.opened[key] = ch
	}
	return ch
}

type idleConn struct {
	conn  *pgx.Conn
	since time.Time
}

// sharedDB is one DSN's way to its database, and what its readers share.
type sharedDB struct {
	key string // a digest of the DSN: the DSN itself is never a map key that could be logged
	cfg *pgx.ConnConfig
	// tokens log in with spec.database.auth's tokens; nil: the DSN's password.
	tokens *dbauth.Source
	db     *database
	refs   int
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

// dsnKey is a digest of dsn, the key of its shared state.
func dsnKey(dsn string) string {
	sum := sha256.Sum256([]byte(dsn))
	return hex.EncodeToString(sum[:16])
}

// acquire returns dsn's shared state, making it on first use (no
// connection yet). An unparsable DSN is errDSNUnparsable.
func (o *FlowObserver) acquire(dsn string, t *dbTLS, auth dbAuth) (*sharedDB, error) {
	k := dsnKey(dsn + "\x00" + t.digest() + "\x00" + string(auth.method) + "\x00" + auth.region)
	o.mu.Lock()
	defer o.mu.Unlock()
	if db := o.dbs[k]; db != nil {
		db.refs++
		return db, nil
	}
	cfg, err := backlogConnConfig(dsn, t, auth)
	if err != nil {
		return nil, err
	}
	tokens, err := o.tokenSourceLocked(auth)
	if err != nil {
		return nil, err
	}
	n := o.ConnsPerDatabase
	if n <= 0 {
		n = DefaultConnsPerDatabase
	}
	name := cfg.Host + ":" + strconv.Itoa(int(cfg.Port)) + "/" + cfg.Database
	group := o.databases[name]
	if group == nil {
		group = newDatabase(n)
		o.databases[name] = group
	}
	db := &sharedDB{key: k, cfg: cfg, tokens: tokens, db: group, refs: 1, recent: map[string]recentRead{}}
	o.dbs[k] = db
	return db, nil
}

// tokenSourceLocked is the token source of auth, one per method and
// region for the whole operator (its tokens are cached by host, port and
// user); nil for the DSN's password. o.mu is held.
func (o *FlowObserver) tokenSourceLocked(auth dbAuth) (*dbauth.Source, error) {
	if !auth.token() {
		return nil, nil
	}
	if s := o.tokens[auth]; s != nil {
		return s, nil
	}
	newProvider := o.TokenProvider
	if newProvider == nil {
		newProvider = dbauth.New
	}
	ctx, cancel := context.WithTimeout(context.Background(), backlogQueryTimeout)
	defer cancel()
	p, err := newProvider(ctx, auth.method, auth.region)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", dbauth.ErrNoToken, err)
	}
	s := dbauth.NewSource(p)
	o.tokens[auth] = s
	return s, nil
}

// release drops one reference to db; after the last, its idle connections close.
func (o *FlowObserver) release(db *sharedDB) {
	o.mu.Lock()
	db.refs--
	last := db.refs == 0
	if last {
		delete(o.dbs, db.key)
	}
	o.mu.Unlock()
	if last {
		db.db.closeIdle(db.key, time.Time{})
	}
}

// conn returns an idle connection of key's DSN, or opens one, first closing
// another DSN's idle connection when the database has cap open. The caller
// holds a turn.
func (d *database) conn(ctx context.Context, key string, cfg *pgx.ConnConfig, tokens *dbauth.Source) (*pgx.Conn, error) {
	d.mu.Lock()
	if l := d.idle[key]; len(l) > 0 {
		c := l[len(l)-1].conn
		d.idle[key] = l[:len(l)-1]
		d.mu.Unlock()
		return c, nil
	}
	var victim *pgx.Conn
	if d.open >= d.cap {
		victim = d.victimLocked()
	}
	if victim == nil && d.open >= d.cap {
		d.mu.Unlock()
		return nil, fmt.Errorf("%d backlog connections open and none idle", d.open) // cannot happen while reads take turns
	}
	if victim == nil {
		d.open++ // counted before it is opened: the cap holds while it connects
	}
	d.mu.Unlock()
	if victim != nil {
		closeAndWait(victim) // its place passes to the new one
	}
	c, err := tokens.Connect(ctx, cfg)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err != nil {
		d.open--
		return nil, err
	}
	if ch := d.opened[key]; ch != nil {
		close(ch)
		delete(d.opened, key)
	}
	return c, nil
}

// victimLocked takes the idle connection to close for another DSN's: the
// longest idle of a DSN no read waits for, or else the longest idle; nil
// when none is idle.
func (d *database) victimLocked() *pgx.Conn {
	waited := map[string]bool{}
	for _, w := range d.queue {
		waited[w.key] = true
	}
	var key string
	var best idleConn
	for k, l := range d.idle {
		if len(l) == 0 {
			continue
		}
		better := best.conn == nil || waited[key] && !waited[k] ||
			waited[key] == waited[k] && l[0].since.Before(best.since)
		if better {
			key, best = k, l[0]
		}
	}
	if best.conn != nil {
		d.idle[key] = d.idle[key][1:]
	}
	return best.conn
}

// put keeps c for key's next read, or closes it when it is broken.
func (d *database) put(key string, c *pgx.Conn) {
	if c.IsClosed() || c.PgConn().IsBusy() || c.PgConn().TxStatus() != 'I' {
		closeAndWait(c)
		d.mu.Lock()
		d.open--
		d.mu.Unlock()
		return
	}
	d.mu.Lock()
	d.idle[key] = append(d.idle[key], idleConn{conn: c, since: time.Now()})
	d.mu.Unlock()
}

// closeIdle closes key's idle connections idle since before (all with a
// zero before: the DSN's last reader is gone).
func (d *database) closeIdle(key string, before time.Time) {
	d.mu.Lock()
	if before.IsZero() {
		delete(d.opened, key)
	}
	var doomed []*pgx.Conn
	keep := d.idle[key][:0]
	for _, ic := range d.idle[key] {
		if before.IsZero() || ic.since.Before(before) {
			doomed = append(doomed, ic.conn)
		} else {
			keep = append(keep, ic)
		}
	}
	d.idle[key] = keep
	if len(keep) == 0 {
		delete(d.idle, key)
	}
	d.open -= len(doomed)
	d.mu.Unlock()
	for _, c := range doomed {
		closeAndWait(c)
	}
}

// closeIdleConns closes the connections idle longer than connIdleTime.
func (o *FlowObserver) closeIdleConns() {
	o.mu.Lock()
	dbs := make([]*database, 0, len(o.databases))
	for _, d := range o.databases {
		dbs = append(dbs, d)
	}
	o.mu.Unlock()
	for _, d := range dbs {
		d.mu.Lock()
		keys := make([]string, 0, len(d.idle))
		for k := range d.idle {
			keys = append(keys, k)
		}
		d.mu.Unlock()
		for _, k := range keys {
			d.closeIdle(k, time.Now().Add(-connIdleTime))
		}
	}
}

// read answers q on db: a reading of the same question taken within fresh
// is shared, so is one in flight, and at most the database's cap of reads
// run at once.
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
		conn, err := db.db.turn(wctx, db.key)
		if err != nil {
			// Within two intervals: a read holds its turn for up to
			// backlogQueryTimeout and more, as long as this wait.
			if failed := db.db.failedWithin(4 * max(fresh, backlogQueryTimeout)); failed != nil {
				// The reads ahead failed to reach the database, each taking
				// its time out: that, not their number, is why.
				return backlogSample{}, fmt.Errorf("read the backlog of %s: %w (%w)", q.table, failed, errNoTurn)
			}
			return backlogSample{}, fmt.Errorf("read the backlog of %s: %w", q.table, errNoTurn)
		}
		defer db.db.done(db.key) // after put: the connection goes with the turn
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), backlogQueryTimeout+time.Second)
		defer cancel()
		o.queries.Add(1)
		if conn == nil {
			conn, err = db.db.conn(rctx, db.key, db.cfg, db.tokens)
			if err != nil {
				db.db.noteRead(err)
				return backlogSample{}, fmt.Errorf("read the backlog of %s: %w", q.table, err)
			}
		}
		s, err := observeBacklog(rctx, conn, q, bound)
		db.db.noteRead(err)
		db.db.put(db.key, conn)
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

// closeAndWait ends c's session and returns once the server has ended it:
// PostgreSQL closes the socket only after the session has left
// pg_stat_activity, while a plain close returns at once.
func closeAndWait(c *pgx.Conn) {
	hc, err := c.PgConn().Hijack()
	if err != nil {
		_ = c.Close(context.Background())
		return
	}
	nc := hc.Conn
	defer nc.Close()
	_ = nc.SetDeadline(time.Now().Add(time.Second))
	if _, err := nc.Write([]byte{'X', 0, 0, 0, 4}); err != nil { // Terminate
		return
	}
	_, _ = io.Copy(io.Discard, nc) // until the server closes it
}
