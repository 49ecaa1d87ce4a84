// Package outboxtest holds test fixtures shared by the relay's, the relay
// binary's and the end-to-end tests: an outbox table in a fresh database,
// topics, row generators, in-process relays and delivery assertions.
package outboxtest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/internal/testenv"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
)

// fixture is one test's database, outbox table and topics.
type Fixture struct {
	T      *testing.T
	DSN    string
	Pool   *pgxpool.Pool
	Table  string
	Topics map[string]string // event type -> topic
}

// newFixture creates a database with an outbox table (the shipped DDL) and
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

func (f *Fixture) NewTopic(suffix string, partitions int, configs ...string) string {
	name := testenv.Broker().TopicName(f.T, suffix)
	testenv.Broker().CreateTopic(f.T, name, partitions, configs...)
	return name
}

func (f *Fixture) Exec(sql string, args ...any) {
	f.T.Helper()
	_, err := f.Pool.Exec(context.Background(), sql, args...)
	require.NoError(f.T, err)
}

func (f *Fixture) Count(sql string, args ...any) int {
	f.T.Helper()
	var n int
	require.NoError(f.T, f.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// insert adds n rows cycling through eventTypes and keys distinct partition
// keys, with ~300-byte JSON payloads.
func (f *Fixture) Insert(n, keys int, eventTypes ...string) {
	f.T.Helper()
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
SELECT gen_random_uuid(), 'Order', 'order-' || (g % $2), ($3::text[])[1 + g % cardinality($3::text[])],
       jsonb_build_object('seq', g, 'order_id', 'order-' || (g % $2), 'pad', repeat('x', 240)),
       'order-' || (g % $2)
FROM generate_series(1, $1) g`, n, keys, eventTypes)
}

func (f *Fixture) Unpublished() int {
	return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL`)
}

// config is a relay configuration for the fixture with fast polling.
func (f *Fixture) Config() relay.Config {
	return relay.Config{
		DSN:          f.DSN,
		Table:        f.Table,
		Brokers:      []string{testenv.Broker().Addr()},
		Topics:       f.Topics,
		PollInterval: 20 * time.Millisecond,
		MaxBackoff:   time.Second,
	}
}

// running is an in-process relay started by start.
type Running struct {
	R      *relay.Relay
	cancel context.CancelFunc
	done   chan error
	Reg    *prometheus.Registry
}

func (x *Running) Stop(t *testing.T) {
	t.Helper()
	x.cancel()
	select {
	case err := <-x.done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("relay did not stop within 30s")
	}
}

// start runs a relay in this process until the test ends (or stop).
func Start(t *testing.T, cfg relay.Config) *Running {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	r, err := relay.New(cfg)
	require.NoError(t, err)
	require.NoError(t, r.Check(context.Background()))
	ctx, cancel := context.WithCancel(context.Background())
	x := &Running{R: r, cancel: cancel, done: make(chan error, 1), Reg: reg}
	go func() { x.done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-x.done:
		case <-time.After(30 * time.Second):
		}
		r.Close()
	})
	return x
}

// waitDrained waits until no row is unpublished (beyond keep).
func (f *Fixture) WaitDrained(keep int, timeout time.Duration) {
	f.T.Helper()
	require.Eventually(f.T, func() bool { return f.Unpublished() <= keep }, timeout, 50*time.Millisecond,
		"outbox not drained: %d rows unpublished", f.Unpublished())
}

// eventIDs returns every row's event id.
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

// deliveries counts how often each event id arrived on the topics.
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

// requireExactlyOnce asserts every expected id arrived exactly once and nothing else arrived.
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

// requireAtLeastOnce asserts none was lost and returns the number of extra deliveries.
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

// javaPartition is the partition the Java client's default partitioner picks
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

func MetricValue(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
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
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			case m.Histogram != nil:
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
		return sum
	}
	return 0
}
