package relay_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	cloudevent "github.com/cloudevents/sdk-go/v2/event"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/examples/consumer/events"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// insertWithHeaders adds one row of type E whose headers column is headers
// (SQL text, or NULL) and returns its event id.
func insertWithHeaders(f *outboxtest.Fixture, key, headers string) string {
	f.T.Helper()
	id := outbox.NewEventID()
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, headers)
		VALUES ($1, 'Order', $2, 'E', '{"n":1}', $2, `+headers+`)`, id, key)
	return id
}

// The row's headers become record headers after the relay's own; names the
// relay sets itself are skipped and counted; malformed headers hold the row
// alone (invalid_row) while the rest flows.
func TestRowHeadersBecomeRecordHeaders(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 2, "E")
	plain := insertWithHeaders(f, "a", `'{"tenant":"t1","x-request-id":"r-9"}'`)
	none := insertWithHeaders(f, "b", `NULL`)
	reserved := insertWithHeaders(f, "c", `'{"event_id":"forged","Outbox_error":"x","ce_id":"y","content-type":"text/plain","tenant":"t2"}'`)
	bad := map[string]string{
		"array":      insertWithHeaders(f, "d", `'["a"]'`),
		"number":     insertWithHeaders(f, "e", `'{"a":1}'`),
		"json null":  insertWithHeaders(f, "f", `'null'`),
		"oversize":   insertWithHeaders(f, "g", `jsonb_build_object('big', repeat('x', 20000))`),
		"empty name": insertWithHeaders(f, "h", `'{"":"v"}'`),
	}
	x := outboxtest.Start(t, f.Config())
	f.WaitDrained(len(bad), 30*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 3, 30*time.Second)
	require.Len(t, msgs, 3)
	byID := map[string]map[string]string{}
	for _, m := range msgs {
		e, err := events.Read(m)
		require.NoError(t, err)
		byID[e.ID] = e.Headers
		require.Equal(t, []string{"event_id", "event_type", "aggregate_type", "aggregate_id"},
			[]string{m.Headers[0].Key, m.Headers[1].Key, m.Headers[2].Key, m.Headers[3].Key}, "the relay's headers come first")
	}
	require.Equal(t, "t1", byID[plain]["tenant"])
	require.Equal(t, "r-9", byID[plain]["x-request-id"])
	require.Len(t, byID[none], 4, "no headers column value: the relay's headers only")
	require.Equal(t, reserved, byID[reserved]["event_id"], "a row cannot forge the relay's headers")
	require.Equal(t, "t2", byID[reserved]["tenant"])
	for _, k := range []string{"Outbox_error", "ce_id", "content-type"} {
		require.NotContains(t, byID[reserved], k)
	}
	require.Equal(t, 4.0, outboxtest.MetricValue(t, x.Reg, "outbox_relay_headers_skipped_total"))
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldInvalidRow) == float64(len(bad))
	}, 10*time.Second, 50*time.Millisecond)
	for what, id := range bad {
		require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1 AND published_at IS NULL`, id), what)
	}
}

// A table made before the headers column keeps working: the claim never
// names the column, and records carry the relay's headers.
func TestTableWithoutHeadersColumn(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(`ALTER TABLE outbox DROP COLUMN headers`)
	f.Insert(20, 5, "E")
	outboxtest.Start(t, f.Config())
	f.WaitDrained(0, 30*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 20, 30*time.Second)
	require.Len(t, msgs, 20)
	require.Len(t, msgs[0].Headers, 4)

	sql := relay.NewSQL(outbox.Table{Name: "outbox"})
	for _, stmt := range []string{sql.Claim, sql.ClaimBuckets} {
		require.NotContains(t, stmt, ", headers", "without the option the claim never reads the column")
	}
	require.Contains(t, relay.NewSQL(outbox.Table{Name: "outbox"}, relay.WithHeadersColumn()).Claim, ", headers")
}

