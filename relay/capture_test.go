package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// captureFixture is a fixture whose relays stream (--capture
// logical-replication); the test's slot goes with its database.
func captureFixture(t *testing.T, partitions int, eventTypes ...string) (*outboxtest.Fixture, relay.Config) {
	f := outboxtest.NewFixture(t, partitions, eventTypes...)
	t.Cleanup(func() { // after the relays stop (cleanups run last registered first)
		require.Eventually(t, func() bool {
			_, err := f.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
				WHERE database = current_database() AND NOT active`)
			return err == nil && f.Count(`SELECT count(*) FROM pg_replication_slots WHERE database = current_database()`) == 0
		}, 10*time.Second, 50*time.Millisecond, "the test's replication slot is dropped")
	})
	cfg := f.Config()
	cfg.Capture = relay.CaptureLogicalReplication
	return f, cfg
}

// startStreaming starts a relay with cfg and waits until it streams.
func startStreaming(t *testing.T, cfg relay.Config) *outboxtest.Running {
	t.Helper()
	x := outboxtest.Start(t, cfg)
	waitStreaming(t, x)
	return x
}

// waitStreaming waits until relay x streams. Making its slot waits for
// every transaction running on the server, other tests' too, which on a
// loaded machine took longer than 30 s once.
func waitStreaming(t *testing.T, x *outboxtest.Running) {
	t.Helper()
	require.Eventually(t, func() bool { return outboxtest.MetricValue(t, x.Reg, "outbox_relay_capture_streaming") == 1 },
		3*time.Minute, 20*time.Millisecond, "the relay streams")
}

// eventIDs are the table's event ids in the order of the SQL ORDER BY order.
func eventIDs(t *testing.T, f *outboxtest.Fixture, order string) []string {
	t.Helper()
	rows, err := f.Pool.Query(context.Background(), `SELECT event_id::text FROM outbox ORDER BY `+order)
	require.NoError(t, err)
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	return ids
}

// With logical replication the relay publishes in commit order: a row
// whose transaction commits after a later id's reaches Kafka after it,
// which id-order polling cannot promise. Every row is published once, and
// the slot's confirmed position moves past them.
func TestLogicalReplicationPublishesInCommitOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	startStreaming(t, cfg)

	insert := `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'o1', 'E', $1, 'o1')`
	late, err := f.Pool.Begin(ctx) // takes the lower id, commits last
	require.NoError(t, err)
	_, err = late.Exec(ctx, insert, `{"n":1}`)
	require.NoError(t, err)
	_, err = f.Pool.Exec(ctx, insert, `{"n":2}`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE id = 2 AND published_at IS NOT NULL`) == 1
	},
		10*time.Second, 10*time.Millisecond, "the committed row is out at once")
	require.NoError(t, late.Commit(ctx))
	for i := range 10 { // more transactions, several rows each
		f.Insert(20, 7, "E")
		_ = i
	}
	f.WaitDrained(0, 30*time.Second)
	var order []string // event ids in the order they first reached Kafka (a retry may repeat one)
	seen := map[string]bool{}
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], 202, 30*time.Second) {
		if id := header(m, relay.HeaderEventID); !seen[id] {
			seen[id], order = true, append(order, id)
		}
	}
	require.Len(t, order, 202, "every row")
	byID := eventIDs(t, f, "id")
	require.Equal(t, byID[1], order[0], "the row committed first comes first")
	require.Equal(t, byID[0], order[1], "the lower id, committed later, after it")
	require.Equal(t, byID[2:], order[2:], "then the transactions in commit order")
	requireSlotConfirmedPastNow(t, f)
}

