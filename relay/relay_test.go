package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka))
}

// The murmur2 reference must match Kafka's Java Utils.murmur2 (vectors from
// Kafka's UtilsTest), so the partition assertions below mean what they say.
func TestJavaMurmur2Reference(t *testing.T) {
	t.Parallel()
	vectors := map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	}
	for key, want := range vectors {
		// javaPartition over 2^31 partitions exposes the positive hash.
		require.Equal(t, int(want)&0x7fffffff, outboxtest.JavaPartition([]byte(key), 1<<31-1+1), key)
	}
}

// 1. Round trip: every row once, on its mapped topic, with key, headers,
// payload as stored, on the partition a Java client would pick.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	types := []string{"OrderConfirmed", "OrderShipped", "OrderCancelled"}
	f := outboxtest.NewFixture(t, 6, types...)
	const n = 10000
	f.Insert(n, 300, types...)

	type stored struct{ eventType, aggType, aggID, key, payload string }
	want := map[string]stored{}
	rows, err := f.Pool.Query(context.Background(), `SELECT event_id::text, event_type, aggregate_type, aggregate_id, partition_key, payload::text FROM outbox`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var s stored
		require.NoError(t, rows.Scan(&id, &s.eventType, &s.aggType, &s.aggID, &s.key, &s.payload))
		want[id] = s
	}
	require.NoError(t, rows.Err())
	require.Len(t, want, n)

	x := outboxtest.Start(t, f.Config())
	f.WaitDrained(0, 60*time.Second)

	seen := map[string]int{}
	for _, et := range types {
		topic := f.Topics[et]
		msgs := testenv.Broker().Consume(t, topic, n/3, 60*time.Second)
		for _, m := range msgs {
			id := testenv.Header(m, relay.HeaderEventID)
			seen[id]++
			s, ok := want[id]
			require.True(t, ok, "unknown event %s", id)
			require.Equal(t, et, s.eventType, "event %s on the topic of another type", id)
			require.Equal(t, s.key, string(m.Key))
			require.JSONEq(t, s.payload, string(m.Value))
			require.Equal(t, s.eventType, testenv.Header(m, relay.HeaderEventType))
			require.Equal(t, s.aggType, testenv.Header(m, relay.HeaderAggregateType))
			require.Equal(t, s.aggID, testenv.Header(m, relay.HeaderAggregateID))
			require.Equal(t, outboxtest.JavaPartition(m.Key, 6), m.Partition, "key %s", m.Key)
		}
	}
	counts := map[string]bool{}
	for id := range want {
		counts[id] = true
	}
	outboxtest.RequireExactlyOnce(t, counts, seen)
	require.Equal(t, float64(n), outboxtest.MetricValue(t, x.Reg, "outbox_relay_events_published_total"))
	require.Equal(t, 0, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL OR published_at < created_at`))
}

// Within one replica, rows reach each partition in id order.
func TestSingleReplicaKeepsIDOrderPerKey(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 3, "E")
	f.Insert(3000, 20, "E")
	outboxtest.Start(t, f.Config())
	f.WaitDrained(0, 60*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 3000, 60*time.Second)
	last := map[string]int{}
	for _, m := range msgs {
		var p struct{ Seq int }
		require.NoError(t, json.Unmarshal(m.Value, &p))
		require.Greater(t, p.Seq, last[string(m.Key)], "key %s out of order", m.Key)
		last[string(m.Key)] = p.Seq
	}
}

// 2. Four replicas on one table share it: none lost, none duplicated.
func TestFourReplicasNoLossNoDuplicates(t *testing.T) {
	t.Parallel()
	types := []string{"A", "B"}
	f := outboxtest.NewFixture(t, 8, types...)
	const n = 50000
	f.Insert(n, 1000, types...)
	expected := f.EventIDs("")
	var rs []*outboxtest.Running
	for range 4 {
		rs = append(rs, outboxtest.Start(t, f.Config()))
	}
	f.WaitDrained(0, 3*time.Minute)
	counts, _ := outboxtest.Deliveries(t, n/2, f.Topics["A"], f.Topics["B"])
	outboxtest.RequireExactlyOnce(t, expected, counts)
	busy := 0
	for _, x := range rs {
		if outboxtest.MetricValue(t, x.Reg, "outbox_relay_events_published_total") > 0 {
			busy++
		}
	}
	require.GreaterOrEqual(t, busy, 2, "replicas shared the work")
}

// Rows committed out of id order (an older transaction committing after a
// newer one was claimed) are still published: the cursor must not skip them.
func TestLateCommitBehindCursorIsPublished(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	// A transaction open across many polls is found by the periodic full
	// rescan (the floor scan only covers commits late by about a second).
	cfg.FullRescanInterval = 2 * time.Second
	outboxtest.Start(t, cfg)

	ctx := context.Background()
	late, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = late.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'late', 'E', '{"late":true}', 'late')`)
	require.NoError(t, err)
	f.Insert(500, 5, "E") // newer ids, committed first and published
	f.WaitDrained(0, 30*time.Second)
	require.NoError(t, late.Commit(ctx))
	f.WaitDrained(0, 10*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 501, 30*time.Second)
	require.Len(t, msgs, 501)
}

