package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// runLatency measures the steady state (and the relay's footprint in it):
// producers insert one row per transaction at a fixed rate for a fixed time
// while one relay with the default batch size and poll interval runs; a
// consumer on the same machine notes when each event arrives, and the
// latency is that time minus the moment the row's commit returned to its
// writer (one clock): commit-to-consumed.
func runLatency(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	type tc struct {
		rate   int
		poll   time.Duration
		notify bool
	}
	var cases []tc
	for _, rate := range o.rates {
		cases = append(cases, tc{rate, relayconfig.DefaultPollInterval, false})
	}
	// The poll interval's side of the trade-off, and the opt-in wake-up, at the first rate.
	for _, poll := range o.latencyPolls {
		if poll != relayconfig.DefaultPollInterval && len(o.rates) > 0 {
			cases = append(cases, tc{o.rates[0], poll, false})
		}
	}
	if len(o.rates) > 0 {
		cases = append(cases, tc{o.rates[0], relayconfig.DefaultPollInterval, true})
	}
	for _, c := range cases {
		m, err := latencyRun(ctx, o, e, c.rate, c.poll, c.notify)
		if err != nil {
			return err
		}
		name := fmt.Sprintf("rate=%d", c.rate)
		if c.poll != relayconfig.DefaultPollInterval {
			name += " poll=" + c.poll.String()
		}
		if c.notify {
			name += " notify"
		}
		logf("latency %s: achieved %.0f/s, p50 %.0f ms, p95 %.0f ms, p99 %.0f ms, backlog %.0f→%.0f, RSS %.1f MiB",
			name, m["achieved_per_s"], m["p50_ms"], m["p95_ms"], m["p99_ms"], m["backlog_start"], m["backlog_end"], m["relay_rss_mib"])
		rep.add(scLatency, name, map[string]any{"rate": c.rate, "duration_s": o.latencyFor.Seconds(),
			"producers": o.producers, "batch": relayconfig.DefaultBatchSize, "poll_interval": c.poll.String(), "notify": c.notify},
			[]map[string]float64{m})
	}
	return nil
}

// runIdle measures the other side of the poll interval: what an idle relay
// costs the database (transactions/s) and itself (CPU), per poll interval.
func runIdle(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	for _, poll := range o.idlePolls {
		m, err := idleRun(ctx, o, e, flagArg(relayconfig.FlagPollInterval, poll))
		if err != nil {
			return err
		}
		logf("idle poll=%s: %.1f database transactions/s, relay %.1f millicores", poll, m["db_xacts_per_s"], m["relay_cpu_millicores"])
		rep.add(scIdle, "poll="+poll.String(), map[string]any{"poll_interval": poll.String(), "duration_s": o.idleFor.Seconds()}, []map[string]float64{m})
	}
	return nil
}

// idleRun watches one relay with the flags extra on an empty table for
// o.idleFor: the database transactions per second and the relay's CPU.
func idleRun(ctx context.Context, o *options, e *benchEnv, extra ...string) (map[string]float64, error) {
	if err := e.freshTable(ctx, 0); err != nil {
		return nil, err
	}
	topic, err := e.newTopic(o, scIdle)
	if err != nil {
		return nil, err
	}
	defer e.deleteTopic(topic)
	p, err := e.startRelay(e.relayArgs(topic, relayconfig.DefaultBatchSize, "", extra...))
	if err != nil {
		return nil, err
	}
	defer stopRelay(p)
	if err := p.WaitReady(ctx, 30*time.Second); err != nil {
		return nil, err
	}
	time.Sleep(2 * time.Second)
	x0, err := e.xactCommits(ctx)
	if err != nil {
		return nil, err
	}
	c0, _ := cpuSeconds(p.Pid())
	s0, err := e.serverCPUSeconds(ctx)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	time.Sleep(o.idleFor)
	x1, err := e.xactCommits(ctx)
	if err != nil {
		return nil, err
	}
	c1, _ := cpuSeconds(p.Pid())
	s1, err := e.serverCPUSeconds(ctx)
	if err != nil {
		return nil, err
	}
	d := time.Since(t0).Seconds()
	// The two xactCommits reads are themselves one transaction each.
	return map[string]float64{"db_xacts_per_s": (x1 - x0 - 1) / d, "relay_cpu_millicores": 1000 * (c1 - c0) / d,
		"db_cpu_millicores": 1000 * (s1 - s0) / d}, nil
}

