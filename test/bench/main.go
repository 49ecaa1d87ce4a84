// Command outbox-bench measures the relay side by side with the limits of
// this machine in one run: the PostgreSQL claim+mark ceiling, the relay
// binary draining a pre-inserted backlog, the naive shape of a hand-written
// relay (scenario naive-per-row), scaling over replicas, what headers, tracing,
// retention and pruning cost, a long-lived table, steady-state latency, the
// idle cost of the poll interval, what the operator's backlog reads cost the
// database, a burst drained by one relay pod or by autoscaled ones, and the
// footprint of the relay and the operator, each against the targets in
// report.go. It starts its own PostgreSQL (fsync on) and Kafka broker from
// `make deps`, runs the real relay and manager binaries as separate
// processes (the autoscale scenario: the local cluster of `make demo`), and
// writes a Markdown report and a JSON file of every repetition.
//
//	outbox-bench                     # the full run (make bench)
//	outbox-bench -quick              # a ~3-minute subset (make bench-quick)
//	outbox-bench -scenarios claim-ceiling,drain,naive-per-row   # the relay's throughput alone (make bench-relay)
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"
	"unicode"

	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// options is the parsed command line.
type options struct {
	scenarios    []string
	quick        bool
	reps         int
	rows         int
	batches      []int
	replicas     []int
	orderings    []string
	partitions   int
	seedsFor     time.Duration
	rates        []int
	latencyFor   time.Duration
	producers    int
	relays       int // OutboxRelays for the operator footprint
	outMD        string
	outJSON      string
	profileDir   string
	relayBin     string
	keepWorkDir  bool
	fsync        bool
	drainTimeout time.Duration
	latencyPolls []time.Duration
	idlePolls    []time.Duration
	idleFor      time.Duration
	writersFor   time.Duration
	// The long-lived table (scenario longlived).
	longRows      int
	longWriteRate int
	// The operator's backlog reads (scenario backlog).
	backlogRows  []int
	backlogReads int
	// The burst drained by a fixed relay and an autoscaled one (scenario autoscale).
	burstRows         int
	autoscaleMax      int
	autoscaleInterval time.Duration
	autoscaleDown     time.Duration
	// The capture modes compared (scenario capture-modes), by name.
	captureModes []string
}

var allScenarios = []string{scCeiling, scDrain, scNaive, scScaling, scRetention, scCompression, scHeaders, scPruning, scLongLived,
	scLatency, scWriters, scCapture, scLinger, scIdle, scBacklog, scBreakdown, scProfile, scFootprint, scAutoscale}

// The scenarios, each named for what it measures.
const (
	scCeiling      = "claim-ceiling"       // PostgreSQL claim and mark alone, no Kafka: the ceiling any relay meets
	scDrain        = "drain"               // one relay process draining a pre-inserted backlog, per ordering and batch size
	scNaive        = "naive-per-row"       // a hand-written relay: claim through the pool, one WriteMessages and one UPDATE per row
	scScaling      = "replica-scaling"     // replicas draining one table together
	scRetention    = "mark-or-delete"      // marking published rows against deleting them
	scCompression  = "compression"         // one relay draining with each produce codec
	scHeaders      = "headers-and-tracing" // a headers column and tracing, off and on
	scPruning      = "pruning-cost"        // what pruning published rows costs the relay and the writers
	scLongLived    = "long-transaction"    // a long drain while writers insert and an old transaction holds back vacuum
	scLatency      = "latency"             // end-to-end latency at steady insert rates
	scWriters      = "notify-cost"         // what a notification per transaction costs the writers
	scCapture      = "capture-modes"       // polling, polling with the wake-up, and logical replication side by side
	scCaptureIdle  = "capture-modes-idle"  // the same modes with nothing to publish (run by capture-modes)
	scCaptureDrain = "capture-modes-drain" // the same modes draining a backlog at batch 500 (run by capture-modes)
	scLinger       = "linger-cost"         // adaptive polling's wait after a partial claim against a fixed poller, in rounds
	scIdle         = "idle-cost"           // what an idle relay costs the database per poll interval
	scBacklog      = "backlog-read"        // the operator's backlog read at growing backlogs
	scBreakdown    = "batch-time"          // where a batch's time goes
	scProfile      = "cpu-profile"         // a CPU profile of the relay at batch 500
	scFootprint    = "operator-fleet"      // the operator reconciling a thousand OutboxRelays
	scAutoscale    = "autoscale"           // a burst drained by a fixed relay and by an autoscaled one
)

