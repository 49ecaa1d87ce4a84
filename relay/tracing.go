package relay

import (
	"context"
	"strconv"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
)

// tracerName is the instrumentation scope of the relay's spans.
const tracerName = "github.com/outbox-relay/outbox-operator/relay"

// traceContext reads and writes the W3C traceparent and tracestate headers:
// the writer stores them in the headers column, and consumers read them from
// the record. The relay uses this propagator, never the process's global
// one, so the record's trace headers do not depend on how the process that
// embeds the library is set up.
var traceContext propagation.TraceContext

// startSpan starts row x's producer span, a child of the trace context in
// its headers (the writer's span), and puts the span's own context in the
// row's headers in its place, so the consumer continues the trace from the
// relay's span.
func (r *Relay) startSpan(x *row, topic string) trace.Span {
	carrier := headerCarrier{&x.custom}
	parent := traceContext.Extract(context.Background(), carrier)
	ctx, span := r.tracer.Start(parent, "send "+topic, trace.WithSpanKind(trace.SpanKindProducer))
	if span.IsRecording() { // an unsampled row's span costs no attributes
		span.SetAttributes(
			semconv.MessagingSystemKafka,
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName(topic),
			semconv.MessagingMessageID(x.eventID),
			semconv.MessagingKafkaMessageKey(x.partitionKey),
			semconv.MessagingMessageBodySize(len(x.payload)),
			attribute.String("outbox.event_type", x.eventType),
			attribute.String("outbox.aggregate_type", x.aggregateType),
			attribute.String("outbox.aggregate_id", x.aggregateID),
			attribute.Int64("outbox.row_id", x.id),
		)
	}
	if span.SpanContext().IsValid() {
		traceContext.Inject(ctx, carrier)
	}
	return span
}

// endSpans ends the batch's spans with each row's outcome.
func (r *Relay) endSpans(b *batch) {
	for i, span := range b.spans {
		if span == nil {
			continue
		}
		if !span.IsRecording() {
			span.End()
			continue
		}
		switch b.out[i] {
		case acked:
		case skipped:
			span.SetStatus(codes.Error, "not sent in this batch; it is claimed again")
		default:
			if err := b.errs[i]; err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			} else {
				span.SetStatus(codes.Error, "outcome "+strconv.Itoa(int(b.out[i])))
			}
		}
		span.End()
	}
}

// headerCarrier lets a propagator read and write Kafka headers.
type headerCarrier struct{ h *[]kafka.Header }

func (c headerCarrier) Get(key string) string {
	for _, h := range *c.h {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func (c headerCarrier) Set(key, value string) {
	for i, h := range *c.h {
		if h.Key == key {
			(*c.h)[i].Value = []byte(value)
			return
		}
	}
	*c.h = append(*c.h, kafka.Header{Key: key, Value: []byte(value)})
}

func (c headerCarrier) Keys() []string {
	keys := make([]string, len(*c.h))
	for i, h := range *c.h {
		keys[i] = h.Key
	}
	return keys
}
