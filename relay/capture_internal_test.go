package relay

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"
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
	dsn, pool := outboxDB(t)
	slot := fmt.Sprintf("test_given_up_%d", testenv.PG().Port)
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
	require.NoError(t, r.checkSlot(ctx, slot), "within the default limit")
	r.cfg.MaxRetainedWAL = 1024
	err = r.checkSlot(ctx, slot)
	require.True(t, errors.Is(err, errSlotGone), "%v", err)
	require.ErrorContains(t, err, "more than --max-retained-wal 1024")
	require.Greater(t, testutil.ToFloat64(r.m.slotRetainedWAL), 1024.0)

	r.dropSlot(ctx, slot)
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&left))
	require.Zero(t, left, "the slot is dropped")
}

// One replica at a time publishes what the slot carries: while another
// session holds the slot's capture lock (a replica streaming, or polling
// in the stream's stead), this relay neither streams nor polls in the
// stream's stead; once it is free, its polling publishes.
func TestCaptureLockFencesStreamingAndFallbackPolling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, pool := outboxDB(t)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'O', 'a', 'E', '{}', 'a' FROM generate_series(1, 20)`)
	require.NoError(t, err)
	topic := testenv.Broker().TopicName(t, "E")
	testenv.Broker().CreateTopic(t, topic, 1)

	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": topic},
		Capture: CaptureLogicalReplication}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
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
