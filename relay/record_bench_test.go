package relay

import (
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// BenchmarkRecord is the cost of building one record with its producer
// span: tracing off, on for a row whose writer did not sample its trace, and
// on for a sampled one (recorded, exported nowhere). docs/relay.md names it.
func BenchmarkRecord(b *testing.B) {
	headers := []byte(`{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tenant":"t1"}`)
	unsampled := []byte(`{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00","tenant":"t1"}`)
	cases := []struct {
		name string
		tp   trace.TracerProvider
		raw  []byte
	}{
		{"tracing-off", nil, headers},
		{"unsampled-parent", sdktrace.NewTracerProvider(), unsampled},
		{"sampled-parent", sdktrace.NewTracerProvider(), headers},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			r := &Relay{cfg: Config{Settings: Settings{Format: FormatRaw}}.withDefaults(), m: newMetrics(nil)}
			if c.tp != nil {
				r.tracer = c.tp.Tracer(tracerName)
			}
			x := row{id: 1, eventID: "01a22b69-0948-77d7-a050-7528b9bdeceb", eventType: "OrderConfirmed", aggregateType: "Order",
				aggregateID: "o1", partitionKey: "o1", payload: make([]byte, 300), createdAt: time.Now(), headers: c.raw}
			b.ReportAllocs()
			for b.Loop() {
				bt := &batch{rows: []row{x}, out: []outcome{acked}, errs: []error{nil}}
				custom, _, err := rowHeaders(x.headers)
				if err != nil {
					b.Fatal(err)
				}
				y := x
				y.custom = custom
				if r.tracer != nil {
					bt.spans = []trace.Span{r.startSpan(&y, "orders")}
				}
				_ = r.message(y, "orders")
				r.endSpans(bt)
			}
		})
	}
}
