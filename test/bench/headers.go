package main

import (
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// headersCases are the drains of the headers scenario, at batch 500: rows
// without and with a headers column value (a traceparent and two custom
// entries), each with the relay's tracing off and on. With tracing on the
// relay exports every producer span over OTLP/HTTP to an in-process sink
// that decodes and counts them.
func headersCases(o *options, e *benchEnv) []*benchCase {
	const batch = 500
	var cases []*benchCase
	for _, tracing := range []bool{false, true} {
		for _, headers := range []bool{false, true} {
			cases = append(cases, &benchCase{scenario: scHeaders, name: headersCaseName(headers, tracing),
				params: map[string]any{"headers": headers, "tracing": tracing, "batch": batch, "ordering": "none"},
				run: func(ctx context.Context) (map[string]float64, error) {
					d := drainSetup{headers: headers}
					var sink *otlpSink
					if tracing {
						var err error
						if sink, err = startOTLPSink(); err != nil {
							return nil, err
						}
						defer sink.Close()
						d.env = sink.relayEnv()
					}
					// relayDrainWith stops the relays before it returns, and
					// a relay flushes its spans as it stops.
					m, err := relayDrainWith(ctx, o, e, d, batch, 1, "none")
					if err != nil || sink == nil {
						return m, err
					}
					if sink.failed.Load() > 0 {
						return nil, fmt.Errorf("the OTLP sink could not decode %d of %d requests", sink.failed.Load(), sink.requests.Load())
					}
					m["spans_per_event"] = float64(sink.spans.Load()) / float64(o.rows)
					m["otlp_requests"] = float64(sink.requests.Load())
					m["otlp_mib"] = float64(sink.bytes.Load()) / (1 << 20)
					return m, nil
				}})
		}
	}
	return cases
}

func headersCaseName(headers, tracing bool) string {
	return fmt.Sprintf("headers=%v tracing=%v", headers, tracing)
}

// otlpSink is an OTLP/HTTP trace receiver that decodes each export request,
// counts its spans and discards them.
type otlpSink struct {
	srv                            *http.Server
	addr                           string
	requests, spans, bytes, failed atomic.Int64
}

func startOTLPSink() (*otlpSink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &otlpSink{addr: ln.Addr().String()}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/traces", s.export)
	s.srv = &http.Server{Handler: mux}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// relayEnv turns the relay's tracing on, exporting to the sink.
func (s *otlpSink) relayEnv() []string {
	return []string{relayconfig.EnvOTELTracesExporter + "=otlp", relayconfig.EnvOTELExporterOTLPEndpoint + "=http://" + s.addr}
}

func (s *otlpSink) export(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			s.failed.Add(1)
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = zr
	}
	b, err := io.ReadAll(body)
	var req coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(b, &req)
	}
	if err != nil {
		s.failed.Add(1)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.bytes.Add(int64(len(b)))
	var n int64
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			n += int64(len(ss.Spans))
		}
	}
	s.spans.Add(n)
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// Close stops the sink.
func (s *otlpSink) Close() { _ = s.srv.Close() }