// 6. An unmapped event type is held (not claimed, not blocking the rows
// behind it, counted) and flows once the map has it.
func TestUnmappedTypeIsHeldThenFlows(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 2, "Known")
	f.Insert(100, 10, "Unknown") // first in id order
	f.Insert(1000, 10, "Known")
	cfg := f.Config()
	x := outboxtest.Start(t, cfg)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_type = 'Known'`) == 0
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 100, f.Unpublished(), "unmapped rows stay unpublished")
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "unroutable") == 100
	}, 15*time.Second, 100*time.Millisecond)
	// No row is left locked while held.
	require.Equal(t, 100, f.Count(`SELECT count(*) FROM (SELECT 1 FROM outbox WHERE published_at IS NULL FOR UPDATE NOWAIT) s`))
	x.Stop(t)

	cfg.Topics = map[string]string{"Known": f.Topics["Known"], "Unknown": f.NewTopic("unknown", 2)}
	outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	msgs := testenv.Broker().Consume(t, cfg.Topics["Unknown"], 100, 30*time.Second)
	require.Len(t, msgs, 100)
}

// 7. A record larger than the topic accepts goes to the dead-letter topic
// with the error in headers; the rows behind it flow.
func TestOversizedRecordGoesToDeadLetterTopic(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 2, "max.message.bytes", "2000")
	dlt := f.NewTopic("dlt", 1)
	f.Insert(20, 5, "E")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ('00000000-0000-7000-8000-000000000001', 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
	f.Insert(200, 5, "E")
	cfg := f.Config()
	cfg.DeadLetterTopic = dlt
	x := outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)

	ok := testenv.Broker().Consume(t, f.Topics["E"], 220, 30*time.Second)
	require.Len(t, ok, 220)
	dead := testenv.Broker().Consume(t, dlt, 1, 30*time.Second)
	require.Len(t, dead, 1)
	require.Equal(t, "00000000-0000-7000-8000-000000000001", testenv.Header(dead[0], relay.HeaderEventID))
	require.Equal(t, f.Topics["E"], testenv.Header(dead[0], relay.HeaderOriginalTopic))
	require.Contains(t, strings.ToLower(testenv.Header(dead[0], relay.HeaderError)), "too large")
	require.Equal(t, 1.0, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
}

// A topic's limit raised since the relay last read it (every few seconds)
// takes the row: before a row is judged too large by a limit it knows, the
// relay reads the limit again. Before, a row within the new limit claimed
// before the relay's next read went to the dead-letter topic.
func TestALimitRaisedMeanwhileTakesTheRow(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	dlt := f.NewTopic("dlt", 1)
	cfg := f.Config()
	cfg.DeadLetterTopic = dlt
	x := outboxtest.Start(t, cfg)
	f.Insert(1, 1, "E")
	f.WaitDrained(0, 30*time.Second) // the relay knows the limit

	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.Broker().Addr()))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	raised := "20000"
	adm := kadm.NewClient(cl)
	_, err = adm.AlterTopicConfigs(context.Background(),
		[]kadm.AlterConfig{{Op: kadm.SetConfig, Name: "max.message.bytes", Value: &raised}}, f.Topics["E"])
	require.NoError(t, err)
	require.Eventually(t, func() bool { // the broker has applied it
		rcs, err := adm.DescribeTopicConfigs(context.Background(), f.Topics["E"])
		if err != nil {
			return false
		}
		rc, err := rcs.On(f.Topics["E"], nil)
		if err != nil {
			return false
		}
		for _, c := range rc.Configs {
			if c.Key == "max.message.bytes" && c.Value != nil && *c.Value == raised {
				return true
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
	f.WaitDrained(0, 30*time.Second)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 2, 30*time.Second), 2)
}

// A record is dead-lettered as too large only when its topic would refuse
// it sent alone. Rows whose records span the last bytes under the topic's
// limit, in both ordering modes: each dead-lettered record, its dead-letter
// headers taken off, is produced alone to its topic, which must refuse it.
// Before, the relay's margin for batches of many records also bounded a
// record alone: on this topic, a record with 1,757 bytes of payload was
// dead-lettered though the topic took it.
//
// With compression, the broker judges a record batch after compression,
// so a record alone is sent compressed and only its refusal there counts:
// rows several times the limit uncompressed that compress under it are
// published, and random ones that do not are dead-lettered. Before, a
// compressing relay judged a record by its size uncompressed and
// dead-lettered every one over the limit, valid events the topic takes.
func TestOnlyRecordsTheTopicRefusesAloneAreDeadLettered(t *testing.T) {
	codecs := map[relay.Compression]kafka.Compression{"none": 0, "gzip": kafka.Gzip}
	type variant struct {
		name  string
		mode  relay.Ordering
		codec relay.Compression
	}
	var variants []variant
	for _, mode := range modes {
		variants = append(variants, variant{string(mode), mode, "none"})
	}
	variants = append(variants, variant{"gzip", relay.OrderingNone, "gzip"})
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 1)
			f.Topics["E"] = f.NewTopic("small", 2, "max.message.bytes", "2000")
			dlt := f.NewTopic("dlt", 1)
			if v.codec == "none" {
				f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
					SELECT gen_random_uuid(), 'Order', 'o', 'E', jsonb_build_object('pad', repeat('y', n)), 'k' || (n % 3)
					FROM generate_series(1500, 2000, 2) n`)
			} else {
				// Compressible rows past the limit, which the topic takes
				// compressed, and random ones that stay past it.
				f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
					SELECT gen_random_uuid(), 'Order', 'o', 'E', jsonb_build_object('pad', repeat('y', n)), 'k' || (n % 3)
					FROM generate_series(3000, 6000, 100) n`)
				f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
					SELECT gen_random_uuid(), 'Order', 'o', 'E',
						jsonb_build_object('pad', (SELECT string_agg(md5(random()::text || n || i), '') FROM generate_series(1, n / 32) i)), 'k' || (n % 3)
					FROM generate_series(1000, 6000, 100) n`)
			}
			rows := f.Count(`SELECT count(*) FROM outbox`)
			cfg := f.Config()
			cfg.Ordering = v.mode
			cfg.Compression = v.codec
			cfg.DeadLetterTopic = dlt
			x := outboxtest.Start(t, cfg)
			f.WaitDrained(0, 30*time.Second)
			dead := int(outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
			published := testenv.Broker().Consume(t, f.Topics["E"], rows-dead, 30*time.Second)
			require.Len(t, published, rows-dead)
			require.NotZero(t, dead, "the largest rows are over the topic's limit")
			require.NotEmpty(t, published, "the smallest rows are within it")
			// One replica and no failure: id order in both modes.
			violations, _ := orderViolations(t, published, idsByEvent(t, f))
			require.Zero(t, violations, "a record sent in a batch of its own keeps its key's order")

			if v.codec != "none" {
				larger := 0
				for _, m := range published {
					if len(m.Value) > 2000 {
						larger++
					}
				}
				require.NotZero(t, larger, "records larger than the limit uncompressed, which the topic takes compressed")
			}
			// Each dead-lettered record, sent alone as the relay sends it
			// (compressed by the same codec when it compresses), is refused.
			w := &kafka.Writer{Addr: kafka.TCP(testenv.Broker().Addr()), Topic: f.Topics["E"], RequiredAcks: kafka.RequireAll,
				BatchTimeout: time.Microsecond, BatchBytes: 1 << 20, Compression: codecs[v.codec]}
			t.Cleanup(func() { w.Close() })
			for _, m := range testenv.Broker().Consume(t, dlt, dead, 30*time.Second) {
				alone := kafka.Message{Key: m.Key, Value: m.Value}
				for _, h := range m.Headers {
					if h.Key != relay.HeaderError && h.Key != relay.HeaderOriginalTopic {
						alone.Headers = append(alone.Headers, h)
					}
				}
				var werrs kafka.WriteErrors
				err := w.WriteMessages(context.Background(), alone)
				for try := 0; errors.Is(err, kafka.UnknownTopicOrPartition) && try < 50; try++ {
					<-time.After(100 * time.Millisecond) // the writer's metadata lags behind the new topic
					err = w.WriteMessages(context.Background(), alone)
				}
				require.NotNil(t, err, "event %s (%d bytes of payload) was dead-lettered, but its topic takes it",
					testenv.Header(m, relay.HeaderEventID), len(m.Value))
				require.ErrorAs(t, err, &werrs)
				require.ErrorIs(t, werrs[0], kafka.MessageSizeTooLarge)
			}
		})
	}
}

