package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// captureMode is one way the relay learns of new rows, compared side by
// side in the capture-modes scenario.
type captureMode struct {
	name   string
	notify bool
	args   []string
	// latencyOnly: not in the writers' rounds (its cost to the writers is
	// polling's).
	latencyOnly bool
}

// The polling modes whose cost is compared: adaptive polling at the
// default linger, at 10 ms and at 20 ms, and pollFixed, which polls every 200 ms
// whatever it finds (a linger as long as the poll interval): the
// yardstick of what adaptive polling costs.
const (
	pollAdaptive = "poll"
	pollLinger10 = "poll, --linger 10ms"
	pollLinger20 = "poll, --linger 20ms"
	pollFixed    = "poll every 200 ms (--linger 200ms)"
)

// noRelay names the writers' runs with no relay at all: the yardstick of
// what each mode costs them.
const noRelay = "no relay"

// Modes named outside the list below: polling with the wake-up, and logical
// replication at its defaults and with writer deletes, whose targets the
// report reads (captureTargets).
const (
	pollNotify         = "poll + notify"
	logicalRepl        = "logical-replication"
	logicalReplDeletes = "logical-replication, writer deletes"
)

// captureCase names a case of the capture-modes scenarios: what ran
// ("latency rate=1000", "writers", "writers split", "idle", "drain") and
// the mode it ran in.
func captureCase(what, mode string) string { return what + " " + mode }

// captureLatencyCase names the capture-modes steady state of a mode at a rate.
func captureLatencyCase(rate int, mode string) string {
	return captureCase(fmt.Sprintf("latency rate=%d", rate), mode)
}

// writersRatio names the writers' throughput beside a relay in mode against
// no relay, on a shared machine.
func writersRatio(mode string) string { return "writers with " + mode + " / " + noRelay }

// captureDrainRatio names a mode's drain at batch captureDrainBatch against
// polling's.
func captureDrainRatio(mode string) string {
	return fmt.Sprintf("drain at batch %d, %s / %s", captureDrainBatch, mode, pollAdaptive)
}

// streams reports whether the relay runs with logical replication in m.
func (m captureMode) streams() bool {
	return slices.Contains(m.args, flagArg(relayconfig.FlagCapture, relayconfig.CaptureLogicalReplication))
}

var captureModes = []captureMode{
	{name: pollAdaptive},
	{name: pollLinger10, args: []string{flagArg(relayconfig.FlagLinger, 10*time.Millisecond)}, latencyOnly: true},
	{name: pollLinger20, args: []string{flagArg(relayconfig.FlagLinger, 20*time.Millisecond)}, latencyOnly: true},
	{name: pollFixed, args: []string{flagArg(relayconfig.FlagLinger, relayconfig.DefaultPollInterval)}, latencyOnly: true},
	{name: pollNotify, notify: true},
	{name: logicalRepl, args: []string{flagArg(relayconfig.FlagCapture, relayconfig.CaptureLogicalReplication)}},
	{name: "logical-replication, batch 500", args: []string{flagArg(relayconfig.FlagCapture, relayconfig.CaptureLogicalReplication), flagArg(relayconfig.FlagBatchSize, 500)}},
	{name: logicalReplDeletes, args: []string{flagArg(relayconfig.FlagCapture, relayconfig.CaptureLogicalReplication), "--" + relayconfig.FlagWriterDeletes}},
	// The shortest wait the relay allows for more rows before it publishes
	// what the stream brought: the lowest latency the capture modes reach.
	{name: "logical-replication, --linger " + relayconfig.MinLinger.String(), args: []string{flagArg(relayconfig.FlagCapture, relayconfig.CaptureLogicalReplication), flagArg(relayconfig.FlagLinger, relayconfig.MinLinger)}, latencyOnly: true},
	{name: "logical-replication, writer deletes, --linger " + relayconfig.MinLinger.String(), args: []string{flagArg(relayconfig.FlagCapture, relayconfig.CaptureLogicalReplication), "--" + relayconfig.FlagWriterDeletes, flagArg(relayconfig.FlagLinger, relayconfig.MinLinger)}, latencyOnly: true},
}