// --format cloudevents: every record decodes with the CloudEvents SDK into a
// valid event (binary content mode), and keeps the raw format's headers.
func TestCloudEventsFormat(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 2, "OrderConfirmed")
	f.Insert(10, 3, "OrderConfirmed")
	custom := insertWithHeaders(f, "k", `'{"tenant":"t1"}'`)
	f.Exec(`UPDATE outbox SET event_type = 'OrderConfirmed'`)
	type stored struct {
		aggID, payload string
		created        time.Time
	}
	want := map[string]stored{}
	rows, err := f.Pool.Query(t.Context(), `SELECT event_id::text, aggregate_id, payload::text, created_at FROM outbox`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var s stored
		require.NoError(t, rows.Scan(&id, &s.aggID, &s.payload, &s.created))
		want[id] = s
	}
	require.NoError(t, rows.Err())

	cfg := f.Config()
	cfg.Format = relay.FormatCloudEvents
	outboxtest.Start(t, cfg)
	msgs := testenv.Broker().Consume(t, f.Topics["OrderConfirmed"], len(want), 30*time.Second)
	require.Len(t, msgs, len(want))
	for _, m := range msgs {
		ev, err := events.CloudEvent(m)
		require.NoError(t, err)
		s, ok := want[ev.ID()]
		require.True(t, ok, "ce_id is the event id: %s", ev.ID())
		require.Equal(t, "1.0", ev.SpecVersion())
		require.Equal(t, "OrderConfirmed", ev.Type())
		require.Equal(t, "/outbox/outbox", ev.Source())
		require.Equal(t, s.aggID, ev.Subject())
		require.True(t, s.created.Equal(ev.Time()), "ce_time %s is created_at %s", ev.Time(), s.created)
		require.Equal(t, "application/json", ev.DataContentType())
		require.JSONEq(t, s.payload, string(ev.Data()))
		var data map[string]any
		require.NoError(t, json.Unmarshal(ev.Data(), &data))
		e, err := events.Read(m)
		require.NoError(t, err, "the raw format's headers are kept")
		require.Equal(t, ev.ID(), e.ID)
		if ev.ID() == custom {
			require.Equal(t, "t1", e.Headers["tenant"])
		}
		require.Empty(t, ev.Extensions(), "no header but the binding's own starts with ce_")
	}
}

// --cloudevents-source sets ce_source.
func TestCloudEventsSource(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(1, 1, "E")
	cfg := f.Config()
	cfg.Format = relay.FormatCloudEvents
	cfg.CloudEventsSource = "https://orders.example/outbox"
	outboxtest.Start(t, cfg)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 30*time.Second)
	ev, err := events.CloudEvent(msgs[0])
	require.NoError(t, err)
	require.Equal(t, cfg.CloudEventsSource, ev.Source())

	cfg.CloudEventsSource = "not a uri"
	_, err = relay.New(cfg)
	require.ErrorContains(t, err, "cloudevents-source")
}

// Every codec round-trips through the real broker: each row once, payload
// and headers intact.
func TestCompressionCodecs(t *testing.T) {
	t.Parallel()
	for _, c := range []relay.Compression{"none", "gzip", "snappy", "lz4", "zstd"} {
		t.Run(string(c), func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 2, "E")
			f.Insert(300, 20, "E")
			cfg := f.Config()
			cfg.Compression = c
			outboxtest.Start(t, cfg)
			f.WaitDrained(0, 60*time.Second)
			counts, msgs := outboxtest.Deliveries(t, 300, f.Topics["E"])
			outboxtest.RequireExactlyOnce(t, f.EventIDs(""), counts)
			for _, m := range msgs {
				require.True(t, json.Valid(m.Value))
				require.Contains(t, string(m.Value), `"seq"`)
			}
		})
	}
	_, err := relay.New(relay.Config{Settings: relay.Settings{DSN: "postgres://x", Brokers: []string{"k:9092"}, Topics: map[string]string{"E": "t"}, Compression: "brotli"}})
	require.ErrorContains(t, err, `compression: "brotli" is not one of`)
}

// Headers count toward the claim's byte budget: rows with 12 KiB of headers
// and tiny payloads fill a 64 KiB budget after six rows.
func TestHeadersCountTowardTheByteBudget(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	for i := range 40 {
		insertWithHeaders(f, "k", fmt.Sprintf(`(SELECT jsonb_object_agg('h' || g, repeat(md5(g::text || '%d'), 6)) FROM generate_series(1, 60) g)`, i))
	}
	cfg := f.Config()
	cfg.MaxBatchBytes = 64 << 10
	cfg.BatchSize = 40
	x := outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	var batches, rows float64
	require.Eventually(t, func() bool { // the last batch is counted once its commit is settled, after the rows show published
		var err error
		batches, rows, err = outboxtest.ReadMetric(x.Reg, "outbox_relay_batch_size_rows")
		return err == nil && rows == 40
	}, 10*time.Second, 20*time.Millisecond, "%v rows counted", rows)
	require.LessOrEqual(t, rows/batches, 6.0, "%v rows in %v batches", rows, batches)
}

