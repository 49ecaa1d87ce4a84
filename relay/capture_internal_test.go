package relay

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// outboxDB is a new database with the outbox table, and a pool on it.
func outboxDB(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := testenv.PG().NewDatabase(t)
	pool, err := pgxpool.New(context.Background(), dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = pool.Exec(context.Background(), outbox.SchemaDDL(outbox.Table{Name: "outbox"}))
	require.NoError(t, err)
	return dsn, pool
}

// A slot holding back more WAL than MaxRetainedWAL is given up: checkSlot
// says so (errSlotGone, naming the bytes and the limit) and sets the gauge,
// and dropSlot removes it, so the relay polls and later makes a new one.
func TestSlotPastMaxRetainedWALIsGivenUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool, slot := retainingSlot(t, "test_given_up")
	_, _, err := r.checkSlot(ctx, slot, false)
	require.NoError(t, err, "within the default limit")
	r.cfg.MaxRetainedWAL = 1024
	_, _, err = r.checkSlot(ctx, slot, false)
	require.True(t, errors.Is(err, errSlotGone), "%v", err)
	require.ErrorContains(t, err, "more than --max-retained-wal 1024")
	require.Greater(t, testutil.ToFloat64(r.m.slotRetainedWAL), 1024.0)

	r.dropSlot(ctx, slot)
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&left))
	require.Zero(t, left, "the slot is dropped")
	require.Zero(t, testutil.ToFloat64(r.m.slotRetainedWAL), "a dropped slot holds back nothing: the alert that reads the gauge stops")
}

// A sweep can run for minutes (Kafka down, rows piling up, each batch
// failing after its retries), calling keepAlive between its batches: the
// bound on the slot's WAL is checked there too, and a slot past it is
// given up and dropped. Before, only the stream's loop checked it, so the
// WAL grew past the bound for as long as a sweep ran.
func TestKeepAliveChecksTheSlot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool, slot := retainingSlot(t, "test_keepalive")
	conn, err := pgconn.Connect(ctx, r.cfg.DSN)
	require.NoError(t, err)
	s := &streamState{r: r, conn: conn, nextStatus: time.Now().Add(time.Hour), nextAlive: time.Now().Add(time.Hour)}

	require.NoError(t, s.keepAlive(ctx), "within the default limit")
	require.Greater(t, testutil.ToFloat64(r.m.slotRetainedWAL), 1024.0, "it read the slot")
	r.cfg.MaxRetainedWAL = 1024
	require.NoError(t, s.keepAlive(ctx), "checked again only after slotCheckInterval")
	s.nextCheck = time.Now()
	err = s.keepAlive(ctx)
	require.ErrorIs(t, err, errSlotGone)
	require.ErrorContains(t, err, "more than --max-retained-wal 1024")
	require.True(t, conn.IsClosed(), "the stream's session is closed")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&left))
	require.Zero(t, left, "the slot is dropped")
}

// retainingSlot makes a slot named name (and the test server's port)
// behind 2,000 inserts, and a relay (not started) whose capture state names
// it.
func retainingSlot(t *testing.T, name string) (*Relay, *pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	dsn, pool := outboxDB(t)
	slot := fmt.Sprintf("%s_%d", name, testenv.PG().Port)
	_, err := pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot)
	})
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 2000)`)
	require.NoError(t, err)
	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": "t"}}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	r.capture = &captureState{slot: slot, publication: slot}
	return r, pool, slot
}

// captureRelay is a relay with logical replication capture of a database
// of its own (outboxDB), on a topic of the test's for the event type E.
func captureRelay(t *testing.T) (*Relay, *pgxpool.Pool) {
	t.Helper()
	dsn, pool := outboxDB(t)
	topic := testenv.Broker().TopicName(t, "E")
	testenv.Broker().CreateTopic(t, topic, 1)
	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": topic},
		Capture: CaptureLogicalReplication}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r, pool
}

// Making a slot waits until every transaction that had taken an id has
// ended, anywhere on the server: behind a long one the relay waits, and
// /healthz must not call that wait a wedged loop (the pod would be
// restarted for a wait that is not its own, and wait again). Meanwhile it
// polls: it holds the capture lock, so no other replica publishes, and
// before, rows committed during the wait waited as long as the transaction
// ran (0 of 5 published after 15 s).
func TestMakingASlotBehindALongTransactionIsNoWedge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	r.health = newHealth(time.Second, 2*time.Second, time.Now()) // wedged after 2 s

	old, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer old.Rollback(ctx)                               //nolint:errcheck // committed below
	_, err = old.Exec(ctx, `SELECT pg_current_xact_id()`) // the slot waits for it
	require.NoError(t, err)
	require.NoError(t, r.Check(ctx))
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database() AND NOT active`)
	})
	require.Never(t, func() bool { return r.Live() != nil }, 5*time.Second, 50*time.Millisecond, "/healthz passes while the slot waits")
	require.Zero(t, testutil.ToFloat64(r.m.captureStreaming), "the slot still waits for the transaction")
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 5)`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`).Scan(&n) == nil && n == 5
	}, 10*time.Second, 50*time.Millisecond, "rows committed while the slot waits are polled")
	require.Equal(t, 1.0, testutil.ToFloat64(r.m.captureFallback), "polling in the stream's stead says so")
	require.Zero(t, testutil.ToFloat64(r.m.captureStreaming), "the slot still waits for the transaction")
	require.NoError(t, old.Commit(ctx))
	// The slot also waits for other tests' transactions on the server: a
	// stalled claim's runs up to its batch deadline, 25 s.
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.m.captureStreaming) == 1 }, 45*time.Second, 20*time.Millisecond,
		"the relay streams once the transaction ended")
	require.Zero(t, testutil.ToFloat64(r.m.captureFallback))
}