// requireSlotConfirmedPastNow waits for the test's slot to be confirmed
// past the server's WAL position now, which is past every commit so far.
// The cluster's other databases keep writing WAL (other tests run beside
// this one), so the slot is compared with this fixed position, not a
// moving one: the relay confirms its last commit at once and, idle, the
// server's position from its keepalives, sent every statusInterval.
func requireSlotConfirmedPastNow(t *testing.T, f *outboxtest.Fixture) {
	t.Helper()
	var now string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&now))
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM pg_replication_slots WHERE database = current_database()
			AND confirmed_flush_lsn >= $1::pg_lsn`, now) == 1
	}, 45*time.Second, 100*time.Millisecond, "the slot's position is confirmed past %s", now)
}

// One replica streams, the other waits; when the streaming one stops, the
// standby takes the slot within seconds, and nothing is lost.
func TestLogicalReplicationStandbyTakesOver(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 2, "E")
	a := outboxtest.Start(t, cfg)
	streaming := func(x *outboxtest.Running) bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_capture_streaming") == 1
	}
	waitStreaming(t, a) // makes the slot
	b := outboxtest.Start(t, cfg)
	f.Insert(100, 10, "E")
	f.WaitDrained(0, 30*time.Second)
	require.False(t, streaming(b), "one replica streams at a time")

	a.Stop(t)
	stopped := time.Now()
	require.Eventually(t, func() bool { return streaming(b) }, 10*time.Second, 20*time.Millisecond, "the standby takes over")
	t.Logf("the standby streamed %s after the streaming replica stopped", time.Since(stopped).Round(time.Millisecond))
	f.Insert(100, 10, "E")
	f.WaitDrained(0, 30*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 200, 30*time.Second)
	seen := map[string]bool{}
	for _, m := range msgs {
		seen[header(m, relay.HeaderEventID)] = true
	}
	require.Len(t, seen, 200, "nothing lost")
}

// The slot is nothing the rows depend on: dropped (its walsender ended by
// an administrator), the relay makes a new one, and the rows committed
// while there was none are published by the sweep that follows.
func TestLogicalReplicationSurvivesALostSlot(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	startStreaming(t, cfg)
	f.Insert(50, 5, "E")
	f.WaitDrained(0, 30*time.Second)
	dropSlot(t, f)
	f.Insert(50, 5, "E")
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 100, 30*time.Second), 100)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM pg_replication_slots WHERE database = current_database()`) == 1
	}, 10*time.Second, 50*time.Millisecond, "a new slot")
}

// dropSlot ends f's walsender and drops its slot before the relay
// reconnects, as an administrator could.
func dropSlot(t *testing.T, f *outboxtest.Fixture) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		_, _ = f.Pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = current_database() AND active`)
		_, err := f.Pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database() AND NOT active`)
		return err == nil && f.Count(`SELECT count(*) FROM pg_replication_slots WHERE database = current_database() AND active`) == 0
	}, 10*time.Second, time.Millisecond)
}

// A backlog from before the slot is swept as polling drains it, full
// batches pipelined (a batch's mark and commit beside the next claim and
// publish): every row reaches Kafka once, in id order, and is marked.
func TestLogicalReplicationSweepsABacklogInOrder(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	f.Insert(1000, 10, "E")
	cfg.BatchSize = 50
	x := startStreaming(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	var order []string
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], 1000, 30*time.Second) {
		order = append(order, header(m, relay.HeaderEventID))
	}
	require.Equal(t, eventIDs(t, f, "id"), order, "each row once, in id order")
	require.Equal(t, 0, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL`), "every row marked")
	require.Greater(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_batches_total"), 1000.0/50-1, "in full batches")
}

// What logical replication needs is named with the statement that grants it.
func TestLogicalReplicationNamesMissingPrivileges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, _ := captureFixture(t, 1, "E")
	role := fmt.Sprintf("plain_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN; GRANT SELECT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(ctx, `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	cfg := f.Config()
	cfg.Capture = relay.CaptureLogicalReplication
	cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	require.ErrorContains(t, r.Check(ctx), `may not stream from a replication slot; grant it with: ALTER ROLE "`+role+`" REPLICATION`)

	f.Exec(`ALTER ROLE ` + role + ` REPLICATION`)
	err = r.Check(ctx)
	require.ErrorContains(t, err, `the publication outbox_`)
	require.ErrorContains(t, err, `as the table's owner, run: CREATE PUBLICATION`)
}