func latencyRun(ctx context.Context, o *options, e *benchEnv, rate int, poll time.Duration, notify bool, extra ...string) (map[string]float64, error) {
	if err := e.freshTable(ctx, 0); err != nil {
		return nil, err
	}
	topic, err := e.newTopic(o, fmt.Sprintf("latency-%d", rate))
	if err != nil {
		return nil, err
	}
	defer e.deleteTopic(topic)

	// Consumer first: every partition from the first offset.
	var (
		mu        sync.Mutex
		committed = map[string]time.Time{} // when each row's transaction's commit returned to its writer
	)
	recv, err := e.readArrivals(ctx, topic)
	if err != nil {
		return nil, err
	}
	defer recv.close()

	p, err := e.readyRelay(ctx, topic, notify, append([]string{flagArg(relayconfig.FlagPollInterval, poll)}, extra...)...)
	if err != nil {
		return nil, err
	}
	defer stopRelay(p)
	insert := insertSQL(notify, writerDeletes(extra))
	pw := startPaced(ctx, o, e, rate, insert, func(id string, at time.Time) {
		mu.Lock()
		committed[id] = at
		mu.Unlock()
	})
	prodStart, start, end, inserted := pw.prodStart, pw.start, pw.end, &pw.inserted
	// Sample the relay's RSS in the second half (steady state), and the
	// WAL written over the measured window.
	// The counters are read at the window's start and at its end, and
	// divided by the time between the reads and the rows inserted
	// between them. Before, the end was read at the first sampling tick
	// after it, up to a second late, which the nominal duration and the
	// window's rows did not count: up to 5 % more per event at 20 s.
	var rssMax, cpu0, cpu1 float64
	var batches0, batches1 batchStats
	var db0, db1 dbCounters
	var inserted0, inserted1 int64
	var read0, read1 time.Time
	sampleDone := make(chan struct{})
	go func() {
		defer close(sampleDone)
		time.Sleep(time.Until(start))
		read0 = time.Now()
		cpu0, _ = cpuSeconds(p.Pid())
		batches0 = relayBatches(p)
		db0, _ = e.dbCounters(ctx)
		inserted0 = inserted.Load()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		windowEnd := time.NewTimer(time.Until(end))
		defer windowEnd.Stop()
		for {
			select {
			case <-t.C:
				if time.Since(start) > o.latencyFor/2 {
					if rss, _, err := memKiB(p.Pid()); err == nil {
						rssMax = max(rssMax, rss)
					}
				}
				continue
			case <-windowEnd.C:
			}
			break
		}
		read1 = time.Now()
		cpu1, _ = cpuSeconds(p.Pid())
		batches1 = relayBatches(p)
		db1, _ = e.dbCounters(ctx)
		inserted1 = inserted.Load()
	}()
	if err := pw.wait(); err != nil {
		return nil, err
	}
	produceEnd := time.Now()
	<-sampleDone
	batches := batches1.minus(batches0)
	window := read1.Sub(read0).Seconds()
	n := int(inserted.Load())
	windowRows := float64(inserted1 - inserted0)
	// Let the relay and the consumer catch up (bounded).
	recv.waitFor(n, 60*time.Second)
	recv.close()

	// Join receive times with the commits, in id order.
	rows, err := e.pool.Query(ctx, `SELECT event_id::text, created_at FROM outbox ORDER BY id`)
	if err != nil {
		return nil, err
	}
	type ev struct{ created, committed, recv time.Time }
	var evs []ev
	for rows.Next() {
		var id string
		var created time.Time
		if err := rows.Scan(&id, &created); err != nil {
			rows.Close()
			return nil, err
		}
		mu.Lock()
		c := committed[id]
		mu.Unlock()
		r := recv.at[id]
		if c.IsZero() { // the writer stopped between its commit and noting it
			c = created
		}
		evs = append(evs, ev{created, c, r})
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if writerDeletes(extra) {
		// The writers deleted their rows: the commits alone, in commit
		// order, the moment of the commit standing for created_at.
		mu.Lock()
		for id, c := range committed {
			evs = append(evs, ev{c, c, recv.at[id]})
		}
		mu.Unlock()
		slices.SortFunc(evs, func(a, b ev) int { return a.committed.Compare(b.committed) })
	}
	// A row whose transaction took its id before a claim but committed after
	// it sits behind the relay's cursor until a floor scan: it is overtaken
	// (arrives >50 ms after some row with a higher id). Split the latency by that.
	overtaken := make([]bool, len(evs))
	var laterMin time.Time
	for i := len(evs) - 1; i >= 0; i-- {
		if !evs[i].recv.IsZero() && !laterMin.IsZero() && evs[i].recv.Sub(laterMin) > 50*time.Millisecond {
			overtaken[i] = true
		}
		if !evs[i].recv.IsZero() && (laterMin.IsZero() || evs[i].recv.Before(laterMin)) {
			laterMin = evs[i].recv
		}
	}
	var inOrder []float64
	nOvertaken := 0
	var lat, fromCreated []float64
	thirds := make([][]float64, 3)
	consumed := 0
	for i, x := range evs {
		if x.recv.IsZero() {
			continue
		}
		consumed++
		if x.created.Before(start) {
			continue
		}
		ms := float64(x.recv.Sub(x.committed).Microseconds()) / 1000
		lat = append(lat, ms)
		fromCreated = append(fromCreated, float64(x.recv.Sub(x.created).Microseconds())/1000)
		if overtaken[i] {
			nOvertaken++
		} else {
			inOrder = append(inOrder, ms)
		}
		i := int(3 * x.created.Sub(start).Seconds() / o.latencyFor.Seconds())
		thirds[min(max(i, 0), 2)] = append(thirds[min(max(i, 0), 2)], ms)
	}
	sort.Float64s(lat)
	sort.Float64s(fromCreated)
	sort.Float64s(inOrder)
	for _, t := range thirds {
		sort.Float64s(t)
	}
	// Backlog per second: rows created but not yet received at that instant.
	secs := int(o.latencyFor / time.Second)
	backlog := make([]float64, secs)
	for s := range secs {
		at := start.Add(time.Duration(s+1) * time.Second)
		for _, x := range evs {
			if !x.created.After(at) && !x.created.Before(start) && (x.recv.IsZero() || x.recv.After(at)) {
				backlog[s]++
			}
		}
	}
	// Flat: the last 10 s hold no more than the first 10 s plus a quarter
	// second of events; growth would mean the relay does not keep up.
	w := min(10, max(1, secs/2))
	first := mean(backlog[:w])
	last := mean(backlog[secs-w:])
	flat := last <= first+0.25*float64(rate)
	return map[string]float64{
		"inserted":       float64(n),
		"consumed":       float64(consumed),
		"achieved_per_s": float64(n) / produceEnd.Sub(prodStart).Seconds(),
		"p50_ms":         pct(lat, 0.50),
		"p95_ms":         pct(lat, 0.95),
		"p99_ms":         pct(lat, 0.99),
		"max_ms":         pct(lat, 1),
		// From the row's created_at (its transaction's start): adds the
		// writer's insert and commit (fsync) to the relay's part.
		"p99_ms_from_created": pct(fromCreated, 0.99),
		"overtaken_pct":       100 * float64(nOvertaken) / float64(max(consumed, 1)),
		"p99_ms_in_order":     pct(inOrder, 0.99),
		"p99_ms_w1":           pct(thirds[0], 0.99),
		"p99_ms_w2":           pct(thirds[1], 0.99),
		"p99_ms_w3":           pct(thirds[2], 0.99),
		"backlog_start":       first,
		"backlog_end":         last,
		"backlog_max":         slices.Max(backlog),
		"backlog_flat":        b2f(flat && consumed == n),
		"relay_cpu_cores":     (cpu1 - cpu0) / max(window, 1e-9),
		"relay_rss_mib":       rssMax / 1024,
		// The relay's claim transactions (each claims, publishes and marks
		// a batch in one), counted by the relay: the database's own
		// transaction counter is flushed by each session about once a
		// second, a thousand writer transactions behind at 1,000 events/s.
		"relay_claims_per_1k": 1000 * batches.claims / max(windowRows, 1),
		"wal_bytes_per_event": float64(db1.walBytes-db0.walBytes) / max(windowRows, 1),
		// The whole database server's, the writers' backends included.
		"db_cpu_ms_per_1k":    1000 * 1000 * (db1.cpuSeconds - db0.cpuSeconds) / max(windowRows, 1),
		"relay_cpu_ms_per_1k": 1000 * 1000 * (cpu1 - cpu0) / max(windowRows, 1),
		// The relay's batches over the window: how full, and how long each
		// took (a claim-publish-mark transaction; streaming, a publish).
		"relay_batch_rows_mean": batches.rows / max(batches.n, 1),
		"relay_batch_ms_mean":   1000 * batches.seconds / max(batches.durations, 1),
		// What the writers paid: each one's insert and commit, measured.
		"writer_commit_p50_ms": pct(pw.commits, 0.50),
		"writer_commit_p99_ms": pct(pw.commits, 0.99),
	}, nil
}

// warmUp is how long paced writers run at their rate before the measured
// window (connections, JIT, first metadata).
func (o *options) warmUp() time.Duration {
	if o.latencyFor >= 30*time.Second {
		return 5 * time.Second
	}
	return 2 * time.Second
}

// arrivals are the moments the events of a topic reached a consumer that
// reads it from its first offset, by event id (the relay's header); at may
// be read once close returned.
type arrivals struct {
	mu     sync.Mutex
	at     map[string]time.Time
	reader *testenv.TopicReader
}

// readArrivals starts reading topic.
func (e *benchEnv) readArrivals(ctx context.Context, topic string) (*arrivals, error) {
	a := &arrivals{at: map[string]time.Time{}}
	r, err := e.kafka.ReadTopic(ctx, topic, func(m kafka.Message) {
		now := time.Now()
		id := testenv.Header(m, relay.HeaderEventID)
		a.mu.Lock()
		if _, dup := a.at[id]; !dup { // a duplicate's latency is not the event's: its first copy's is
			a.at[id] = now
		}
		a.mu.Unlock()
	})
	if err != nil {
		return nil, err
	}
	a.reader = r
	return a, nil
}

// waitFor waits until n events arrived, or for at most timeout.
func (a *arrivals) waitFor(n int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for {
		a.mu.Lock()
		got := len(a.at)
		a.mu.Unlock()
		if got >= n || time.Now().After(deadline) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// close stops reading; it may be called more than once.
func (a *arrivals) close() { a.reader.Close() }

// pacedWriters are o.producers writers in an open loop, each on its own
// schedule of rate/producers, for a warm-up that is not measured and then
// o.latencyFor (from start to end).
type pacedWriters struct {
	prodStart, start, end time.Time
	inserted              atomic.Int64
	wg                    sync.WaitGroup
	errs                  []error
	mu                    sync.Mutex
	// commits are how long each insert and commit between start and end
	// took, in ms; sorted once wait returns.
	commits []float64
}

// startPaced starts paced writers at rate events/s; noted (if not nil) is
// told of each commit: the event's id and when its commit returned to the
// writer.
func startPaced(ctx context.Context, o *options, e *benchEnv, rate int, insert writeSQL, noted func(id string, at time.Time)) *pacedWriters {
	w := &pacedWriters{errs: make([]error, o.producers)}
	w.prodStart = time.Now()
	w.start = w.prodStart.Add(o.warmUp())
	w.end = w.start.Add(o.latencyFor)
	for c := range o.producers {
		w.wg.Go(func() {
			w.errs[c] = produce(ctx, e, c, insert, &w.inserted, pacedBy(rate, o.producers, c, w.prodStart, func() bool { return time.Now().Before(w.end) }),
				func(id string, at time.Time, took time.Duration) {
					if noted != nil {
						noted(id, at)
					}
					if at.Before(w.start) || at.After(w.end) {
						return
					}
					w.mu.Lock()
					w.commits = append(w.commits, float64(took.Microseconds())/1000)
					w.mu.Unlock()
				})
		})
	}
	return w
}

// wait waits for the writers to stop and sorts the commits' durations.
func (w *pacedWriters) wait() error {
	w.wg.Wait()
	sort.Float64s(w.commits)
	return errors.Join(w.errs...)
}

// pacedBy is writer c's schedule in an open loop: producers writers share
// rate events/s, writer c taking its turn c/producers of an interval after
// start. Each call waits for the writer's next turn, then asks goOn.
func pacedBy(rate, producers, c int, start time.Time, goOn func() bool) func() bool {
	interval := time.Duration(float64(time.Second) * float64(producers) / float64(rate))
	next := start.Add(time.Duration(c) * interval / time.Duration(producers))
	return func() bool {
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
		next = next.Add(interval)
		return goOn()
	}
}

// writersAtRate runs the paced writers of latencyRun with no relay: what
// their inserts and commits take when nothing reads the table or its WAL.
func writersAtRate(ctx context.Context, o *options, e *benchEnv, rate int) (map[string]float64, error) {
	if err := e.freshTable(ctx, 0); err != nil {
		return nil, err
	}
	w := startPaced(ctx, o, e, rate, insertSQL(false, false), nil)
	if err := w.wait(); err != nil {
		return nil, err
	}
	return map[string]float64{
		"inserted":             float64(w.inserted.Load()),
		"achieved_per_s":       float64(w.inserted.Load()) / time.Since(w.prodStart).Seconds(),
		"writer_commit_p50_ms": pct(w.commits, 0.50),
		"writer_commit_p99_ms": pct(w.commits, 0.99),
	}, nil
}

// batchStats are a relay's batch counters: batches, the rows in them, the
// timed batches with their total duration, and its claims (empty or not).
type batchStats struct{ n, rows, durations, seconds, claims float64 }

func (b batchStats) minus(a batchStats) batchStats {
	return batchStats{b.n - a.n, b.rows - a.rows, b.durations - a.durations, b.seconds - a.seconds, b.claims - a.claims}
}

// relayBatches scrapes a relay's batch counters (zero when it cannot).
func relayBatches(p *devproc.Proc) batchStats {
	var b batchStats
	b.n, _ = scrape(p, "outbox_relay_batch_size_rows_count")
	b.rows, _ = scrape(p, "outbox_relay_batch_size_rows_sum")
	b.durations, _ = scrape(p, "outbox_relay_batch_duration_seconds_count")
	b.seconds, _ = scrape(p, "outbox_relay_batch_duration_seconds_sum")
	b.claims, _ = scrape(p, "outbox_relay_claim_duration_seconds_count")
	return b
}

// insertSQL stores one row in its own transaction, as a service does; with
// notify it also notifies the table's channel, as outbox.WithNotify does.
func insertSQL(notify, deletes bool) writeSQL {
	ins := `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
VALUES ($1, 'Order', $2, $3, jsonb_build_object('seq', $4::int, 'order_id', $2::text, 'pad', repeat('x', 240)), $2)`
	var w writeSQL
	switch {
	case notify:
		channel := outbox.Table{Name: "outbox"}.NotifyChannel()
		w.insert = `WITH ins AS (` + ins + ` RETURNING 1) SELECT pg_notify('` + channel + `', '') FROM ins`
	default:
		w.insert = ins
	}
	if deletes { // as outbox.WithDeleteOnStore does; $2 is the slot
		w.deleteAfter = `DELETE FROM outbox WHERE event_id = $1 AND ` + outbox.DeleteOnStoreConditionFor("$2", outbox.Table{Name: "outbox"})
	}
	return w
}

// writeSQL is what a producer runs per row, in one transaction: the insert
// and, with writer deletes, the delete of the row by its event id.
type writeSQL struct{ insert, deleteAfter string }

// writerDeletes says the relay's flags make it publish rows its writers
// delete (--writer-deletes): the writers must then delete them.
func writerDeletes(relayFlags []string) bool {
	return slices.Contains(relayFlags, "--"+relayconfig.FlagWriterDeletes)
}

// runWriters measures what the opt-in wake-up costs the writers: producers
// insert one row per transaction as fast as they can, without and with a
// notification per transaction (and a relay listening), in alternating
// rounds; the ratio is taken per round.
func runWriters(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	var ratios []float64
	results := map[bool][]map[string]float64{}
	for round := range o.reps {
		var off float64
		for _, notify := range []bool{false, true} {
			m, err := writersRun(ctx, o, e, notify)
			if err != nil {
				return err
			}
			logf("writers round %d notify=%v: %.0f rows/s", round+1, notify, m["rows_per_s"])
			results[notify] = append(results[notify], m)
			if !notify {
				off = m["rows_per_s"]
			} else if off > 0 {
				ratios = append(ratios, m["rows_per_s"]/off)
			}
		}
	}
	for _, notify := range []bool{false, true} {
		rep.add(scWriters, fmt.Sprintf("notify=%v", notify), map[string]any{"writers": o.producers, "duration_s": o.writersFor.Seconds(), "notify": notify}, results[notify])
	}
	if len(ratios) > 0 {
		rep.Ratios["writers notify / without"] = ratioResult{Median: median(ratios), Rounds: ratios}
	}
	return nil
}

func writersRun(ctx context.Context, o *options, e *benchEnv, notify bool) (map[string]float64, error) {
	return writersRunWith(ctx, o, e, tableFill{}, notify)
}

// writersRunWith is writersRun on a table filled as fill says, with extra
// relay flags; with published rows it also returns the rows the relay
// pruned while the writers ran ("pruned").
func writersRunWith(ctx context.Context, o *options, e *benchEnv, fill tableFill, notify bool, extra ...string) (map[string]float64, error) {
	if err := e.fillTable(ctx, fill); err != nil {
		return nil, err
	}
	topic, err := e.newTopic(o, scWriters)
	if err != nil {
		return nil, err
	}
	defer e.deleteTopic(topic)
	p, err := e.readyRelay(ctx, topic, notify, extra...)
	if err != nil {
		return nil, err
	}
	defer stopRelay(p)
	pruned0, err := scrape(p, metricPruned)
	if err != nil {
		return nil, err
	}
	perSec, err := writeFor(ctx, o, e, insertSQL(notify, writerDeletes(extra)))
	if err != nil {
		return nil, err
	}
	m := map[string]float64{"rows_per_s": perSec}
	if fill.published > 0 {
		pruned1, err := scrape(p, metricPruned)
		if err != nil {
			return nil, err
		}
		m["pruned"] = pruned1 - pruned0
	}
	return m, nil
}

// readyRelay starts one relay at the default batch size on topic (with
// --notify when notify) and waits until it is ready.
func (e *benchEnv) readyRelay(ctx context.Context, topic string, notify bool, extra ...string) (*devproc.Proc, error) {
	if notify {
		extra = append(extra, flagArg(relayconfig.FlagNotify, true))
	}
	p, err := e.startRelay(e.relayArgs(topic, relayconfig.DefaultBatchSize, "", extra...))
	if err != nil {
		return nil, err
	}
	if err := p.WaitReady(ctx, 30*time.Second); err != nil {
		stopRelay(p)
		return nil, err
	}
	if writerDeletes(extra) {
		// Writers delete only while the relay streams (outbox.DeleteOnStoreConditionFor).
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if on, err := outbox.DeletesOnStore(ctx, e.pool, outbox.Table{Name: "outbox"}); err == nil && on {
				break
			}
			if time.Now().After(deadline) {
				stopRelay(p)
				return nil, errors.New("the relay's replication slot is not streaming after 30 s")
			}
		}
	}
	return p, nil
}

// produce is one producer: its own connection, one row per transaction
// (insert), as long as more says so; it counts the rows in inserted.
//
// committed, when not nil, is told each event's id, the moment its
// transaction's commit returned (the start of commit-to-consumed latency)
// and how long the insert and commit took.
func produce(ctx context.Context, e *benchEnv, c int, w writeSQL, inserted *atomic.Int64, more func() bool, committed func(id string, at time.Time, took time.Duration)) error {
	conn, err := pgConnect(ctx, e.dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var slot string
	if w.deleteAfter != "" {
		var db string
		if err := conn.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
			return err
		}
		slot = outbox.SlotName(db, outbox.Table{Name: "outbox"})
	}
	for seq := 0; more() && ctx.Err() == nil; seq++ {
		key := fmt.Sprintf("order-%d", (c*1_000_003+seq)%1000)
		id := uuid.New()
		began := time.Now()
		if w.deleteAfter == "" {
			if _, err := conn.Exec(ctx, w.insert, id, key, eventType, seq); err != nil {
				return fmt.Errorf("producer insert: %w", err)
			}
		} else { // one round trip, one implicit transaction
			b := &pgx.Batch{}
			b.Queue(w.insert, id, key, eventType, seq)
			b.Queue(w.deleteAfter, id, slot)
			if err := conn.SendBatch(ctx, b).Close(); err != nil {
				return fmt.Errorf("producer insert and delete: %w", err)
			}
		}
		if committed != nil {
			now := time.Now()
			committed(id.String(), now, now.Sub(began))
		}
		inserted.Add(1)
	}
	return nil
}

func pct(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func mean(vs []float64) float64 {
	if len(vs) == 0 {
		return math.NaN()
	}
	var s float64
	for _, v := range vs {
		s += v
	}
	return s / float64(len(vs))
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// writeFor runs o.producers writers, one row per transaction (insert), for
// o.writersFor and returns the rows they wrote per second.
func writeFor(ctx context.Context, o *options, e *benchEnv, insert writeSQL) (float64, error) {
	var n atomic.Int64
	end := time.Now().Add(o.writersFor)
	errs := make([]error, o.producers)
	var wg sync.WaitGroup
	start := time.Now()
	for c := range o.producers {
		wg.Go(func() { errs[c] = produce(ctx, e, c, insert, &n, func() bool { return time.Now().Before(end) }, nil) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	return float64(n.Load()) / time.Since(start).Seconds(), nil
}