// A sweep of many batches is a loop that moves: /healthz passes through
// it. Before, only the stream's loop and its waits counted, so a sweep of
// a backlog from before the slot (or one large transaction) that outlasted
// a batch's deadline and the stall timeout, about 2.5 minutes by default,
// failed /healthz and the kubelet restarted the relay mid-sweep, again and
// again. Here wedged is 2 s, and the sweep takes 3 s or more.
func TestLongSweepIsNoWedge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	slowBatches(t, r)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 600)`) // before the slot: swept
	require.NoError(t, err)
	require.NoError(t, r.Check(ctx))
	r.health = newHealth(time.Second, 2*time.Second, time.Now()) // wedged after 2 s
	runLogged(t, r, pool)
	unpublished := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n))
		return n
	}
	started := time.Now()
	for unpublished() > 0 {
		require.NoError(t, r.Live(), "/healthz passes through the sweep")
		require.Less(t, time.Since(started), time.Minute, "swept")
		<-time.After(20 * time.Millisecond)
	}
	require.Greater(t, time.Since(started), 2500*time.Millisecond, "the sweep outlasted the wedged limit")
}

// With writer deletes, a large transaction published from the stream is a
// loop that moves too: /healthz passes through it. Before, its batches
// reported no turn of the loop, so a transaction that took longer than
// the wedge limit (150 s by default) failed /healthz, and the kubelet
// restarted the relay
// mid-transaction, which it then streamed again from its start, without
// end. Here wedged is 2 s, and the transaction's 600 rows take 3 s or more.
func TestLargeTransactionWithWriterDeletesIsNoWedge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	r.cfg.WriterDeletes = true
	slowBatches(t, r)
	require.NoError(t, r.Check(ctx))
	r.health = newHealth(time.Second, 2*time.Second, time.Now()) // wedged after 2 s
	runLogged(t, r, pool)
	require.Eventually(t, func() bool {
		on, err := outbox.DeletesOnStore(ctx, pool, outbox.Table{Name: "outbox"})
		return err == nil && on
	}, 30*time.Second, 20*time.Millisecond, "the writers delete on store")
	w, err := outbox.NewWriter("outbox", outbox.WithDeleteOnStore())
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for i := range 600 {
			if err := w.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "O", AggregateID: "a",
				EventType: "E", Payload: fmt.Appendf(nil, `{"n": %d}`, i), PartitionKey: "a"}); err != nil {
				return err
			}
		}
		return nil
	}))
	published := func() float64 { return testutil.ToFloat64(r.m.published.WithLabelValues(r.cfg.Topics["E"])) }
	started := time.Now()
	for published() < 600 {
		require.NoError(t, r.Live(), "/healthz passes through the transaction")
		require.Less(t, time.Since(started), time.Minute, "published")
		<-time.After(20 * time.Millisecond)
	}
	require.Greater(t, time.Since(started), 2500*time.Millisecond, "the transaction outlasted the wedged limit")
}

// A replica whose replication session ends mid-transaction stops
// publishing it within about a second: the capture lock went with the
// session, and another replica may stream the same rows already. Before,
// it went on through the whole transaction (here 1,000 rows, about 5 s),
// the dead session showing only at the stream's next read; a new session
// streamed only once every row was out.
func TestEndedReplicationSessionStopsTheTransactionInHand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	slowBatches(t, r)
	require.NoError(t, r.Check(ctx))
	runLogged(t, r, pool)
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.m.captureStreaming) == 1 }, 20*time.Second, 20*time.Millisecond)
	walsender := func() int {
		var pid int
		_ = pool.QueryRow(ctx, `SELECT COALESCE(max(active_pid), 0) FROM pg_replication_slots WHERE slot_name = $1`, r.capture.slot).Scan(&pid)
		return pid
	}
	first := walsender()
	require.NotZero(t, first)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 1000)`) // one transaction
	require.NoError(t, err)
	published := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return published() >= 50 }, 20*time.Second, 10*time.Millisecond)
	_, err = pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, first)
	require.NoError(t, err)
	var next int
	require.Eventually(t, func() bool {
		next = walsender()
		return next != 0 && next != first
	}, 20*time.Second, 10*time.Millisecond, "a new session streams")
	require.Less(t, published(), 1000, "the new session streams before the old one went through the transaction")
	require.Eventually(t, func() bool { return published() == 1000 }, 30*time.Second, 20*time.Millisecond)
}

// A stream that starts and then fails, every time, is a stream failing:
// past the failing limit the relay polls between its attempts, and its
// backoff grows. Before, any stream that got as far as starting counted
// as working, so a sweep that always failed (here, the table refuses the
// marks), or a publication dropped and made again, kept the relay trying
// to stream every 100 ms for good, never polling or checking its slot.
func TestStreamFailingAfterItStartsFallsBackToPolling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 20)`) // before the slot: swept first
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$;
		CREATE TRIGGER refuse BEFORE UPDATE OR DELETE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse()`)
	require.NoError(t, err)
	require.NoError(t, r.Check(ctx))
	r.capture.failingLimit = 2 * time.Second
	logs := runLogged(t, r, pool)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "streaming failed; streaming again") },
		10*time.Second, 20*time.Millisecond, "the sweep fails")
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "streaming failed; polling, then streaming again") },
		15*time.Second, 20*time.Millisecond, "past the failing limit, the relay polls between its attempts")
}

// A stream that works is no failing one, even on an idle database, where
// no position moves: the walsender ended twice, a healthy idle session
// between, longer than the failing limit, is two failures a session apart,
// not a stream failing all along. Before, only a confirmed position counted
// as working, and the second end made the relay poll, in id order.
func TestIdleStreamIsNoFailingStream(t *testing.T) {
	t.Parallel()
	r, pool, logs := runFailingLimited(t, 2*time.Second)
	streams := func(n int) { waitStreams(t, logs, n) }
	streams(1)
	endWalsender(t, pool, r.capture.slot)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "streaming failed; streaming again") }, 10*time.Second, 20*time.Millisecond)
	streams(2)
	endWalsender(t, pool, r.capture.slot)
	streams(3)
	<-time.After(3 * time.Second) // a healthy session, longer than the failing limit
	endWalsender(t, pool, r.capture.slot)
	<-time.After(time.Second)
	require.NotContains(t, logs.String(), "polling, then streaming again")
}

// Standby time is not failing time: the relay that takes the slot over
// again after a standby longer than the failing limit, and whose stream
// then fails once, streams again. Before, the failing time ran on through
// the standby, and it polled at once, in id order. (failingClock's unit
// test walks through its other rules.)
func TestStandbyTimeEndsAFailingStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool, logs := runFailingLimited(t, 2*time.Second)
	streams := func(n int) { waitStreams(t, logs, n) }
	lock, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer lock.Release()
	streams(1)
	// The walsender ends (a failure), and a test session takes the capture
	// lock before the relay is back: it waits as a standby.
	require.Eventually(t, func() bool {
		_, err := pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active`, r.capture.slot)
		require.NoError(t, err)
		var locked bool
		require.NoError(t, lock.QueryRow(ctx, sqlTryCaptureLock(outbox.QuoteLiteral(r.capture.slot))).Scan(&locked))
		return locked
	}, 20*time.Second, time.Millisecond, "the test takes the capture lock")
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "streaming failed; streaming again") },
		10*time.Second, 20*time.Millisecond)
	<-time.After(3 * time.Second) // a standby, longer than the failing limit
	_, err = lock.Exec(ctx, `SELECT pg_advisory_unlock_all()`)
	require.NoError(t, err)
	streams(2)
	endWalsender(t, pool, r.capture.slot)
	streams(3)
	require.NotContains(t, logs.String(), "polling, then streaming again")
}

// A relay whose stream has failed for the failing limit, and that cannot
// stream again, reports no retained WAL: it reads the slot no more, and
// another replica that streams reports it (the alert takes the largest).
// Before, it kept its last reading for as long as it could not stream.
func TestAFailedStreamReportsNoRetainedWAL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool, logs := runFailingLimited(t, time.Second)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	require.Eventually(t, func() bool {
		_, err := conn.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
			SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 100)`)
		require.NoError(t, err)
		return testutil.ToFloat64(r.m.slotRetainedWAL) > 0
	}, 30*time.Second, 200*time.Millisecond, "the streaming relay reports the slot's retained WAL")

	// No new session reaches the database: the relay cannot stream again.
	refuseSessions(t, r.cfg.DSN)
	_, err = conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active`, r.capture.slot)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "streaming failed") }, 10*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.m.slotRetainedWAL) == 0 },
		10*time.Second, 20*time.Millisecond, "past the failing limit")
	<-time.After(time.Second) // more failed attempts
	require.Zero(t, testutil.ToFloat64(r.m.slotRetainedWAL))
}

// Polling in the stream's stead (a minute after a slot was given up) tries
// again when its session is refused, within the minute. Before, one
// refusal left every row unpublished for the whole minute.
func TestPollingInsteadRetriesARefusedSession(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	require.NoError(t, r.Check(ctx))
	logs := &syncBuffer{}
	r.log = slog.New(slog.NewTextHandler(logs, nil))
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 5)`)
	require.NoError(t, err)
	allow := refuseSessions(t, r.cfg.DSN)
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); r.pollFor(pctx, time.Minute) }()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "cannot take the capture lock") },
		10*time.Second, 20*time.Millisecond, "the session is refused")
	allow()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n))
		return n == 0
	}, 15*time.Second, 50*time.Millisecond, "published within the minute")
}

