// Command relay runs the outbox relay: the process in every relay pod. It
// moves committed rows of an outbox table to Kafka (see docs/relay.md).
//
//	relay --dsn postgres://... --brokers k1:9092 --topic OrderConfirmed=orders.confirmed
//	relay schema --table app.outbox
//	relay held --reason too_large
//	relay redrive --id 42
//
// Every flag of the relay can also be set by an environment variable
// RELAY_<FLAG> (upper case, "-" becomes "_"); a flag on the command line
// wins, and RELAY_ARGS_ONLY=true leaves all but the Secrets' variables
// unread. `relay held` and `relay redrive` take only their connection
// flags from the environment, `relay schema` none.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/version"
)

// softMemoryLimit is the Go heap's soft limit when GOMEMLIMIT does not set
// one: a relay's steady heap is a few MiB, and a batch of very large payloads
// (the byte budget always lets one row through) would otherwise peak at
// about twice its live size before the collector runs. Above the limit the
// collector works harder instead (TestLargePayloadsDrainInBoundedMemory).
const softMemoryLimit = 32 << 20

func main() {
	if _, set := os.LookupEnv("GOMEMLIMIT"); !set {
		debug.SetMemoryLimit(softMemoryLimit)
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		switch args[0] {
		case "schema":
			return runSchema(args[1:], stdout, stderr)
		case "held":
			return runHeld(args[1:], false, stdout, stderr)
		case "redrive":
			return runHeld(args[1:], true, stdout, stderr)
		case "version", "-version", "--version":
			fmt.Fprintln(stdout, version.String("relay"))
			return 0
		}
	}
	opts, err := parseFlags(args, os.LookupEnv, stderr)
	if err != nil {
		if errors.Is(err, relayconfig.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "relay: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := serve(ctx, opts); err != nil {
		opts.logger.Error("relay stopped", "err", err)
		return 1
	}
	return 0
}

func newLogger(format string, w io.Writer) *slog.Logger {
	if format == "text" {
		return slog.New(slog.NewTextHandler(w, nil))
	}
	return slog.New(slog.NewJSONHandler(w, nil))
}