// The start-up check refuses a table whose deletes the stream cannot
// follow, naming the relation and the fix, when the relay needs them: with
// no replica identity every delete on the table fails once the publication
// publishes deletes (with --on-publish delete the relay published one row
// again and again: 14 records in 8 s); with an identity without the id, a
// writer-deleted row is claimed from the table, found gone, and the slot
// moves past an event that reached no topic (0 of 5 published). A relay
// that deletes nothing and streams without writer deletes only warns: a
// table that worked so before keeps working. FULL, and DEFAULT over the
// primary key on id, pass; so does a partitioned table's, leaf by leaf.
func TestLogicalReplicationRefusesAReplicaIdentityWithoutTheID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	check := func(cfg relay.Config) error {
		r, err := relay.New(cfg)
		require.NoError(t, err)
		defer r.Close()
		return r.Check(ctx)
	}
	f, plain := captureFixture(t, 1, "E")
	writerDeletes, deletes, prunes := plain, plain, plain
	writerDeletes.WriterDeletes = true
	deletes.OnPublish = relay.OnPublishDelete
	prunes.KeepPublishedFor = time.Hour

	f.Exec(`ALTER TABLE outbox REPLICA IDENTITY USING INDEX outbox_event_id_key`)
	err := check(writerDeletes)
	require.ErrorContains(t, err, "the replica identity of outbox is an index without id")
	require.ErrorContains(t, err, "run: ALTER TABLE outbox REPLICA IDENTITY FULL")
	for _, cfg := range []relay.Config{plain, deletes, prunes} {
		require.NoError(t, check(cfg), "its deletes say which row; nothing it does needs the id")
	}

	f.Exec(`ALTER TABLE outbox REPLICA IDENTITY NOTHING`)
	for _, cfg := range []relay.Config{writerDeletes, deletes, prunes} {
		require.ErrorContains(t, check(cfg), "the replica identity of outbox is NOTHING, so PostgreSQL refuses every delete on it")
	}
	require.NoError(t, check(plain), "deletes nothing")

	for _, ident := range []string{"FULL", "DEFAULT"} {
		f.Exec(`ALTER TABLE outbox REPLICA IDENTITY ` + ident)
		for _, cfg := range []relay.Config{plain, writerDeletes, deletes, prunes} {
			require.NoError(t, check(cfg), ident)
		}
	}

	p, pcfg := captureFixture(t, 1, "E")
	pcfg.WriterDeletes = true
	today := partitioned(t, p)
	require.NoError(t, check(pcfg))
	addDay(p, "outbox_odd", today.Add(-24*time.Hour))
	p.Exec(`ALTER TABLE outbox_odd REPLICA IDENTITY NOTHING`)
	require.ErrorContains(t, check(pcfg), "the replica identity of outbox_odd is NOTHING")
}

// A streamed batch's claim probes the partial index once per id, however
// large the table: measured on 50,000 unpublished rows, with the relay's
// session settings.
func TestClaimIDsPlanProbesTheIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(50000, 100, "E")
	f.Exec(`ANALYZE outbox`)
	sql := relay.NewSQL(outbox.Table{Name: "outbox"}, relay.WithHeadersColumn()).ClaimIDs
	conn, err := f.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `SET plan_cache_mode = force_custom_plan; SET enable_bitmapscan = off`)
	require.NoError(t, err)
	ids := make([]int64, 50)
	for i := range ids {
		ids[i] = int64(40000 - 7*i) // not in id order, as commit order need not be
	}
	rows, err := conn.Query(ctx, "EXPLAIN "+sql, ids, []string{"E"}, []int64{}, 4<<20, 1<<20, []int32(nil), 0)
	require.NoError(t, err)
	var plan strings.Builder
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan.WriteString(line + "\n")
	}
	require.Contains(t, plan.String(), "Index Scan", plan.String())
	require.NotContains(t, plan.String(), "Seq Scan", plan.String())
}