// refuseSessions makes the database of dsn refuse new sessions (those open
// go on) until the function it returns is called, or the test ends.
func refuseSessions(t *testing.T, dsn string) (allow func()) {
	t.Helper()
	ctx := context.Background()
	cc, err := pgx.ParseConfig(dsn)
	require.NoError(t, err)
	db := pgx.Identifier{cc.Database}.Sanitize()
	cc.Database = "postgres"
	admin, err := pgx.ConnectConfig(ctx, cc)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `ALTER DATABASE `+db+` ALLOW_CONNECTIONS false`)
	require.NoError(t, err)
	var once sync.Once
	allow = func() {
		once.Do(func() {
			_, err := admin.Exec(ctx, `ALTER DATABASE `+db+` ALLOW_CONNECTIONS true`)
			require.NoError(t, err)
			require.NoError(t, admin.Close(ctx))
		})
	}
	t.Cleanup(allow)
	return allow
}

// waitStreams waits for the relay logging to logs to begin its nth
// streaming session: an active slot may still be being made, which waits
// for every transaction open on the server (the other tests'), and ending
// that is a failure to stream, not the end of a session that streamed.
func waitStreams(t *testing.T, logs *syncBuffer, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		return strings.Count(logs.String(), "streaming the table's inserts") >= n
	}, 60*time.Second, 20*time.Millisecond, "session %d streams", n)
}

// endWalsender ends the walsender streaming from slot, once one does.
func endWalsender(t *testing.T, pool *pgxpool.Pool, slot string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE slot_name = $1 AND active`,
			slot).Scan(&n))
		return n == 1
	}, 20*time.Second, 20*time.Millisecond, "a relay streams from the slot")
}

// runFailingLimited runs a captureRelay, checked, whose failing limit is
// limit, until the test ends, and returns what it logs.
func runFailingLimited(t *testing.T, limit time.Duration) (*Relay, *pgxpool.Pool, *syncBuffer) {
	t.Helper()
	r, pool := captureRelay(t)
	require.NoError(t, r.Check(context.Background()))
	r.capture.failingLimit = limit
	return r, pool, runLogged(t, r, pool)
}

// runLogged runs r, checked, until the test ends, its slot dropped then,
// and returns what it logs.
func runLogged(t *testing.T, r *Relay, pool *pgxpool.Pool) *syncBuffer {
	t.Helper()
	ctx := context.Background()
	logs := &syncBuffer{}
	r.log = slog.New(slog.NewTextHandler(logs, nil))
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, r.capture.slot)
	})
	return logs
}

// syncBuffer is a bytes.Buffer safe for a logger and a test at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// pausingWriter pauses before each publish: a slow broker.
// slowBatches makes r publish in batches of 10, each taking 50 ms or more:
// a sweep or a large transaction takes seconds.
func slowBatches(t *testing.T, r *Relay) {
	r.cfg.BatchSize = 10
	w := &kafka.Writer{Addr: kafka.TCP(testenv.Broker().Addr()), RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	t.Cleanup(func() { w.Close() })
	r.writer = pausingWriter{w: w, pause: 50 * time.Millisecond}
}

type pausingWriter struct {
	w     MessageWriter
	pause time.Duration
}

func (p pausingWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	<-time.After(p.pause)
	return p.w.WriteMessages(ctx, msgs...)
}

// A replica that polls in the stream's stead holds the capture lock on a
// session of its own, so that no other replica streams meanwhile. When
// that session ends, the lock goes with it: the replica stops polling
// within about a second (captureLockCheck), instead of polling on for the
// rest of its minute while another replica could stream.
func TestFallbackPollingStopsWhenItsLockSessionEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	require.NoError(t, r.Check(ctx))

	done := make(chan struct{})
	go func() {
		defer close(done)
		r.pollFor(ctx, time.Minute)
	}()
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.m.captureFallback) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the relay polls in the stream's stead")
	_, err := pool.Exec(ctx, `SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.locktype = 'advisory' AND a.datname = current_database() AND a.pid <> pg_backend_pid()`)
	require.NoError(t, err)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the relay polled on after the session holding its capture lock ended")
	}
	require.Zero(t, testutil.ToFloat64(r.m.captureFallback))
}

// One replica at a time publishes what the slot carries: while another
// session holds the slot's capture lock (a replica streaming, or polling
// in the stream's stead), this relay neither streams nor polls in the
// stream's stead; once it is free, its polling publishes.
func TestCaptureLockFencesStreamingAndFallbackPolling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 20)`)
	require.NoError(t, err)
	require.NoError(t, r.Check(ctx))
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, r.capture.slot)
	})
	unpublished := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n))
		return n
	}

	holder, err := pool.Acquire(ctx)
	require.NoError(t, err)
	var held bool
	require.NoError(t, holder.QueryRow(ctx, sqlTryCaptureLock(outbox.QuoteLiteral(r.capture.slot))).Scan(&held))
	require.True(t, held)
	require.ErrorIs(t, r.stream(ctx), errSlotBusy, "no stream while another replica holds the lock")
	r.pollFor(ctx, 3*time.Second)
	require.Equal(t, 20, unpublished(), "no polling in the stream's stead either")
	require.Zero(t, testutil.ToFloat64(r.m.captureFallback))

	holder.Conn().Close(ctx) // the other replica ends: its lock goes with its session
	holder.Release()
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() {
		for pctx.Err() == nil && unpublished() > 0 {
			time.Sleep(20 * time.Millisecond)
		}
		cancel()
	}()
	r.pollFor(pctx, 30*time.Second)
	require.Zero(t, unpublished(), "then the relay polls in the stream's stead")
}

// A sweep's fence is the insert position, except just past a page's
// header, where the stream's position stays at the page's start.
func TestFencePositionStepsBackOverAPageHeader(t *testing.T) {
	const page = 8192
	for _, c := range []struct{ at, want pglogrepl.LSN }{
		{0x3000000 + 5*page + 24, 0x3000000 + 5*page}, // a short header
		{0x3000000 + 40, 0x3000000},                   // a segment's first page: a long header
		{0x3000000 + 5*page, 0x3000000 + 5*page},      // at the page's start
		{0x3000000 + 5*page + 48, 0x3000000 + 5*page + 48},
		{0x3000000 + 5*page + 4000, 0x3000000 + 5*page + 4000},
	} {
		require.Equal(t, c.want, fencePosition(c.at, page), "insert position %s", c.at)
	}
}

