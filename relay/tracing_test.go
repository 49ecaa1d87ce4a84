package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-operator/examples/consumer/events"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// storeTraced stores one event inside a span of the writer's tracer and
// returns the event id and the span's context.
func storeTraced(t *testing.T, f *outboxtest.Fixture, tp trace.TracerProvider) (string, trace.SpanContext) {
	t.Helper()
	// Services set the global propagator; the writer records through it.
	otel.SetTextMapPropagator(propagation.TraceContext{})
	ctx, span := tp.Tracer("orderservice").Start(context.Background(), "ConfirmOrder")
	defer span.End()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	id := outbox.NewEventID()
	require.NoError(t, outbox.Store(ctx, tx, outbox.Entry{EventID: id, AggregateType: "Order", AggregateID: "o1",
		EventType: "E", Payload: []byte(`{"a":1}`), PartitionKey: "o1", Headers: map[string]string{"tenant": "t1"}}))
	require.NoError(t, tx.Commit(ctx))
	return id, span.SpanContext()
}

// One trace from the writer's span, through the row and the relay's producer
// span, to the record the consumer reads.
func TestTraceContextEndToEnd(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	writerTP := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter()))
	id, writer := storeTraced(t, f, writerTP)
	var stored map[string]string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT headers FROM outbox WHERE event_id = $1`, id).Scan(&stored))
	require.Equal(t, "t1", stored["tenant"])
	require.Contains(t, stored["traceparent"], writer.TraceID().String(), "the writer recorded its trace context in the row")

	spans := tracetest.NewInMemoryExporter()
	cfg := f.Config()
	cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	outboxtest.Start(t, cfg)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 30*time.Second)
	require.Len(t, msgs, 1)
	e, err := events.Read(msgs[0])
	require.NoError(t, err)
	require.Equal(t, "t1", e.Headers["tenant"])
	consumer := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(e.Headers)))
	require.Equal(t, writer.TraceID(), consumer.TraceID(), "the consumer continues the writer's trace")

	var send tracetest.SpanStub
	require.Eventually(t, func() bool {
		for _, s := range spans.GetSpans() {
			if s.Name == "send "+f.Topics["E"] {
				send = s
				return true
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, trace.SpanKindProducer, send.SpanKind)
	require.Equal(t, writer.TraceID(), send.SpanContext.TraceID())
	require.Equal(t, writer.SpanID(), send.Parent.SpanID(), "the relay's span is a child of the writer's")
	require.Equal(t, send.SpanContext.SpanID(), consumer.SpanID(), "the record carries the relay's span as parent")
	attrs := map[attribute.Key]string{}
	for _, kv := range send.Attributes {
		attrs[kv.Key] = kv.Value.Emit()
	}
	require.Equal(t, "kafka", attrs["messaging.system"])
	require.Equal(t, f.Topics["E"], attrs["messaging.destination.name"])
	require.Equal(t, id, attrs["messaging.message.id"])
	require.Equal(t, "send", attrs["messaging.operation.type"])
}

// With tracing off the relay records nothing and forwards the writer's
// trace context as stored.
func TestTraceContextForwardedWithoutTracing(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	writerTP := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter()))
	_, writer := storeTraced(t, f, writerTP)
	outboxtest.Start(t, f.Config())
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 30*time.Second)
	require.Len(t, msgs, 1)
	got := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(),
		propagation.MapCarrier{"traceparent": testenv.Header(msgs[0], "traceparent")}))
	require.Equal(t, writer.TraceID(), got.TraceID())
	require.Equal(t, writer.SpanID(), got.SpanID(), "forwarded unchanged")
}
