package outbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

func store(t *testing.T, f *outboxtest.Fixture, ctx context.Context, e outbox.Entry) error {
	t.Helper()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	if err := outbox.Store(ctx, tx, e); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// The writer refuses the relay's own header names and headers over the limits.
func TestStoreRefusesBadHeaders(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	cases := map[string]map[string]string{
		`reserved for the relay: "Event_ID", "ce_type", "content-type", "outbox_error"`: {
			"Event_ID": "x", "ce_type": "x", "content-type": "x", "outbox_error": "x", "fine": "x"},
		"an empty name":            {"": "x"},
		"not valid UTF-8":          {"k": "\xff"},
		"headers hold 16385 bytes": {"k": strings.Repeat("x", outbox.MaxHeaderBytes)},
		"65 headers, at most 64":   manyHeaders(65),
	}
	for want, h := range cases {
		e := entry()
		e.Headers = h
		require.ErrorContains(t, store(t, f, context.Background(), e), want)
	}
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`))
	for _, name := range []string{"event_id", "EVENT_TYPE", "aggregate_type", "aggregate_id", "outbox_original_topic", "ce_id", "Content-Type"} {
		require.True(t, outbox.IsReservedHeader(name), name)
	}
	for _, name := range []string{"traceparent", "tenant", "eventid", "x-ce_id"} {
		require.False(t, outbox.IsReservedHeader(name), name)
	}
}

func manyHeaders(n int) map[string]string {
	h := map[string]string{}
	for i := range n {
		h[strings.Repeat("k", i+1)] = "v"
	}
	return h
}

// Headers are stored; a retried handler stores its entry once even though
// its trace context changed, while other headers under the same id conflict.
func TestStoreHeadersAndTraceContext(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	tracer := sdktrace.NewTracerProvider().Tracer("test")
	e := entry()
	e.Headers = map[string]string{"tenant": "t1"}

	ctx, span := tracer.Start(context.Background(), "first try")
	require.NoError(t, store(t, f, ctx, e))
	span.End()
	var stored map[string]string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT headers FROM outbox WHERE event_id = $1`, e.EventID).Scan(&stored))
	require.Equal(t, "t1", stored["tenant"])
	require.Equal(t, "00-"+span.SpanContext().TraceID().String()+"-"+span.SpanContext().SpanID().String()+"-01", stored["traceparent"])

	ctx, span = tracer.Start(context.Background(), "second try")
	defer span.End()
	require.NoError(t, store(t, f, ctx, e), "the same entry from another trace is the same event")
	other := e
	other.Headers = map[string]string{"tenant": "t2"}
	require.ErrorIs(t, store(t, f, ctx, other), outbox.ErrEventIDConflict)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox`))

	plain := entry()
	require.NoError(t, store(t, f, context.Background(), plain))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1 AND headers IS NULL`, plain.EventID),
		"no headers and no span: NULL")
}

// A table made before the headers column: entries without headers are
// stored, the trace context is dropped, explicit headers are an error that
// says how to add the column.
func TestStoreOnTableWithoutHeadersColumn(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Exec(`ALTER TABLE outbox DROP COLUMN headers`)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	ctx, span := sdktrace.NewTracerProvider().Tracer("test").Start(context.Background(), "handler")
	defer span.End()
	require.NoError(t, store(t, f, context.Background(), entry()))
	require.NoError(t, store(t, f, ctx, entry()))
	e := entry()
	e.Headers = map[string]string{"tenant": "t1"}
	require.ErrorContains(t, store(t, f, ctx, e), `has no headers column; add it with: ALTER TABLE "outbox" ADD COLUMN headers jsonb`)
	require.Equal(t, 2, f.Count(`SELECT count(*) FROM outbox`))
}

// Headers that fit alone but not with the trace context are stored without it:
// the relay would otherwise hold the row as invalid.
func TestTraceContextNeverPushesHeadersOverTheLimit(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	ctx, span := sdktrace.NewTracerProvider().Tracer("test").Start(context.Background(), "handler")
	defer span.End()
	e := entry()
	e.Headers = map[string]string{"big": strings.Repeat("x", outbox.MaxHeaderBytes-len("big"))}
	require.NoError(t, store(t, f, ctx, e))
	var stored []byte
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT headers FROM outbox WHERE event_id = $1`, e.EventID).Scan(&stored))
	h, err := outbox.ParseHeaders(stored)
	require.NoError(t, err, "what the writer stores, the relay accepts")
	require.NotContains(t, h, "traceparent")
}

// fieldless is a propagator that injects a header and names no fields, as
// a hand-written one may.
type fieldless struct{}

func (fieldless) Inject(_ context.Context, c propagation.TextMapCarrier) { c.Set("x-trace", "1") }
func (fieldless) Extract(ctx context.Context, _ propagation.TextMapCarrier) context.Context {
	return ctx
}
func (fieldless) Fields() []string { return nil }

// A propagator whose Fields is nil: a retried store is still the same
// event, on a plain table and a partitioned one, and other headers under
// the id still conflict. Before, the nil went as NULL, so a retry on a
// plain table conflicted and other headers on a partitioned one did not.
// Not parallel: it sets the global propagator, which the parallel tests,
// run after it, set again.
func TestStoreWithAPropagatorWithoutFields(t *testing.T) {
	otel.SetTextMapPropagator(fieldless{})
	// Back to a propagator that injects nothing, as the default does:
	// what GetTextMapPropagator returned before is the global delegate,
	// which the first Set bound to fieldless, so setting it back would keep
	// fieldless.
	t.Cleanup(func() { otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator()) })
	for _, partitioned := range []bool{false, true} {
		f := outboxtest.NewFixture(t, 1)
		if partitioned {
			f.Exec(`DROP TABLE outbox`)
			f.Exec(outbox.PartitionedSchemaDDL(outbox.Table{Name: "outbox"}, outbox.PartitionDay, 1))
		}
		e := entry()
		e.Headers = map[string]string{"tenant": "t1"}
		require.NoError(t, store(t, f, context.Background(), e))
		require.NoError(t, store(t, f, context.Background(), e), "partitioned %v: a retry is the same event", partitioned)
		other := e
		other.Headers = map[string]string{"tenant": "t2"}
		require.ErrorIs(t, store(t, f, context.Background(), other), outbox.ErrEventIDConflict, "partitioned %v", partitioned)
	}
}