// A waiting streamed claim bounds its lock waits and itself, and then sets
// both back to the session's values for the rest of its transaction: the
// mark and the commit that follow must not run under the claim's bounds.
func TestStreamedClaimBoundsOnlyItsOwnWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, _ := outboxDB(t)
	pcfg, err := pgxpool.ParseConfig(dsn)
	require.NoError(t, err)
	pcfg.ConnConfig.RuntimeParams["statement_timeout"] = "30000" // as the relay's sessions start
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // read only
	show := func() (lock, statement string) {
		require.NoError(t, tx.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`).Scan(&lock, &statement))
		return lock, statement
	}
	lock, statement := show()
	require.Equal(t, "30s", statement)
	_, err = tx.Exec(ctx, sqlBoundWaits, "1500")
	require.NoError(t, err)
	l, s := show()
	require.Equal(t, []string{"1500ms", "1500ms"}, []string{l, s}, "the claim's bounds")
	_, err = tx.Exec(ctx, sqlUnboundWaits)
	require.NoError(t, err)
	l, s = show()
	require.Equal(t, []string{lock, statement}, []string{l, s}, "the session's again")
}

// A streamed claim takes the stream's ids in the order given, whether the
// claim finds their order in commitOrder's lookup (ids close together) or
// in the ids themselves (one far from the rest), and a byte budget that
// cuts the claim leaves the ids at the end, never ones in the middle.
func TestClaimIDsTakesTheGivenOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := outboxDB(t)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', jsonb_build_object('pad', repeat('x', 90)), 'a' FROM generate_series(1, 3000)`)
	require.NoError(t, err)
	var first int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT min(id) FROM outbox`).Scan(&first))
	// Commit order interleaves the ids of concurrent writers.
	near := make([]int64, 0, 400)
	for i := range int64(200) {
		near = append(near, first+2*i+1, first+2*i)
	}
	far := append([]int64{first + 2999}, near[:40]...)
	sql := NewSQL(outbox.Table{Name: "outbox"})
	for _, c := range []struct {
		name  string
		ids   []int64
		dense bool
	}{{"close together", near, true}, {"one far from the rest", far, false}} {
		pos, lo := commitOrder(c.ids)
		require.Equal(t, c.dense, pos != nil, "%s: the lookup", c.name)
		for _, budget := range []int{1 << 30, 3000} {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			rows, err := tx.Query(ctx, sql.ClaimIDs, c.ids, []string{"E"}, []int64{}, budget, 1<<20, pos, lo)
			require.NoError(t, err)
			var got []int64
			for rows.Next() {
				v, err := rows.Values()
				require.NoError(t, err)
				got = append(got, v[0].(int64))
			}
			require.NoError(t, rows.Err())
			require.NoError(t, tx.Rollback(ctx))
			want := c.ids
			if budget < 1<<30 {
				require.Less(t, len(got), len(c.ids), "%s: the budget cuts the claim", c.name)
				want = c.ids[:len(got)]
			}
			require.Equal(t, want, got, "%s, budget %d", c.name, budget)
		}
	}
}

// commitOrder places each id at its first place in the list, and gives no
// lookup for ids spread wider than its bound, however far apart they are.
func TestCommitOrderPlacesEachID(t *testing.T) {
	pos, lo := commitOrder([]int64{12, 10, 11, 10})
	require.Equal(t, int64(10), lo)
	require.Equal(t, []int32{2, 3, 1}, pos, "each id's first place, 1-based")
	pos, _ = commitOrder([]int64{1, 2 + denseOrderSpan*2})
	require.Nil(t, pos, "ids spread wider than the bound")
	pos, _ = commitOrder([]int64{math.MinInt64 + 1, math.MaxInt64})
	require.Nil(t, pos, "ids whose difference overflows an int64")
	pos, lo = commitOrder([]int64{-1, 1})
	require.Equal(t, int64(-1), lo)
	require.Equal(t, []int32{1, 0, 2}, pos)
	pos, _ = commitOrder(nil)
	require.Nil(t, pos)
}

// tupleData is pgoutput's TupleData of cols: nil is NULL, toast a TOASTed
// value left unchanged, anything else a text column.
func tupleData(cols ...*string) []byte {
	b := binary.BigEndian.AppendUint16(nil, uint16(len(cols)))
	for _, c := range cols {
		switch {
		case c == nil:
			b = append(b, pglogrepl.TupleDataTypeNull)
		case c == toast:
			b = append(b, pglogrepl.TupleDataTypeToast)
		default:
			b = append(b, pglogrepl.TupleDataTypeText)
			b = binary.BigEndian.AppendUint32(b, uint32(len(*c)))
			b = append(b, *c...)
		}
	}
	return b
}

var toast = new(string)

func str(s string) *string { return &s }

func TestTupleColumnsReadsEachKind(t *testing.T) {
	tuple := tupleData(str("42"), nil, str(""), toast, str(`{"a": 1}`))
	cols, err := tupleColumns(tuple, nil)
	require.NoError(t, err)
	require.Equal(t, [][]byte{[]byte("42"), nil, {}, nil, []byte(`{"a": 1}`)}, cols)
	require.NotNil(t, cols[2], "an empty text is not NULL")
	bin := slices.Clone(tuple)
	bin[2+1+4+2] = pglogrepl.TupleDataTypeBinary // the second column's kind
	bin = slices.Insert(bin, 2+1+4+2+1, 0, 0, 0, 1, 'x')
	cols, err = tupleColumns(bin, cols)
	require.NoError(t, err)
	require.Equal(t, []byte("x"), cols[1], "a binary column's bytes")

	for n := range len(tuple) { // every truncation fails, none reads past the end
		_, err := tupleColumns(tuple[:n], nil)
		require.Error(t, err, "%d of %d bytes", n, len(tuple))
	}
	bad := slices.Clone(tuple)
	bad[2] = 'z'
	_, err = tupleColumns(bad, nil)
	require.ErrorContains(t, err, `column 1 of 5 is of kind 'z'`)
	long := slices.Clone(tuple)
	binary.BigEndian.PutUint32(long[3:], math.MaxUint32)
	_, err = tupleColumns(long, nil)
	require.ErrorContains(t, err, "it ends within column 1 of 5")
}

// A row that the transaction inserting it deletes, without writer deletes,
// is put back as the stream delivered it, even after the stream's buffer
// has been reused by the messages after it.
func TestStreamKeepsTheRowsItsTransactionDeletes(t *testing.T) {
	r := &Relay{cfg: Config{Settings: Settings{BatchSize: 100, MaxBatchBytes: 1 << 20}}, capture: &captureState{txTupleLimit: maxTxTuples},
		log: slog.New(slog.DiscardHandler)}
	r.capture.oid.Store(7)
	s := &streamState{r: r, rels: takes(7, "id", "payload", "note")}
	buf := make([]byte, 0, 256) // one buffer for every message, as pgconn's
	feed := func(msg []byte) {
		buf = append(buf[:0], msg...)
		require.NoError(t, s.decode(context.Background(), buf))
		clear(buf) // the next message's bytes
	}
	change := func(kind, tupleKind byte, rel uint32, tuple []byte) []byte {
		return append(binary.BigEndian.AppendUint32([]byte{kind}, rel), append([]byte{tupleKind}, tuple...)...)
	}
	feed(append([]byte{'B'}, make([]byte, 20)...))
	feed(change('I', 'N', 7, tupleData(str("1"), str(`{"n": 1}`), nil)))
	feed(change('I', 'N', 7, tupleData(str("2"), str(`{"n": 2}`), str("gone"))))
	feed(change('I', 'N', 8, tupleData(str("3"), str(`{"n": 3}`), nil))) // another table's
	feed(change('I', 'N', 7, tupleData(str("4"), str(`{"n": 4}`), str(""))))
	feed(change('D', 'K', 7, tupleData(str("2"), nil, nil)))
	feed(change('D', 'K', 7, tupleData(str("99"), nil, nil))) // a row of an earlier transaction
	require.Empty(t, s.pending, "nothing before the commit")
	feed(append([]byte{'C'}, make([]byte, 25)...))

	require.Equal(t, []int64{1, 2, 4}, s.pending, "the table's rows in the order they came")
	require.Len(t, s.restore, 1)
	x := s.restore[0]
	require.Equal(t, int64(2), x.id)
	require.Equal(t, []string{"id", "payload", "note"}, x.names)
	require.Equal(t, []*string{str("2"), str(`{"n": 2}`), str("gone")}, x.text)

	err := s.decode(context.Background(), change('I', 'N', 7, tupleData(str("x"))))
	require.ErrorContains(t, err, `the stream's id "x"`)
	err = s.decode(context.Background(), change('I', 'N', 7, tupleData(str("5"))[:4]))
	require.ErrorContains(t, err, `decode pgoutput 'I' message: it ends within column 1 of 1`)
	require.ErrorContains(t, s.decode(context.Background(), nil), "an empty message")

	// A large transaction's copy is not kept once it committed.
	s.pending = s.pending[:0]
	feed(append([]byte{'B'}, make([]byte, 20)...))
	big := str(strings.Repeat("x", maxKeptTxRaw/4))
	for id := range 5 {
		feed(change('I', 'N', 7, tupleData(str(fmt.Sprint(10+id)), big, nil)))
	}
	require.Greater(t, cap(s.txRaw), maxKeptTxRaw)
	feed(append([]byte{'C'}, make([]byte, 25)...))
	require.Equal(t, []int64{10, 11, 12, 13, 14}, s.pending)
	require.Zero(t, cap(s.txRaw), "released")
}