// 7b. Without a dead-letter topic the refused row is held and reported, and
// the rows behind it (same partition included) flow.
func TestOversizedRecordHeldWithoutDeadLetterTopic(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
	f.Insert(300, 5, "E")
	x := outboxtest.Start(t, f.Config())
	f.WaitDrained(1, 30*time.Second)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id = 'big'`))
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "too_large") == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 300, 30*time.Second), 300)
}

// A compressing relay sends a record alone up to its byte budget per claim
// (--max-batch-bytes), or its topic's limit if that is larger; a row
// larger is held as too large, a limit of the relay's and no refusal of
// Kafka's, never dead-lettered, and the rows behind it flow.
func TestCompressingRelayHoldsARowOverItsByteBudget(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("e", 1, "max.message.bytes", "2000")
	dlt := f.NewTopic("dlt", 1)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', $1::int)), 'big')`, relayconfig.MinMaxBatchBytes+1000)
	f.Insert(50, 5, "E")
	cfg := f.Config()
	cfg.Compression = "gzip"
	cfg.MaxBatchBytes = relayconfig.MinMaxBatchBytes
	cfg.DeadLetterTopic = dlt
	x := outboxtest.Start(t, cfg)
	f.WaitDrained(1, 30*time.Second)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id = 'big'`))
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "too_large") == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 50, 30*time.Second), 50)
}

// With compression, a row whose record fits its topic alone but is over
// the margin a compressing relay keeps for batches is read and published
// alone, not held as too large from its size before it is read: the claim
// reads every payload a topic could take. Before, the claim's bound was
// the margin's, and such a row was held for good.
func TestCompressingRelayReadsEveryRowATopicTakes(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("big", 1, "max.message.bytes", "100000")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'near', 'E', jsonb_build_object('pad', repeat('y', 99500)), 'near')`)
	f.Insert(10, 5, "E")
	cfg := f.Config()
	cfg.Compression = "gzip"
	x := outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 11, 30*time.Second), 11)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "too_large"))
}

