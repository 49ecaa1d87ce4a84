package controllers

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/singleflight"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/source"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// This file keeps one backlog observer per OutboxRelay: a goroutine that
// reads the backlog every spec.backlog.interval (with jitter, so that
// observers started together spread out) through its database's
// shared pool (flowdb.go) and wakes the reconciler. Reconcile only reads the
// latest sample, so a slow or unreachable database never holds up the
// reconcile queue, nor the observers of other databases.

// rateWindow is the span the publish rate is measured over.
const rateWindow = time.Minute

// FlowObserver reads the backlog of every OutboxRelay the reconciler hands
// it. It is a manager Runnable (it needs leader election like the
// reconciler) and stops every observer when the manager stops.
type FlowObserver struct {
	// Bound is how many unpublished rows one read counts exactly
	// (outboxv1alpha1.BacklogBound when zero).
	Bound int64
	// ConnsPerDatabase caps the backlog reads in flight, and so the
	// connections in use, per database (DefaultConnsPerDatabase when zero).
	ConnsPerDatabase int
	// TokenProvider makes the token provider of a spec.database.auth
	// method (dbauth.New when nil): the operator's own cloud identity.
	TokenProvider func(ctx context.Context, method relayconfig.DatabaseAuth, region string) (dbauth.Provider, error)

	mu        sync.Mutex
	ctx       context.Context // set by Start
	relays    map[types.NamespacedName]*relayFlow
	events    chan event.GenericEvent
	dbs       map[string]*sharedDB // by dsnKey
	tokens    map[dbAuth]*dbauth.Source
	databases map[string]*database // by host:port/name
	flight    singleflight.Group
	// queries counts the backlog statements run (shared reads run one).
	queries atomic.Int64
}

// NewFlowObserver returns an observer that is not started yet.
func NewFlowObserver() *FlowObserver {
	return &FlowObserver{
		relays:    map[types.NamespacedName]*relayFlow{},
		events:    make(chan event.GenericEvent, 1024),
		dbs:       map[string]*sharedDB{},
		databases: map[string]*database{},
		tokens:    map[dbAuth]*dbauth.Source{},
	}
}

// flowTarget is what an observer connects to and how often it reads.
type flowTarget struct {
	dsn       string // held in memory only, to connect; never logged or written
	tls       *dbTLS // spec.database.tls's material, nil without it
	auth      dbAuth // spec.database.auth
	dsnSecret string // the Secret's name, for messages
	table     outbox.Table
	interval  time.Duration
	topics    map[string]outboxv1alpha1.TopicName // the topic map, to tell held rows from pending ones
	byKey     bool                                // PartitionKey ordering
	streams   bool                                // LogicalReplication capture: its slot must be read
	// deletes: the relay deletes the rows it publishes, so its publish
	// rate counts deleted rows; else it counts updated ones (marks), and
	// pruning's deletes are no publishing. With writer deletes the rows the
	// writers delete are counted by neither: only those kept in the table.
	deletes bool
}

// relayFlow is one OutboxRelay's observer and what it saw.
type relayFlow struct {
	target flowTarget
	cancel context.CancelFunc
	done   chan struct{}

	latest     *backlogSample // last successful read
	lastErr    string         // the last read's failure, "" when it succeeded
	authFailed bool           // the last read failed to authenticate
	// retargeted: the target changed (the table, or the database the DSN
	// connects to) and no read of the new one has succeeded yet.
	retargeted bool
	// counters are the recent (time, updated rows) readings for the rate.
	counters []counterReading
	// recs are the autoscaler's recent recommendations; since is when the
	// observer began recommending (a history shorter than the
	// stabilization window keeps the running count).
	recs   []recommendation
	since  time.Time
	window time.Duration // the stabilization window recommend last used
	// based is the reading ratioBase last saw, and base the replicas that
	// ran when a reconcile first used it.
	based *backlogSample
	base  int32
}

type counterReading struct {
	at        time.Time
	published int64 // the counter the rate reads (flowTarget.deletes)
}

// flowView is what Reconcile learns from the observer.
type flowView struct {
	sample     *backlogSample // nil before the first successful read
	lastErr    string
	authFailed bool // the DSN did not authenticate: its Secret may have changed
	// retargeted: what status says of the backlog was read from another
	// target (relayFlow.retargeted).
	retargeted bool
}

