package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBenchQuick runs `make bench-quick` end to end — PostgreSQL, Kafka, the
// relay binary and every quick scenario — on a tiny data set, and checks
// that the report and the JSON hold every scenario and the targets.
func TestBenchQuick(t *testing.T) {
	dir := t.TempDir()
	md, js := filepath.Join(dir, "quick.md"), filepath.Join(dir, "quick.json")
	flags := "-rows 3000 -reps 1 -latency-duration 4s -seeds-duration 2s -rates 500 -replicas 1,2 -writers-duration 1s -idle-duration 2s" +
		" -longlived-rows 30000 -backlog-rows 1000,5000 -backlog-reads 2" +
		" -out-md " + md + " -out-json " + js + " -profile-dir " + filepath.Join(dir, "profiles")
	cmd := exec.Command("make", "-C", filepath.Join("..", ".."), "bench-quick", "BENCH_QUICK_FLAGS="+flags)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "make bench-quick:\n%s", out)
	t.Logf("make bench-quick took %s", time.Since(start).Round(time.Second))

	b, err := os.ReadFile(js)
	require.NoError(t, err)
	var rep report
	require.NoError(t, json.Unmarshal(b, &rep))
	for k, v := range rep.Notes {
		require.NotContains(t, v, "failed", "case %s", k)
	}
	seen := map[string]bool{}
	for _, r := range rep.Results {
		seen[r.Scenario] = true
		require.NotEmpty(t, r.Median, "%s %s has no values", r.Scenario, r.Case)
	}
	for _, s := range []string{scCeiling, scDrain, scNaive, scScaling, scLatency, scCapture, scLinger, scBreakdown, scHeaders, scPruning, scLongLived, scBacklog} {
		require.True(t, seen[s], "scenario %s missing from %s", s, js)
	}
	v, ok := rep.get(scDrain, "ordering=none batch=500", "events_per_s")
	require.True(t, ok)
	require.Positive(t, v)
	// The ratios between scenarios are found by the scenarios' names.
	// Before, they looked for names the scenarios no longer had, and every
	// one of them, and every target built on them, was silently missing.
	for _, key := range []string{"drain none batch 500 / ceiling batch 500", "drain none batch 50 / naive shape",
		"scaling none 2 replicas / 1", "headers with / without, batch 500", "retention delete / mark batch 500"} {
		r, ok := rep.Ratios[key]
		require.True(t, ok, "ratio %q missing from %s", key, js)
		require.Positive(t, r.Median, key)
	}
	// With tracing on, every span reaches the sink.
	v, ok = rep.get(scHeaders, headersCaseName(true, true), "spans_per_event")
	require.True(t, ok)
	require.InDelta(t, 1, v, 0.001)
	v, ok = rep.get(scPruning, "writers pruning=true", "pruned")
	require.True(t, ok)
	require.Positive(t, v, "nothing pruned while the writers ran")
	// Logical replication delivered every row the producers wrote.
	inserted, ok := rep.get(scCapture, captureLatencyCase(500, logicalRepl), "inserted")
	require.True(t, ok)
	consumed, _ := rep.get(scCapture, captureLatencyCase(500, logicalRepl), "consumed")
	require.Positive(t, inserted)
	require.Equal(t, inserted, consumed, "every streamed row reached Kafka")
	inserted, ok = rep.get(scCapture, captureLatencyCase(500, logicalReplDeletes), "inserted")
	require.True(t, ok)
	consumed, _ = rep.get(scCapture, captureLatencyCase(500, logicalReplDeletes), "consumed")
	require.Positive(t, inserted)
	require.Equal(t, inserted, consumed, "every row the writers deleted reached Kafka")
	v, ok = rep.get(scCapture, captureLatencyCase(500, logicalRepl), "db_cpu_ms_per_1k")
	require.True(t, ok)
	require.Positive(t, v, "the database server's CPU per event is measured")
	// What the writers' commits take at the rate, with no relay and with each mode.
	alone, ok := rep.get(scCapture, captureLatencyCase(500, noRelay), "writer_commit_p99_ms")
	require.True(t, ok, "the writers' commits with no relay are measured")
	require.Positive(t, alone)
	v, ok = rep.get(scCapture, captureLatencyCase(500, logicalRepl), "writer_commit_p99_ms")
	require.True(t, ok, "the writers' commits beside logical replication are measured")
	require.Positive(t, v)
	q, ok := rep.Ratios["writers' commit p99 at 500/s, with logical-replication / "+noRelay]
	require.True(t, ok, "the writers' commit p99 against no relay, in the same run")
	require.InDelta(t, v/alone, q.Median, 1e-9)
	// The writers again with the relay and the broker on a CPU of their
	// own: the machine that runs make test has two.
	require.GreaterOrEqual(t, runtime.NumCPU(), 2, "the CPU split needs two CPUs")
	aloneSplit, ok := rep.get(scCapture, captureCase("writers split", noRelay), "rows_per_s")
	require.True(t, ok, "the writers with no relay are measured with the CPUs split")
	require.Positive(t, aloneSplit)
	v, ok = rep.get(scCapture, captureCase("writers split", logicalRepl), "rows_per_s")
	require.True(t, ok, "the writers beside logical replication are measured with the CPUs split")
	require.Positive(t, v)
	q, ok = rep.Ratios[writersSplitRatio(logicalRepl)]
	require.True(t, ok, "the writers with the CPUs split against no relay, in the same run")
	require.InDelta(t, v/aloneSplit, q.Median, 1e-9)
	_, ok = rep.get(scCaptureIdle, captureCase("idle", logicalReplDeletes), "relay_cpu_millicores")
	require.True(t, ok, "the capture modes' idle cost is measured")
	// Idle, the server may use less than one clock tick (10 ms) in the
	// quick run's seconds.
	v, ok = rep.get(scCaptureIdle, captureCase("idle", logicalReplDeletes), "db_cpu_millicores")
	require.True(t, ok, "the database server's idle CPU is measured")
	require.GreaterOrEqual(t, v, 0.0)
	q, ok = rep.Ratios["relay CPU per event, poll / poll every 200 ms (--linger 200ms) at 500/s"]
	require.True(t, ok, "adaptive polling's cost against the fixed poller, per round")
	require.Len(t, q.Rounds, 1)
	require.Positive(t, q.Median)
	v, ok = rep.get(scCaptureDrain, captureCase("drain", logicalReplDeletes), "counter_events_per_s")
	require.True(t, ok, "a backlog in the slot's WAL alone is drained")
	require.Positive(t, v)
	v, ok = rep.get(scCaptureDrain, captureCase("drain", logicalRepl), "db_cpu_s_per_10k")
	require.True(t, ok, "what a drain costs the database server is measured")
	require.Positive(t, v)
	w, ok := rep.get(scCaptureDrain, captureCase("drain", logicalRepl), "walsender_cpu_s_per_10k")
	require.True(t, ok, "what its walsender costs is measured")
	// Decoding the quick run's few thousand rows may take the walsender
	// less than one clock tick (10 ms), which /proc counts as none.
	require.GreaterOrEqual(t, w, 0.0)
	require.Less(t, w, v, "the walsender is a part of the server")
	v, ok = rep.get(scBacklog, "pending=5000", "rows_read")
	require.True(t, ok)
	require.Equal(t, 5000.0, v)
	require.NotNil(t, rep.Profile)
	require.NotEmpty(t, rep.Profile.CPUTop)
	require.NotEmpty(t, rep.Targets)
	// The capture targets are read from this run's cases; the fleet's,
	// which -quick does not run, are not listed.
	measured := map[string]string{}
	for _, x := range rep.Targets {
		measured[x.Name] = x.Status
		require.NotContains(t, x.Name, "OutboxRelays Ready")
	}
	require.Contains(t, []string{"met", "missed"}, measured["logical replication at its defaults: commit-to-consumed p99 at 500 events/s"])
	require.Contains(t, []string{"met", "missed"}, measured["drain at batch 500, logical-replication, writer deletes vs polling"])
	inserted, ok = rep.get(scCapture, captureLatencyCase(500, kafkaAlone), "inserted")
	require.True(t, ok, "the Kafka hop alone is measured")
	consumed, _ = rep.get(scCapture, captureLatencyCase(500, kafkaAlone), "consumed")
	require.Equal(t, inserted, consumed, "every event published alone reached the consumer")

	text, err := os.ReadFile(md)
	require.NoError(t, err)
	require.Contains(t, string(text), genBegin)
	require.Contains(t, string(text), "### Targets\n")
}