// A jsonb payload stored uncompressed can take several times its text: a
// row over the topic's limit by its stored size whose text fits is
// published, never held as too large (it was, for good).
func TestPayloadStoredLargerThanItsTextIsPublished(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "20000")
	f.Exec(`ALTER TABLE outbox ALTER COLUMN payload SET STORAGE EXTERNAL`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'numbers', 'E', (SELECT jsonb_agg(i % 10) FROM generate_series(1, 3000) i), 'numbers')`)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE pg_column_size(payload) > 20000 AND octet_length(payload::text) < 10000`),
		"stored, the payload is larger than the topic takes; as text it fits")
	f.Insert(10, 5, "E")
	x := outboxtest.Start(t, f.Config())
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 11, 30*time.Second), 11)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "too_large"))
}

// faultyWriter fails chosen messages of the first calls with per-message
// errors, as kafka-go reports a partial batch failure.
type faultyWriter struct {
	relay.MessageWriter
	mu    sync.Mutex
	calls int
	fail  func(call int, m kafka.Message) error
}

func (w *faultyWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	w.calls++
	call := w.calls
	w.mu.Unlock()
	werrs := make(kafka.WriteErrors, len(msgs))
	var okMsgs []kafka.Message
	failed := false
	for i, m := range msgs {
		if err := w.fail(call, m); err != nil {
			werrs[i] = err
			failed = true
			continue
		}
		okMsgs = append(okMsgs, m)
	}
	if err := w.MessageWriter.WriteMessages(ctx, okMsgs...); err != nil {
		return err
	}
	if failed {
		return werrs
	}
	return nil
}