// Start implements manager.Runnable: observers run until ctx ends.
func (o *FlowObserver) Start(ctx context.Context) error {
	o.mu.Lock()
	o.ctx = ctx
	for key, f := range o.relays { // registered before the manager started
		o.startLocked(key, f)
	}
	o.mu.Unlock()
	idle := time.NewTicker(connIdleTime / 4)
	defer idle.Stop()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-idle.C:
			o.closeIdleConns()
		}
	}
	o.mu.Lock()
	flows := make([]*relayFlow, 0, len(o.relays))
	for _, f := range o.relays {
		flows = append(flows, f)
	}
	o.mu.Unlock()
	for _, f := range flows {
		if f.done != nil {
			<-f.done
		}
	}
	return nil
}

// Observe makes sure key's backlog is read from target: it starts an
// observer, or replaces the one that reads another DSN or table (closing its
// pool). A new interval or topic map needs no new observer.
func (o *FlowObserver) Observe(key types.NamespacedName, target flowTarget) flowView {
	o.mu.Lock()
	defer o.mu.Unlock()
	f := o.relays[key]
	switch {
	case f == nil:
		f = &relayFlow{target: target}
		o.relays[key] = f
		o.startLocked(key, f)
	case f.target.dsn != target.dsn || f.target.tls.digest() != target.tls.digest() || f.target.auth != target.auth || f.target.table != target.table:
		o.stopLocked(f)
		if f.target.table != target.table || dsnPlace(f.target.dsn) != dsnPlace(target.dsn) {
			f.latest, f.lastErr, f.counters, f.retargeted = nil, "", nil, true
		} else if f.target.deletes != target.deletes {
			f.counters = nil // another counter: the rate starts again
		} // else the same table with new credentials (a password or certificate rotated): what was read of it stands
		f.target = target
		o.startLocked(key, f)
	case target.interval < f.target.interval && f.cancel != nil:
		// The observer waits out the longer interval before it reads the
		// new one: a shorter one starts it again, reading at once. Before,
		// an interval lowered from 1h to 15s took effect up to an hour
		// later, lag and autoscaling frozen meanwhile.
		o.stopLocked(f)
		if f.target.deletes != target.deletes {
			f.counters = nil
		}
		f.target = target
		o.startLocked(key, f)
	default:
		f.target.interval, f.target.dsnSecret, f.target.streams = target.interval, target.dsnSecret, target.streams
		f.target.topics, f.target.byKey = target.topics, target.byKey
		if f.target.deletes != target.deletes {
			f.counters = nil // another counter: the rate starts again
		}
		f.target.deletes = target.deletes
	}
	return flowView{sample: f.latest, lastErr: f.lastErr, authFailed: f.authFailed, retargeted: f.retargeted}
}

// dsnPlace is the table a DSN reaches: its hosts and ports, its database,
// and the search_path and options that say which schema an unqualified
// table name is in, without the user, password or TLS settings, which a
// rotation of credentials changes (sslmode prefer lists each host twice,
// with TLS and without: once here). A DSN that does not parse is its own
// place.
func dsnPlace(dsn string) string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return dsn
	}
	hosts := []string{fmt.Sprint(cfg.Host, ":", cfg.Port)}
	for _, f := range cfg.Fallbacks {
		if h := fmt.Sprint(f.Host, ":", f.Port); !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	return fmt.Sprint(hosts, "/", cfg.Database, "?search_path=", cfg.RuntimeParams["search_path"], "&options=", cfg.RuntimeParams["options"])
}

// Forget stops key's observer and closes its pool: the OutboxRelay is gone,
// or cannot be observed (its DSN Secret is missing, its spec invalid).
func (o *FlowObserver) Forget(key types.NamespacedName) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if f := o.relays[key]; f != nil {
		o.stopLocked(f)
		delete(o.relays, key)
	}
}

// observing reports whether key has an observer.
func (o *FlowObserver) observing(key types.NamespacedName) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.relays[key]
	return ok
}