// runCaptureModes compares polling, polling with the wake-up and logical
// replication in one run: the steady state at each rate (latency, the
// relay's CPU, its claim transactions and the WAL
// written per event), and what each costs the writers against writers
// with no relay at all (alternating rounds; the ratio is taken per round).
func runCaptureModes(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	for _, rate := range o.rates {
		// The writers at this rate with no relay: what their commits take
		// when nothing reads the table or its WAL.
		alone, err := writersAtRate(ctx, o, e, rate)
		if err != nil {
			return fmt.Errorf("writers alone at %d/s: %w", rate, err)
		}
		logf("capture no relay at %d/s: writers' commits p50 %.2f ms, p99 %.2f ms", rate, alone["writer_commit_p50_ms"], alone["writer_commit_p99_ms"])
		rep.add(scCapture, captureLatencyCase(rate, noRelay),
			map[string]any{"kind": "latency", "mode": noRelay, "rate": rate, "duration_s": o.latencyFor.Seconds(), "producers": o.producers},
			[]map[string]float64{alone})
		floor, err := kafkaAloneAt(ctx, o, e, rate)
		if err != nil {
			return fmt.Errorf("%s at %d/s: %w", kafkaAlone, rate, err)
		}
		logf("capture %s at %d/s: p50 %.1f ms, p99 %.1f ms (%.0f of %.0f events consumed)", kafkaAlone, rate, floor["p50_ms"], floor["p99_ms"], floor["consumed"], floor["inserted"])
		rep.add(scCapture, captureLatencyCase(rate, kafkaAlone),
			map[string]any{"kind": "latency", "mode": kafkaAlone, "rate": rate, "duration_s": o.latencyFor.Seconds(), "producers": o.producers},
			[]map[string]float64{floor})
		byMode := map[string]map[string]float64{}
		for _, m := range o.chosenCaptureModes() {
			res, err := latencyRun(ctx, o, e, rate, relayconfig.DefaultPollInterval, m.notify, m.args...)
			if err != nil {
				return fmt.Errorf("%s at %d/s: %w", m.name, rate, err)
			}
			byMode[m.name] = res
			if err := e.dropSlots(ctx); err != nil {
				return err
			}
			logf("capture %s at %d/s: p50 %.1f ms, p99 %.1f ms, relay CPU %.3f cores, relay claims/1k events %.0f, WAL %.0f B/event, writers' commits p99 %.2f ms",
				m.name, rate, res["p50_ms"], res["p99_ms"], res["relay_cpu_cores"], res["relay_claims_per_1k"], res["wal_bytes_per_event"], res["writer_commit_p99_ms"])
			if !m.latencyOnly {
				r := res["writer_commit_p99_ms"] / alone["writer_commit_p99_ms"]
				rep.Ratios[fmt.Sprintf("writers' commit p99 at %d/s, with %s / %s", rate, m.name, noRelay)] = ratioResult{Median: r, Rounds: []float64{r}}
			}
			rep.add(scCapture, captureLatencyCase(rate, m.name),
				map[string]any{"kind": "latency", "mode": m.name, "rate": rate, "duration_s": o.latencyFor.Seconds(), "producers": o.producers},
				[]map[string]float64{res})
		}
		// What adaptive polling costs against the fixed poller, in this run.
		for _, name := range lingerModes {
			if byMode[name] == nil || byMode[pollFixed] == nil {
				continue
			}
			for _, k := range []struct{ key, what string }{{"relay_cpu_ms_per_1k", lingerCPU}, {"relay_claims_per_1k", lingerClaims}} {
				r := byMode[name][k.key] / byMode[pollFixed][k.key]
				rep.Ratios[fmt.Sprintf("%s at %d/s, %s / %s", k.what, rate, name, pollFixed)] = ratioResult{Median: r, Rounds: []float64{r}}
			}
		}
	}
	// What each costs with nothing to publish.
	for _, m := range o.chosenCaptureModes() {
		if m.latencyOnly {
			continue
		}
		args := m.args
		if m.notify {
			args = append(slices.Clone(args), flagArg(relayconfig.FlagNotify, true))
		}
		res, err := idleRun(ctx, o, e, args...)
		if err != nil {
			return fmt.Errorf("idle %s: %w", m.name, err)
		}
		if err := e.dropSlots(ctx); err != nil {
			return err
		}
		logf("capture idle %s: %.1f database transactions/s, database %.1f millicores, relay %.1f millicores", m.name, res["db_xacts_per_s"], res["db_cpu_millicores"], res["relay_cpu_millicores"])
		rep.add(scCaptureIdle, captureCase("idle", m.name), map[string]any{"mode": m.name, "duration_s": o.idleFor.Seconds()}, []map[string]float64{res})
	}
	results, ratios, err := writerRounds(ctx, o, e, "")
	if err != nil {
		return err
	}
	for _, name := range append([]string{noRelay}, o.writerModeNames()...) {
		rep.add(scCapture, captureCase("writers", name), map[string]any{"kind": "writers", "mode": name, "writers": o.producers, "duration_s": o.writersFor.Seconds()}, results[name])
	}
	for name, rs := range ratios {
		rep.Ratios[writersRatio(name)] = ratioResult{Median: median(rs), Rounds: rs}
	}
	if err := writersSplit(ctx, o, e, rep); err != nil {
		return err
	}
	return captureDrains(ctx, o, e, rep)
}

