package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// The OpenTelemetry environment the relay reads; the OTLP exporter reads
// the rest of OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout, TLS), and
// the SDK OTEL_TRACES_SAMPLER, OTEL_BSP_* and OTEL_RESOURCE_ATTRIBUTES.
const (
	envTracesExporter      = relayconfig.EnvOTELTracesExporter
	envOTLPProtocol        = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envOTLPTracesProtocol  = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	defaultTracingService  = "outbox-relay"
	tracingShutdownTimeout = 5 * time.Second
)

// tracerProvider builds the relay's tracer provider from the OTEL_*
// environment. Tracing is off (nil, no spans, no cost) unless
// OTEL_TRACES_EXPORTER is "otlp"; the exporter speaks OTLP over HTTP
// (http/protobuf) only, which keeps gRPC out of the binary.
func tracerProvider(lookupEnv func(string) (string, bool)) (*sdktrace.TracerProvider, error) {
	exporter, _ := lookupEnv(envTracesExporter)
	switch exporter = strings.TrimSpace(exporter); exporter {
	case "", "none":
		return nil, nil
	case "otlp":
	default:
		return nil, fmt.Errorf("%s: %q is not supported (otlp or none)", envTracesExporter, exporter)
	}
	for _, env := range []string{envOTLPTracesProtocol, envOTLPProtocol} {
		if p, ok := lookupEnv(env); ok && p != "" {
			if p != "http/protobuf" {
				return nil, fmt.Errorf("%s: %q is not supported; the relay exports OTLP over http/protobuf", env, p)
			}
			break
		}
	}
	ctx := context.Background()
	exp, err := otlptracehttp.New(ctx) // connects lazily
	if err != nil {
		return nil, fmt.Errorf("%s=otlp: %w", envTracesExporter, err)
	}
	// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over the default name.
	res, err := resource.New(ctx, resource.WithAttributes(semconv.ServiceName(defaultTracingService)),
		resource.WithFromEnv(), resource.WithTelemetrySDK())
	if err != nil {
		return nil, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// shutdownTracing flushes the spans still queued.
func shutdownTracing(tp *sdktrace.TracerProvider) error {
	if tp == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), tracingShutdownTimeout)
	defer cancel()
	return tp.Shutdown(ctx)
}