// A streaming relay that holds a row stays ready: the stall check counts
// only rows the relay could claim, and the row it holds is not one of them
// (the stream's claims tell it so, as polling's claims do).
func TestLogicalReplicationHoldingARowIsNotAStall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	f.Exec(`ALTER TABLE outbox ADD COLUMN IF NOT EXISTS headers jsonb`)
	cfg.StallTimeout = relayconfig.MinStallTimeout
	x := startStreaming(t, cfg)
	_, err := f.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, headers)
		VALUES (gen_random_uuid(), 'Order', 'o1', 'E', '{}', 'o1', '[1]')`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldInvalidRow) == 1
	},
		10*time.Second, 20*time.Millisecond, "the malformed row is held")
	// Past the stall timeout and two readings of the backlog gauges.
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for end := time.Now().Add(cfg.StallTimeout + 11*time.Second); time.Now().Before(end); <-tick.C {
		require.NoError(t, x.R.Ready(), "the relay stays ready while it holds a row it cannot publish")
	}
}

// The stream's linger runs from the first row waiting, not from the last
// message: rows committed steadily, a message every fraction of a
// millisecond, go out in small batches instead of waiting for a full one.
// (The stream pauses too rarely for its pauses to end the wait.)
func TestLogicalReplicationLingerRunsFromTheFirstRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	cfg.BatchSize = 1000
	cfg.Linger = relayconfig.MinLinger
	x := startStreaming(t, cfg)
	before, beforeRows, err := outboxtest.ReadMetric(x.Reg, "outbox_relay_batch_size_rows")
	require.NoError(t, err)
	end := time.Now().Add(2 * time.Second)
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			var err error
			tick := time.NewTicker(time.Millisecond) // each writer a row a millisecond at most
			defer tick.Stop()
			for err == nil && time.Now().Before(end) {
				_, err = f.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
					VALUES (gen_random_uuid(), 'Order', 'o1', 'E', '{}', 'o1')`)
				<-tick.C
			}
			errs <- err
		}()
	}
	for range 2 {
		require.NoError(t, <-errs)
	}
	f.WaitDrained(0, 30*time.Second)
	batches, rows, err := outboxtest.ReadMetric(x.Reg, "outbox_relay_batch_size_rows")
	require.NoError(t, err)
	batches, rows = batches-before, rows-beforeRows
	inserted := f.Count(`SELECT count(*) FROM outbox`)
	require.Greater(t, inserted, 500, "rows arrived steadily")
	t.Logf("%d rows in %.0f batches", inserted, batches)
	require.Less(t, rows/batches, 150.0, "%d rows in %.0f batches: batches of 1,000 waited to fill", inserted, batches)
}

// A sweep that comes due while the stream is in the middle of a
// transaction waits for the transaction's end: the loop must go on reading
// it. (It once ended each wait at once instead, spinning without reading,
// so the stream stopped for good while the relay looked busy.) Sweeps due
// every millisecond and transactions of hundreds of rows make that moment
// come many times.
func TestLogicalReplicationSweepDueMidTransactionWaitsForIt(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	cfg.FullRescanInterval = time.Millisecond
	startStreaming(t, cfg)
	for range 10 {
		f.Insert(300, 7, "E") // one transaction each
	}
	f.WaitDrained(0, 30*time.Second)
	requireSlotConfirmedPastNow(t, f)
}