// writerRounds runs o.reps rounds of the writers with no relay and then
// beside a relay in each mode, and gives each run's result and each
// mode's ratios to no relay by mode; what ends its log lines and errors.
func writerRounds(ctx context.Context, o *options, e *benchEnv, what string) (map[string][]map[string]float64, map[string][]float64, error) {
	ratios := map[string][]float64{}
	results := map[string][]map[string]float64{}
	for round := range o.reps {
		base, err := writersAlone(ctx, o, e)
		if err != nil {
			return nil, nil, err
		}
		results[noRelay] = append(results[noRelay], base)
		for _, m := range o.chosenCaptureModes() {
			if m.latencyOnly {
				continue
			}
			res, err := writersRunWith(ctx, o, e, tableFill{}, m.notify, m.args...)
			if err != nil {
				return nil, nil, fmt.Errorf("writers with %s%s: %w", m.name, what, err)
			}
			if err := e.dropSlots(ctx); err != nil {
				return nil, nil, err
			}
			logf("capture writers round %d %s%s: %.0f rows/s (no relay %.0f)", round+1, m.name, what, res["rows_per_s"], base["rows_per_s"])
			results[m.name] = append(results[m.name], res)
			ratios[m.name] = append(ratios[m.name], res["rows_per_s"]/base["rows_per_s"])
		}
	}
	return results, ratios, nil
}

// writersSplitRatio names the ratio of the writers' throughput beside a
// relay in mode to theirs with no relay, the CPUs split (cpuSplit).
func writersSplitRatio(mode string) string { return writersRatio(mode) + ", CPUs split" }

// writersSplit runs the writer rounds again with the CPUs split
// (cpuSplit): the relay and the broker on CPUs of their own, so the
// writers lose only what each mode costs the database server.
func writersSplit(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	s, ok, err := newCPUSplit()
	if err != nil {
		return err
	}
	if !ok {
		logf("capture writers with the CPUs split: not run, the benchmark may use a single CPU")
		return nil
	}
	if err := e.split(ctx, s); err != nil {
		return err
	}
	defer func() {
		if err := e.unsplit(context.WithoutCancel(ctx), s); err != nil {
			logf("capture writers with the CPUs split: cannot give the processes every CPU again: %v", err)
		}
	}()
	results, ratios, err := writerRounds(ctx, o, e, ", CPUs split")
	if err != nil {
		return err
	}
	for _, name := range append([]string{noRelay}, o.writerModeNames()...) {
		rep.add(scCapture, captureCase("writers split", name), map[string]any{"kind": "writers", "mode": name, "writers": o.producers,
			"duration_s": o.writersFor.Seconds(), "cpus": s.describe()}, results[name])
	}
	for name, rs := range ratios {
		rep.Ratios[writersSplitRatio(name)] = ratioResult{Median: median(rs), Rounds: rs}
	}
	return nil
}

// captureDrainBatch is the batch size the capture modes drain a backlog at.
const captureDrainBatch = 500

// captureDrains drains o.rows rows at batch 500 in each mode, in
// alternating rounds: polling from the table; streaming, from a slot
// whose WAL holds the rows after the relay was down (they are in the
// table too, and the stream claims them from it as it reads them); with
// writer deletes, from the slot's WAL alone. The rate is the relay's counter's, the same
// for all; "caught_up_s" is how long until the slot was confirmed past
// the rows (new rows wait behind them until then).
func captureDrains(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	var modes []captureMode
	for _, m := range o.chosenCaptureModes() {
		if !m.latencyOnly && !m.notify && !slices.Contains(m.args, flagArg(relayconfig.FlagBatchSize, captureDrainBatch)) {
			modes = append(modes, m)
		}
	}
	results := map[string][]map[string]float64{}
	ratios := map[string][]float64{}
	for range o.reps {
		var poll float64
		for _, m := range modes {
			res, err := relayDrainWith(ctx, o, e, drainSetup{fromSlot: m.streams(), writerDeletes: writerDeletes(m.args)}, captureDrainBatch, 1, "", m.args...)
			if err != nil {
				return fmt.Errorf("drain with %s: %w", m.name, err)
			}
			if err := e.dropSlots(ctx); err != nil {
				return err
			}
			logf("capture drain %s: %.0f events/s (caught up after %.1f s)", m.name, res["counter_events_per_s"], res["caught_up_s"])
			results[m.name] = append(results[m.name], res)
			if m.name == pollAdaptive {
				poll = res["counter_events_per_s"]
			} else if poll > 0 {
				ratios[m.name] = append(ratios[m.name], res["counter_events_per_s"]/poll)
			}
		}
	}
	for _, m := range modes {
		rep.add(scCaptureDrain, captureCase("drain", m.name), map[string]any{"mode": m.name, "batch": captureDrainBatch, "rows": o.rows}, results[m.name])
	}
	for name, rs := range ratios {
		rep.Ratios[captureDrainRatio(name)] = ratioResult{Median: median(rs), Rounds: rs}
	}
	return nil
}