// Only the rows Kafka acknowledged are marked: a per-message transient error
// leaves its row unpublished, to be published by a later batch.
func TestOnlyAcknowledgedRowsAreMarked(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 2, "E")
	f.Insert(200, 10, "E")
	real := &kafka.Writer{Addr: kafka.TCP(testenv.Broker().Addr()), RequiredAcks: kafka.RequireAll,
		Balancer: &kafka.Murmur2Balancer{}, BatchTimeout: time.Millisecond}
	defer real.Close()
	w := &faultyWriter{MessageWriter: real, fail: func(call int, m kafka.Message) error {
		if call == 1 && strings.HasSuffix(string(m.Key), "-3") {
			return kafka.NotLeaderForPartition
		}
		return nil
	}}
	cfg := f.Config()
	cfg.BatchSize = 200
	r, err := relay.NewWithWriter(cfg, w)
	require.NoError(t, err)
	defer r.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	// After the first call exactly the 20 rows of key order-3 are unpublished.
	require.Eventually(t, func() bool { return f.Unpublished() == 0 }, 30*time.Second, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	counts, _ := outboxtest.Deliveries(t, 200, f.Topics["E"])
	outboxtest.RequireExactlyOnce(t, f.EventIDs(""), counts)
	require.GreaterOrEqual(t, w.calls, 2)
}

// An error that says nothing about delivery (a timeout) marks nothing:
// the batch is published again (at-least-once, duplicates bounded by the batch).
func TestAmbiguousPublishErrorMarksNothing(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(30, 3, "E")
	real := &kafka.Writer{Addr: kafka.TCP(testenv.Broker().Addr()), RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer real.Close()
	var once sync.Once
	w := writerFunc(func(ctx context.Context, msgs ...kafka.Message) error {
		var fail error
		once.Do(func() {
			// Deliver for sure (a fresh topic's first write can fail), then
			// tell the relay it timed out.
			for err := real.WriteMessages(ctx, msgs...); err != nil; err = real.WriteMessages(ctx, msgs...) {
				if ctx.Err() != nil {
					t.Errorf("could not deliver the first batch: %v", err)
					break
				}
			}
			fail = context.DeadlineExceeded
		})
		if fail != nil {
			return fail
		}
		return real.WriteMessages(ctx, msgs...)
	})
	r, err := relay.NewWithWriter(f.Config(), w)
	require.NoError(t, err)
	defer r.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	f.WaitDrained(0, 30*time.Second)
	cancel()
	require.NoError(t, <-done)
	counts, _ := outboxtest.Deliveries(t, 60, f.Topics["E"])
	dups := outboxtest.RequireAtLeastOnce(t, f.EventIDs(""), counts)
	require.Equal(t, 30, dups, "the whole ambiguous batch is published again, nothing more")
}

type writerFunc func(ctx context.Context, msgs ...kafka.Message) error

func (f writerFunc) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	return f(ctx, msgs...)
}

// 10. A schema-qualified table works; its name is quoted, never spliced raw.
func TestSchemaQualifiedTable(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(outbox.SchemaDDL(outbox.Table{Schema: "app", Name: "events_outbox"}))
	f.Exec(`INSERT INTO app.events_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 'k' FROM generate_series(1, 50)`)
	cfg := f.Config()
	cfg.Table = "app.events_outbox"
	outboxtest.Start(t, cfg)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM app.events_outbox WHERE published_at IS NULL`) == 0
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 50, f.Unpublished()+50, "the default outbox table was not touched")
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 50, 30*time.Second), 50)
}

func TestHostileTableNamesRefused(t *testing.T) {
	t.Parallel()
	for _, name := range []string{
		`outbox; DROP TABLE users`, `"outbox"`, `Outbox`, `a.b.c`, `outbox--`, ``, `.outbox`, `app.`,
		`o` + strings.Repeat("x", 63), `a b`, `outbox'`,
	} {
		_, err := outbox.ParseTable(name)
		require.Error(t, err, "table %q", name)
		cfg := relay.Config{Settings: relay.Settings{DSN: "postgres://x", Table: name, Brokers: []string{"k:9092"}, Topics: map[string]string{"E": "t"}}}
		if name == "" {
			continue // empty means the default
		}
		_, err = relay.New(cfg)
		require.ErrorContains(t, err, "table")
	}
	for _, name := range []string{"outbox", "app.outbox", "_x.y_1", strings.Repeat("x", 63)} {
		_, err := outbox.ParseTable(name)
		require.NoError(t, err, name)
	}
}