// takes is a stream's relations when it takes relation rel alone, whose
// first column is the id.
func takes(rel uint32, names ...string) map[uint32]streamRelation {
	return map[uint32]streamRelation{rel: {idCol: 0, names: names}}
}

// relation is pgoutput's Relation message of relation rel, named
// namespace.name, with text columns names.
func relation(rel uint32, namespace, name string, names ...string) []byte {
	b := binary.BigEndian.AppendUint32([]byte{'R'}, rel)
	b = append(append(b, namespace...), 0)
	b = append(append(b, name...), 0)
	b = binary.BigEndian.AppendUint16(append(b, 'd'), uint16(len(names)))
	for _, n := range names {
		b = append(append(append(b, 0), n...), 0)
		b = binary.BigEndian.AppendUint32(b, 25) // text
		b = binary.BigEndian.AppendUint32(b, math.MaxUint32)
	}
	return b
}

// The stream keeps every relation it takes: pgoutput sends a relation's
// message once a session, and again when the relation changed, so the
// changes after an earlier table's message may be the table now's. Here
// the table was replaced (the earlier one renamed away, 7, the table now
// 8); a transaction deletes the earlier table's rows after the table now's
// message came, and the table now's next insert comes without one. Before,
// the stream kept only the last relation sent, and left that insert out: a
// row its writer deleted was lost, one it kept waited for the sweep.
func TestStreamKeepsEachRelationItTakes(t *testing.T) {
	r := &Relay{cfg: Config{Settings: Settings{BatchSize: 100, MaxBatchBytes: 1 << 20}},
		capture: &captureState{txTupleLimit: maxTxTuples, namespace: "public", relations: map[uint32]bool{7: true, 8: true}},
		table:   outbox.Table{Schema: "public", Name: "outbox"}, log: slog.New(slog.DiscardHandler)}
	r.capture.oid.Store(8)
	s := &streamState{r: r}
	feed := func(msgs ...[]byte) {
		for _, m := range msgs {
			require.NoError(t, s.decode(context.Background(), m))
		}
	}
	insert := func(rel uint32, id int) []byte {
		return append(binary.BigEndian.AppendUint32([]byte{'I'}, rel), append([]byte{'N'}, tupleData(str(fmt.Sprint(id)), str("{}"))...)...)
	}
	del := func(rel uint32, id int) []byte {
		return append(binary.BigEndian.AppendUint32([]byte{'D'}, rel), append([]byte{'K'}, tupleData(str(fmt.Sprint(id)), nil)...)...)
	}
	feed(begin(0x100, 1), relation(8, "public", "outbox", "id", "payload"), insert(8, 1), commit(0x100))
	feed(begin(0x200, 2), relation(7, "public", "outbox_old", "id", "payload"), insert(7, 50), del(7, 50), del(7, 40), commit(0x200))
	feed(begin(0x300, 3), insert(8, 2), del(8, 2), insert(8, 3), commit(0x300))
	require.Equal(t, []int64{1, 50, 2, 3}, s.pending, "the table now's inserts after the earlier table's message are read")
	var restored []int64
	for _, x := range s.restore {
		restored = append(restored, x.id)
	}
	require.Equal(t, []int64{50, 2}, restored, "the rows the writers deleted, of each table, are put back")
	require.True(t, s.restore[0].earlier)
	require.False(t, s.restore[1].earlier)
}

// A delete is matched with the insert of its own table: the tables of the
// name may share ids (a new table's start over), and a migration copies
// the rows it keeps into the table now and deletes them from the earlier
// one in one transaction. Before, a delete matched an insert of either
// table by id: with writer deletes the copy was published from the stream
// and again by the sweep; without, a row its writer kept in the earlier
// table went back into the table now and out.
func TestStreamMatchesADeleteWithItsOwnTablesInsert(t *testing.T) {
	cols := []string{"id", "event_id", "aggregate_type", "aggregate_id", "event_type", "payload", "partition_key", "created_at"}
	row := func(kind byte, rel uint32, id int) []byte {
		tuple := tupleData(str(fmt.Sprint(id)), str(fmt.Sprintf("0193a0b4-0000-7000-8000-%012d", id)), str("Order"), str("o1"), str("E"),
			str("{}"), str("o1"), str("2026-12-01 00:00:00+00"))
		if kind == 'D' {
			tuple = tupleData(str(fmt.Sprint(id)), nil, nil, nil, nil, nil, nil, nil)
			return append(binary.BigEndian.AppendUint32([]byte{'D'}, rel), append([]byte{'K'}, tuple...)...)
		}
		return append(binary.BigEndian.AppendUint32([]byte{'I'}, rel), append([]byte{'N'}, tuple...)...)
	}
	for _, writerDeletes := range []bool{false, true} {
		t.Run(fmt.Sprintf("writer deletes %v", writerDeletes), func(t *testing.T) {
			r := &Relay{cfg: Config{Settings: Settings{BatchSize: 100, MaxBatchBytes: 1 << 20, WriterDeletes: writerDeletes}},
				capture: &captureState{txTupleLimit: maxTxTuples, namespace: "public", relations: map[uint32]bool{7: true, 8: true}},
				table:   outbox.Table{Schema: "public", Name: "outbox"}, log: slog.New(slog.DiscardHandler)}
			r.capture.oid.Store(8)
			s := &streamState{r: r}
			for _, m := range [][]byte{begin(0x100, 1), relation(8, "public", "outbox", cols...), relation(7, "public", "outbox_old", cols...),
				row('I', 8, 60), row('D', 7, 60), // copied into the table now, deleted from the earlier one
				row('I', 7, 61), row('D', 8, 61), // kept in the earlier table; the table now's row 61 deleted
				row('I', 8, 62), row('D', 8, 62), // deleted by the writer that inserted it
				row('I', 7, 70), row('D', 7, 70), row('I', 8, 70), // one id in both tables, the earlier one's deleted
				commit(0x100)} {
				require.NoError(t, s.decode(context.Background(), m))
			}
			if writerDeletes {
				deleted := map[relRow]bool{}
				for _, x := range s.pendRows {
					deleted[relRow{rel: x.rel, id: x.id}] = x.deleted
				}
				require.Equal(t, map[relRow]bool{{8, 60}: false, {7, 61}: false, {8, 62}: true, {7, 70}: true, {8, 70}: false}, deleted,
					"only the row its own table's delete names is in no table")
				return
			}
			var restored []relRow
			at := map[relRow]int{}
			for _, x := range s.restore {
				restored = append(restored, relRow{rel: x.rel, id: x.id})
				at[relRow{rel: x.rel, id: x.id}] = x.pendingAt
			}
			require.Equal(t, []relRow{{8, 62}, {7, 70}}, restored, "only the rows their own table's deletes name are put back")
			require.Equal(t, []int64{60, 62, 70, 70}, s.pending, "the row kept in the earlier table stays there")
			require.Equal(t, map[relRow]int{{8, 62}: 1, {7, 70}: 2}, at, "each put back in its own place, the earlier table's 70 before the table now's")
		})
	}
}