// timeAt interpolates between the samples around the value.
func TestTimeAt(t *testing.T) {
	t0 := time.Unix(1000, 0)
	samples := []counterSample{{t0, 0}, {t0.Add(time.Second), 100}, {t0.Add(2 * time.Second), 100}, {t0.Add(3 * time.Second), 300}}
	at, ok := timeAt(samples, 50)
	require.True(t, ok)
	require.Equal(t, t0.Add(500*time.Millisecond), at)
	at, ok = timeAt(samples, 100)
	require.True(t, ok)
	require.Equal(t, t0.Add(time.Second), at, "the first sample that reached it")
	_, ok = timeAt(samples, 301)
	require.False(t, ok)
	require.InDelta(t, 100, rateBetween(samples, 100, 300), 1e-9, "200 rows in 2 s")
	require.Zero(t, rateBetween(samples, 100, 400), "never reached")
}

// -quick leaves out the scenarios that need kube-apiserver, which
// make bench-quick does not provision.
func TestQuickScenarios(t *testing.T) {
	o, err := parseFlags([]string{"-quick"})
	require.NoError(t, err)
	require.NotContains(t, o.scenarios, scFootprint)
	require.NotContains(t, o.scenarios, scAutoscale)
	require.Contains(t, o.scenarios, scLongLived)
	require.Equal(t, []int{10000, 100000}, o.backlogRows)
	o, err = parseFlags(nil)
	require.NoError(t, err)
	require.Equal(t, allScenarios, o.scenarios)
	require.Equal(t, 1_000_000, o.longRows)
}

