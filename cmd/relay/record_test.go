package main_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// The binary exports spans over OTLP/HTTP when the OTEL_* environment asks
// for it, and publishes CloudEvents with a compression codec from its flags.
func TestTracingFormatAndCompressionFlags(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	defer collector.Close()

	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(20, 4, "E")
	outboxtest.StartRelayProcess(t, f.Args("--format", "cloudevents", "--compression", "lz4", "--cloudevents-source", "urn:orders"),
		append(f.Env(), "OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL,
			"OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_SERVICE_NAME=relay-under-test")...)
	f.WaitDrained(0, 30*time.Second)
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 20, 30*time.Second)
	require.Len(t, msgs, 20)
	require.Equal(t, "urn:orders", testenv.Header(msgs[0], "ce_source"))
	require.Equal(t, testenv.Header(msgs[0], "event_id"), testenv.Header(msgs[0], "ce_id"))
	require.NotEmpty(t, testenv.Header(msgs[0], "traceparent"), "the relay's span context travels with the record")
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range got {
			if r == "POST /v1/traces application/x-protobuf" {
				return true
			}
		}
		return false
	}, 15*time.Second, 50*time.Millisecond, "spans reach the OTLP/HTTP endpoint")
}

// Tracing settings the relay cannot honour are refused at once.
func TestBadTracingEnvironmentIsRefused(t *testing.T) {
	t.Parallel()
	bin := outboxtest.RelayBinary(t)
	for env, want := range map[string]string{
		"OTEL_TRACES_EXPORTER=zipkin":      `OTEL_TRACES_EXPORTER: "zipkin" is not supported`,
		"OTEL_EXPORTER_OTLP_PROTOCOL=grpc": `OTEL_EXPORTER_OTLP_PROTOCOL: "grpc" is not supported`,
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, bin, "--brokers", "127.0.0.1:9092", "--topic", "E=t")
		cmd.Env = append(os.Environ(), "RELAY_DSN=postgres://x", "OTEL_TRACES_EXPORTER=otlp", env) // the last value of a name wins
		out, err := cmd.CombinedOutput()
		cancel()
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "%s must fail: %s", env, out)
		require.Equal(t, 2, exit.ExitCode(), "%s: %s", env, out)
		require.Contains(t, string(out), want)
	}
}