// begin and commit are pgoutput's messages of a transaction's begin and
// commit, for transaction xid whose commit is at lsn.
func begin(lsn pglogrepl.LSN, xid uint32) []byte {
	b := binary.BigEndian.AppendUint64([]byte{'B'}, uint64(lsn))
	b = binary.BigEndian.AppendUint64(b, 0)
	return binary.BigEndian.AppendUint32(b, xid)
}

func commit(lsn pglogrepl.LSN) []byte {
	b := binary.BigEndian.AppendUint64([]byte{'C', 0}, uint64(lsn))
	b = binary.BigEndian.AppendUint64(b, uint64(lsn)+8)
	return binary.BigEndian.AppendUint64(b, 0)
}

// Without writer deletes the stream keeps a transaction's insert tuples,
// in case it deletes the rows, only up to the capture's limit, and past it
// only the ids, which is all the claim needs: a transaction of any size
// streams in the limit's memory. Before, it kept every tuple until the
// commit, so a bulk backfill needed its whole size in memory, and a pod
// sized for batches was killed for it, again at each restart. A
// transaction that deletes a row past the limit, whose tuple is gone, is
// read again, keeping that row's tuple: the stream ends (errReadAgain),
// and on the next reading the row is restored with the ones deleted
// within the limit.
func TestStreamKeepsATransactionsTuplesUpToTheLimit(t *testing.T) {
	const limit = 4096
	r := &Relay{cfg: Config{Settings: Settings{BatchSize: 1000, MaxBatchBytes: 1 << 30}}, capture: &captureState{txTupleLimit: limit},
		log: slog.New(slog.DiscardHandler)}
	r.capture.oid.Store(7)
	s := &streamState{r: r, rels: takes(7, "id", "payload")}
	buf := make([]byte, 0, 512)
	feed := func(msg []byte) error {
		buf = append(buf[:0], msg...)
		err := s.decode(context.Background(), buf)
		clear(buf) // the next message's bytes
		return err
	}
	insert := func(id int) []byte {
		payload := fmt.Sprintf(`{"n": %d, "pad": %q}`, id, strings.Repeat("x", 200))
		return append(binary.BigEndian.AppendUint32([]byte{'I'}, 7), append([]byte{'N'}, tupleData(str(fmt.Sprint(id)), str(payload))...)...)
	}
	del := func(id int) []byte {
		return append(binary.BigEndian.AppendUint32([]byte{'D'}, 7), append([]byte{'K'}, tupleData(str(fmt.Sprint(id)), nil)...)...)
	}
	const rows = 200 // about 50 KiB of tuples
	var want []int64
	require.NoError(t, feed(begin(0x1000, 41)))
	for id := 1; id <= rows; id++ {
		require.NoError(t, feed(insert(id)))
		want = append(want, int64(id))
		require.LessOrEqual(t, cap(s.txRaw), limit, "the tuples kept stay within the limit (row %d)", id)
	}
	require.Less(t, len(s.txIns), rows/4, "only the first rows' tuples are kept")
	require.NoError(t, feed(commit(0x1000)))
	require.Equal(t, want, s.pending, "every row, in the order they came")
	require.Empty(t, s.restore)

	// A transaction deleting a row within the limit and two past it.
	s.pending = s.pending[:0]
	msgs := [][]byte{begin(0x2000, 42)}
	for id := 1001; id <= 1000+rows; id++ {
		msgs = append(msgs, insert(id))
	}
	msgs = append(msgs, del(1002), del(1150), del(7), del(1199), commit(0x2000)) // 7: a row of an earlier transaction
	for _, m := range msgs[:len(msgs)-1] {
		require.NoError(t, feed(m))
	}
	err := feed(msgs[len(msgs)-1])
	require.ErrorIs(t, err, errReadAgain)
	require.ErrorContains(t, err, "transaction 42 (commit 0/2000) deleted 2 rows it inserted past the 4096 bytes")
	require.Equal(t, []int64{1150, 1199}, r.capture.rereads[0x2000].ids)

	// The next stream starts before it and reads it again.
	s = &streamState{r: r, rels: takes(7, "id", "payload")}
	for _, m := range msgs {
		require.NoError(t, feed(m))
	}
	require.Len(t, s.pending, rows)
	var restored []int64
	for _, x := range s.restore {
		restored = append(restored, x.id)
	}
	require.Equal(t, []int64{1002, 1150, 1199}, restored, "each row it deleted, to put back")
	require.Equal(t, []*string{str("1150"), str(fmt.Sprintf(`{"n": 1150, "pad": %q}`, strings.Repeat("x", 200)))}, s.restore[1].text)
	require.Less(t, cap(s.txRaw), 2*limit, "the limit's tuples and the two deleted rows'")
	require.Contains(t, r.capture.rereads, pglogrepl.LSN(0x2000), "until the slot is confirmed past it")

	s.confirmed = 0x2008
	require.NoError(t, feed(begin(0x3000, 43)))
	require.Empty(t, r.capture.rereads, "forgotten once confirmed past")
}

// An idle stream on a busy server is not a stall. While other tables
// write, the server sends keepalives many times a second, so the stream's
// reads time out only when its own slot check or status report is due
// (every 5 s and 10 s): a stream that counted only a read that timed out
// as idle reported no_progress past a stall timeout that short, with
// nothing to publish. Each message that leaves nothing waiting counts.
func TestIdleStreamOnABusyServerIsNotAStall(t *testing.T) {
	t0 := time.Now().Add(-time.Minute)
	r := &Relay{health: newHealth(5*time.Second, time.Hour, t0)}
	r.health.batchDone(t0, 1, 0) // a row claimed and not published, a minute ago
	s := &streamState{r: r}
	keepalive := &pgproto3.CopyData{Data: append([]byte{pglogrepl.PrimaryKeepaliveMessageByteID}, make([]byte, 17)...)}

	s.pending = []int64{1}
	require.NoError(t, s.handle(context.Background(), keepalive))
	require.Contains(t, r.health.stalls(time.Now()), StallNoProgress, "a row waits: the stall stays")

	s.pending = nil
	s.inTx = true
	require.NoError(t, s.handle(context.Background(), keepalive))
	require.Contains(t, r.health.stalls(time.Now()), StallNoProgress, "a transaction is being read: the stall stays")

	s.inTx = false
	require.NoError(t, s.handle(context.Background(), keepalive))
	require.Empty(t, r.health.stalls(time.Now()), "nothing waits: the stream is idle")

	// A failing batch (a flush the stream replays) stays failing: an idle
	// message between its tries is no batch completed.
	r.health.batchFailed(t0, errors.New("put back: refused"))
	require.NoError(t, s.handle(context.Background(), keepalive))
	require.Contains(t, r.health.stalls(time.Now()), StallBatchFailing, "the failure stays")
}

// bigTxRelay is captureRelay streaming with a tuple limit of 4 KiB, about
// a dozen of the rows storeBig writes, and what it logs.
func bigTxRelay(t *testing.T) (*Relay, *pgxpool.Pool, *syncBuffer) {
	t.Helper()
	ctx := context.Background()
	r, pool := captureRelay(t)
	require.NoError(t, r.Check(ctx))
	r.capture.txTupleLimit = 4096
	logs := runLogged(t, r, pool)
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.m.captureStreaming) == 1 }, 30*time.Second, 20*time.Millisecond, "the relay streams")
	return r, pool, logs
}