func (o *FlowObserver) startLocked(key types.NamespacedName, f *relayFlow) {
	if o.ctx == nil {
		return // Start starts it
	}
	ctx, cancel := context.WithCancel(o.ctx)
	f.cancel, f.done = cancel, make(chan struct{})
	// An observer started again on the same table (a shorter interval,
	// credentials rotated) knows whether its held table exists: without
	// it, its first reading counted the held rows as pending.
	go o.run(ctx, key, f.target, f.done, f.latest != nil && f.latest.heldTable)
}

// stopLocked cancels f's observer without waiting: its pool closes as the
// goroutine ends, and a read in flight ends at its deadline at the latest.
func (o *FlowObserver) stopLocked(f *relayFlow) {
	if f.cancel != nil {
		f.cancel()
		f.cancel = nil
	}
}

// run reads the backlog at once and then every interval until ctx ends.
func (o *FlowObserver) run(ctx context.Context, key types.NamespacedName, target flowTarget, done chan struct{}, withHeld bool) {
	defer close(done)
	log := ctrl.LoggerFrom(ctx).WithValues("outboxrelay", key)
	db, err := o.acquire(target.dsn, target.tls, target.auth)
	defer func() {
		if db != nil {
			o.release(db)
		}
	}()
	bound := o.Bound
	if bound <= 0 {
		bound = outboxv1alpha1.BacklogBound
	}
	// The first read comes at once (the status wants a backlog soon); the
	// second after half to one and a half intervals, at random, so that
	// observers started together (a manager start) spread over the
	// interval; the later ones every interval, give or take a tenth, or up
	// to half an interval early (readingDue).
	due, early := time.Now(), time.Duration(0)
	reads := 0
	lastLogged := ""
	// Unless known, the first read finds out whether the held table exists.
	for {
		if !readingDue(ctx, db, due, early) {
			return
		}
		if db == nil && reads > 0 {
			// Acquiring failed (a cloud identity's token source not ready
			// in the manager's first seconds, say): try again at each
			// reading, not only when the DSN, its TLS or its auth change.
			db, err = o.acquire(target.dsn, target.tls, target.auth)
		}
		var s backlogSample
		if db != nil {
			q := o.query(key, done, withHeld)
			q.table = target.table // the same; also when the observer was replaced meanwhile
			fresh := o.interval(key, done, target.interval) / 2
			s, err = o.read(ctx, db, q, bound, fresh)
			if isUndefinedTable(err) && withHeld { // the held table was dropped
				q.withHeld = false
				s, err = o.read(ctx, db, q, bound, fresh)
			}
			withHeld = err == nil && s.heldTable
		}
		if ctx.Err() != nil {
			return
		}
		msg := ""
		if err != nil {
			msg = backlogError(err, target.dsnSecret)
			if msg != lastLogged {
				log.Error(err, "cannot read the backlog")
			}
		}
		lastLogged = msg
		interval := o.record(key, done, &s, msg, isAuthFailure(err))
		o.wake(key)
		reads++
		next := interval - interval/10 + time.Duration(rand.Int64N(int64(interval/5)+1))
		if reads == 1 {
			next = interval/2 + time.Duration(rand.Int64N(int64(interval)+1))
		}
		due, early = time.Now().Add(next), interval/2
	}
}

// readingDue waits until due, or until a connection of db's DSN opens in the
// last early before it, and reports whether ctx is still live then. Where
// the DSNs on a database outnumber its connections, a DSN's connection is
// closed for another's between its reads; a reading almost due is taken
// with the one opened for another reading of its DSN rather than open one
// later. After a reading taken together the observers' next ones are due
// together, give or take a tenth of an interval, so each DSN's readings
// soon come in one batch an interval, on one session. The cost is a
// reading taken up to early before it is due, on a session already open.
func readingDue(ctx context.Context, db *sharedDB, due time.Time, early time.Duration) bool {
	var opened <-chan struct{}
	if db != nil && early > 0 {
		if wait := time.Until(due.Add(-early)); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return false
			case <-t.C:
			}
		}
		opened = db.db.sessionOpened(db.key)
	}
	t := time.NewTimer(time.Until(due))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-opened:
	}
	return true
}

// interval is key's reading interval as the reconciler last handed it over.
func (o *FlowObserver) interval(key types.NamespacedName, done chan struct{}, fallback time.Duration) time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	if f := o.relays[key]; f != nil && f.done == done {
		return f.target.interval
	}
	return fallback
}