// quickScenarios are the scenarios of -quick: all but those that need
// kube-apiserver (footprint, autoscale).
var quickScenarios = slices.DeleteFunc(slices.Clone(allScenarios), func(s string) bool { return s == scFootprint || s == scAutoscale })

func parseFlags(args []string) (*options, error) {
	fs := flag.NewFlagSet("outbox-bench", flag.ContinueOnError)
	o := &options{}
	var scenarios, batches, replicas, orderings, rates, backlogRows string
	fs.StringVar(&scenarios, "scenarios", strings.Join(allScenarios, ","), "comma-separated scenarios to run: "+strings.Join(allScenarios, ","))
	fs.BoolVar(&o.quick, "quick", false, "a ~3-minute subset: fewer rows, one repetition, short runs, none of the scenarios that need kube-apiserver (footprint, autoscale)")
	fs.IntVar(&o.reps, "reps", 0, "repetitions of each scenario; the median is reported (default 3, quick 1)")
	fs.IntVar(&o.rows, "rows", 0, "pre-inserted rows per drain (default 200000, quick 30000)")
	fs.StringVar(&batches, "batches", "50,500", "batch sizes for the ceiling and the drain")
	fs.StringVar(&replicas, "replicas", "1,2,4", "replica counts for the scaling scenario (batch 50)")
	fs.StringVar(&orderings, "orderings", "none,partition-key", "relay --ordering modes for drain and scaling (a mode the relay refuses is reported as not available)")
	fs.IntVar(&o.partitions, "partitions", 8, "partitions of each benchmark topic")
	fs.DurationVar(&o.seedsFor, "seeds-duration", 0, "how long the naive shape (scenario seeds) drains (it is ~10x slower; default 15s, quick 8s)")
	fs.StringVar(&rates, "rates", "1000,5000", "steady-state insert rates (events/s) for the latency scenario")
	fs.DurationVar(&o.latencyFor, "latency-duration", 0, "duration of each steady-state run (default 60s, quick 12s)")
	var latencyPolls, idlePolls string
	fs.StringVar(&latencyPolls, "latency-polls", "200ms,50ms", "poll intervals for the latency scenario; other than the default (200ms), only at the first rate")
	fs.StringVar(&idlePolls, "idle-polls", "20ms,200ms,1s", "poll intervals whose idle cost is measured")
	fs.DurationVar(&o.idleFor, "idle-duration", 10*time.Second, "how long each idle relay is watched")
	fs.DurationVar(&o.writersFor, "writers-duration", 0, "how long the writers insert in each writers run (default 10s, quick 3s)")
	fs.IntVar(&o.producers, "producers", 8, "producer (writer) clients in the latency, writers, pruning and longlived scenarios")
	fs.IntVar(&o.relays, "operator-relays", 1000, "OutboxRelays the operator reconciles in the footprint scenario, each on a table of its own in one database")
	fs.IntVar(&o.longRows, "longlived-rows", 0, "rows the long-lived table drains (scenario longlived; default 1000000, quick 50000)")
	fs.IntVar(&o.longWriteRate, "longlived-write-rate", 1000, "rows/s the writers insert while the long-lived table drains")
	fs.StringVar(&backlogRows, "backlog-rows", "", "waiting rows at which the operator's backlog read is timed (scenario backlog; default 10000,1000000, quick 10000,100000)")
	fs.IntVar(&o.backlogReads, "backlog-reads", 0, "backlog reads timed at each size (default 20, quick 5)")
	fs.IntVar(&o.burstRows, "burst-rows", 0, "rows of the burst the autoscale scenario drains (default 200000, quick 20000)")
	fs.IntVar(&o.autoscaleMax, "autoscale-max", 4, "spec.autoscaling.maxReplicas of the autoscaled relay (its minReplicas is 0)")
	fs.DurationVar(&o.autoscaleInterval, "autoscale-interval", controllers.DefaultBacklogInterval, "spec.backlog.interval of both relays in the autoscale scenario")
	fs.DurationVar(&o.autoscaleDown, "autoscale-scale-down", 30*time.Second, "spec.autoscaling.scaleDownStabilization of the autoscaled relay")
	var modes string
	fs.StringVar(&modes, "capture-modes", "", "the capture modes the capture-modes scenario compares, by name, separated by semicolons (default all: "+strings.Join(captureModeNames(), "; ")+")")
	fs.StringVar(&o.outMD, "out-md", "", "Markdown report (default docs/benchmarks.md; quick: bench/quick.md)")
	fs.StringVar(&o.outJSON, "out-json", "", "JSON results (default bench/results.json; quick: bench/quick-results.json)")
	fs.StringVar(&o.profileDir, "profile-dir", "bench/profiles", "where the relay's pprof profiles go")
	fs.StringVar(&o.relayBin, "relay-bin", "", "relay binary to run (default: go build ./cmd/relay into the work folder)")
	fs.BoolVar(&o.keepWorkDir, "keep", false, "keep the work folder (PostgreSQL, Kafka and relay logs)")
	fs.BoolVar(&o.fsync, "fsync", true, "run PostgreSQL with fsync and synchronous_commit on")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 5*time.Minute, "give up on one drain after this long")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	o.scenarios = splitList(scenarios)
	if modes != "" {
		for _, m := range strings.Split(modes, ";") {
			m = strings.TrimSpace(m)
			if !slices.Contains(captureModeNames(), m) {
				return nil, fmt.Errorf("-capture-modes: unknown mode %q (want some of %s)", m, strings.Join(captureModeNames(), "; "))
			}
			o.captureModes = append(o.captureModes, m)
		}
	}
	for _, s := range o.scenarios {
		if !slices.Contains(allScenarios, s) {
			return nil, fmt.Errorf("-scenarios: unknown scenario %q (want some of %s)", s, strings.Join(allScenarios, ","))
		}
	}
	var err error
	if o.batches, err = intList("batches", batches); err != nil {
		return nil, err
	}
	if o.replicas, err = intList("replicas", replicas); err != nil {
		return nil, err
	}
	if o.rates, err = intList("rates", rates); err != nil {
		return nil, err
	}
	if backlogRows == "" {
		backlogRows = "10000,1000000"
		if o.quick {
			backlogRows = "10000,100000"
		}
	}
	if o.backlogRows, err = intList("backlog-rows", backlogRows); err != nil {
		return nil, err
	}
	o.orderings = splitList(orderings)
	for _, l := range []struct {
		name, s string
		into    *[]time.Duration
	}{{"latency-polls", latencyPolls, &o.latencyPolls}, {"idle-polls", idlePolls, &o.idlePolls}} {
		for _, p := range splitList(l.s) {
			d, err := time.ParseDuration(p)
			if err != nil || d < 10*time.Millisecond {
				return nil, fmt.Errorf("-%s: %q is not a duration of at least 10ms", l.name, p)
			}
			*l.into = append(*l.into, d)
		}
	}
	def := func(v *int, full, quick int) {
		if *v == 0 {
			*v = full
			if o.quick {
				*v = quick
			}
		}
	}
	defD := func(v *time.Duration, full, quick time.Duration) {
		if *v == 0 {
			*v = full
			if o.quick {
				*v = quick
			}
		}
	}
	def(&o.reps, 3, 1)
	if o.quick && !flagSet(fs, "idle-duration") {
		o.idleFor = 4 * time.Second
	}
	def(&o.rows, 200_000, 30_000)
	defD(&o.seedsFor, 15*time.Second, 8*time.Second)
	defD(&o.latencyFor, 60*time.Second, 12*time.Second)
	defD(&o.writersFor, 10*time.Second, 3*time.Second)
	def(&o.longRows, 1_000_000, 50_000)
	def(&o.backlogReads, 20, 5)
	def(&o.burstRows, 200_000, 20_000)
	if o.quick && !flagSet(fs, "scenarios") {
		o.scenarios = quickScenarios
	}
	if o.outMD == "" {
		o.outMD = "docs/benchmarks.md"
		if o.quick || flagSet(fs, "scenarios") {
			o.outMD = "bench/quick.md"
		}
	}
	if o.outJSON == "" {
		o.outJSON = "bench/results.json"
		if o.quick || flagSet(fs, "scenarios") {
			o.outJSON = "bench/quick-results.json"
		}
	}
	return o, nil
}

