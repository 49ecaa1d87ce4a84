package events_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outbox-relay/outbox-operator/examples/consumer/events"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka))
}

// A service stores an event in a span; the relay publishes it; the consumer
// processes it once however often it is delivered, in the writer's trace.
func TestProcessOnceInTheWritersTrace(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "OrderConfirmed")
	f.Exec(events.Schema)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	ctx, span := sdktrace.NewTracerProvider().Tracer("orderservice").Start(context.Background(), "ConfirmOrder")
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	id := outbox.NewEventID()
	require.NoError(t, outbox.Store(ctx, tx, outbox.Entry{EventID: id, AggregateType: "Order", AggregateID: "o1",
		EventType: "OrderConfirmed", Payload: []byte(`{"order_id":"o1"}`), PartitionKey: "o1"}))
	require.NoError(t, tx.Commit(ctx))
	span.End()

	outboxtest.Start(t, f.Config())
	msgs := testenv.Broker().Consume(t, f.Topics["OrderConfirmed"], 1, 30*time.Second)
	require.Len(t, msgs, 1)

	spans := tracetest.NewSpanRecorder()
	var handled []events.Event
	p := &events.Processor{
		DB:     f.Pool,
		Tracer: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)).Tracer("consumer"),
		Handle: func(_ context.Context, _ pgx.Tx, e events.Event) error { handled = append(handled, e); return nil },
	}
	for range 3 { // the relay delivers at least once
		_, err := p.Process(context.Background(), msgs[0])
		require.NoError(t, err)
	}
	require.Len(t, handled, 1, "processed once")
	require.Equal(t, id, handled[0].ID)
	require.Equal(t, "OrderConfirmed", handled[0].Type)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM processed_events WHERE event_id = $1`, id))
	ended := spans.Ended()
	require.Len(t, ended, 3)
	for _, s := range ended {
		require.Equal(t, span.SpanContext().TraceID(), s.SpanContext().TraceID(), "the consumer continues the writer's trace")
		require.Equal(t, span.SpanContext().SpanID(), s.Parent().SpanID())
	}
}