// A partitioned outbox streams too: its publication publishes its
// partitions' changes as the table's own (publish_via_partition_root), so
// the stream's inserts are the table's, in commit order, and not left to a
// sweep. A publication made without it is altered.
func TestLogicalReplicationStreamsAPartitionedTable(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	today := partitioned(t, f)
	slot := tableSlot(t, f)
	f.Exec(`CREATE PUBLICATION ` + slot + ` FOR TABLE outbox WITH (publish = 'insert, delete')`) // as a relay made it before
	// No sweep delivers what the stream skipped.
	cfg.FullRescanInterval = time.Hour
	startStreaming(t, cfg)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_publication WHERE pubname = $1 AND pubviaroot`, slot))
	insertAt(f, 30, 3, today.Add(time.Hour), false, "E")
	f.WaitDrained(0, 20*time.Second)
	deliveredInOrder(t, f, f.Topics["E"], 30)
}

// A backlog whose publishing outlasts wal_sender_timeout does not cost the
// stream its session: the relay reports its position between batches (at
// a third of a timeout shorter than its usual interval), so the server
// does not end a session that seemed silent. The rows are written while no
// relay streams, after the slot's position, so the stream publishes them,
// a large transaction at a time (a sweep through rows from before the
// slot reports its position the same way).
func TestLogicalReplicationSweepOutlastsWALSenderTimeout(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	var db string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT current_database()`).Scan(&db))
	f.Exec(`ALTER DATABASE ` + db + ` SET wal_sender_timeout = '2s'`)
	x := startStreaming(t, cfg) // the slot, so that what follows is in its WAL
	x.Stop(t)
	f.Insert(8000, 100, "E")
	cfg.BatchSize = 50
	w := newKafkaWriter(t)
	require.Eventually(t, func() bool { // a new topic: the writer knows it before the sweep's first write
		return w.WriteMessages(context.Background(), kafka.Message{Topic: f.Topics["E"], Value: []byte(`{}`)}) == nil
	}, 30*time.Second, 100*time.Millisecond)
	// 160 batches of at least 20 ms each: the sweep lasts 3.2 s or more.
	y := run(t, cfg, &pacedWriter{w: w, pause: 20 * time.Millisecond})
	streaming := func() bool { return outboxtest.MetricValue(t, y.Reg, "outbox_relay_capture_streaming") == 1 }
	require.Eventually(t, streaming, 10*time.Second, 5*time.Millisecond) // then it sweeps
	started := time.Now()
	var drained time.Time // the session would end at its first read after the sweep: watch a while longer
	for drained.IsZero() || time.Since(drained) < 2*time.Second {
		require.True(t, streaming(), "the stream's session lasts through the sweep")
		require.Less(t, time.Since(started), 60*time.Second, "drained")
		if drained.IsZero() && f.Unpublished() == 0 {
			drained = time.Now()
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.Greater(t, drained.Sub(started), 2500*time.Millisecond, "the sweep outlasted the timeout")
}

// pacedWriter pauses before each publish: a slow broker.
type pacedWriter struct {
	w     relay.MessageWriter
	pause time.Duration
}

func (p *pacedWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	time.Sleep(p.pause)
	return p.w.WriteMessages(ctx, msgs...)
}

// lockedRowStream starts a streaming relay and writes two rows of key k,
// the first locked by a transaction of the test's (lock) before the relay
// can claim it: the relay is publishing an earlier row meanwhile. The
// relay waits for a locked row up to publishTimeout.
func lockedRowStream(t *testing.T, publishTimeout time.Duration) (f *outboxtest.Fixture, x *outboxtest.Running, logs *lockedBuffer, lock pgx.Tx, first, second string) {
	t.Helper()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	cfg.PublishTimeout = publishTimeout
	logs = &lockedBuffer{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	released := make(chan struct{})
	w := &slowFirstWriter{w: newKafkaWriter(t), delay: 30 * time.Second, released: released}
	x = run(t, cfg, w)
	waitStreaming(t, x)

	insert := `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ($1, 'Order', $2, 'E', '{}', $2)`
	_, err := f.Pool.Exec(ctx, insert, outbox.NewEventID(), "other")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return w.calls.Load() == 1 }, 10*time.Second, 5*time.Millisecond,
		"the stream publishes the first row, and waits in the broker")
	first, second = outbox.NewEventID(), outbox.NewEventID()
	_, err = f.Pool.Exec(ctx, insert, first, "k")
	require.NoError(t, err)
	lock, err = f.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(context.Background()) })
	_, err = lock.Exec(ctx, `SELECT id FROM outbox WHERE event_id = $1 FOR UPDATE`, first)
	require.NoError(t, err)
	_, err = f.Pool.Exec(ctx, insert, second, "k")
	require.NoError(t, err)
	close(released)
	return f, x, logs, lock, first, second
}

// A row the stream delivers that another transaction has locked (another
// relay's batch, during a switch from polling, or an application's) is
// waited for, so its key's rows go out in commit order. Skipped, it was
// left to a sweep, up to 10 s later, after the key's next row.
func TestLogicalReplicationWaitsForARowAnotherTransactionLocked(t *testing.T) {
	t.Parallel()
	f, x, logs, lock, first, second := lockedRowStream(t, relayconfig.DefaultPublishTimeout)
	require.Never(t, func() bool { return x.Published() > 1 }, 2*time.Second, 10*time.Millisecond,
		"the key's second row waits for its first, locked")
	require.NoError(t, lock.Commit(context.Background()))

	msgs := testenv.Broker().Consume(t, f.Topics["E"], 3, 8*time.Second) // before a sweep, 10 s on
	require.Equal(t, []string{first, second}, keyOrder(msgs, "k"), "the key's rows in commit order")
	require.NotContains(t, logs.String(), "stayed locked", "the lock ended within the wait")
}

