// Command demo is `make demo`: it starts the whole system on this machine
// (PostgreSQL, Kafka, kube-apiserver + etcd, the manager binary and the local
// pod runner, see internal/localcluster), applies config/samples, runs the
// example order service at a steady rate, and shows live what the relay does.
// Ctrl-C stops everything.
//
//	go run ./cmd/demo -bin bin -dir .demo -rate 20
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-operator/internal/localcluster"
)

func main() {
	dir := flag.String("dir", ".demo", "folder for the demo's state and logs (wiped at start)")
	bin := flag.String("bin", "bin", "folder holding the built manager and relay binaries (make build)")
	rate := flag.Float64("rate", 20, "orders the order service confirms per second")
	flag.Parse()
	if *rate <= 0 {
		fmt.Fprintln(os.Stderr, "demo: -rate must be positive")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dir, *bin, *rate); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dir, bin string, rate float64) (err error) {
	dir, _ = filepath.Abs(dir)
	bin, _ = filepath.Abs(bin)
	say := func(format string, args ...any) { fmt.Printf(format+"\n", args...) }

	say("» cleaning %s (stopping anything an earlier demo left running)", dir)
	if err := localcluster.CleanDir(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return err
	}
	logf, err := os.Create(filepath.Join(dir, "logs", "demo.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	log := slog.New(slog.NewTextHandler(logf, nil))

	say("» starting the local stack (about 15 s)")
	stack, err := localcluster.Start(ctx, localcluster.Options{
		Dir:           dir,
		ManagerBinary: filepath.Join(bin, "manager"),
		RelayBinary:   filepath.Join(bin, "relay"),
		Log:           log,
		Progress:      func(s string) { say("  ✓ %s", s) },
	})
	if err != nil {
		return err
	}
	defer func() {
		say("\n» stopping: relay processes, manager, kube-apiserver + etcd, Kafka, PostgreSQL")
		if cerr := stack.Close(); cerr != nil {
			say("  stop: %v", cerr)
		}
		say("» stopped; nothing is left running. Logs: %s", filepath.Join(dir, "logs"))
	}()

	say("» creating database %q (orders + outbox tables), role %q and the sample's topics", localcluster.OrdersDatabase, localcluster.RelayRole)
	if err := stack.PrepareOrders(ctx); err != nil {
		return err
	}
	samples := filepath.Join(dir, "samples")
	if err := stack.RenderSamples(samples, nil); err != nil {
		return err
	}
	say("» kubectl apply -f config/samples (rendered to %s with this stack's Kafka and PostgreSQL ports)", samples)
	out, err := stack.Kubectl(ctx, "apply", "-f", samples)
	if err != nil {
		return err
	}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		say("  %s", l)
	}

	svc, err := startOrderService(ctx, stack.OrdersDSN("postgres"), rate, log)
	if err != nil {
		return err
	}
	defer svc.Close()
	tail, err := startTail(ctx, stack.Kafka, "orders.confirmed")
	if err != nil {
		return err
	}
	defer tail.Close()

	w := &screen{out: os.Stdout, tty: isTerminal(os.Stdout)}
	if w.tty {
		fmt.Print("\033[2J")
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var lastPublished int64 = -1
	for {
		snap := takeSnapshot(ctx, stack, svc, tail, rate)
		if lastPublished >= 0 {
			snap.perSecond = snap.published - lastPublished
		}
		lastPublished = snap.published
		w.draw(render(stack, snap))
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// screen redraws a frame in place on a terminal, or appends frames to a
// pipe or file.
type screen struct {
	out io.Writer
	tty bool
}

func (s *screen) draw(frame string) {
	if !s.tty {
		fmt.Fprint(s.out, frame, "\n")
		return
	}
	var b strings.Builder
	b.WriteString("\033[H")
	for _, l := range strings.Split(frame, "\n") {
		b.WriteString(l)
		b.WriteString("\033[K\n")
	}
	b.WriteString("\033[J")
	fmt.Fprint(s.out, b.String())
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