// The record's timestamp is the row's created_at by default (Kafka keeps
// it: the topic's timestamps are CreateTime), or the publish time.
func TestRecordTimestamp(t *testing.T) {
	t.Parallel()
	for _, mode := range []relay.RecordTimestamp{"", relay.RecordTimestampPublish} {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 1, "E")
			created := time.Date(2026, 3, 4, 5, 6, 7, 123_000_000, time.UTC)
			f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
				VALUES ($1, 'Order', 'a', 'E', '{}', 'a', $2)`, outbox.NewEventID(), created)
			cfg := f.Config()
			cfg.RecordTimestamp = mode
			before := time.Now()
			outboxtest.Start(t, cfg)
			f.WaitDrained(0, 30*time.Second)
			msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 30*time.Second)
			require.Len(t, msgs, 1)
			if mode == relay.RecordTimestampPublish {
				require.WithinDuration(t, time.Now(), msgs[0].Time, time.Since(before)+time.Second, "the publish time")
				return
			}
			require.True(t, created.Equal(msgs[0].Time), "created_at %s, record %s", created, msgs[0].Time)
		})
	}
}

// In a CloudEvents format a row's ce_* headers set attributes: subject
// and datacontenttype replace the relay's, dataschema and extensions are
// added; a bad one holds the row with the reason while the rest flows. The
// CloudEvents SDK decodes and validates every record, in both content modes.
func TestCloudEventsAttributesFromHeaders(t *testing.T) {
	t.Parallel()
	for _, format := range []relay.Format{relay.FormatCloudEvents, relay.FormatCloudEventsStructured} {
		t.Run(string(format), func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 1, "E")
			rich := insertWithHeaders(f, "a", `'{"ce_subject":"orders/42","ce_dataschema":"https://schemas.example/order.json","ce_tenantid":"t1","tenant":"plain"}'`)
			plain := insertWithHeaders(f, "b", `NULL`)
			bad := map[string]string{
				"a relative dataschema":    insertWithHeaders(f, "c", `'{"ce_dataschema":"order.json"}'`),
				"an upper-case extension":  insertWithHeaders(f, "d", `'{"ce_TenantID":"t1"}'`),
				"an extension named data":  insertWithHeaders(f, "e", `'{"ce_data":"x"}'`),
				"a media type that is not": insertWithHeaders(f, "g", `'{"ce_datacontenttype":"json please"}'`),
			}
			cfg := f.Config()
			cfg.Format = format
			x := outboxtest.Start(t, cfg)
			f.WaitDrained(len(bad), 30*time.Second)
			msgs := testenv.Broker().Consume(t, f.Topics["E"], 2, 30*time.Second)
			require.Len(t, msgs, 2)
			for _, m := range msgs {
				var ev *cloudevent.Event
				if format == relay.FormatCloudEvents {
					var err error
					ev, err = events.CloudEvent(m)
					require.NoError(t, err)
				} else {
					e := cloudevent.New()
					require.NoError(t, json.Unmarshal(m.Value, &e), "%s", m.Value)
					require.NoError(t, e.Validate())
					ev = &e
					require.Contains(t, m.Headers, kafka.Header{Key: "content-type", Value: []byte(relay.CloudEventsStructuredContentType)})
				}
				require.JSONEq(t, `{"n":1}`, string(ev.Data()))
				r, err := events.Read(m)
				require.NoError(t, err, "the raw format's headers are kept")
				switch ev.ID() {
				case rich:
					require.Equal(t, "orders/42", ev.Subject(), "the row's subject")
					require.Equal(t, "https://schemas.example/order.json", ev.DataSchema())
					require.Equal(t, "t1", ev.Extensions()["tenantid"])
					require.Equal(t, "plain", r.Headers["tenant"], "other headers stay headers")
					n := 0
					for _, h := range m.Headers {
						if h.Key == "ce_subject" {
							n++
						}
					}
					require.Equal(t, map[relay.Format]int{relay.FormatCloudEvents: 1, relay.FormatCloudEventsStructured: 0}[format], n,
						"the row's ce_subject is the attribute, once (binary) or in the value only (structured)")
				case plain:
					require.Equal(t, "b", ev.Subject(), "aggregate_id by default")
					require.Empty(t, ev.Extensions())
				default:
					t.Fatalf("unexpected event %s", ev.ID())
				}
			}
			require.Equal(t, float64(len(bad)), outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldInvalidRow))
		})
	}
}

// A topic that takes records from the last hour only
// (message.timestamp.before.max.ms) refuses a row written before that with
// INVALID_TIMESTAMP, and would refuse it at every retry, so its key would
// never move again; one more than an hour ahead of the broker's clock
// (message.timestamp.after.max.ms, a row whose writer's clock is ahead) is
// refused too. The relay sends such rows stamped with the publish time
// instead, in their key's order, among rows it takes; nothing is held or
// dead-lettered. It reads the topic's window and stamps the old rows so
// before it sends them; the one ahead it sends again once refused.
func TestRowOutsideItsTopicsTimestampWindowGoesOutStampedWithThePublishTime(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	cfg.Topics = map[string]string{"E": f.NewTopic("lasthour", 1,
		"message.timestamp.before.max.ms", "3600000", "message.timestamp.after.max.ms", "3600000")}
	cfg.DeadLetterTopic = f.NewTopic("dlq", 1)
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	insert := func(key, at string) string {
		id := outbox.NewEventID()
		f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
			VALUES ($1, 'Order', $2, 'E', '{}', $2, now() + $3::interval)`, id, key, at)
		return id
	}
	want := []string{
		insert("a", "-2 hours"), insert("a", "0"), insert("b", "0"), insert("a", "-3 hours"), insert("a", "2 hours"), insert("a", "0"),
	}
	restamped := map[string]bool{want[0]: true, want[3]: true, want[4]: true}
	before := time.Now()
	x := outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	var got []string
	for _, m := range testenv.Broker().Consume(t, cfg.Topics["E"], len(want), 30*time.Second) {
		id := header(m, relay.HeaderEventID)
		got = append(got, id)
		if restamped[id] {
			require.WithinDuration(t, time.Now(), m.Time, time.Since(before)+time.Second, "stamped with the publish time")
		} else {
			require.Less(t, time.Since(m.Time), time.Since(before)+time.Minute, "a row in the window keeps its created_at")
		}
	}
	require.Equal(t, want, got, "every row once, in id order (one partition)")
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox_held`), "nothing held")
	require.Equal(t, 3.0, outboxtest.MetricValue(t, x.Reg, "outbox_relay_records_restamped_total"), "each row outside the window counted once")
	refused := regexp.MustCompile(`refused the row's created_at.* event_id=(\S+)`).FindAllStringSubmatch(logs.String(), -1)
	require.Len(t, refused, 1, "only the row ahead of the window was refused first: %v", refused)
	require.Equal(t, want[4], refused[0][1])
}