// storeBig stores n events in one transaction, deletes those of dels (by
// their index) in it, as a writer with writer deletes does, runs before
// its commit (unless nil), and returns the events' ids in the order they
// were stored.
func storeBig(t *testing.T, pool *pgxpool.Pool, n int, before func(), dels ...int) []string {
	t.Helper()
	ctx := context.Background()
	ids := make([]string, n)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		defer func() {
			if before != nil {
				before()
			}
		}()
		for i := range ids {
			ids[i] = outbox.NewEventID()
			if _, err := tx.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
				VALUES ($1, 'O', 'a', 'E', $2, 'a')`, ids[i], fmt.Sprintf(`{"n": %d, "pad": %q}`, i, strings.Repeat("x", 200))); err != nil {
				return err
			}
		}
		for _, i := range dels {
			if _, err := tx.Exec(ctx, `DELETE FROM outbox WHERE event_id = $1`, ids[i]); err != nil {
				return err
			}
		}
		return nil
	}))
	return ids
}

// consumedEventIDs are the event ids of topic's first n records, in the
// topic's order.
func consumedEventIDs(t *testing.T, topic string, n int) []string {
	t.Helper()
	var ids []string
	for _, m := range testenv.Broker().Consume(t, topic, n, 30*time.Second) {
		for _, h := range m.Headers {
			if h.Key == HeaderEventID {
				ids = append(ids, string(h.Value))
			}
		}
	}
	return ids
}

// A transaction whose inserts are far past the stream's tuple limit, with
// no deletes, streams without reading it again: each row once, in commit
// order, between the transactions around it.
func TestStreamPublishesATransactionPastTheTupleLimit(t *testing.T) {
	t.Parallel()
	r, pool, logs := bigTxRelay(t)
	want := storeBig(t, pool, 1, nil)
	want = append(want, storeBig(t, pool, 300, nil)...)
	want = append(want, storeBig(t, pool, 1, nil)...)
	require.Equal(t, want, consumedEventIDs(t, r.cfg.Topics["E"], len(want)), "each row once, in commit order")
	require.NotContains(t, logs.String(), "reading again")
}

// A transaction past the stream's tuple limit that deletes rows it
// inserted, within the limit and past it, against a relay without writer
// deletes: the rows past it, whose tuples the stream did not keep, are
// read again from the slot, and every row, the deleted ones put back,
// goes out once, in commit order, with the rows of the transactions
// committed before it (one just before its commit, read with it) and
// after it.
func TestStreamReadsAgainATransactionDeletingRowsPastTheTupleLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool, logs := bigTxRelay(t)
	want := storeBig(t, pool, 2, nil)
	var just []string
	big := storeBig(t, pool, 300, func() { just = storeBig(t, pool, 2, nil) }, 3, 150, 151, 299)
	want = append(append(want, just...), big...)
	want = append(want, storeBig(t, pool, 1, nil)...)
	require.Equal(t, want, consumedEventIDs(t, r.cfg.Topics["E"], len(want)), "each row once, in commit order")
	require.Contains(t, logs.String(), "streaming again from the slot's confirmed position to read it again")
	require.Contains(t, logs.String(), "reading again a transaction that deleted rows it inserted")
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`).Scan(&n))
	require.Equal(t, len(want), n, "the deleted rows are back in the table, published")
}

// A row put back while the stream still knows the table by a relation
// since dropped (the table was dropped and made again, and the stream has
// not read the new table's relation yet) goes into the table that has the
// name now, as that table's columns stand. A row whose id the new table
// gave another event, and a row of the earlier table (its id is of that
// table's sequence, which the new one's may yet reach), go back under new
// ids; put back again, none is doubled. Before, the put-back read the
// columns of the dropped relation, found none, and failed at every retry,
// so the stream stalled behind the row; and a row whose id was taken was
// left out (ON CONFLICT DO NOTHING), its event lost.
func TestPutBackGoesIntoTheTableThatHasTheNameNow(t *testing.T) {
	t.Parallel()
	for name, ddl := range map[string]string{
		"plain":         outbox.SchemaDDL(outbox.Table{Name: "outbox"}),
		"partitioned":   outbox.PartitionedSchemaDDL(outbox.Table{Name: "outbox"}, outbox.PartitionDay, 1),
		"text event_id": outbox.SchemaDDL(outbox.Table{Name: "outbox"}) + `; ALTER TABLE outbox ALTER COLUMN event_id TYPE text`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			r, pool := captureRelay(t)
			require.NoError(t, r.Check(ctx))
			_, err := pool.Exec(ctx, `DROP TABLE outbox; `+ddl+`;
				INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
				VALUES (gen_random_uuid(), 'Order', 'o1', 'E', '{}', 'o1', now() - interval '1 minute')`) // id 1, another event's
			require.NoError(t, err)
			names := []string{"id", "event_id", "aggregate_type", "aggregate_id", "event_type", "payload", "partition_key", "created_at", "published_at", "headers"}
			now := time.Now().UTC().Format("2006-01-02 15:04:05+00")
			row := func(id int64, event string) streamedRow {
				return tupleText(id, names, [][]byte{fmt.Appendf(nil, "%d", id), []byte(event), []byte("Order"), []byte("o2"),
					[]byte("E"), []byte(`{"n": 1}`), []byte("o2"), []byte(now), nil, nil})
			}
			// Row 7 twice: ids that started over between two of the
			// stream's transactions.
			taken, free, twin, earlier := row(1, "0193a0b4-0000-7000-8000-000000000001"), row(7, "0193a0b4-0000-7000-8000-000000000007"),
				row(7, "0193a0b4-0000-7000-8000-000000000008"), row(9, "0193a0b4-0000-7000-8000-000000000009")
			earlier.earlier = true
			rows := []streamedRow{taken, free, twin, earlier}
			moved, err := r.restoreDeleted(ctx, rows)
			require.NoError(t, err)
			require.Len(t, moved, 3)
			to := map[string]int64{}
			for _, m := range moved {
				to[m.eventID] = m.to
				require.NotEqual(t, m.from, m.to)
			}
			require.Equal(t, []int64{1, 7, 9}, []int64{moved[0].from, moved[1].from, moved[2].from})
			var ids []int64
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				res, err := tx.Query(ctx, `SELECT id FROM outbox WHERE event_id::text = ANY($1) ORDER BY event_id`,
					[]string{taken.column("event_id"), free.column("event_id"), twin.column("event_id"), earlier.column("event_id")})
				if err != nil {
					return err
				}
				ids, err = pgx.CollectRows(res, pgx.RowTo[int64])
				return err
			}))
			require.Equal(t, []int64{to[taken.column("event_id")], 7, to[twin.column("event_id")], to[earlier.column("event_id")]}, ids,
				"the rows whose ids were taken and the earlier table's went back under new ids, the other under its own")

			// Put back again (a stream that reads them again), none is
			// doubled, and the moved ones are found under their new ids.
			again, err := r.restoreDeleted(ctx, rows)
			require.NoError(t, err)
			require.Equal(t, moved, again)
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n))
			require.Equal(t, 5, n)
		})
	}
}

// The silence check finds the stream's own session on the server, by its
// pid and its start, and a healthy one waits (for WAL or for its client),
// so it is not taken for busy. A session of that pid that began at another
// time (another replica's on a new primary, the pid reused) is not found,
// so the check never ends it.
func TestTheSilenceCheckFindsTheStreamsOwnSession(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, pool := captureRelay(t)
	require.NoError(t, r.Check(ctx))
	runLogged(t, r, pool)
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.m.captureStreaming) == 1 }, 45*time.Second, 20*time.Millisecond,
		"the relay streams")
	pid, start := r.capture.streamPID, r.capture.streamStart
	require.NotZero(t, pid)
	require.NotZero(t, start)
	require.Eventually(t, func() bool {
		var event string
		return pool.QueryRow(ctx, sqlStreamSession, r.capture.slot, pid, start).Scan(&event) == nil && walSenderWaiting(event)
	}, 10*time.Second, 50*time.Millisecond, "the stream's session is found, waiting")
	var event string
	require.ErrorIs(t, pool.QueryRow(ctx, sqlStreamSession, r.capture.slot, pid, start+1).Scan(&event), pgx.ErrNoRows,
		"a session of that pid that began at another time is not the stream's")
	var ended bool
	require.NoError(t, pool.QueryRow(ctx, sqlEndStreamSession, r.capture.slot, pid, start+1).Scan(&ended))
	require.False(t, ended, "nor is it ended")
}