// Every section renders its rows without formatting errors, from the
// parameters as set in a run and as read back from results.json.
func TestTablesRender(t *testing.T) {
	o, err := parseFlags(nil)
	require.NoError(t, err)
	rep := &report{Rows: 1000, Ratios: map[string]ratioResult{}, Notes: map[string]string{}}
	one := func(m map[string]float64) []map[string]float64 { return []map[string]float64{m} }
	for _, h := range []bool{false, true} {
		rep.add(scHeaders, headersCaseName(h, h), map[string]any{"headers": h, "tracing": h, "batch": 500},
			one(map[string]float64{"events_per_s": 1000, "cpu_s_per_10k": 0.1, "spans_per_event": 1, "topic_mib": 1}))
		rep.add(scPruning, fmt.Sprintf("writers pruning=%v", h), map[string]any{"kind": "writers", "pruning": h, "batch": 50, "writers": 8},
			one(map[string]float64{"events_per_s": 900, "pruned": 10}))
	}
	rep.add(scLongLived, "on-publish=delete", map[string]any{"on_publish": "delete", "rows": 1000, "batch": 500, "writers": 8,
		"write_rate": 1000, "long_tx_from": longTxFrom, "long_tx_to": longTxTo}, one(map[string]float64{"first10_per_s": 10, "last10_per_s": 9, "last_first": 0.9}))
	rep.add(scBacklog, "pending=1000", map[string]any{"pending": 1000}, one(map[string]float64{"rows_read": 1000, "read_ms": 1, "db_ms_per_s": 0.1}))
	for _, auto := range []bool{false, true} {
		rep.add(scAutoscale, autoscaleCase(auto), map[string]any{"autoscaling": auto, "burst_rows": 1000, "batch": 50, "interval": "15s",
			"min_replicas": 0, "max_replicas": 4, "pending_per_replica": 125, "scale_down_stabilization": "30s"},
			one(map[string]float64{"drain_s": 10 + 10*b2f(auto), "replica_s_drain": 10, "peak_replicas": 1}))
	}
	rep.Ratios["longlived last / first 10% on-publish delete"] = ratioResult{Median: 0.9}
	rep.evaluate(o)
	b, err := json.Marshal(rep)
	require.NoError(t, err)
	var back report
	require.NoError(t, json.Unmarshal(b, &back))
	for _, r := range []*report{rep, &back} {
		text := r.tables()
		require.NotContains(t, text, "%!")
		require.Contains(t, text, "from 25% to 75% of the drain")
		require.Contains(t, text, "| delete | the DDL's | 10 | 9 | 90% |")
		require.Contains(t, text, "| set | on | 1000 | 100% |")
		require.Contains(t, text, "| 8 writers, one row per transaction (relay at batch 50) | on | 900 | 100% | 10 |")
		require.Contains(t, text, "| autoscaling 0..4, 125 pending rows per replica, scale-down after 30s | 20.0 | 2.00× |")
	}
	require.Contains(t, rep.tables(), "rate over the last 10% of the drain vs the first 10% | ≥ 80% | 90% | met |")
}