// query is what key's next observation reads: its table and the topic map
// and ordering as the reconciler last handed them over.
func (o *FlowObserver) query(key types.NamespacedName, done chan struct{}, withHeld bool) backlogQuery {
	o.mu.Lock()
	defer o.mu.Unlock()
	q := backlogQuery{withHeld: withHeld}
	if f := o.relays[key]; f != nil && f.done == done {
		q.table, q.byKey = f.target.table, f.target.byKey
		// Poll relays' too: a slot left by logical replication (a switch
		// to Poll, a relay deleted) holds back the database's WAL with no
		// relay to give it up (backlogStatus).
		q.slot, q.slotRequired = o.slotName(f.target), f.target.streams
		q.topics = make(map[string]string, len(f.target.topics))
		for et, t := range f.target.topics {
			q.topics[et] = string(t)
		}
	}
	return q
}

// isAuthFailure reports whether PostgreSQL refused the DSN's credentials
// (invalid_password, invalid_authorization_specification).
func isAuthFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "28P01" || pgErr.Code == "28000")
}

// isUndefinedTable reports whether err is PostgreSQL's "relation does not exist".
func isUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}

// wake enqueues a reconcile of key.
func (o *FlowObserver) wake(key types.NamespacedName) {
	relay := &outboxv1alpha1.OutboxRelay{}
	relay.Namespace, relay.Name = key.Namespace, key.Name
	select {
	case o.events <- event.GenericEvent{Object: relay}:
	default: // the queue is full of wake-ups already; the next read wakes it again
	}
}

// Source is the watch source of the observers' wake-ups.
func (o *FlowObserver) Source() source.Source {
	return source.Channel(o.events, &handler.EnqueueRequestForObject{})
}

// recommend records rec, the autoscaler's count for now, and returns the
// count to run: rec when it is not lower than current, else the highest count
// recommended within window (current itself while the history is shorter
// than window, as after a manager restart).
func (o *FlowObserver) recommend(key types.NamespacedName, now time.Time, rec, current int32, window time.Duration) int32 {
	o.mu.Lock()
	defer o.mu.Unlock()
	f := o.relays[key]
	if f == nil {
		return current
	}
	if f.since.IsZero() || window > f.window {
		// A history shorter than the window keeps the running count: a
		// window made longer has none that long yet.
		f.since = now
	}
	f.window = window
	keep := f.recs[:0]
	for _, r := range f.recs {
		if now.Sub(r.at) < window {
			keep = append(keep, r)
		}
	}
	f.recs = append(keep, recommendation{at: now, replicas: rec})
	return stabilized(f.recs, rec, current, now.Sub(f.since) < window)
}

// stopRecommending drops key's recommendations: its autoscaling is off
// (or suspended), and when it is on again its history starts anew.
func (o *FlowObserver) stopRecommending(key types.NamespacedName) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if f := o.relays[key]; f != nil {
		f.recs, f.since = nil, time.Time{}
	}
}

// ratioBase is the replica count a ratio target (oldestAge) multiplies for
// the latest reading: running as it was when a reconcile first used that
// reading. Every write of the replicas triggers a reconcile over the same
// reading; multiplying the count just written again would climb to
// maxReplicas on one reading.
func (o *FlowObserver) ratioBase(key types.NamespacedName, running int32) int32 {
	o.mu.Lock()
	defer o.mu.Unlock()
	f := o.relays[key]
	if f == nil || f.latest == nil {
		return running
	}
	if f.based != f.latest {
		f.based, f.base = f.latest, running
	}
	return f.base
}