func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// splitList splits a list flag's value at commas, dropping blanks.
func splitList(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return r == ',' || unicode.IsSpace(r) })
}

func intList(name, s string) ([]int, error) {
	var out []int
	for _, p := range splitList(s) {
		var n int
		if _, err := fmt.Sscan(p, &n); err != nil || n <= 0 {
			return nil, fmt.Errorf("-%s: %q is not a positive integer", name, p)
		}
		out = append(out, n)
	}
	return out, nil
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	o, err := parseFlags(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := bench(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		return 1
	}
	return 0
}

// bench runs the chosen scenarios and writes the report.
func bench(ctx context.Context, o *options) error {
	if o.fsync {
		os.Setenv("OUTBOX_PG_FSYNC", "on")
	}
	root, err := testenv.FindRepoRoot()
	if err != nil {
		return err
	}
	if err := os.Chdir(root); err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "outbox-bench-")
	if err != nil {
		return err
	}
	failed := true
	defer func() {
		if o.keepWorkDir || failed {
			logf("work folder (logs) kept in %s", work)
			return
		}
		os.RemoveAll(work)
	}()
	start := time.Now()
	env, err := startEnv(ctx, o, work)
	if err != nil {
		return err
	}
	defer env.close()
	rep := newReport(o, env)
	if err := runScenarios(ctx, o, env, rep); err != nil {
		return err
	}
	rep.Duration = time.Since(start).Round(time.Second).String()
	if err := rep.write(o); err != nil {
		return err
	}
	fmt.Print(rep.tables())
	logf("done in %s; wrote %s and %s", rep.Duration, o.outMD, o.outJSON)
	if len(rep.Failed) > 0 {
		return fmt.Errorf("scenarios failed: %v (see the notes in %s)", rep.Failed, o.outMD)
	}
	failed = false
	return nil
}

