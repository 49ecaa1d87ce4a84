package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"time"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// report is everything one run measured; it becomes bench/results.json and
// the generated part of docs/benchmarks.md.
type report struct {
	Date       string            `json:"date"`
	Commit     string            `json:"commit"`
	GoVersion  string            `json:"go_version"`
	CPUModel   string            `json:"cpu_model"`
	CPUs       int               `json:"cpus"`
	PostgreSQL string            `json:"postgresql"`
	Kafka      string            `json:"kafka"`
	Fsync      bool              `json:"postgres_fsync"`
	Quick      bool              `json:"quick"`
	Reps       int               `json:"reps"`
	Rows       int               `json:"rows"`
	Partitions int               `json:"partitions"`
	Duration   string            `json:"duration"`
	Results    []*result         `json:"results"`
	Notes      map[string]string `json:"notes,omitempty"`
	Failed     []string          `json:"failed_scenarios,omitempty"`
	// Ratios are taken within each round (cases measured minutes apart, not
	// hours), and the median of the rounds is reported.
	Ratios  map[string]ratioResult `json:"ratios"`
	Targets []target               `json:"targets"`
	Profile *profileSummary        `json:"profile,omitempty"`
}

// result is one case of one scenario: each metric's value per repetition and median.
type result struct {
	Scenario string               `json:"scenario"`
	Case     string               `json:"case"`
	Params   map[string]any       `json:"params"`
	Median   map[string]float64   `json:"median"`
	Reps     []map[string]float64 `json:"reps"`
}

type ratioResult struct {
	Median float64   `json:"median"`
	Rounds []float64 `json:"rounds"`
}

type target struct {
	Name     string `json:"name"`
	Want     string `json:"want"`
	Measured string `json:"measured"`
	Status   string `json:"status"` // met, missed, not measured
	Why      string `json:"why,omitempty"`
}

func newReport(o *options, e *benchEnv) *report {
	r := &report{
		Date: time.Now().UTC().Format(time.RFC3339), Commit: gitCommit(), GoVersion: runtime.Version(),
		CPUModel: cpuModel(), CPUs: runtime.NumCPU(), PostgreSQL: e.pgVer, Kafka: kafkaVersion(),
		Fsync: o.fsync, Quick: o.quick, Reps: o.reps, Rows: o.rows, Partitions: o.partitions,
		Notes: map[string]string{}, Ratios: map[string]ratioResult{},
	}
	return r
}

// repeat runs fn o.reps times and returns each repetition's metrics.
func repeat(o *options, fn func(i int) (map[string]float64, error)) ([]map[string]float64, error) {
	var out []map[string]float64
	for i := range o.reps {
		m, err := fn(i)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}

func (r *report) add(scenario, cas string, params map[string]any, reps []map[string]float64) {
	res := &result{Scenario: scenario, Case: cas, Params: params, Reps: reps, Median: map[string]float64{}}
	keys := map[string]bool{}
	for _, m := range reps {
		for k, v := range m {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				delete(m, k) // JSON has no NaN; a missing value means "no sample"
				continue
			}
			keys[k] = true
		}
	}
	for k := range keys {
		var vs []float64
		for _, m := range reps {
			if v, ok := m[k]; ok {
				vs = append(vs, v)
			}
		}
		res.Median[k] = median(vs)
	}
	r.Results = append(r.Results, res)
}

func (r *report) note(scenario, cas, msg string) { r.Notes[scenario+" "+cas] = msg }

func (r *report) get(scenario, cas, metric string) (float64, bool) {
	for _, x := range r.Results {
		if x.Scenario == scenario && x.Case == cas {
			v, ok := x.Median[metric]
			return v, ok
		}
	}
	return 0, false
}