// A run lists the targets of the scenarios it chose, each read from the
// medians and ratios of its own cases, and not the targets of the rest.
func TestCaptureTargets(t *testing.T) {
	o, err := parseFlags([]string{"-scenarios", scCapture + "," + scLinger, "-rates", "1000"})
	require.NoError(t, err)
	rep := &report{Ratios: map[string]ratioResult{}, Notes: map[string]string{}}
	one := func(m map[string]float64) []map[string]float64 { return []map[string]float64{m} }
	for mode, p99 := range map[string]float64{kafkaAlone: 3, pollAdaptive: 14, logicalRepl: 6, logicalReplDeletes: 8, "logical-replication, --linger 1ms": 4.5} {
		rep.add(scCapture, captureLatencyCase(1000, mode), map[string]any{"kind": "latency", "mode": mode, "rate": 1000}, one(map[string]float64{"p99_ms": p99}))
	}
	for mode, x := range map[string]float64{pollAdaptive: 6.7, logicalRepl: 4.2, logicalReplDeletes: 7} {
		rep.add(scCaptureIdle, captureCase("idle", mode), map[string]any{"mode": mode}, one(map[string]float64{"db_xacts_per_s": x}))
	}
	rep.Ratios[writersRatio(logicalRepl)] = ratioResult{Median: 0.61}
	rep.Ratios[writersSplitRatio(logicalRepl)] = ratioResult{Median: 0.96}
	rep.Ratios[captureDrainRatio(logicalRepl)] = ratioResult{Median: 0.81}
	rep.Ratios[captureDrainRatio(logicalReplDeletes)] = ratioResult{Median: 1.31}
	for mode, v := range map[string][3]float64{pollAdaptive: {2.7, 3.2, 1}, pollLinger20: {1.8, 1.7, 1.9}} {
		rep.Ratios[lingerRatio(lingerCPU, mode, pollFixed, 1000)] = ratioResult{Median: v[0]}
		rep.Ratios[lingerRatio(lingerClaims, mode, pollFixed, 1000)] = ratioResult{Median: v[1]}
		rep.Ratios[lingerRatio(lingerP99, mode, pollAdaptive, 1000)] = ratioResult{Median: v[2]}
	}
	rep.evaluate(o)
	status := map[string]string{}
	for _, x := range rep.Targets {
		status[x.Name] = x.Measured + " " + x.Status
	}
	require.Equal(t, map[string]string{
		"the Kafka hop alone, no database (paced producers with the relay's produce settings, and a consumer): p99 at 1000 events/s":                    "3.0 ms reported",
		"logical replication at its defaults: commit-to-consumed p99 at 1000 events/s":                                                                  "6.0 ms missed",
		"the lowest p99 of the logical-replication settings at 1000 events/s":                                                                           "4.5 ms (logical-replication, --linger 1ms) met",
		"writers beside logical-replication vs no relay (8 writers, one row per transaction, flat out)":                                                 "61% missed",
		"the same with the database and the writers on one CPU, the relay and Kafka on the other (logical-replication)":                                 "96% met",
		"the same with the database and the writers on one CPU, the relay and Kafka on the other (logical-replication, writer deletes)":                 " not measured",
		"writers beside logical-replication, writer deletes vs no relay (8 writers, one row per transaction, flat out)":                                 " not measured",
		"drain at batch 500, logical-replication vs polling":                                                                                            "81% missed",
		"drain at batch 500, logical-replication, writer deletes vs polling":                                                                            "131% met",
		"idle, logical-replication: database transactions/s vs polling's":                                                                               "4.2 against 6.7 met",
		"idle, logical-replication, writer deletes: database transactions/s vs polling's":                                                               "7.0 against 6.7 missed",
		"poll at 1000 events/s: relay CPU and claim transactions per event vs a relay polling every 200 ms, p99 vs the default's (poll)":                "2.70×, 3.20×, 1.00× missed",
		"poll, --linger 10ms at 1000 events/s: relay CPU and claim transactions per event vs a relay polling every 200 ms, p99 vs the default's (poll)": " not measured",
		"poll, --linger 20ms at 1000 events/s: relay CPU and claim transactions per event vs a relay polling every 200 ms, p99 vs the default's (poll)": "1.80×, 1.70×, 1.90× missed",
	}, status)
	require.NotContains(t, rep.tables(), "%!")
	require.Contains(t, rep.tables(), "| latency | "+kafkaAlone+" | 1000 | 0.0 | 3.0 | – |")
}

// A ratio of a case that measured nothing is left out of the report, with
// a note, and the rest is written. Before, JSON could not encode its NaN
// and the whole run's report was lost.
func TestReportWritesWithoutARatioThatMeasuredNothing(t *testing.T) {
	o, err := parseFlags(nil)
	require.NoError(t, err)
	dir := t.TempDir()
	o.outMD, o.outJSON = filepath.Join(dir, "r.md"), filepath.Join(dir, "r.json")
	rep := &report{Rows: 1000, Ratios: map[string]ratioResult{}, Notes: map[string]string{}}
	rep.Ratios["nothing / nothing"] = ratioResult{Median: math.NaN(), Rounds: []float64{math.NaN()}}
	rep.Ratios["something / nothing"] = ratioResult{Median: math.Inf(1)}
	rep.Ratios["kept"] = ratioResult{Median: 1.5, Rounds: []float64{1.5}}
	require.NoError(t, rep.write(o))
	b, err := os.ReadFile(o.outJSON)
	require.NoError(t, err)
	var back report
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, map[string]ratioResult{"kept": {Median: 1.5, Rounds: []float64{1.5}}}, back.Ratios)
	require.Contains(t, back.Notes["ratios nothing / nothing"], "not measured")
}