// A publication's other table is refused only when a relay of it would
// name its slot as this one: by its name with or without its schema, and
// only when a relay may take it (a plain lower-case name).
func TestFoldsToSlotRefusesOnlyATableARelayWouldShareTheSlotWith(t *testing.T) {
	slot := outbox.SlotName("db", outbox.Table{Schema: "a", Name: "b"}) // outbox_db_a_b
	taken, extra := foldsToSlot("db", slot,
		[]string{`public."Outbox"`, "public.a_b", "public.outbox_old", "archive.a_b", `"A".b`, `"MyApp".a_b`},
		[]string{"public", "public", "public", "archive", "A", "MyApp"},
		[]string{"Outbox", "a_b", "outbox_old", "a_b", "b", "a_b"})
	require.NotNil(t, taken)
	require.Equal(t, "public.a_b", *taken, "a relay of a_b names its slot outbox_db_a_b")
	require.Equal(t, []string{`public."Outbox"`, "public.outbox_old", `"A".b`}, extra,
		"no relay takes an upper-case name, and outbox_old folds to another slot; archive.a_b and \"MyApp\".a_b (a_b on a search path) are collisions too, not extras")
	taken, extra = foldsToSlot("db", slot, nil, nil, nil)
	require.Nil(t, taken)
	require.Empty(t, extra)
}

// A relay without writer deletes removes the writer-deletes mark only
// while its own session streams from the slot: one whose session ended a
// moment ago may have let a relay with writer deletes take the slot and
// mark the publication, and its removal would let the next relay without
// them give the slot up. Other notes stay.
func TestMarkIsRemovedOnlyWhileTheRemoverStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, pool := outboxDB(t)
	pub := fmt.Sprintf("test_unmark_%d", testenv.PG().Port)
	_, err := pool.Exec(ctx, `CREATE PUBLICATION `+pub)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP PUBLICATION `+pub) })
	// A slot is the server's, not the database's: one a killed run left.
	_, _ = pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, pub)
	_, err = pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, pub)
	require.NoError(t, err)
	t.Cleanup(func() { // once the walsender below has ended
		require.Eventually(t, func() bool {
			_, err := pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, pub)
			return err == nil
		}, 10*time.Second, 20*time.Millisecond)
	})
	_, err = pool.Exec(ctx, sqlSetNote(pub, outbox.WriterDeletesMark, outbox.WriterDeletesMark))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, sqlSetNote(pub, beforeSlotNote, beforeSlotNote+" xmax=1 xip="))
	require.NoError(t, err)
	comment := func() string {
		var c string
		require.NoError(t, pool.QueryRow(ctx, `SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1`, pub).Scan(&c))
		return c
	}
	var pid int32
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = pool.Exec(ctx, sqlUnmarkWhileStreaming(pub, pub, pid))
	require.NoError(t, err)
	require.Contains(t, comment(), outbox.WriterDeletesMark, "no session streams from the slot: the mark stays")

	// The slot's session: a replication connection streaming from it.
	cfg, err := pgconn.ParseConfig(dsn)
	require.NoError(t, err)
	cfg.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	require.NoError(t, pglogrepl.StartReplication(ctx, conn, pub, 0, pglogrepl.StartReplicationOptions{PluginArgs: []string{"proto_version '1'", "publication_names '" + pub + "'"}}))
	require.Eventually(t, func() bool {
		var active int32
		_ = pool.QueryRow(ctx, `SELECT COALESCE(active_pid, 0) FROM pg_replication_slots WHERE slot_name = $1`, pub).Scan(&active)
		pid = active
		return active != 0
	}, 10*time.Second, 10*time.Millisecond)
	_, err = pool.Exec(ctx, sqlUnmarkWhileStreaming(pub, pub, pid+1))
	require.NoError(t, err)
	require.Contains(t, comment(), outbox.WriterDeletesMark, "another session streams: the mark stays")
	_, err = pool.Exec(ctx, sqlUnmarkWhileStreaming(pub, pub, pid))
	require.NoError(t, err)
	require.Equal(t, beforeSlotNote+" xmax=1 xip=", comment(), "the streaming session removes the mark, and only it")
}

// A streamed insert the relay cannot read says which of its faults it has,
// naming the table. Before, one message named both, and no table.
func TestADecodedRowNamesItsFault(t *testing.T) {
	rel := &pglogrepl.RelationMessage{Namespace: "shop", RelationName: "outbox"}
	for _, name := range []string{"id", "event_id", "aggregate_type", "aggregate_id", "event_type", "payload", "partition_key", "created_at"} {
		rel.Columns = append(rel.Columns, &pglogrepl.RelationMessageColumn{Name: name})
	}
	c, err := newStreamColumns(rel, "")
	require.NoError(t, err)
	cols := [][]byte{nil, []byte("e"), []byte("O"), []byte("a"), []byte("E"), []byte("{}"), []byte("k"), []byte("2026-01-01 00:00:00+00")}
	_, err = c.decodeRow(cols)
	require.EqualError(t, err, "the stream's insert into shop.outbox has a NULL id")
	_, err = c.decodeRow(cols[:7])
	require.EqualError(t, err, "the stream's insert into shop.outbox has 7 columns, its relation message 8")
}

// A replica's failing time is its own: standby time between its failures
// does not count, however long, and two replicas whose streams fail alike
// each reach the limit and poll.
func TestFailingClockCountsOnlyTheReplicasOwnTime(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }

	// One failure, a standby shorter than the limit, a takeover whose
	// stream fails: its own time, not the standby's.
	var c failingClock
	c.active(at(0), streamFailingLimit)
	require.Equal(t, time.Duration(0), c.failed(at(0)))
	for s := 1.0; s < 20; s += 1.5 {
		c.standby(at(s))
	}
	c.active(at(20), streamFailingLimit)
	require.Equal(t, 2*time.Second, c.failed(at(21)), "its wait from the failure to the standby, 1 s, and 1 s after it")

	// Nearly the limit of its own, then hours of standby while another
	// replica streamed: a takeover whose stream fails starts again.
	c.failed(at(50))
	for s := 51.0; s < 7200; s += 1.5 {
		c.standby(at(s))
	}
	c.active(at(7200), streamFailingLimit)
	require.Equal(t, time.Duration(0), c.failed(at(7201)), "its first failure")
	require.Equal(t, time.Second, c.failed(at(7202)))

	// Two replicas failing alike, in turns: each attempt fails within
	// 0.1 s, its backoff (doubling to 5 s) counts, the other's turn does
	// not. The replica's own time passes the 30 s limit.
	var a failingClock
	now, backoff, failed := 0.0, 0.1, time.Duration(0)
	for range 12 {
		a.active(at(now), streamFailingLimit)
		failed = a.failed(at(now + 0.1))
		now += 0.1 + backoff // its own attempt and wait
		backoff = min(2*backoff, 5)
		a.standby(at(now)) // the other replica's turn
		now += 3
	}
	require.GreaterOrEqual(t, failed, streamFailingLimit, "its own failing time reaches the limit")
	require.Less(t, failed, 50*time.Second, "the other's turns are not counted")

	// Progress, or a new slot, starts it again.
	a.reset()
	a.active(at(now), streamFailingLimit)
	require.Equal(t, time.Duration(0), a.failed(at(now)))
}