func median(vs []float64) float64 {
	if len(vs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(vs)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// evaluate compares the medians with the performance targets the relay
// and the operator are held to (the thresholds below). A target is listed
// when the run chose a scenario that measures it (in), so that a run of
// some scenarios reports what they measured and not the rest.
func (r *report) evaluate(o *options) {
	r.Targets = nil
	listed := true
	in := func(scenarios ...string) {
		listed = slices.ContainsFunc(scenarios, func(s string) bool { return slices.Contains(o.scenarios, s) })
	}
	add := func(name, want string, measured float64, have bool, ok bool, format string) {
		if !listed {
			return
		}
		t := target{Name: name, Want: want, Status: "not measured"}
		if have {
			t.Measured = fmt.Sprintf(format, measured)
			t.Status = map[bool]string{true: "met", false: "missed"}[ok]
			if want == "reported" {
				t.Status = "reported"
			}
		}
		r.Targets = append(r.Targets, t)
	}
	in(scCeiling, scDrain)
	q, ok := r.Ratios["drain none batch 500 / ceiling batch 500"]
	add("one replica, none, at batch 500 vs the claim+mark ceiling at batch 500 (median of per-round ratios)", "≥ 80%", 100*q.Median, ok, q.Median >= 0.80, "%.0f%%")
	q, ok = r.Ratios["drain none batch 50 / ceiling batch 50"]
	add("one replica, none, at batch 50 vs the ceiling at batch 50", "≥ 70%", 100*q.Median, ok, q.Median >= 0.70, "%.0f%%")
	in(scScaling)
	for _, n := range []int{1, 4} {
		q, ok = r.Ratios[fmt.Sprintf("scaling partition-key / none %d replicas", n)]
		add(fmt.Sprintf("PartitionKey vs None at %d replica(s), batch 50", n), "≥ 90%", 100*q.Median, ok, q.Median >= 0.90, "%.0f%%")
	}
	in(scNaive)
	q, ok = r.Ratios["drain none batch 50 / naive shape"]
	add("one replica at batch 50 vs the naive shape (median of per-round ratios)", "≥ 10×", q.Median, ok, q.Median >= 10, "%.1f×")
	in(scScaling)
	q, ok = r.Ratios["scaling none 4 replicas / 1"]
	add("4 replicas vs 1 at batch 50 (median of per-round ratios)", "≥ 1.5×", q.Median, ok, q.Median >= 1.5, "%.2f×")
	in(scLatency)
	p99, ok1 := r.get(scLatency, "rate=1000", "p99_ms")
	add("commit-to-consumed p99 at 1,000 events/s (default settings)", "≤ 30 ms", p99, ok1, p99 <= 30, "%.0f ms")
	p99, ok1 = r.get(scLatency, "rate=5000", "p99_ms")
	add("commit-to-consumed p99 at 5,000 events/s (default settings)", "≤ 50 ms", p99, ok1, p99 <= 50, "%.0f ms")
	p99, ok1 = r.get(scLatency, "rate=1000 notify", "p99_ms")
	add("commit-to-consumed p99 at 1,000 events/s with --notify", "≤ 5 ms", p99, ok1, p99 <= 5, "%.1f ms")
	in(scIdle)
	x, ok1 := r.get(scIdle, "poll="+relayconfig.DefaultPollInterval.String(), "db_xacts_per_s")
	add("idle relay at default settings: database transactions/s", "≤ 10", x, ok1, x <= 10, "%.1f")
	in(scWriters)
	q, ok = r.Ratios["writers notify / without"]
	add("writers' throughput with a notification per transaction vs without (8 writers, one row per transaction)", "reported", 100*q.Median, ok, true, "%.0f%%")
	in(scRetention)
	q, ok = r.Ratios["retention delete / mark batch 500"]
	add("drain at batch 500, --on-publish delete vs mark", "reported", 100*q.Median, ok, true, "%.0f%%")
	in(scHeaders)
	q, ok = r.Ratios["headers with / without, batch 500"]
	add("drain at batch 500 with a headers column of three entries vs without", "reported", 100*q.Median, ok, true, "%.0f%%")
	q, ok = r.Ratios["headers tracing on / off, batch 500"]
	add("drain at batch 500 with tracing on (every span exported) vs off", "reported", 100*q.Median, ok, true, "%.0f%%")
	in(scPruning)
	q, ok = r.Ratios["pruning drain with / without"]
	add("drain at batch 500 while the relay prunes vs without pruning", "reported", 100*q.Median, ok, true, "%.0f%%")
	q, ok = r.Ratios["pruning writers with / without"]
	add("writers' throughput while the relay prunes vs without pruning", "reported", 100*q.Median, ok, true, "%.0f%%")
	in(scLongLived)
	q, ok = r.Ratios[longLivedRatio(relayconfig.OnPublishDelete, false)]
	add(fmt.Sprintf("long-lived table (%d rows, writers, a long transaction), --on-publish delete: rate over the last 10%% of the drain vs the first 10%%", o.longRows),
		"≥ 80%", 100*q.Median, ok, q.Median >= 0.80, "%.0f%%")
	q, ok = r.Ratios[longLivedRatio(relayconfig.OnPublishMark, false)]
	add("the same without retention (--on-publish mark)", "reported", 100*q.Median, ok, true, "%.0f%%")
	q, ok = r.Ratios[longLivedRatio(relayconfig.OnPublishMark, true)]
	add("the same with mark and the server's default autovacuum settings instead of the DDL's", "reported", 100*q.Median, ok, true, "%.0f%%")
	in(scAutoscale)
	q, ok = r.Ratios[autoscaleRatio(o, "time to drain")]
	add(fmt.Sprintf("a burst of %d rows drained with autoscaling 0..%d vs one fixed replica: time to drain", o.burstRows, o.autoscaleMax), "reported", 100*q.Median, ok, true, "%.0f%%")
	q, ok = r.Ratios[autoscaleRatio(o, "replica-seconds to drain")]
	add("the same: replica-seconds until drained", "reported", 100*q.Median, ok, true, "%.0f%%")
	in(scBacklog)
	if len(o.backlogRows) > 0 {
		n := slices.Max(o.backlogRows)
		x, ok1 := r.get(scBacklog, fmt.Sprintf("pending=%d", n), "db_ms_per_s")
		add(fmt.Sprintf("the operator's backlog reads at %d waiting rows: database time per OutboxRelay", n), "reported", x, ok1, true, "%.2f ms/s")
	}
	in(scLatency)
	flat, ok1 := r.get(scLatency, "rate=5000", "backlog_flat")
	grow, _ := r.get(scLatency, "rate=5000", "backlog_end")
	add("backlog at 5,000 events/s", "flat", grow, ok1, flat == 1, "flat=%v"+fmt.Sprintf(" (end-of-run backlog %.0f rows)", grow))
	if ok1 && listed {
		r.Targets[len(r.Targets)-1].Measured = map[bool]string{true: "flat", false: "growing"}[flat == 1] + fmt.Sprintf(" (last-10 s backlog %.0f rows)", grow)
	}
	rss := math.NaN()
	for _, x := range r.Results {
		if x.Scenario == scLatency {
			if v, ok := x.Median["relay_rss_mib"]; ok && !(v <= rss) {
				rss = v
			}
		}
	}
	add("relay RSS at steady state (largest of the latency runs)", "≤ 64 MiB", rss, !math.IsNaN(rss), rss <= 64, "%.1f MiB")
	in(scFootprint)
	n := o.relays
	fleet := fmt.Sprintf("relays=%d", n)
	t, ok1 := r.get(scFootprint, fleet, "ready_s")
	add(fmt.Sprintf("%d OutboxRelays Ready, backlogs read", n), "≤ 60 s", t, ok1, t <= 60, "%.1f s")
	m, ok1 := r.get(scFootprint, fleet, "manager_rss_mib")
	add("manager RSS with them", "≤ 256 MiB", m, ok1, m <= 256, "%.1f MiB")
	c, ok1 := r.get(scFootprint, fleet, "db_conns_peak")
	add(fmt.Sprintf("operator connections to their one database (%d users), peak", fleetNamespaces),
		fmt.Sprintf("≤ %d (the cap)", controllers.DefaultConnsPerDatabase), c, ok1, c <= controllers.DefaultConnsPerDatabase, "%.0f")
	g, ok1 := r.get(scFootprint, fleet, "secret_gets_per_s")
	add("Secret GETs in the steady window", "0 /s", g, ok1, g == 0, "%.2f /s")
	w, ok1 := r.get(scFootprint, fleet, "fleet_writes_per_s")
	most := float64(n) / 60 // a status write per OutboxRelay per minute, as the rows age (controllers.statusRefresh)
	add("API writes in the steady window (only the rows' age changes)", fmt.Sprintf("≤ %.1f /s (one status write per OutboxRelay per minute)", most),
		w, ok1, w <= most, "%.2f /s")
	r.captureTargets(o, in, add)
}

// captureTargets are the targets of capture from the write-ahead log beside
// polling: latency, the writers' throughput, the drain and the idle cost of
// logical replication against polling; and adaptive polling's cost against
// a relay polling every 200 ms while it keeps its p99.
func (r *report) captureTargets(o *options, in func(...string), add func(name, want string, measured float64, have, ok bool, format string)) {
	in(scCapture)
	for _, rate := range o.rates {
		floor, ok := r.get(scCapture, captureLatencyCase(rate, kafkaAlone), "p99_ms")
		add(fmt.Sprintf("the Kafka hop alone, no database (paced producers with the relay's produce settings, and a consumer): p99 at %d events/s", rate), "reported", floor, ok, true, "%.1f ms")
		p99, ok := r.get(scCapture, captureLatencyCase(rate, logicalRepl), "p99_ms")
		add(fmt.Sprintf("logical replication at its defaults: commit-to-consumed p99 at %d events/s", rate), "≤ 5 ms", p99, ok, p99 <= 5, "%.1f ms")
		best, bestMode := math.Inf(1), ""
		for _, m := range o.chosenCaptureModes() {
			if v, ok := r.get(scCapture, captureLatencyCase(rate, m.name), "p99_ms"); ok && m.streams() && v < best {
				best, bestMode = v, m.name
			}
		}
		add(fmt.Sprintf("the lowest p99 of the logical-replication settings at %d events/s", rate), "≤ 5 ms", best, bestMode != "", best <= 5, "%.1f ms ("+bestMode+")")
	}
	for _, mode := range []string{logicalRepl, logicalReplDeletes} {
		q, ok := r.Ratios[writersRatio(mode)]
		add(fmt.Sprintf("writers beside %s vs no relay (%d writers, one row per transaction, flat out)", mode, o.producers), "≥ 95%", 100*q.Median, ok, q.Median >= 0.95, "%.0f%%")
		q, ok = r.Ratios[writersSplitRatio(mode)]
		add(fmt.Sprintf("the same with the database and the writers on one CPU, the relay and Kafka on the other (%s)", mode), "≥ 95%", 100*q.Median, ok, q.Median >= 0.95, "%.0f%%")
	}
	for _, mode := range []string{logicalRepl, logicalReplDeletes} {
		q, ok := r.Ratios[captureDrainRatio(mode)]
		add(fmt.Sprintf("drain at batch %d, %s vs polling", captureDrainBatch, mode), "≥ 100%", 100*q.Median, ok, q.Median >= 1, "%.0f%%")
	}
	poll, okPoll := r.get(scCaptureIdle, captureCase("idle", pollAdaptive), "db_xacts_per_s")
	for _, mode := range []string{logicalRepl, logicalReplDeletes} {
		x, ok := r.get(scCaptureIdle, captureCase("idle", mode), "db_xacts_per_s")
		add(fmt.Sprintf("idle, %s: database transactions/s vs polling's", mode), "no more than polling's", x, ok && okPoll, x <= poll, "%.1f against "+fmt.Sprintf("%.1f", poll))
	}
	in(scLinger)
	if len(o.rates) == 0 {
		return
	}
	rate := o.rates[0]
	for _, mode := range lingerModes {
		cpu, ok1 := r.Ratios[lingerRatio(lingerCPU, mode, pollFixed, rate)]
		claims, ok2 := r.Ratios[lingerRatio(lingerClaims, mode, pollFixed, rate)]
		p99 := ratioResult{Median: 1} // the default's own
		ok3 := true
		if mode != pollAdaptive {
			p99, ok3 = r.Ratios[lingerRatio(lingerP99, mode, pollAdaptive, rate)]
		}
		add(fmt.Sprintf("%s at %d events/s: relay CPU and claim transactions per event vs a relay polling every 200 ms, p99 vs the default's (%s)", mode, rate, pollAdaptive),
			"≤ 2×, ≤ 2×, ≤ 1.1×", cpu.Median, ok1 && ok2 && ok3, cpu.Median <= 2 && claims.Median <= 2 && p99.Median <= 1.1,
			"%.2f×, "+fmt.Sprintf("%.2f×, %.2f×", claims.Median, p99.Median))
	}
}

func (r *report) write(o *options) error {
	// A ratio of a case that measured nothing (0/0, x/0) is no result, and
	// JSON has no NaN or Inf: before, one such ratio failed the encoding,
	// and the whole run's report was lost.
	for k, v := range r.Ratios {
		if math.IsNaN(v.Median) || math.IsInf(v.Median, 0) {
			delete(r.Ratios, k)
			r.note("ratios", k, "not measured: a case it divides measured nothing")
			continue
		}
		v.Rounds = slices.DeleteFunc(v.Rounds, func(x float64) bool { return math.IsNaN(x) || math.IsInf(x, 0) })
		r.Ratios[k] = v
	}
	r.evaluate(o)
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(o.outJSON), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(o.outJSON, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return writeMarkdown(o.outMD, r.markdown(o.outJSON))
}

const (
	genBegin = "<!-- BEGIN GENERATED by test/bench: do not edit by hand -->"
	genEnd   = "<!-- END GENERATED -->"
)

// writeMarkdown replaces the generated block of path, keeping the
// hand-written sections around it.
func writeMarkdown(path, generated string) error {
	block := genBegin + "\n" + generated + genEnd + "\n"
	old, err := os.ReadFile(path)
	var out string
	switch {
	case err == nil && bytes.Contains(old, []byte(genBegin)) && bytes.Contains(old, []byte(genEnd)):
		s := string(old)
		i := strings.Index(s, genBegin)
		j := strings.Index(s, genEnd) + len(genEnd)
		out = s[:i] + strings.TrimSuffix(block, "\n") + s[j:]
	default:
		out = "# Benchmarks\n\nProduced by `make bench` (test/bench).\n\n" + block
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(out), 0o644)
}

// markdown is the report's generated block; jsonPath is where every
// repetition was written.
func (r *report) markdown(jsonPath string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Run of %s at commit `%s`: %d × %s, Go %s, PostgreSQL %s (fsync %s), Kafka %s (one KRaft broker on the JVM, same machine), topics of %d partitions. ",
		r.Date, r.Commit, r.CPUs, r.CPUModel, strings.TrimPrefix(r.GoVersion, "go"), r.PostgreSQL, onOff(r.Fsync), r.Kafka, r.Partitions)
	fmt.Fprintf(&b, "Each scenario ran %d time(s); medians are shown, every repetition is in `%s`. Drains use %d pre-inserted rows of ~300-byte JSON. The whole run took %s.\n\n",
		r.Reps, filepath.ToSlash(jsonPath), r.Rows, r.Duration)
	b.WriteString(r.tables())
	return b.String()
}

func onOff(v bool) string {
	if v {
		return "on"
	}
	return "off"
}

// tables renders every measured scenario and the targets as Markdown tables.
func (r *report) tables() string {
	var b strings.Builder
	reps := func(x *result, k, f string) string {
		var parts []string
		for _, m := range x.Reps {
			parts = append(parts, fmt.Sprintf(f, m[k]))
		}
		return strings.Join(parts, " / ")
	}
	section := func(scenario, title, header string, row func(x *result) string) {
		var rows []string
		for _, x := range r.Results {
			if x.Scenario == scenario {
				rows = append(rows, row(x))
			}
		}
		var notes []string
		for k, v := range r.Notes {
			if strings.HasPrefix(k, scenario+" ") {
				notes = append(notes, fmt.Sprintf("- `%s`: %s", strings.TrimPrefix(k, scenario+" "), v))
			}
		}
		if len(rows) == 0 && len(notes) == 0 {
			return
		}
		sort.Strings(notes)
		fmt.Fprintf(&b, "### %s\n\n", title)
		if len(rows) > 0 {
			b.WriteString(header + "\n")
			for _, l := range rows {
				b.WriteString(l + "\n")
			}
			b.WriteString("\n")
		}
		for _, n := range notes {
			b.WriteString(n + "\n")
		}
		if len(notes) > 0 {
			b.WriteString("\n")
		}
	}
	section(scCeiling, "1. Ceiling: PostgreSQL claim+mark, no Kafka",
		"| batch | loops | rows/s (median) | repetitions |\n| ---: | ---: | ---: | --- |",
		func(x *result) string {
			return fmt.Sprintf("| %v | %v | %.0f | %s |", x.Params["batch"], x.Params["loops"], x.Median["events_per_s"], reps(x, "events_per_s", "%.0f"))
		})
	section(scDrain, "2. Relay drain: one relay process, pre-inserted backlog",
		"| ordering | batch | events/s (median) | vs ceiling | CPU s / 10k events | peak RSS MiB | repetitions (events/s) |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |",
		func(x *result) string {
			ratio := "–"
			if c, ok := r.get(scCeiling, fmt.Sprintf("batch=%v loops=1", x.Params["batch"]), "events_per_s"); ok {
				ratio = fmt.Sprintf("%.0f%%", 100*x.Median["events_per_s"]/c)
			}
			return fmt.Sprintf("| %v | %v | %.0f | %s | %.2f | %.1f | %s |", x.Params["ordering"], x.Params["batch"], x.Median["events_per_s"], ratio,
				x.Median["cpu_s_per_10k"], x.Median["peak_rss_mib"], reps(x, "events_per_s", "%.0f"))
		})
	section(scNaive, "3. The naive shape: claim through the pool, one WriteMessages and one UPDATE per row",
		"| batch | events/s (median) | relay batch 50 / naive | repetitions |\n| ---: | ---: | ---: | --- |",
		func(x *result) string {
			ratio := "–"
			if d, ok := r.get(scDrain, "ordering=none batch=50", "events_per_s"); ok {
				ratio = fmt.Sprintf("%.1f×", d/x.Median["events_per_s"])
			}
			return fmt.Sprintf("| %v | %.0f | %s | %s |", x.Params["batch"], x.Median["events_per_s"], ratio, reps(x, "events_per_s", "%.0f"))
		})
	section(scScaling, "4. Scaling: replicas draining one table, batch 50",
		"| ordering | replicas | events/s (median) | vs 1 replica | CPU s / 10k (all replicas) | repetitions |\n| --- | ---: | ---: | ---: | ---: | --- |",
		func(x *result) string {
			ratio := "–"
			if one, ok := r.get(scScaling, fmt.Sprintf("ordering=%v replicas=1", x.Params["ordering"]), "events_per_s"); ok {
				ratio = fmt.Sprintf("%.2f×", x.Median["events_per_s"]/one)
			}
			return fmt.Sprintf("| %v | %v | %.0f | %s | %.2f | %s |", x.Params["ordering"], x.Params["replicas"], x.Median["events_per_s"], ratio,
				x.Median["cpu_s_per_10k"], reps(x, "events_per_s", "%.0f"))
		})
	section(scLatency, "5. Steady state: one relay (batch 50), producers inserting one row per transaction",
		"| target events/s | poll interval | achieved inserts/s | consumed | p50 ms | p95 ms | p99 ms | max ms | p99 per third (ms) | rows overtaken (%) | p99 of the rest ms | backlog first / last 10 s (rows) | backlog flat | relay CPU (cores) | relay RSS MiB |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- | ---: | ---: |",
		func(x *result) string {
			m := x.Median
			poll := fmt.Sprint(x.Params["poll_interval"])
			if x.Params["notify"] == true {
				poll += " + notify"
			}
			return fmt.Sprintf("| %v | %v | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f / %.0f / %.0f | %.2f | %.0f | %.0f / %.0f | %s | %.2f | %.1f |",
				x.Params["rate"], poll, m["achieved_per_s"], m["consumed"], m["p50_ms"], m["p95_ms"], m["p99_ms"], m["max_ms"],
				m["p99_ms_w1"], m["p99_ms_w2"], m["p99_ms_w3"], m["overtaken_pct"], m["p99_ms_in_order"], m["backlog_start"], m["backlog_end"],
				map[bool]string{true: "yes", false: "no"}[m["backlog_flat"] == 1], m["relay_cpu_cores"], m["relay_rss_mib"])
		})
	section(scRetention, "Retention: mark against delete on publish, one relay, batch 500 (timed by the relay's counter)",
		"| on publish | events/s (median) | repetitions |\n| --- | ---: | --- |",
		func(x *result) string {
			return fmt.Sprintf("| %v | %.0f | %s |", x.Params["on_publish"], x.Median["events_per_s"], reps(x, "events_per_s", "%.0f"))
		})
	section(scCompression, fmt.Sprintf("Compression: one relay draining at batch 500 with each codec (same %d rows)", r.Rows),
		"| codec | events/s (median) | topic on the broker's disk (MiB) | repetitions |\n| --- | ---: | ---: | --- |",
		func(x *result) string {
			return fmt.Sprintf("| %v | %.0f | %.1f | %s |", x.Params["codec"], x.Median["events_per_s"], x.Median["topic_mib"], reps(x, "events_per_s", "%.0f"))
		})
	section(scHeaders, fmt.Sprintf("Headers and tracing: one relay draining at batch 500 (%d rows), with and without a headers column of three entries, tracing off and on", r.Rows),
		"| headers column | tracing | events/s (median) | vs neither | CPU s / 10k events | spans exported per event | topic on the broker's disk (MiB) | repetitions |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
		func(x *result) string {
			ratio, spans := "–", "–"
			if v, ok := r.get(scHeaders, headersCaseName(false, false), "events_per_s"); ok {
				ratio = fmt.Sprintf("%.0f%%", 100*x.Median["events_per_s"]/v)
			}
			if v, ok := x.Median["spans_per_event"]; ok {
				spans = fmt.Sprintf("%.2f", v)
			}
			return fmt.Sprintf("| %s | %s | %.0f | %s | %.2f | %s | %.1f | %s |", map[bool]string{true: "set", false: "NULL"}[x.Params["headers"] == true],
				onOff(x.Params["tracing"] == true), x.Median["events_per_s"], ratio, x.Median["cpu_s_per_10k"], spans, x.Median["topic_mib"], reps(x, "events_per_s", "%.0f"))
		})
	section(scPruning, fmt.Sprintf("Pruning: what it costs the relay and the writers (the table also holds %d rows published a day ago; pruning is --%s=%s)", r.Rows, relayconfig.FlagKeepPublishedFor, pruneKeep),
		"| run | pruning | rows/s (median) | vs without | rows pruned during the run | repetitions |\n| --- | --- | ---: | ---: | ---: | --- |",
		func(x *result) string {
			ratio := "–"
			if v, ok := r.get(scPruning, fmt.Sprintf("%v pruning=false", x.Params["kind"]), "events_per_s"); ok {
				ratio = fmt.Sprintf("%.0f%%", 100*x.Median["events_per_s"]/v)
			}
			run := fmt.Sprintf("drain, one relay at batch %v", x.Params["batch"])
			if x.Params["kind"] == "writers" {
				run = fmt.Sprintf("%v writers, one row per transaction (relay at batch %v)", x.Params["writers"], x.Params["batch"])
			}
			return fmt.Sprintf("| %s | %s | %.0f | %s | %.0f | %s |", run, onOff(x.Params["pruning"] == true), x.Median["events_per_s"], ratio, x.Median["pruned"], reps(x, "events_per_s", "%.0f"))
		})
	section(scLongLived, r.longLivedTitle(),
		"| on publish | autovacuum settings | first 10% events/s | last 10% events/s | last / first | while the long transaction was open | whole drain | long transaction open (s) | writers' rows/s | table at the end (MiB) |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
		func(x *result) string {
			m := x.Median
			lastFirst := "–"
			if v, ok := m["last_first"]; ok {
				lastFirst = fmt.Sprintf("%.0f%%", 100*v)
			}
			return fmt.Sprintf("| %v | %v | %.0f | %.0f | %s | %.0f | %.0f | %.1f | %.0f | %.0f |", x.Params["on_publish"], cmp.Or(x.Params["autovacuum"], any(autovacuumLabel(false))), m["first10_per_s"], m["last10_per_s"], lastFirst,
				m["long_tx_per_s"], m["events_per_s"], m["long_tx_open_s"], m["writers_per_s"], m["table_mib"])
		})
	section(scWriters, "Writers: what a notification per transaction costs (8 writers, one row per transaction)",
		"| notify | rows/s (median) | repetitions |\n| --- | ---: | --- |",
		func(x *result) string {
			return fmt.Sprintf("| %v | %.0f | %s |", x.Params["notify"], x.Median["rows_per_s"], reps(x, "rows_per_s", "%.0f"))
		})
	section(scCapture, "Capture modes side by side: polling, polling with the wake-up (--notify), logical replication (--capture logical-replication); one relay at batch 50, producers inserting one row per transaction",
		"| run | mode | target events/s | p50 ms | p99 ms | relay CPU (cores) | relay CPU ms / 1k events | relay claim transactions / 1k events | database CPU ms / 1k events (writers' included) | WAL bytes / event | writers' insert + commit p50 / p99 ms | writers' rows/s (median) | repetitions |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
		func(x *result) string {
			m := x.Median
			switch {
			case x.Params["kind"] == "writers":
				run := "writers"
				if cpus, ok := x.Params["cpus"]; ok {
					run = fmt.Sprintf("writers, %v", cpus)
				}
				return fmt.Sprintf("| %s | %v | – | – | – | – | – | – | – | – | – | %.0f | %s |", run, x.Params["mode"], m["rows_per_s"], reps(x, "rows_per_s", "%.0f"))
			case x.Params["mode"] == kafkaAlone:
				return fmt.Sprintf("| latency | %v | %v | %.1f | %.1f | – | – | – | – | – | – | – | %s |", x.Params["mode"], x.Params["rate"], m["p50_ms"], m["p99_ms"], reps(x, "p99_ms", "%.1f"))
			case x.Params["mode"] == noRelay:
				return fmt.Sprintf("| latency | %v | %v | – | – | – | – | – | – | – | %.2f / %.2f | – | – |", x.Params["mode"], x.Params["rate"], m["writer_commit_p50_ms"], m["writer_commit_p99_ms"])
			}
			return fmt.Sprintf("| latency | %v | %v | %.1f | %.1f | %.3f | %.0f | %.0f | %.0f | %.0f | %.2f / %.2f | – | %s |", x.Params["mode"], x.Params["rate"], m["p50_ms"], m["p99_ms"],
				m["relay_cpu_cores"], m["relay_cpu_ms_per_1k"], m["relay_claims_per_1k"], m["db_cpu_ms_per_1k"], m["wal_bytes_per_event"],
				m["writer_commit_p50_ms"], m["writer_commit_p99_ms"], reps(x, "p99_ms", "%.1f"))
		})
	section(scCaptureIdle, "The capture modes idle (one relay, empty table; with logical replication the database's transactions may include those the walsender runs to decode)",
		"| mode | database transactions/s | database CPU (millicores) | relay CPU (millicores) |\n| --- | ---: | ---: | ---: |",
		func(x *result) string {
			return fmt.Sprintf("| %v | %.1f | %.1f | %.1f |", x.Params["mode"], x.Median["db_xacts_per_s"], x.Median["db_cpu_millicores"], x.Median["relay_cpu_millicores"])
		})
	section(scCaptureDrain, fmt.Sprintf("The capture modes draining a backlog (%d rows, one relay at batch %d): polling from the table; logical replication from the slot's WAL after the relay was down (the rows are in the table too); writer deletes from the slot's WAL alone. Events/s by the relay's counter; caught up: until the slot was confirmed past the rows", r.Rows, captureDrainBatch),
		"| mode | events/s (median) | caught up after (s) | relay CPU s / 10k events | database CPU s / 10k events | of which its walsender | repetitions (events/s) |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |",
		func(x *result) string {
			caught, walsender := "–", "–"
			if v, ok := x.Median["caught_up_s"]; ok {
				caught = fmt.Sprintf("%.1f", v)
			}
			if v, ok := x.Median["walsender_cpu_s_per_10k"]; ok {
				walsender = fmt.Sprintf("%.2f", v)
			}
			return fmt.Sprintf("| %v | %.0f | %s | %.2f | %.2f | %s | %s |", x.Params["mode"], x.Median["counter_events_per_s"], caught, x.Median["cpu_s_per_10k"], x.Median["db_cpu_s_per_10k"], walsender, reps(x, "counter_events_per_s", "%.0f"))
		})
	section(scLinger, "Adaptive polling's wait after a partial claim (--linger) against a relay polling every 200 ms: one relay at batch 50, producers inserting one row per transaction, each setting in turn in every round",
		"| mode | target events/s | p50 ms (median) | p99 ms (median) | relay CPU ms / 1k events | relay claim transactions / 1k events | p99 ms in each round |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |",
		func(x *result) string {
			m := x.Median
			return fmt.Sprintf("| %v | %v | %.1f | %.1f | %.0f | %.0f | %s |", x.Params["mode"], x.Params["rate"], m["p50_ms"], m["p99_ms"],
				m["relay_cpu_ms_per_1k"], m["relay_claims_per_1k"], reps(x, "p99_ms", "%.1f"))
		})
	section(scFootprint, fmt.Sprintf("6. Footprint: a fleet of OutboxRelays in %d namespaces (one database user each), each on an outbox table of its own with %d waiting rows in one real PostgreSQL database, reconciled in envtest; the steady window follows all Ready (defaults: %s backlog interval, %d connections per database, Secrets read every %s)",
		fleetNamespaces, fleetRows, controllers.DefaultBacklogInterval, controllers.DefaultConnsPerDatabase, controllers.DefaultSecretRefreshInterval),
		"| OutboxRelays | created in s | all Ready, backlogs read, in s | manager CPU s until then | manager RSS MiB | peak RSS MiB | steady millicores | database connections, peak / steady | database ms/s (steady) | database sessions opened/s (steady) | Secret GETs/s (steady) | API writes/s (steady) | API reads/s (steady) |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
		func(x *result) string {
			m := x.Median
			sessions := "–" // runs from before it was measured
			if v, ok := m["db_sessions_per_s"]; ok {
				sessions = fmt.Sprintf("%.2f", v)
			}
			return fmt.Sprintf("| %v | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f / %.0f | %.2f | %s | %.2f | %.2f | %.2f |", x.Params["relays"], m["created_s"], m["ready_s"],
				m["manager_cpu_s"], m["manager_rss_mib"], m["manager_peak_rss_mib"], m["manager_steady_millicores"], m["db_conns_peak"], m["db_conns_steady"],
				m["db_ms_per_s"], sessions, m["secret_gets_per_s"], m["fleet_writes_per_s"], m["fleet_reads_per_s"])
		})
	section(scIdle, "Idle cost of the poll interval (one relay, empty table)",
		"| poll interval | database transactions/s | relay CPU (millicores) |\n| --- | ---: | ---: |",
		func(x *result) string {
			return fmt.Sprintf("| %v | %.1f | %.1f |", x.Params["poll_interval"], x.Median["db_xacts_per_s"], x.Median["relay_cpu_millicores"])
		})
	section(scBacklog, fmt.Sprintf("The operator's backlog read: one query per OutboxRelay every %s (the default), on its own connection with the operator's settings, at most %d rows read",
		controllers.DefaultBacklogInterval, outboxv1alpha1.BacklogBound),
		"| waiting rows | rows read | ms per read (median) | p95 ms | database ms per second, per OutboxRelay | OutboxRelays per database core |\n| ---: | ---: | ---: | ---: | ---: | ---: |",
		func(x *result) string {
			m := x.Median
			return fmt.Sprintf("| %v | %.0f | %.1f | %.1f | %.2f | %.0f |", x.Params["pending"], m["rows_read"], m["read_ms"], m["read_ms_p95"], m["db_ms_per_s"], m["relays_per_core"])
		})
	section(scAutoscale, r.autoscaleTitle(),
		"| relay | burst drained in s | vs fixed | replica-seconds until drained | peak replicas | first replica ready after s | back at its minimum after s | replica-seconds until then |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
		func(x *result) string {
			m := x.Median
			relay, ratio := "fixed, 1 replica", "–"
			if x.Params["autoscaling"] == true {
				relay = fmt.Sprintf("autoscaling %v..%v, %v pending rows per replica, scale-down after %v", x.Params["min_replicas"], x.Params["max_replicas"],
					x.Params["pending_per_replica"], x.Params["scale_down_stabilization"])
			}
			if v, ok := r.get(scAutoscale, autoscaleCase(false), "drain_s"); ok {
				ratio = fmt.Sprintf("%.2f×", m["drain_s"]/v)
			}
			return fmt.Sprintf("| %s | %.1f | %s | %.1f | %.0f | %.1f | %.1f | %.1f |", relay, m["drain_s"], ratio, m["replica_s_drain"], m["peak_replicas"],
				m["first_ready_s"], m["settled_s"], m["replica_s_settled"])
		})
	section(scBreakdown, "Where a batch's time goes (in-process relay, one replica, same Writer settings, wall time per batch)",
		"| batch | events/s | ms per batch | claim ms | publish (WriteMessages) ms | mark + commit ms |\n| ---: | ---: | ---: | ---: | ---: | ---: |",
		func(x *result) string {
			m := x.Median
			return fmt.Sprintf("| %v | %.0f | %.2f | %.2f | %.2f | %.2f |", x.Params["batch"], m["events_per_s"], m["batch_ms"], m["claim_ms"], m["publish_ms"], m["mark_commit_ms"])
		})
	if r.Profile != nil {
		p := r.Profile
		fmt.Fprintf(&b, "### Profile of the relay at batch %d (in-process relay.Run, %d rows, %.0f events/s)\n\n", p.Batch, p.Rows, p.EventsPerS)
		fmt.Fprintf(&b, "CPU (top by cumulative time, `go tool pprof -top -cum`):\n\n```\n%s```\n\n", p.CPUTop)
		fmt.Fprintf(&b, "Allocations during the drain (top by allocated bytes, flat):\n\n```\n%s```\n\n", p.AllocTop)
	}
	if len(r.Ratios) > 0 {
		b.WriteString("### Ratios within each round (median, and each round)\n\n| ratio | median | rounds |\n| --- | ---: | --- |\n")
		keys := make([]string, 0, len(r.Ratios))
		for k := range r.Ratios {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			var parts []string
			for _, v := range r.Ratios[k].Rounds {
				parts = append(parts, fmt.Sprintf("%.2f", v))
			}
			fmt.Fprintf(&b, "| %s | %.2f | %s |\n", k, r.Ratios[k].Median, strings.Join(parts, " / "))
		}
		b.WriteString("\n")
	}
	if len(r.Targets) > 0 {
		b.WriteString("### Targets\n\n| target | wanted | measured | status |\n| --- | --- | --- | --- |\n")
		for _, t := range r.Targets {
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", t.Name, t.Want, cmp.Or(t.Measured, "–"), t.Status)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// longLivedTitle says what the long-lived runs did, from their parameters.
func (r *report) longLivedTitle() string {
	for _, x := range r.Results {
		if x.Scenario == scLongLived {
			p := x.Params
			return fmt.Sprintf("A long-lived table: one relay drains %v rows at batch %v while %v writers insert %v rows/s and a transaction holding a transaction id stays open from %.0f%% to %.0f%% of the drain",
				p["rows"], p["batch"], p["writers"], p["write_rate"], 100*toFloat(p["long_tx_from"]), 100*toFloat(p["long_tx_to"]))
		}
	}
	return "A long-lived table"
}

// autoscaleTitle says what the autoscale runs did, from their parameters.
func (r *report) autoscaleTitle() string {
	for _, x := range r.Results {
		if x.Scenario == scAutoscale {
			return fmt.Sprintf("Autoscaling: a burst of %v rows inserted in one transaction, drained by relay pods the operator runs (batch %v, backlog read every %v)",
				x.Params["burst_rows"], x.Params["batch"], x.Params["interval"])
		}
	}
	return "Autoscaling"
}

// toFloat reads a number from params, whether set in this run or read back from JSON.
func toFloat(v any) float64 {
	switch n := v.(type) {
	case float64:
		return n
	case int:
		return float64(n)
	}
	return math.NaN()
}

func gitCommit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
		c += " (with uncommitted changes)"
	}
	return c
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}

func kafkaVersion() string {
	libs := os.Getenv("OUTBOX_KAFKA_LIBS")
	if libs == "" {
		m, _ := filepath.Glob("bin/kafka/*/libs")
		if len(m) == 0 {
			return "unknown"
		}
		libs = m[len(m)-1]
	}
	return filepath.Base(filepath.Dir(libs))
}