// lockedBuffer is a log destination the relay's goroutines share.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A row too large for its topic goes to the dead-letter topic, whose window
// of timestamps is its own: a row its topic takes by age (no limit there)
// can be too old for the dead-letter topic. It goes out stamped with the
// publish time, not held for ever while it grows older.
func TestDeadLetterTopicsTimestampWindowIsItsOwn(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	cfg := f.Config()
	cfg.Topics = map[string]string{"E": f.NewTopic("small", 1, "max.message.bytes", "2000")}
	cfg.DeadLetterTopic = f.NewTopic("dlq-lasthour", 1, "message.timestamp.before.max.ms", "3600000")
	ids := map[string]bool{}
	for _, age := range []string{"2 days", "5 minutes"} {
		id := outbox.NewEventID()
		ids[id] = true
		f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
			VALUES ($1, 'Order', 'a', 'E', jsonb_build_object('big', repeat('x', 5000)), 'a', now() - $2::interval)`, id, age)
	}
	before := time.Now()
	x := outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	for _, m := range testenv.Broker().Consume(t, cfg.DeadLetterTopic, len(ids), 30*time.Second) {
		id := header(m, relay.HeaderEventID)
		require.True(t, ids[id], "an unknown record %q", id)
		delete(ids, id)
		require.Greater(t, m.Time, before.Add(-time.Hour), "a record the dead-letter topic took is in its window")
	}
	require.Empty(t, ids, "every row dead-lettered once")
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox_held`), "nothing held")
	require.Equal(t, 2.0, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
}