// Start-up checks name what is missing: the table, a column, the partial
// index (with its DDL).
func TestStartupChecks(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	check := func(cfg relay.Config) error {
		r, err := relay.New(cfg)
		require.NoError(t, err)
		defer r.Close()
		return r.Check(context.Background())
	}
	cfg := f.Config()
	require.NoError(t, check(cfg))

	cfg.Table = "nope"
	require.ErrorContains(t, check(cfg), "table nope does not exist")

	// A missing topic is no failed check: its rows wait as a topic down
	// (TestMissingTopicAtStartHoldsOnlyItsRows).
	cfg = f.Config()
	cfg.Topics = map[string]string{"E": "missing.topic"}
	cfg.DeadLetterTopic = "missing.dlt"
	require.NoError(t, check(cfg))

	cfg = f.Config()
	cfg.Brokers = []string{"127.0.0.1:1"}
	err := check(cfg)
	var unreachable *relay.UnreachableError
	require.True(t, errors.As(err, &unreachable), "unreachable broker is retryable: %v", err)

	f.Exec(`DROP INDEX ix_outbox_unpublished`)
	err = check(f.Config())
	require.ErrorContains(t, err, "no partial index")
	require.ErrorContains(t, err, `CREATE INDEX CONCURRENTLY "ix_outbox_unpublished" ON "outbox" (id) WHERE published_at IS NULL`)

	f.Exec(`ALTER TABLE outbox DROP COLUMN partition_key`)
	require.ErrorContains(t, check(f.Config()), "column partition_key is missing")

}

// The claim query uses the partial index even after a large drain leaves the
// table churned: planner statistics ignore dead rows, and a generic plan made
// while the table was small could stay a sequential scan.
func TestClaimPlanUsesPartialIndexAfterDrain(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 4, "E")
	f.Insert(30000, 100, "E")
	cfg := f.Config()
	cfg.BatchSize = 500
	outboxtest.Start(t, cfg)
	f.WaitDrained(0, 2*time.Minute)
	f.Exec(`ANALYZE outbox`)
	f.Insert(10, 5, "E")
	var plan strings.Builder
	rows, err := f.Pool.Query(context.Background(), `EXPLAIN SELECT id FROM outbox WHERE published_at IS NULL AND id > 0 AND event_type = ANY('{E}') AND id <> ALL('{}') ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED`)
	require.NoError(t, err)
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan.WriteString(line + "\n")
	}
	require.Contains(t, plan.String(), "ix_outbox_unpublished", plan.String())
	require.NotContains(t, plan.String(), "Seq Scan", plan.String())
}

