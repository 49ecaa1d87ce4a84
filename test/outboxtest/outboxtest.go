// Package outboxtest holds the fixtures the relay's, the relay binary's and
// the outbox writer's tests share — an outbox table in a fresh database,
// topics, row generators, in-process relays, relay processes, metrics and
// delivery assertions — and the benchmark uses the same generators, relays
// and metric readers through the functions that take no *testing.T.
package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Fixture is one test's database, outbox table and topics.
type Fixture struct {
	// T is the test the fixture belongs to.
	T *testing.T
	// DSN reaches the test's database as the superuser.
	DSN string
	// Pool is a pool on DSN.
	Pool *pgxpool.Pool
	// Table is the outbox table, "outbox".
	Table string
	// Topics maps each event type to its topic.
	Topics map[string]string
}

// NewFixture creates a database with an outbox table (the shipped DDL) and
// one topic per event type, each with partitions partitions.
func NewFixture(t *testing.T, partitions int, eventTypes ...string) *Fixture {
	t.Helper()
	dsn := testenv.PG().NewDatabase(t)
	pool, err := pgxpool.New(context.Background(), dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	f := &Fixture{T: t, DSN: dsn, Pool: pool, Table: "outbox", Topics: map[string]string{}}
	f.Exec(outbox.SchemaDDL(outbox.Table{Name: "outbox"}))
	for _, et := range eventTypes {
		f.Topics[et] = f.NewTopic(strings.ToLower(et), partitions)
	}
	return f
}

// NewTopic creates a topic unique to the test and returns its name.
func (f *Fixture) NewTopic(suffix string, partitions int, configs ...string) string {
	name := testenv.Broker().TopicName(f.T, suffix)
	testenv.Broker().CreateTopic(f.T, name, partitions, configs...)
	return name
}

// Exec runs a statement in the test's database.
func (f *Fixture) Exec(sql string, args ...any) {
	f.T.Helper()
	_, err := f.Pool.Exec(context.Background(), sql, args...)
	require.NoError(f.T, err)
}

// Count runs a query returning one number.
func (f *Fixture) Count(sql string, args ...any) int {
	f.T.Helper()
	var n int
	require.NoError(f.T, f.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// Insert adds rows as InsertRows does.
func (f *Fixture) Insert(n, keys int, eventTypes ...string) {
	f.T.Helper()
	require.NoError(f.T, InsertRows(context.Background(), f.Pool, n, keys, eventTypes...))
}

// InsertRowsSQL inserts InsertRows' rows: $1 rows over $2 keys, their
// types taken in turn from $3.
const InsertRowsSQL = `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
SELECT gen_random_uuid(), 'Order', 'order-' || (g % $2), ($3::text[])[1 + g % cardinality($3::text[])],
       jsonb_build_object('seq', g, 'order_id', 'order-' || (g % $2), 'pad', repeat('x', 240)),
       'order-' || (g % $2)
FROM generate_series(1, $1) g`

// InsertRows adds n rows to the outbox table, cycling through eventTypes
// and keys distinct partition keys, with ~300-byte JSON payloads.
func InsertRows(ctx context.Context, db *pgxpool.Pool, n, keys int, eventTypes ...string) error {
	_, err := db.Exec(ctx, InsertRowsSQL, n, keys, eventTypes)
	if err != nil {
		return fmt.Errorf("insert %d outbox rows: %w", n, err)
	}
	return nil
}

// Unpublished counts the rows not yet published.
func (f *Fixture) Unpublished() int {
	return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL`)
}

// Config is a relay configuration for the fixture with fast polling.
func (f *Fixture) Config() relay.Config {
	return relay.Config{
		Settings: relay.Settings{
			DSN: f.DSN, Table: f.Table, Brokers: []string{testenv.Broker().Addr()}, Topics: f.Topics,
			PollInterval: 20 * time.Millisecond,
		},
		MaxBackoff: time.Second,
	}
}

// Running is an in-process relay started by Start or RunRelay.
type Running struct {
	// R is the relay.
	R *relay.Relay
	// Reg is the relay's own metrics registry.
	Reg *prometheus.Registry

	cancel   context.CancelFunc
	finished chan struct{} // closed when Run returned, with runErr set
	runErr   error
	stopOnce sync.Once
	stopErr  error
}

// RunRelay builds a relay from cfg with its own metrics registry (replacing
// cfg.Registerer) and, when w is not nil, w as its Kafka writer; checks it
// (relay.Check); and runs it in this process until Close.
func RunRelay(cfg relay.Config, w relay.MessageWriter) (*Running, error) {
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	var r *relay.Relay
	var err error
	if w == nil {
		r, err = relay.New(cfg)
	} else {
		r, err = relay.NewWithWriter(cfg, w)
	}
	if err != nil {
		return nil, err
	}
	if err := r.Check(context.Background()); err != nil {
		r.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	x := &Running{R: r, Reg: reg, cancel: cancel, finished: make(chan struct{})}
	go func() { x.runErr = r.Run(ctx); close(x.finished) }()
	return x, nil
}

// Published is the relay's outbox_relay_events_published_total.
func (x *Running) Published() float64 {
	v, _, _ := ReadMetric(x.Reg, "outbox_relay_events_published_total")
	return v
}

// WaitPublished waits until the relay has published n events; it fails if
// the relay stops first or ctx ends.
func (x *Running) WaitPublished(ctx context.Context, n int) error {
	for x.Published() < float64(n) {
		select {
		case <-x.finished:
			return fmt.Errorf("relay stopped after publishing %.0f of %d events: %v", x.Published(), n, x.runErr)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// stop ends Run and returns its error; it gives up after 30s.
func (x *Running) stop() error {
	x.stopOnce.Do(func() {
		x.cancel()
		select {
		case <-x.finished:
			x.stopErr = x.runErr
		case <-time.After(30 * time.Second):
			x.stopErr = errors.New("relay did not stop within 30s")
		}
	})
	return x.stopErr
}

// Stop ends Run and fails the test if it did not end cleanly.
func (x *Running) Stop(t *testing.T) {
	t.Helper()
	require.NoError(t, x.stop())
}

// Close ends Run, closes the relay and returns Run's error. A relay whose
// Run did not end within 30s is left open: closing it would wait for the
// connections the wedged Run holds, and hang the test binary.
func (x *Running) Close() error {
	err := x.stop()
	select {
	case <-x.finished:
		x.R.Close()
	default:
	}
	return err
}

// Start runs a relay in this process until the test ends (or Stop).
func Start(t *testing.T, cfg relay.Config) *Running {
	t.Helper()
	x, err := RunRelay(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close() })
	return x
}

// WaitDrained waits until no row is unpublished (beyond keep).
func (f *Fixture) WaitDrained(keep int, timeout time.Duration) {
	f.T.Helper()
	require.Eventually(f.T, func() bool { return f.Unpublished() <= keep }, timeout, 50*time.Millisecond,
		"outbox not drained: %d rows unpublished", f.Unpublished())
}

// EventIDs returns the event ids of the rows a WHERE clause (or "") selects.
func (f *Fixture) EventIDs(where string) map[string]bool {
	f.T.Helper()
	rows, err := f.Pool.Query(context.Background(), `SELECT event_id::text FROM outbox `+where)
	require.NoError(f.T, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.T, err)
	out := make(map[string]bool, len(ids))
	for _, id := range ids {
		out[id] = true
	}
	return out
}

// Deliveries reads the topics back and counts how often each event id
// arrived; it also returns every message read.
func Deliveries(t *testing.T, want int, topics ...string) (map[string]int, []kafka.Message) {
	t.Helper()
	counts := map[string]int{}
	var all []kafka.Message
	for _, topic := range topics {
		msgs := testenv.Broker().Consume(t, topic, want, 90*time.Second)
		for _, m := range msgs {
			counts[testenv.Header(m, relay.HeaderEventID)]++
		}
		all = append(all, msgs...)
	}
	return counts, all
}

// RequireExactlyOnce asserts every expected id arrived exactly once and nothing else arrived.
func RequireExactlyOnce(t *testing.T, expected map[string]bool, counts map[string]int) {
	t.Helper()
	var missing, dup, extra int
	for id := range expected {
		switch c := counts[id]; {
		case c == 0:
			missing++
		case c > 1:
			dup++
		}
	}
	for id := range counts {
		if !expected[id] {
			extra++
		}
	}
	require.Zero(t, missing, "events lost")
	require.Zero(t, dup, "events duplicated")
	require.Zero(t, extra, "unexpected events")
}

// RequireAtLeastOnce asserts none was lost and returns the number of extra deliveries.
func RequireAtLeastOnce(t *testing.T, expected map[string]bool, counts map[string]int) int {
	t.Helper()
	missing, dups := 0, 0
	for id := range expected {
		if counts[id] == 0 {
			missing++
		}
		if counts[id] > 1 {
			dups += counts[id] - 1
		}
	}
	require.Zero(t, missing, "events lost")
	return dups
}

// JavaPartition is the partition the Java client's default partitioner picks
// for a key: murmur2 (Kafka's variant) of the key bytes, made positive, modulo
// the partition count. Written from the Java source, independently of kafka-go.
func JavaPartition(key []byte, partitions int) int {
	const seed uint32 = 0x9747b28c
	const m uint32 = 0x5bd1e995
	const r = 24
	length := len(key)
	h := seed ^ uint32(length)
	for i := 0; i+4 <= length; i += 4 {
		k := uint32(key[i]) | uint32(key[i+1])<<8 | uint32(key[i+2])<<16 | uint32(key[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := length &^ 3
	switch length % 4 {
	case 3:
		h ^= uint32(key[tail+2]) << 16
		fallthrough
	case 2:
		h ^= uint32(key[tail+1]) << 8
		fallthrough
	case 1:
		h ^= uint32(key[tail])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int(h&0x7fffffff) % partitions
}

// MetricValue is ReadMetric's value, failing the test on error.
func MetricValue(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	v, _, err := ReadMetric(reg, name, labels...)
	require.NoError(t, err)
	return v
}

// ReadMetric reads a metric from g, summed over the series whose labels
// match labels (name, value pairs): a counter's or a gauge's value, or a
// histogram's observation count (value) and the sum of its observations
// (sum). A metric g does not hold reads as 0.
func ReadMetric(g prometheus.Gatherer, name string, labels ...string) (value, sum float64, err error) {
	mfs, err := g.Gather()
	if err != nil {
		return 0, 0, fmt.Errorf("gather metrics: %w", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue metric
				}
			}
			switch {
			case m.Counter != nil:
				value += m.Counter.GetValue()
			case m.Gauge != nil:
				value += m.Gauge.GetValue()
			case m.Histogram != nil:
				value += float64(m.Histogram.GetSampleCount())
				sum += m.Histogram.GetSampleSum()
			}
		}
	}
	return value, sum, nil
}