func runScenarios(ctx context.Context, o *options, env *benchEnv, rep *report) error {
	want := func(s string) bool {
		if s == "throughput" {
			return slices.ContainsFunc(o.scenarios, func(x string) bool {
				return x == scCeiling || x == scDrain || x == scNaive || x == scScaling || x == scRetention || x == scCompression || x == scHeaders
			})
		}
		return slices.Contains(o.scenarios, s)
	}
	steps := []struct {
		name string
		fn   func(context.Context, *options, *benchEnv, *report) error
	}{
		{"throughput", runRounds},
		{scPruning, runPruning},
		{scLongLived, runLongLived},
		{scLatency, runLatency},
		{scWriters, runWriters},
		{scCapture, runCaptureModes},
		{scLinger, runLinger},
		{scIdle, runIdle},
		{scBacklog, runBacklogCost},
		{scBreakdown, runBreakdown},
		{scProfile, runProfile},
		{scFootprint, runFootprint},
		// Last: it starts a cluster of its own.
		{scAutoscale, runAutoscale},
	}
	if err := warmUp(ctx, o, env); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	for _, s := range steps {
		if !want(s.name) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		t0 := time.Now()
		logf("== %s", s.name)
		if err := s.fn(ctx, o, env, rep); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("scenario %s: %w", s.name, err)
			}
			// One broken scenario must not cost the others' results.
			logf("scenario %s failed: %v", s.name, err)
			rep.note(s.name, "error", err.Error())
			rep.Failed = append(rep.Failed, s.name)
		}
		logf("== %s done in %s", s.name, time.Since(t0).Round(time.Second))
	}
	return nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}