func TestConfigValidationNamesFieldAndValue(t *testing.T) {
	t.Parallel()
	ok := relay.Config{Settings: relay.Settings{DSN: "postgres://x", Brokers: []string{"k:9092"}, Topics: map[string]string{"E": "t"}}}
	cases := map[string]func(c *relay.Config){
		`batch-size: 20000`:                      func(c *relay.Config) { c.BatchSize = 20000 },
		`poll-interval: 2h0m0s`:                  func(c *relay.Config) { c.PollInterval = 2 * time.Hour },
		`brokers: "nohost"`:                      func(c *relay.Config) { c.Brokers = []string{"nohost"} },
		`brokers: "k:99999" has an invalid port`: func(c *relay.Config) { c.Brokers = []string{"k:99999"} },
		`topic: event type "E": "bad topic"`:     func(c *relay.Config) { c.Topics = map[string]string{"E": "bad topic"} },
		`topic: event type "E": ".."`:            func(c *relay.Config) { c.Topics = map[string]string{"E": ".."} },
		`topic: event type "" must be`:           func(c *relay.Config) { c.Topics = map[string]string{"": "t"} },
		`topic: at least one`:                    func(c *relay.Config) { c.Topics = nil },
		`dead-letter-topic: "t" is also`:         func(c *relay.Config) { c.DeadLetterTopic = "t" },
		`dead-letter-topic: "a/b"`:               func(c *relay.Config) { c.DeadLetterTopic = "a/b" },
		`dsn: required`:                          func(c *relay.Config) { c.DSN = "" },
		`ordering: "sorted"`:                     func(c *relay.Config) { c.Ordering = "sorted" },
	}
	for want, mutate := range cases {
		c := ok
		mutate(&c)
		_, err := relay.New(c)
		require.ErrorContains(t, err, want, fmt.Sprintf("%+v", c))
		var fe *relayconfig.FieldError
		require.ErrorAs(t, err, &fe, "the bad field is data, not only text")
	}
	r, err := relay.New(ok)
	require.NoError(t, err)
	require.NoError(t, r.Close())
}

// A bytea payload is sized by its length, not by its text form (hex, twice
// as long): a compressed 15,000-byte payload on a topic that takes 20,000
// bytes goes out, where its hex length would have held it as too large
// without reading it.
func TestByteaPayloadIsSizedByItsLength(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("bytes", 1, "max.message.bytes", "20000")
	f.Exec(`ALTER TABLE outbox ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')`)
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'o1', 'E', convert_to(repeat('y', 15000), 'UTF8'), 'o1')`)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE pg_column_compression(payload) IS NOT NULL`), "stored compressed")
	x := outboxtest.Start(t, f.Config())
	f.WaitDrained(0, 30*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 30*time.Second)
	require.Len(t, msgs, 1)
	require.Len(t, msgs[0].Value, 15000)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge))
}

// A table whose id is an integer (the start-up check takes one) is
// claimed, published and pruned in every mode. Before, each claim from the
// start of the index compared the id with the lowest bigint, sent as an
// integer, which pgx refused to encode: the relay published nothing.
func TestAnIntegerIDIsPublishedAndPruned(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"none", "partition-key", "logical-replication"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			f, cfg := modeFixture(t, mode)
			f.Exec(`ALTER TABLE outbox ALTER COLUMN id TYPE integer`)
			f.Insert(5, 2, "E")
			requirePublishedThenPruned(t, f, cfg)
		})
	}
}

// Rows with an id of 0 or below (a sequence that starts there, ids given
// by hand) are claimed and pruned like any other, in either ordering and
// swept when streaming. Before, claims, sweeps and the pruner started after
// id 0: such rows were never published.
func TestRowsWithIdsAtOrBelowZeroArePublishedAndPruned(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"none", "partition-key", "logical-replication"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			f, cfg := modeFixture(t, mode)
			f.Exec(`INSERT INTO outbox (id, event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
				OVERRIDING SYSTEM VALUE
				SELECT i, gen_random_uuid(), 'Order', 'o' || i, 'E', '{}', 'o' || i
				FROM unnest(ARRAY[-9223372036854775807, -5, 0]::bigint[]) i`)
			f.Insert(2, 2, "E")
			requirePublishedThenPruned(t, f, cfg)
		})
	}
}

// requirePublishedThenPruned runs a relay with retention on f's five rows
// of type E: each reaches Kafka, and once published an hour ago each is
// pruned.
func requirePublishedThenPruned(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
	t.Helper()
	want := f.EventIDs("")
	require.Len(t, want, 5)
	cfg.KeepPublishedFor = time.Minute
	r := run(t, cfg, nil)
	f.WaitDrained(0, 30*time.Second)
	counts, _ := outboxtest.Deliveries(t, 5, f.Topics["E"])
	outboxtest.RequireAtLeastOnce(t, want, counts)

	f.Exec(`UPDATE outbox SET published_at = published_at - interval '1 hour'`)
	require.Eventually(t, func() bool { return f.Count(`SELECT count(*) FROM outbox`) == 0 }, 30*time.Second, 50*time.Millisecond,
		"pruned: %v rows", outboxtest.MetricValue(t, r.Reg, "outbox_relay_pruned_rows_total"))
}
