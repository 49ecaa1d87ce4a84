package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// serve runs the relay and its HTTP endpoints until ctx ends.
func serve(ctx context.Context, o *options) error {
	defer func() {
		if err := shutdownTracing(o.tracing); err != nil {
			o.logger.Warn("could not flush the last spans", "err", err)
		}
	}()
	r, reg := o.relay, o.registry
	defer r.Close()

	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := r.Live(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := r.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ok\n")
	})
	// Listen before anything else starts: an address taken (a sidecar's,
	// or the node's with host networking) stops the relay before it claims
	// a row, instead of while a batch is in flight.
	ln, err := net.Listen("tcp", o.metricsAddr)
	if err != nil {
		return fmt.Errorf("--%s %s: %w", relayconfig.FlagMetricsAddr, o.metricsAddr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	srvErr := make(chan error, 1)
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			srvErr <- fmt.Errorf("--metrics-addr %s: %w", o.metricsAddr, err)
		}
		close(srvErr)
	}()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()

	// Wait for PostgreSQL and Kafka; a missing table or index is fatal (a
	// missing topic holds only its own rows).
	backoff := 250 * time.Millisecond
	for {
		err := r.Check(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil { // stopped during the check: its error is the stop's
			return nil
		}
		var unreachable *relay.UnreachableError
		if !errors.As(err, &unreachable) {
			return fmt.Errorf("start-up check: %w", err)
		}
		o.logger.Warn("waiting for dependencies", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case err := <-srvErr:
			return err
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
	o.logger.Info("relay started", "table", o.settings.Table, "brokers", o.settings.Brokers, "topics", len(o.settings.Topics), "batch_size", o.settings.BatchSize)

	// When the endpoints fail, the relay stops as it does on SIGTERM: Run
	// settles what is in flight before serve returns and Close runs.
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(runCtx) }()
	select {
	case err := <-srvErr:
		stopRun()
		return errors.Join(err, <-runErr)
	case err := <-runErr:
		if err == nil {
			o.logger.Info("relay stopped cleanly")
		}
		return err
	}
}
