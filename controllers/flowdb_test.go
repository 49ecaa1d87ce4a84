package controllers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// Sixty OutboxRelays on one database: forty on tables of their own (a third
// of them through a second DSN), twenty on one shared table. The operator
// holds no more connections to it than the cap, every relay gets its
// backlog, the twenty share their reads, and relays whose database refuses
// connections report it without holding up the others.
func TestObserversShareCappedConnections(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const own, shared, cap = 40, 20, 2
	for i := range own {
		_, err := db.Exec(ctx, outbox.SchemaDDL(outbox.Table{Name: fmt.Sprintf("outbox_%d", i)}))
		require.NoError(t, err)
	}
	insertRows(t, db, 7, "OrderConfirmed", 0)

	o := NewFlowObserver()
	o.ConnsPerDatabase = cap
	go func() { _ = o.Start(ctx) }()
	topics := map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders"}
	interval := 300 * time.Millisecond
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	dsn2 := dsn + sep + "connect_timeout=4" // another DSN of the same database (another team's Secret)
	var keys []types.NamespacedName
	dsnOf := map[types.NamespacedName]string{}
	for i := range own + shared {
		table := outbox.Table{Name: "outbox"}
		d := dsn
		if i < own {
			table.Name = fmt.Sprintf("outbox_%d", i)
			if i%3 == 0 {
				d = dsn2
			}
			if i%3 == 1 { // many more DSNs: teams with users of their own
				d = dsn + sep + fmt.Sprintf("connect_timeout=%d", 5+i)
			}
		}
		k := types.NamespacedName{Namespace: "ns", Name: fmt.Sprintf("r%d", i)}
		keys = append(keys, k)
		dsnOf[k] = d
		o.Observe(k, flowTarget{dsn: d, dsnSecret: "dsn", table: table, interval: interval, topics: topics})
	}
	refused := types.NamespacedName{Namespace: "ns", Name: "refused"}
	o.Observe(refused, flowTarget{dsn: "postgres://u:p@127.0.0.1:1/db?connect_timeout=1", dsnSecret: "other-dsn",
		table: outbox.Table{Name: "outbox"}, interval: interval})

	var peak atomic.Int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() { // the operator's connections to the database, sampled
		defer close(sampled)
		for {
			var n int64
			if err := db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = 'outbox-operator' AND datname = current_database()`).Scan(&n); err == nil && n > peak.Load() {
				peak.Store(n)
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	require.Eventually(t, func() bool {
		for _, k := range keys {
			if v := o.Observe(k, flowTarget{dsn: dsnOf[k], table: tableOf(o, k), interval: interval, topics: topics}); v.sample == nil {
				return false
			}
		}
		return true
	}, 20*time.Second, 50*time.Millisecond, "every relay gets its backlog")
	before := o.queries.Load()
	time.Sleep(3 * time.Second)
	ran := o.queries.Load() - before
	close(stop)
	<-sampled

	require.LessOrEqual(t, peak.Load(), int64(cap), "connections held to the database")
	require.Positive(t, peak.Load())
	// Unshared, 60 relays read 10 times in 3 s; the 20 on one table share.
	t.Logf("%d backlog statements in 3 s for %d relays (peak %d connections)", ran, own+shared, peak.Load())
	require.Less(t, ran, int64((own+shared/2)*10), "the relays on one table share their reads")
	v := o.Observe(keys[own], flowTarget{dsn: dsn, table: outbox.Table{Name: "outbox"}, interval: interval, topics: topics})
	require.Equal(t, int64(7), v.sample.read)
	require.Eventually(t, func() bool {
		v := o.Observe(refused, flowTarget{dsn: "postgres://u:p@127.0.0.1:1/db?connect_timeout=1", dsnSecret: "other-dsn", table: outbox.Table{Name: "outbox"}, interval: interval})
		return v.lastErr != "" && v.sample == nil
	}, 10*time.Second, 50*time.Millisecond)
}

// tableOf is the table o observes for k.
func tableOf(o *FlowObserver, k types.NamespacedName) outbox.Table {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.relays[k].target.table
}

// A cloud identity's token source that cannot be made at first (the
// metadata server not ready in the manager's first seconds) is made again
// at a later reading: the backlog does not stay unreadable until the
// manager restarts.
func TestObserverRetriesATokenSourceThatFailed(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	o := NewFlowObserver()
	o.TokenProvider = func(context.Context, relayconfig.DatabaseAuth, string) (dbauth.Provider, error) {
		if calls.Add(1) == 1 {
			return nil, errors.New("metadata server not ready yet")
		}
		return dbauth.ProviderFunc(func(context.Context, dbauth.Target) (dbauth.Token, error) {
			return dbauth.Token{Value: "t", Expiry: time.Now().Add(time.Hour)}, nil
		}), nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = o.Start(ctx) }()
	table, err := outbox.ParseTable("outbox")
	require.NoError(t, err)
	key := types.NamespacedName{Namespace: "shop", Name: "orders"}
	target := flowTarget{dsn: "postgres://relay@127.0.0.1:1/orders?sslmode=require", table: table, interval: 50 * time.Millisecond,
		auth: dbAuth{method: relayconfig.DatabaseAuthAWSRDSIAM, region: "eu-west-1"}}
	o.Observe(key, target)
	require.Eventually(t, func() bool { return calls.Load() >= 2 }, 10*time.Second, 10*time.Millisecond,
		"the token source is made again")
	require.Eventually(t, func() bool {
		return !strings.Contains(o.Observe(key, target).lastErr, "metadata server not ready yet")
	}, 10*time.Second, 10*time.Millisecond, "the readings go on with it (here they fail to connect instead)")
}

// The operator's own cloud identity logs in nowhere unless the manager's
// --database-token-logins allows: the OutboxRelay names the host, and with
// sslmode=require or a CA of its author's would have the token sent to a
// server of their choosing. Off, a relay with a token method is not
// observed and no token source is made; Lagging says why, and Argo CD's
// health follows Ready. On, it is read as before.
func TestTokenLoginsAreOptIn(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	o := NewFlowObserver()
	o.TokenProvider = func(context.Context, relayconfig.DatabaseAuth, string) (dbauth.Provider, error) {
		calls.Add(1)
		return dbauth.ProviderFunc(func(context.Context, dbauth.Target) (dbauth.Token, error) {
			return dbauth.Token{Value: "operator-token", Expiry: time.Now().Add(time.Hour)}, nil
		}), nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = o.Start(ctx) }()
	r := &OutboxRelayReconciler{Flow: o}
	relay := unitRelay()
	relay.Spec.Database = &outboxv1alpha1.DatabaseSpec{Auth: &outboxv1alpha1.DatabaseAuth{Method: outboxv1alpha1.DatabaseAuthAzureAD}}
	relay.Spec.Backlog = &outboxv1alpha1.BacklogSpec{Interval: "50ms"}
	// A reading from before an upgrade that turned the reads off.
	relay.Status.Backlog = &outboxv1alpha1.BacklogStatus{Pending: 7, ObservedAt: metav1.Now()}
	key := types.NamespacedName{Namespace: relay.Namespace, Name: relay.Name}
	in := secretInputs{DSN: "postgres://relay@attacker.example:5432/orders?sslmode=require"}

	obs := r.observe(key, relay, in, nil)
	require.Equal(t, tokenLoginsOff, obs.notRead)
	o.mu.Lock()
	observed := len(o.relays)
	o.mu.Unlock()
	require.Zero(t, observed, "the relay is not observed")
	<-time.After(200 * time.Millisecond)
	require.Zero(t, calls.Load(), "no token source is made")
	running := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Generation: 2}, Status: appsv1.DeploymentStatus{
		ObservedGeneration: 2, Replicas: 1, UpdatedReplicas: 1, ReadyReplicas: 1, AvailableReplicas: 1}}
	relay.Status = computeStatus(relay, running, nil, obs)
	require.Nil(t, relay.Status.Backlog, "no earlier reading stands in for the backlog")
	lag := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
	require.Equal(t, metav1.ConditionUnknown, lag.Status)
	require.Equal(t, outboxv1alpha1.ReasonBacklogNotRead, lag.Reason)
	require.Contains(t, lag.Message, "--database-token-logins")
	health, msg := argoHealth(t, relay)
	require.Equal(t, "Healthy", health, msg)
	// Autoscaled to zero, it would never run again: nothing reads its backlog.
	auto := relay.DeepCopy()
	auto.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](0), MaxReplicas: 3, PendingPerReplica: ptr.To[int64](100)}
	idle := &appsv1.Deployment{Spec: appsv1.DeploymentSpec{Replicas: ptr.To[int32](0)}}
	require.Equal(t, int32(1), r.decideReplicas(key, auto, obs, idle), "one replica runs while the backlog is not read")

	r.DatabaseTokenLogins = true
	r.observe(key, relay, in, nil)
	require.Eventually(t, func() bool { return calls.Load() > 0 }, 10*time.Second, 10*time.Millisecond,
		"with --database-token-logins the backlog is read with the operator's identity")
}

// Eighty OutboxRelays on one database through ten DSNs (teams with users
// of their own), two connections: a DSN's readings come together, and its
// session serves them all before it is closed for another DSN's, so logins
// (a process, TLS, SCRAM or a token, a cold catalog cache) stay a small
// fraction of the statements. No relay goes without its readings meanwhile.
func TestObserversReuseSessionsAcrossDSNs(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const dsns, perDSN = 10, 8
	for i := range dsns * perDSN {
		_, err := db.Exec(ctx, outbox.SchemaDDL(outbox.Table{Name: fmt.Sprintf("outbox_%d", i)}))
		require.NoError(t, err)
	}
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	o := NewFlowObserver()
	go func() { _ = o.Start(ctx) }()
	interval := 500 * time.Millisecond
	targets := map[types.NamespacedName]flowTarget{}
	for i := range dsns * perDSN {
		k := types.NamespacedName{Namespace: "ns", Name: fmt.Sprintf("r%d", i)}
		targets[k] = flowTarget{dsn: dsn + sep + fmt.Sprintf("connect_timeout=%d", 5+i%dsns), dsnSecret: "dsn",
			table: outbox.Table{Name: fmt.Sprintf("outbox_%d", i)}, interval: interval}
		o.Observe(k, targets[k])
	}
	require.Eventually(t, func() bool {
		for k, target := range targets {
			if o.Observe(k, target).sample == nil {
				return false
			}
		}
		return true
	}, 20*time.Second, 50*time.Millisecond, "every relay gets its backlog")

	// The server counts the sessions opened in each database (PostgreSQL 14
	// and later) when their backend reports its statistics, at its end at
	// the latest: only the few open at the window's edges may be missed or
	// counted in it late. The test's pool has its connection already.
	sessions := func() int64 {
		var n int64
		require.NoError(t, db.QueryRow(ctx, `SELECT sessions FROM pg_stat_database WHERE datname = current_database()`).Scan(&n))
		return n
	}
	began, before, statements := time.Now(), sessions(), o.queries.Load()
	<-time.After(5 * time.Second) // a window of ten intervals, the readings' own pace
	statements = o.queries.Load() - statements
	opened := sessions() - before
	t.Logf("%d backlog statements and %d new sessions in %s for %d relays over %d DSNs",
		statements, opened, time.Since(began).Round(time.Millisecond), dsns*perDSN, dsns)
	for k, target := range targets {
		v := o.Observe(k, target)
		require.Empty(t, v.lastErr, k.Name)
		require.True(t, v.sample.at.After(began.Add(3*time.Second)), "%s has a recent reading, not one from %s", k.Name, v.sample.at)
	}
	require.Greater(t, statements, int64(dsns*perDSN*5), "the relays are read about every interval")
	require.LessOrEqual(t, opened, statements/5, "sessions opened for the statements run")
}

// A read whose DSN has no connection is passed over by reads of a DSN that
// has one idle (it goes with the turn), but by no more than maxPassedOver
// of them: then it has the next turn, whatever it costs.
func TestTurnsGoByDSNButStarveNone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := newDatabase(1)
	d.open = 1 // a's connection: the cap is reached
	c, err := d.turn(ctx, "a")
	require.NoError(t, err)
	require.Nil(t, c, "no connection is idle yet")
	queued := func(n int) func() bool {
		return func() bool {
			d.mu.Lock()
			defer d.mu.Unlock()
			return len(d.queue) == n
		}
	}
	bTurn := make(chan struct{})
	go func() {
		if _, err := d.turn(ctx, "b"); err == nil {
			close(bTurn)
		}
	}()
	require.Eventually(t, queued(1), 5*time.Second, time.Millisecond)
	conn := &pgx.Conn{} // stands for a's session; never used
	for passed := 0; ; passed++ {
		// Another read of a waits, and a's read ends with its connection kept.
		aTurn := make(chan *pgx.Conn, 1)
		go func() {
			c, _ := d.turn(ctx, "a") // fails only when ctx ends
			aTurn <- c
		}()
		require.Eventually(t, queued(2), 5*time.Second, time.Millisecond)
		d.mu.Lock()
		d.idle["a"] = append(d.idle["a"], idleConn{conn: conn, since: time.Now()})
		d.mu.Unlock()
		d.done("a")
		select {
		case c := <-aTurn:
			require.Same(t, conn, c, "a's connection goes with the turn")
			require.Less(t, passed, maxPassedOver, "b is passed over at most maxPassedOver times")
		case <-bTurn:
			require.Equal(t, maxPassedOver, passed, "b has the turn once passed over maxPassedOver times")
			d.done("b")
			require.Same(t, conn, <-aTurn, "the waiting read of a has the next turn, with a's connection")
			return
		case <-time.After(5 * time.Second):
			t.Fatal("no read has the turn")
		}
	}
}

// A backlog interval lowered is read at the new one at once, with what
// the observer knew: a held row stays held, not pending. Before, the
// observer waited out the wait the old interval had set (up to an hour),
// lag and autoscaling frozen meanwhile.
func TestALowerIntervalIsReadAtOnce(t *testing.T) {
	t.Parallel()
	dsn, db := outboxDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := db.Exec(ctx, outbox.HeldDDL(outboxTable))
	require.NoError(t, err)
	insertRows(t, db, 1, "OrderConfirmed", time.Hour)
	_, err = db.Exec(ctx, `INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		SELECT id, event_id, event_type, 'refused', 'refused', now() + interval '1 hour' FROM outbox`)
	require.NoError(t, err)
	o := NewFlowObserver()
	go func() { _ = o.Start(ctx) }()
	key := types.NamespacedName{Namespace: "ns", Name: "lowered"}
	target := flowTarget{dsn: dsn, dsnSecret: "dsn", table: outboxTable, interval: time.Hour,
		topics: map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders"}}
	var first *backlogSample
	require.Eventually(t, func() bool { first = o.Observe(key, target).sample; return first != nil }, 30*time.Second, 10*time.Millisecond)
	relay, _ := minimalRelay("ns", "lowered")
	require.True(t, first.heldTable, "the first reading finds the held table")
	target.interval = 100 * time.Millisecond
	var again *backlogSample
	require.Eventually(t, func() bool {
		again = o.Observe(key, target).sample
		return again != nil && again.at.After(first.at)
	}, 10*time.Second, 10*time.Millisecond, "read again well within the old hour")
	b := backlogStatus(relay, again)
	require.Zero(t, b.Pending, "the held row is not pending")
	require.Equal(t, int64(1), b.Held.Refused)
}

// A database that does not answer makes each read take its connect
// timeout, so the reads behind them find no turn: they say the database
// cannot be reached, as the reads ahead of them found, not that the
// connections were busy (whose advice, more connections, would add load
// to a database that is down).
func TestASilentDatabaseIsNotCalledBusy(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() { // accepts and never answers
		var held []net.Conn
		defer func() {
			for _, c := range held {
				_ = c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	o := NewFlowObserver()
	o.ConnsPerDatabase = 1
	db, err := o.acquire("postgres://u:p@"+ln.Addr().String()+"/orders?sslmode=disable", nil, dbAuth{})
	require.NoError(t, err)
	defer o.release(db)
	// The first read fails once its connect runs out its time.
	_, err = o.read(context.Background(), db, backlogQuery{table: outbox.Table{Name: "first"}}, 10, 100*time.Millisecond)
	require.Equal(t, "cannot reach PostgreSQL with the DSN in Secret orders-dsn (the operator's log has the error)", backlogError(err, "orders-dsn"))
	const readers = 3 // each takes its connect timeout: the last ones wait past backlogQueryTimeout
	msgs := make(chan string, readers)
	for i := range readers {
		go func() {
			_, err := o.read(context.Background(), db, backlogQuery{table: outbox.Table{Name: fmt.Sprintf("t%d", i)}}, 10, 100*time.Millisecond)
			msgs <- backlogError(err, "orders-dsn")
		}()
	}
	for range readers {
		msg := <-msgs
		require.NotContains(t, msg, "busy")
		require.Contains(t, msg, "cannot reach PostgreSQL with the DSN in Secret orders-dsn")
	}
}