// A row locked for longer than the stream waits for it does not stop the
// stream: the rows after it go out, and it goes out with a sweep once its
// lock ends, as the relay's warning says.
func TestLogicalReplicationGoesOnPastARowLockedForLong(t *testing.T) {
	t.Parallel()
	f, x, logs, lock, first, second := lockedRowStream(t, time.Second) // held longer, it would delay other tests' slots
	require.Eventually(t, func() bool { return x.Published() == 2 }, 10*time.Second, 20*time.Millisecond,
		"the key's second row goes out once the wait ends")
	require.Contains(t, logs.String(), "stayed locked")
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1 AND published_at IS NULL`, first),
		"the locked row waits for its lock")
	require.NoError(t, lock.Commit(context.Background()))
	f.WaitDrained(0, 30*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 3, 10*time.Second)
	require.Equal(t, []string{second, first}, keyOrder(msgs, "k"), "past the wait, after the key's later row")
}

// keyOrder are the event ids of key's records in msgs, in the order each
// first came (a retry may repeat one).
func keyOrder(msgs []kafka.Message, key string) []string {
	var ids []string
	for _, m := range msgs {
		if id := header(m, relay.HeaderEventID); string(m.Key) == key && !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids
}

// With synchronous replication a commit is written, and streamed, before
// the standby confirms it, and until then the transaction is in progress
// for every session: the relay receives rows it cannot see yet. It waits
// for them, so a key's rows go out in commit order; a claim that found
// nothing left the row to the sweep, up to 10 s later, after the key's
// next row. (Here the standby never comes; cancelling the wait lets the
// commit end, as the standby's answer would.)
func TestLogicalReplicationWaitsForACommitToBeVisible(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	server, err := testenv.StartPostgres(filepath.Join(t.TempDir(), "postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = server.Close() })
	dsn, err := server.CreateDatabase(ctx, "syncrep")
	require.NoError(t, err)
	local := dsn + "&options=-c%20synchronous_commit%3Dlocal" // commits that wait for no standby
	admin, err := pgxpool.New(ctx, local)
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	_, err = admin.Exec(ctx, outbox.SchemaDDL(outbox.Table{Name: "outbox"}))
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	// The wait below outlasts it: the relay reports its position while it
	// waits, so the server keeps the session (before, it ended it).
	_, err = admin.Exec(ctx, `ALTER DATABASE syncrep SET wal_sender_timeout = '2s'`)
	require.NoError(t, err)

	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	cfg.DSN, cfg.Capture = local, relay.CaptureLogicalReplication
	x := startStreaming(t, cfg)
	t.Cleanup(func() { // after the relay stops
		_, _ = admin.Exec(context.Background(), `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE NOT active`)
	})

	insert := `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ($1, 'Order', 'o1', 'E', '{}', 'o1')`
	first, second := outbox.NewEventID(), outbox.NewEventID()
	writer, err := pgx.Connect(ctx, dsn+"&options=-c%20synchronous_commit%3Don") // its commit waits for the standby
	require.NoError(t, err)
	t.Cleanup(func() { _ = writer.Close(context.Background()) })
	var pid int
	require.NoError(t, writer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	committed := make(chan error, 1)
	go func() {
		_, err := writer.Exec(ctx, insert, first) // one statement, one transaction
		committed <- err
	}()
	require.Eventually(t, func() bool {
		var waiting bool
		return admin.QueryRow(ctx, `SELECT wait_event = 'SyncRep' FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting) == nil && waiting
	}, 10*time.Second, 10*time.Millisecond, "the first row's commit waits for the standby")
	var walsender int
	require.NoError(t, admin.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE active`).Scan(&walsender))
	_, err = admin.Exec(ctx, insert, second) // committed, and visible, at once
	require.NoError(t, err)
	require.Never(t, func() bool { return x.Published() > 0 }, 5*time.Second, 10*time.Millisecond,
		"the second row, visible, waits for the first, streamed before it but not visible yet")
	var still int
	require.NoError(t, admin.QueryRow(ctx, `SELECT COALESCE(max(active_pid), 0) FROM pg_replication_slots`).Scan(&still))
	require.Equal(t, walsender, still, "the replication session outlived wal_sender_timeout while the relay waited")
	_, err = admin.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid)
	require.NoError(t, err)
	require.NoError(t, <-committed, "committed locally once the wait is cancelled")

	msgs := testenv.Broker().Consume(t, f.Topics["E"], 2, 8*time.Second) // before a sweep, 10 s on
	require.Len(t, msgs, 2)
	require.Equal(t, []string{first, second}, []string{header(msgs[0], relay.HeaderEventID), header(msgs[1], relay.HeaderEventID)},
		"the key's rows in commit order")
}

// Rows committed before the slot was made go out before every row the
// stream delivers, also when a transaction older than theirs ran while the
// slot was made. The slot's catalog horizon is then older than the rows'
// transactions, so a sweep bounded by it leaves them out, and the stream
// does not carry them either: it starts after they committed. When the
// replica that made the slot stops before it has published them (makerStops:
// its broker never answers), the replica that streams next finds the slot's
// snapshot on the publication and publishes them first all the same.
func TestLogicalReplicationSweepsRowsFromBeforeTheSlotFirst(t *testing.T) {
	t.Parallel()
	for _, writerDeletes := range []bool{false, true} {
		for _, makerStops := range []bool{false, true} {
			t.Run(fmt.Sprintf("writerDeletes=%t/makerStops=%t", writerDeletes, makerStops), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				f, cfg := captureFixture(t, 1, "E")
				cfg.WriterDeletes = writerDeletes
				var logs lockedBuffer
				cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
				var opts []outbox.WriterOption
				if writerDeletes {
					opts = append(opts, outbox.WithDeleteOnStore())
				}
				w, err := outbox.NewWriter("outbox", opts...)
				require.NoError(t, err)
				var want []string // the key's event ids in commit order
				store := func() {
					e := entry("E", len(want))
					e.PartitionKey = "k"
					require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return w.Store(ctx, tx, e) }))
					want = append(want, e.EventID)
				}

				old, err := f.Pool.Begin(ctx)
				require.NoError(t, err)
				defer old.Rollback(ctx)                               //nolint:errcheck // committed below
				_, err = old.Exec(ctx, `SELECT pg_current_xact_id()`) // it takes a transaction id: older than the rows'
				require.NoError(t, err)
				for range 20 {
					store()
				}
				var maker *outboxtest.Running
				stuck := &firstWriteSignal{called: make(chan struct{})}
				if makerStops {
					makerCfg := cfg
					makerCfg.Logger = slog.New(slog.NewTextHandler(&lockedBuffer{}, nil))
					// Polling while the slot waits (on a busy test server)
					// holds a batch open on its stuck broker, and the slot
					// waits for that batch too: let each give up soon.
					makerCfg.PublishTimeout = relayconfig.MinPublishTimeout
					maker, err = outboxtest.RunRelay(makerCfg, stuck)
					require.NoError(t, err)
					t.Cleanup(func() { _ = maker.Close() })
				} else {
					outboxtest.Start(t, cfg)
				}
				require.Eventually(t, func() bool {
					return f.Count(`SELECT count(*) FROM pg_replication_slots WHERE database = current_database()`) == 1
				}, 10*time.Second, 10*time.Millisecond, "the relay makes its slot, which waits for the older transaction")
				require.NoError(t, old.Commit(ctx))
				if makerStops {
					select {
					case <-stuck.called:
					case <-time.After(30 * time.Second):
						t.Fatal("the replica that made the slot never began to publish the rows from before it")
					}
					// It polls while the slot waits, and notes the slot's
					// snapshot as soon as the slot is made.
					require.Eventually(t, func() bool {
						return f.Count(`SELECT count(*) FROM pg_publication WHERE pubname = $1 AND obj_description(oid, 'pg_publication') LIKE '%snapshot%'`, tableSlot(t, f)) == 1
					}, 30*time.Second, 10*time.Millisecond, "the maker notes the slot's snapshot")
					require.NoError(t, maker.Close())
				}
				for range 100 { // the key's later rows, one transaction each, while the relay starts streaming
					store()
				}
				if makerStops {
					outboxtest.Start(t, cfg)
				}
				var order []string
				for _, m := range testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second) {
					order = append(order, header(m, relay.HeaderEventID))
				}
				require.Len(t, order, len(want), "each row once")
				for i := range want {
					require.Equal(t, want[i], order[i], "the key's rows in commit order: row %d of %d is out of place", i+1, len(want))
				}
				require.NotContains(t, logs.String(), "streaming failed", "the stream that made the slot streams from it")
				logged := "created the replication slot"
				if makerStops {
					logged = "the rows committed before the slot was made are not all published yet"
				}
				require.Eventually(t, func() bool { return strings.Contains(logs.String(), logged) }, 10*time.Second, 10*time.Millisecond, logged)
				require.Eventually(t, func() bool {
					return f.Count(`SELECT count(*) FROM pg_publication WHERE COALESCE(obj_description(oid, 'pg_publication'), '') LIKE '%snapshot%'`) == 0
				}, 10*time.Second, 10*time.Millisecond, "once the rows are out, the publication no longer keeps the snapshot")
				if writerDeletes {
					require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_publication WHERE obj_description(oid, 'pg_publication') LIKE '%writer deletes%'`),
						"removing the snapshot keeps the writer-deletes mark")
				}
			})
		}
	}
}