// record stores one read (or its failure) and returns the interval to the
// next. done identifies the observer, so a replaced one records nothing.
func (o *FlowObserver) record(key types.NamespacedName, done chan struct{}, s *backlogSample, errMsg string, authFailed bool) time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	f := o.relays[key]
	if f == nil || f.done != done {
		return outboxv1alpha1.DefaultBacklogInterval
	}
	f.authFailed = authFailed
	if errMsg != "" {
		f.lastErr = errMsg
		return f.target.interval
	}
	f.lastErr, f.retargeted = "", false
	if s.tracked {
		published := s.updated
		if f.target.deletes {
			published = s.deleted
		}
		f.counters = appendReading(f.counters, counterReading{at: s.at, published: published})
		s.perMinute = perMinute(f.counters)
	} else {
		f.counters = nil
	}
	if sl := s.slot; sl != nil && sl.Exists && !sl.Active {
		// To the second, as status keeps it: a finer time never equals the
		// stored one, and each reading would rewrite the status.
		since := metav1.NewTime(s.at.Truncate(time.Second))
		if prev := f.latest; prev != nil && prev.slot != nil && prev.slot.InactiveSince != nil {
			since = *prev.slot.InactiveSince
		}
		// A copy: a shared reading hands every relay the same slot, which
		// their reconciles read without the lock.
		sl = sl.DeepCopy()
		sl.InactiveSince = &since
		s.slot = sl
	}
	f.latest = s
	return f.target.interval
}

// appendReading keeps the readings of the last rate window and one before
// it. A counter that went down (statistics reset, another database) starts over.
func appendReading(rs []counterReading, r counterReading) []counterReading {
	if n := len(rs); n > 0 && r.published < rs[n-1].published {
		rs = nil
	}
	rs = append(rs, r)
	cut := 0
	for cut < len(rs)-1 && r.at.Sub(rs[cut+1].at) >= rateWindow {
		cut++
	}
	return rs[cut:]
}

// perMinute is the rate between the oldest kept reading (about a minute
// back) and the newest, scaled to a minute; nil with a single reading.
func perMinute(rs []counterReading) *int64 {
	if len(rs) < 2 {
		return nil
	}
	first, last := rs[0], rs[len(rs)-1]
	dt := last.at.Sub(first.at)
	if dt <= 0 {
		return nil
	}
	v := int64(float64(last.published-first.published)*float64(rateWindow)/float64(dt) + 0.5)
	return &v
}

// backlogConnConfig is the configuration of an observer connection. Its
// sessions are read-only, bounded by a statement timeout, and plan each
// statement for its own arguments (a generic plan for LIMIT $1 could scan
// the whole backlog). Bitmap scans and sorts are off: reading the oldest
// rows then walks the partial index in id order and stops at the bound,
// and the grouping hashes the rows instead of sorting them, which on
// statistics taken while the table was nearly drained spilled to disk at 1M
// waiting rows (TestBacklogQueryPlanStopsAtTheBound checks the plan has no
// sort).
//
// With t (spec.database.tls) the connection is TLS, verifying the server's
// certificate and host name against t's CA, whatever the DSN's sslmode.
// With a token method (spec.database.auth) it must be TLS without a
// plain-text fallback.
func backlogConnConfig(dsn string, t *dbTLS, auth dbAuth) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, errDSNUnparsable
	}
	if t != nil {
		if err := dbauth.OverTLS(&cfg.Config, t.config); err != nil {
			return nil, err
		}
	}
	if auth.token() {
		if err := dbauth.RequireTLS(&cfg.Config); err != nil {
			return nil, err
		}
	}
	cfg.ConnectTimeout = backlogQueryTimeout
	rp := cfg.RuntimeParams
	rp["application_name"] = "outbox-operator"
	rp["default_transaction_read_only"] = "on"
	rp["statement_timeout"] = fmt.Sprint(backlogQueryTimeout.Milliseconds())
	rp["lock_timeout"] = "1000"
	rp["plan_cache_mode"] = "force_custom_plan"
	rp["enable_bitmapscan"] = "off"
	rp["enable_sort"] = "off"
	return cfg, nil
}

// newBacklogPool opens a lazy one-connection pool with an observer's
// session settings (for a probe and for tests).
func newBacklogPool(ctx context.Context, target flowTarget) (*pgxpool.Pool, error) {
	cc, err := backlogConnConfig(target.dsn, target.tls, target.auth)
	if err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig("")
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig = cc
	cfg.MaxConns, cfg.MinConns = 1, 0
	cfg.MaxConnIdleTime = connIdleTime
	return pgxpool.NewWithConfig(ctx, cfg)
}

// slotName is the replication slot of target's table: the relays name it
// after the DSN's database and the table (relayconfig.SlotName).
func (o *FlowObserver) slotName(target flowTarget) string {
	cfg, err := pgx.ParseConfig(target.dsn)
	if err != nil {
		return ""
	}
	return outbox.SlotName(cfg.Database, target.table)
}