// chosenCaptureModes are the modes -capture-modes names (all by default).
func (o *options) chosenCaptureModes() []captureMode {
	if len(o.captureModes) == 0 {
		return captureModes
	}
	return slices.DeleteFunc(slices.Clone(captureModes), func(m captureMode) bool { return !slices.Contains(o.captureModes, m.name) })
}

// writerModeNames are the chosen modes of the writers' rounds.
func (o *options) writerModeNames() []string {
	var names []string
	for _, m := range o.chosenCaptureModes() {
		if !m.latencyOnly {
			names = append(names, m.name)
		}
	}
	return names
}

// captureModeNamed is the capture mode of that name.
func captureModeNamed(name string) (captureMode, bool) {
	i := slices.IndexFunc(captureModes, func(m captureMode) bool { return m.name == name })
	if i < 0 {
		return captureMode{}, false
	}
	return captureModes[i], true
}

// captureModeNames are the names of the capture modes.
func captureModeNames() []string {
	var names []string
	for _, m := range captureModes {
		names = append(names, m.name)
	}
	return names
}

// writersAlone is the writers' throughput with no relay running.
func writersAlone(ctx context.Context, o *options, e *benchEnv) (map[string]float64, error) {
	if err := e.fillTable(ctx, tableFill{}); err != nil {
		return nil, err
	}
	perSec, err := writeFor(ctx, o, e, insertSQL(false, false))
	if err != nil {
		return nil, err
	}
	return map[string]float64{"rows_per_s": perSec}, nil
}

// dbCounters are the WAL the benchmark's database server has written so
// far, and the CPU time it has used (serverCPUSeconds).
type dbCounters struct {
	walBytes   int64
	cpuSeconds float64
}

func (e *benchEnv) dbCounters(ctx context.Context) (dbCounters, error) {
	var c dbCounters
	if err := e.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&c.walBytes); err != nil {
		return c, err
	}
	var err error
	c.cpuSeconds, err = e.serverCPUSeconds(ctx)
	return c, err
}

// serverCPUSeconds is the CPU time the benchmark's PostgreSQL server has
// used so far: its postmaster and every process it runs now (backends,
// walsenders, background workers), and those that ended, whose time the
// postmaster collected when it reaped them. It includes the writers'
// backends, so between capture modes at one rate the difference is what
// each costs the database.
func (e *benchEnv) serverCPUSeconds(ctx context.Context) (float64, error) {
	if e.postmaster == 0 {
		var backend int
		if err := e.pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
			return 0, err
		}
		st, err := readProcStat(backend)
		if err != nil {
			return 0, fmt.Errorf("the database server's processes: %w", err)
		}
		e.postmaster = st.ppid
	}
	pm, err := readProcStat(e.postmaster)
	if err != nil {
		return 0, fmt.Errorf("the database server's processes: %w", err)
	}
	total := pm.utime + pm.stime + pm.cutime + pm.cstime
	err = e.serverProcs(func(_ int, st procStat) { total += st.utime + st.stime }) // one that ended meanwhile is in pm's children's times next time
	return total, err
}

// walsenderCPUSeconds is the CPU time the database server's walsenders
// running now have used: with a streaming relay, what decoding the WAL for
// it costs, a part of serverCPUSeconds. A walsender's time goes with it
// when it ends (into the postmaster's), so it is read while the relay runs.
func (e *benchEnv) walsenderCPUSeconds(ctx context.Context) (float64, error) {
	if _, err := e.serverCPUSeconds(ctx); err != nil { // finds the postmaster
		return 0, err
	}
	var total float64
	err := e.serverProcs(func(pid int, st procStat) {
		// PostgreSQL sets its processes' titles: "postgres: walsender …".
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil && strings.HasPrefix(string(b), "postgres: walsender ") {
			total += st.utime + st.stime
		}
	})
	return total, err
}

// serverProcs calls f with each process the database server runs now.
func (e *benchEnv) serverProcs(f func(pid int, st procStat)) error {
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return err
	}
	for _, d := range procs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if st, err := readProcStat(pid); err == nil && st.ppid == e.postmaster {
			f(pid, st)
		}
	}
	return nil
}

// dropSlots drops the replication slots a logical-replication relay left
// (once its walsender has ended), so the next run starts without one.
func (e *benchEnv) dropSlots(ctx context.Context) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var left int
		_, err := e.pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE NOT active`)
		if err == nil {
			err = e.pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots`).Scan(&left)
		}
		if err == nil && left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replication slots left after the run: %d (%v)", left, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