// firstWriteSignal never publishes, as a broker that stopped answering;
// it closes called on its first write.
type firstWriteSignal struct {
	once   sync.Once
	called chan struct{}
}

func (w *firstWriteSignal) WriteMessages(ctx context.Context, _ ...kafka.Message) error {
	w.once.Do(func() { close(w.called) })
	<-ctx.Done()
	return ctx.Err()
}

// Slot and publication names fold case, '.' and '_', and slot names are the
// server's: two tables can get one name. Sharing it, one stream would serve
// both and the relay of the other would never stream; so a relay refuses a
// publication that publishes another table, or a slot of its name in
// another database, and names them.
func TestLogicalReplicationRefusesANameTakenByAnotherTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	f.Exec(`CREATE SCHEMA a`)
	f.Exec(outbox.SchemaDDL(outbox.Table{Name: "a_b"}))
	f.Exec(outbox.SchemaDDL(outbox.Table{Schema: "a", Name: "b"}))
	check := func(table string) error {
		c := cfg
		c.Table = table
		r, err := relay.New(c)
		require.NoError(t, err)
		defer r.Close()
		return r.Check(ctx)
	}
	require.NoError(t, check("a_b"), "the first makes the publication")
	err := check("a.b")
	require.ErrorContains(t, err, `publishes the table public.a_b too`)
	require.ErrorContains(t, err, `--capture poll`)

	// A slot of this table's name in another database.
	other := outboxtest.NewFixture(t, 1, "E")
	name := tableSlot(t, f)
	_, err = other.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = other.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, name) })
	var db string
	require.NoError(t, other.Pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db))
	require.ErrorContains(t, check("outbox"), `belongs to database `+db)
}

