// Package events is an example consumer of the relay's records: it reads an
// event in either record format, processes it at most once by its event_id
// (the relay delivers at least once), and continues the trace the service
// that stored the event started.
package events

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
)

// Schema is the consumer's de-duplication table: one row per event processed,
// written in the same transaction as the processing.
const Schema = `CREATE TABLE IF NOT EXISTS processed_events (
    event_id     uuid        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);`

// Event is what a consumer reads from a record, in either format.
type Event struct {
	ID, Type, AggregateType, AggregateID string
	Key, Payload                         []byte
	// Headers are every header of the record, the writer's own among them.
	Headers map[string]string
}

// Read reads the relay's headers of a record; both formats carry them.
func Read(m kafka.Message) (Event, error) {
	e := Event{Key: m.Key, Payload: m.Value, Headers: make(map[string]string, len(m.Headers))}
	for _, h := range m.Headers {
		e.Headers[h.Key] = string(h.Value)
	}
	e.ID, e.Type = e.Headers["event_id"], e.Headers["event_type"]
	e.AggregateType, e.AggregateID = e.Headers["aggregate_type"], e.Headers["aggregate_id"]
	if e.ID == "" {
		return e, errors.New("record has no event_id header")
	}
	return e, nil
}

// CloudEvent decodes a record of the cloudevents format (binary content
// mode) with the CloudEvents SDK and validates it.
func CloudEvent(m kafka.Message) (*event.Event, error) {
	ev, err := binding.ToEvent(context.Background(), &kafkaMessage{m: m})
	if err != nil {
		return nil, fmt.Errorf("decode CloudEvent: %w", err)
	}
	if err := ev.Validate(); err != nil {
		return nil, fmt.Errorf("invalid CloudEvent: %w", err)
	}
	return ev, nil
}

var _ binding.MessageMetadataReader = (*kafkaMessage)(nil)

// kafkaMessage is a kafka-go record as a CloudEvents binding message, as the
// Kafka protocol binding reads one: ce_<attribute> headers, content-type as
// datacontenttype, the value as data.
type kafkaMessage struct{ m kafka.Message }

const cePrefix = "ce_"

var ceSpecs = spec.WithPrefix(cePrefix)

func (k *kafkaMessage) version() spec.Version {
	for _, h := range k.m.Headers {
		if strings.ToLower(h.Key) == ceSpecs.PrefixedSpecVersionName() {
			return ceSpecs.Version(string(h.Value))
		}
	}
	return nil
}

func (k *kafkaMessage) ReadEncoding() binding.Encoding {
	if k.version() != nil {
		return binding.EncodingBinary
	}
	return binding.EncodingUnknown
}

func (k *kafkaMessage) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (k *kafkaMessage) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	v := k.version()
	if v == nil {
		return binding.ErrNotBinary
	}
	for _, h := range k.m.Headers {
		name := strings.ToLower(h.Key)
		var err error
		switch {
		case strings.HasPrefix(name, cePrefix):
			if attr := v.Attribute(name); attr != nil {
				err = w.SetAttribute(attr, string(h.Value))
			} else {
				err = w.SetExtension(strings.TrimPrefix(name, cePrefix), string(h.Value))
			}
		case name == "content-type":
			err = w.SetAttribute(v.AttributeFromKind(spec.DataContentType), string(h.Value))
		}
		if err != nil {
			return err
		}
	}
	if k.m.Value != nil {
		return w.SetData(bytes.NewReader(k.m.Value))
	}
	return nil
}

func (k *kafkaMessage) header(name string) string {
	for _, h := range k.m.Headers {
		if strings.ToLower(h.Key) == name {
			return string(h.Value)
		}
	}
	return ""
}

// GetAttribute and GetExtension let the SDK read single attributes.
func (k *kafkaMessage) GetAttribute(kind spec.Kind) (spec.Attribute, interface{}) {
	v := k.version()
	if v == nil {
		return nil, nil
	}
	attr := v.AttributeFromKind(kind)
	if attr == nil {
		return nil, nil
	}
	if kind == spec.DataContentType {
		return attr, k.header("content-type")
	}
	return attr, k.header(attr.PrefixedName())
}

func (k *kafkaMessage) GetExtension(name string) interface{} {
	return k.header(cePrefix + name)
}

func (k *kafkaMessage) Finish(error) error { return nil }

// Processor handles each event once: it records the event id and runs
// Handle in one transaction, so a redelivered event (the relay publishes at
// least once) is recognised and skipped, and a failed Handle leaves no mark.
type Processor struct {
	DB *pgxpool.Pool
	// Tracer records a consumer span per record, a child of the span whose
	// context the record carries (traceparent). Nil: no spans.
	Tracer trace.Tracer
	// Handle processes one event within tx; ctx carries the consumer span.
	Handle func(ctx context.Context, tx pgx.Tx, e Event) error
}

// traceContext reads the W3C traceparent and tracestate headers.
var traceContext propagation.TraceContext

// Process handles record m unless its event was processed already, and
// reports whether it ran Handle.
func (p *Processor) Process(ctx context.Context, m kafka.Message) (bool, error) {
	e, err := Read(m)
	if err != nil {
		return false, err
	}
	ctx = traceContext.Extract(ctx, propagation.MapCarrier(e.Headers))
	if p.Tracer != nil {
		var span trace.Span
		ctx, span = p.Tracer.Start(ctx, "process "+m.Topic, trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(semconv.MessagingSystemKafka, semconv.MessagingOperationTypeProcess,
				semconv.MessagingDestinationName(m.Topic), semconv.MessagingMessageID(e.ID)))
		defer span.End()
	}
	tx, err := p.DB.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("process event %s: %w", e.ID, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	tag, err := tx.Exec(ctx, `INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING`, e.ID)
	if err != nil {
		return false, fmt.Errorf("process event %s: %w", e.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return false, nil // processed before: a redelivery
	}
	if err := p.Handle(ctx, tx, e); err != nil {
		return false, fmt.Errorf("process event %s: %w", e.ID, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("process event %s: %w", e.ID, err)
	}
	return true, nil
}
