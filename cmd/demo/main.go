// Command demo is `make demo`: it starts the whole system on this machine
// (PostgreSQL, Kafka, and a real one-node Kubernetes cluster with the
// operator installed from config/default and running from the locally built
// image, see test/localcluster), applies config/samples, runs the
// example order service at a steady rate, and shows live what the relay
// does. Ctrl-C stops everything and undoes what the node changed.
//
//	go run ./cmd/demo -dir .demo -rate 20   (as root)
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

	"github.com/outbox-relay/outbox-operator/test/localcluster"
)

func main() {
	dir := flag.String("dir", ".demo", "folder for the demo's state and logs (wiped at start)")
	rate := flag.Float64("rate", 20, "orders the order service confirms per second (0: none)")
	var auto autoscalingDemo
	flag.BoolVar(&auto.on, "autoscaling", false, "autoscale the relay on its backlog (0..4 replicas) and write bursts of -burst rows every -burst-every; -rate defaults to 0")
	flag.IntVar(&auto.rows, "burst", 20000, "rows per burst with -autoscaling")
	flag.DurationVar(&auto.every, "burst-every", 90*time.Second, "time between bursts with -autoscaling")
	check := flag.Bool("check", false, "only say whether this machine can run the demo's node (root, cgroup v1), and exit")
	flag.Parse()
	if *check {
		if err := localcluster.CheckHost(); err != nil {
			fmt.Fprintln(os.Stderr, "demo:", err)
			os.Exit(1)
		}
		return
	}
	if auto.on && !flagSet("rate") {
		*rate = 0
	}
	if *rate < 0 || (*rate == 0 && !auto.on) {
		fmt.Fprintln(os.Stderr, "demo: -rate must be positive (or 0 with -autoscaling)")
		os.Exit(2)
	}
	// Piped into tee or less, Ctrl-C ends the reader too; the demo must
	// still stop the cluster, with its output going nowhere.
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dir, *rate, auto); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// autoscalingDemo is the -autoscaling variant: bursts and a relay that
// follows them, down to zero pods between them.
type autoscalingDemo struct {
	on    bool
	rows  int
	every time.Duration
}

// autoscalingPatch turns autoscaling on for the sample OutboxRelay.
const autoscalingPatch = `{"spec":{"backlog":{"interval":"5s"},"autoscaling":{"minReplicas":0,"maxReplicas":4,"pendingPerReplica":2000,"scaleDownStabilization":"30s"}}}`

func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

func run(ctx context.Context, dir string, rate float64, auto autoscalingDemo) (err error) {
	dir, _ = filepath.Abs(dir)
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

	say("» starting the local stack: PostgreSQL, Kafka, a one-node Kubernetes cluster, the operator (about a minute)")
	stack, err := localcluster.Start(ctx, localcluster.Options{
		Dir:      dir,
		Log:      log,
		Progress: func(s string) { say("  ✓ %s", s) },
	})
	if err != nil {
		return err
	}
	defer func() {
		say("\n» stopping: the pods, the node, kube-apiserver + etcd, Kafka, PostgreSQL")
		if cerr := stack.Close(); cerr != nil {
			say("  stop: %v", cerr)
		}
		say("» stopped; nothing is left running. Logs: under %s", dir)
	}()

	say("» the cluster is yours meanwhile:  export KUBECONFIG=%s; %s get obr,pods -A", stack.Kubeconfig, stack.KubectlPath())
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

	if auto.on {
		say("» kubectl patch obr/orders: autoscaling 0..4 replicas, 2000 waiting rows per replica, backlog read every 5s")
		if out, err := stack.Kubectl(ctx, "patch", "obr/orders", "--type=merge", "-p", autoscalingPatch); err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
	}
	svc, err := startOrderService(ctx, stack.OrdersDSN("postgres"), rate, log)
	if err != nil {
		return err
	}
	defer svc.Close()
	// The first burst waits for the relay to scale to zero, so that it
	// shows the whole way up from no pods.
	var nextBurst time.Time
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
		if auto.on {
			if nextBurst.IsZero() && snap.relayFound && snap.desired == 0 && len(snap.pods) == 0 {
				nextBurst = time.Now().Add(5 * time.Second)
			}
			if !nextBurst.IsZero() && time.Now().After(nextBurst) {
				go func() {
					if err := svc.burst(ctx, auto.rows); err != nil && ctx.Err() == nil {
						log.Warn("burst", "err", err)
					}
				}()
				nextBurst = time.Now().Add(auto.every)
			}
			snap.burst = fmt.Sprintf("bursts of %d rows in one transaction, the first once the relay is at zero pods", auto.rows)
			if !nextBurst.IsZero() {
				snap.burst = fmt.Sprintf("bursts of %d rows in one transaction, next in %s", auto.rows, time.Until(nextBurst).Round(time.Second))
			}
		}
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