// A migration that renames the table away and makes it again leaves the
// earlier table in the publication, under a name that does not fold to
// the slot's: a relay starts beside it, says so, and streams the new
// table. Before, a relay that started after such a migration (a restart, a
// standby taking over) refused, as if the two names folded to one.
func TestLogicalReplicationStartsBesideAnEarlierTableRenamedAway(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	first := cfg
	first.Logger = slog.New(slog.DiscardHandler)
	r, err := relay.New(first)
	require.NoError(t, err)
	require.NoError(t, r.Check(ctx), "makes the publication")
	r.Close()
	f.Exec(`CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL)`)
	f.Exec(`ALTER TABLE outbox RENAME TO outbox_old`)
	f.Exec(`ALTER TABLE outbox_new RENAME TO outbox`)

	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	startStreaming(t, cfg)
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	var ids []string
	for i := range 3 {
		e := entry("E", i)
		require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return w.Store(ctx, tx, e) }))
		ids = append(ids, e.EventID)
	}
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 3, 30*time.Second)
	for i, m := range msgs {
		require.Equal(t, ids[i], header(m, relay.HeaderEventID))
	}
	require.Contains(t, logs.String(), "the publication also publishes tables whose names do not fold to its own")
	require.Contains(t, logs.String(), "DROP TABLE public.outbox_old")
}

// Replicas that start at once each find the publication missing and make
// it. The one that loses waits behind the other's uncommitted catalog row,
// then gets a unique violation; it checks again and starts, where it read
// the error as a missing privilege and ended the process.
func TestLogicalReplicationTwoReplicasMakeThePublicationAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	other, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx) //nolint:errcheck // committed below
	_, err = other.Exec(ctx, `CREATE PUBLICATION `+tableSlot(t, f)+` FOR TABLE outbox WITH (publish = 'insert, delete')`)
	require.NoError(t, err)

	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	checked := make(chan error, 1)
	go func() { checked <- r.Check(ctx) }()
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE 'CREATE PUBLICATION%'`) == 1
	}, 20*time.Second, 20*time.Millisecond, "the relay's CREATE PUBLICATION waits for the other's")
	require.NoError(t, other.Commit(ctx))
	err = <-checked
	var unreachable *relay.UnreachableError
	require.ErrorAs(t, err, &unreachable, "the race is waited out, not fatal: %v", err)
	require.NoError(t, r.Check(ctx), "the next check finds the publication")
}
