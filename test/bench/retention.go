package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// pruneKeep is --keep-published-for in the pruning scenario: the shortest
// the relay takes. The table's published rows are a day old, the rows
// published during a run are younger, so only the former are pruned.
const pruneKeep = relayconfig.MinKeepPublishedFor

// runPruning measures what pruning costs the relay and the writers. Every
// run starts from a table holding o.rows rows published a day ago (the
// lowest ids) beside what the run needs; the same relay runs without and
// with --keep-published-for, so with it the relay prunes those rows (in
// batches of the default size, with the default pause) during the run. The
// drain: one relay at batch 500 over o.rows more unpublished rows. The
// writers: 8 writers inserting one row per transaction as fast as they can
// for o.writersFor while one relay with the default settings publishes. In
// rounds; the ratios are taken per round.
func runPruning(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	const batch = 500
	type tc struct {
		kind string // drain or writers
		on   bool
	}
	var cases []tc
	for _, kind := range []string{"drain", "writers"} {
		for _, on := range []bool{false, true} {
			cases = append(cases, tc{kind, on})
		}
	}
	results := map[tc][]map[string]float64{}
	for round := range o.reps {
		for _, c := range cases {
			var extra []string
			if c.on {
				extra = append(extra, flagArg(relayconfig.FlagKeepPublishedFor, pruneKeep))
			}
			var m map[string]float64
			var err error
			if c.kind == "drain" {
				m, err = relayDrainWith(ctx, o, e, drainSetup{published: o.rows}, batch, 1, "none", extra...)
			} else {
				m, err = writersRunWith(ctx, o, e, tableFill{published: o.rows}, false, extra...)
				if err == nil {
					m["events_per_s"] = m["rows_per_s"]
				}
			}
			if err != nil {
				return fmt.Errorf("%s pruning=%v: %w", c.kind, c.on, err)
			}
			logf("pruning round %d %s pruning=%v: %.0f rows/s, %.0f rows pruned", round+1, c.kind, c.on, m["events_per_s"], m["pruned"])
			results[c] = append(results[c], m)
		}
	}
	for _, c := range cases {
		rep.add(scPruning, fmt.Sprintf("%s pruning=%v", c.kind, c.on), map[string]any{"kind": c.kind, "pruning": c.on,
			"published_rows": o.rows, "keep_published_for": pruneKeep.String(), "batch": map[bool]int{true: batch, false: relayconfig.DefaultBatchSize}[c.kind == "drain"],
			"writers": o.producers}, results[c])
	}
	for _, kind := range []string{"drain", "writers"} {
		off, on := results[tc{kind, false}], results[tc{kind, true}]
		var vs []float64
		for i := range min(len(off), len(on)) {
			vs = append(vs, on[i]["events_per_s"]/off[i]["events_per_s"])
		}
		if len(vs) > 0 {
			rep.Ratios["pruning "+kind+" with / without"] = ratioResult{Median: median(vs), Rounds: vs}
		}
	}
	return nil
}

// The long-lived table: when the long transaction opens and closes, as
// fractions of the rows drained.
const (
	longTxFrom = 0.25
	longTxTo   = 0.75
)

// runLongLived drains a large table (o.longRows rows) at batch 500 while
// writers insert o.longWriteRate rows/s and, from a quarter to three
// quarters of the drain, a transaction that took a transaction id stays open
// on another connection (holding back what vacuum may remove). It compares
// the rate over the last tenth of the drain with the first tenth, for
// --on-publish mark (no retention) and delete. One run per mode: each
// takes minutes at the full size.
func runLongLived(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	cases := []struct {
		onPublish relayconfig.OnPublish
		// serverAutovacuum resets the table's own autovacuum settings (the
		// shipped DDL's) to the server's defaults, to measure what they do.
		serverAutovacuum bool
	}{{relayconfig.OnPublishMark, false}, {relayconfig.OnPublishDelete, false}, {relayconfig.OnPublishMark, true}}
	for _, c := range cases {
		m, err := longLivedRun(ctx, o, e, c.onPublish, c.serverAutovacuum)
		if err != nil {
			return fmt.Errorf("on-publish %s: %w", c.onPublish, err)
		}
		av := autovacuumLabel(c.serverAutovacuum)
		logf("longlived on-publish=%s autovacuum=%s: first 10%% %.0f events/s, last 10%% %.0f (%.0f%%), with the long transaction %.0f, whole drain %.0f; writers %.0f rows/s",
			c.onPublish, av, m["first10_per_s"], m["last10_per_s"], 100*m["last_first"], m["long_tx_per_s"], m["events_per_s"], m["writers_per_s"])
		rep.add(scLongLived, "on-publish="+string(c.onPublish)+" autovacuum="+av, map[string]any{"on_publish": string(c.onPublish), "autovacuum": av, "rows": o.longRows, "batch": 500,
			"write_rate": o.longWriteRate, "writers": o.producers, "long_tx_from": longTxFrom, "long_tx_to": longTxTo}, []map[string]float64{m})
		if v, ok := m["last_first"]; ok {
			rep.Ratios[longLivedRatio(c.onPublish, c.serverAutovacuum)] = ratioResult{Median: v, Rounds: []float64{v}}
		}
	}
	return nil
}

// autovacuumLabel names a long-lived run's autovacuum settings.
func autovacuumLabel(server bool) string {
	if server {
		return "server defaults"
	}
	return "the DDL's"
}

// longLivedRatio names the last / first 10% ratio of a long-lived run.
func longLivedRatio(onPublish relayconfig.OnPublish, serverAutovacuum bool) string {
	k := "longlived last / first 10% on-publish " + string(onPublish)
	if serverAutovacuum {
		k += ", server-default autovacuum"
	}
	return k
}

// counterSample is a relay's published counter at one instant.
type counterSample struct {
	at time.Time
	n  float64
}

// timeAt is when the counter reached x, interpolated between the samples
// around it; ok is false when it never did.
func timeAt(samples []counterSample, x float64) (time.Time, bool) {
	for i, s := range samples {
		if s.n < x {
			continue
		}
		if i == 0 || s.n == samples[i-1].n {
			return s.at, true
		}
		p := samples[i-1]
		f := (x - p.n) / (s.n - p.n)
		return p.at.Add(time.Duration(f * float64(s.at.Sub(p.at)))), true
	}
	return time.Time{}, false
}

// rateBetween is the counter's rate from when it reached a to when it reached b.
func rateBetween(samples []counterSample, a, b float64) float64 {
	ta, ok1 := timeAt(samples, a)
	tb, ok2 := timeAt(samples, b)
	if !ok1 || !ok2 || !tb.After(ta) {
		return 0
	}
	return (b - a) / tb.Sub(ta).Seconds()
}

func longLivedRun(ctx context.Context, o *options, e *benchEnv, onPublish relayconfig.OnPublish, serverAutovacuum bool) (map[string]float64, error) {
	n := float64(o.longRows)
	logf("longlived on-publish=%s: filling %d rows", onPublish, o.longRows)
	t0 := time.Now()
	if err := e.freshTable(ctx, o.longRows); err != nil {
		return nil, err
	}
	if serverAutovacuum {
		if _, err := e.pool.Exec(ctx, `ALTER TABLE outbox RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
			autovacuum_vacuum_insert_scale_factor, autovacuum_analyze_scale_factor, autovacuum_vacuum_cost_delay)`); err != nil {
			return nil, err
		}
	}
	fillS := time.Since(t0).Seconds()
	topic, err := e.newTopic(o, scLongLived)
	if err != nil {
		return nil, err
	}
	defer e.deleteTopic(topic)
	p, err := e.startRelay(e.relayArgs(topic, 500, "none", flagArg(relayconfig.FlagOnPublish, onPublish)))
	if err != nil {
		return nil, err
	}
	defer stopRelay(p)

	// Writers on their own schedule, as in the steady state, for as long as the drain lasts.
	var stop atomic.Bool
	var inserted atomic.Int64
	insert := insertSQL(false, false)
	wStart := time.Now()
	errs := make([]error, o.producers)
	var wg sync.WaitGroup
	for c := range o.producers {
		wg.Go(func() {
			errs[c] = produce(ctx, e, c, insert, &inserted, pacedBy(o.longWriteRate, o.producers, c, wStart, func() bool { return !stop.Load() }), nil)
		})
	}
	stopWriters := func() error {
		stop.Store(true)
		wg.Wait()
		return errors.Join(errs...)
	}
	defer stopWriters() //nolint:errcheck // the error path already has an error

	var (
		samples          []counterSample
		txConn           *pgx.Conn
		tx               pgx.Tx
		txOpen, txClosed time.Time
	)
	closeTx := func() {
		if tx != nil {
			_ = tx.Rollback(context.Background())
			_ = txConn.Close(context.Background())
			tx, txClosed = nil, time.Now()
		}
	}
	defer closeTx()
	deadline := time.Now().Add(o.drainTimeout)
	lastMove := time.Now()
	for {
		if p.HasExited() {
			return nil, fmt.Errorf("relay exited during the drain: %s", p.Tail(5))
		}
		if c, err := published(p); err == nil {
			if len(samples) == 0 || c > samples[len(samples)-1].n {
				lastMove = time.Now()
			}
			samples = append(samples, counterSample{time.Now(), c})
			if txOpen.IsZero() && c >= longTxFrom*n {
				if txConn, err = pgConnect(ctx, e.dsn); err != nil {
					return nil, err
				}
				if tx, err = txConn.Begin(ctx); err != nil {
					return nil, err
				}
				if _, err := tx.Exec(ctx, "SELECT txid_current()"); err != nil {
					return nil, err
				}
				txOpen = time.Now()
			}
			if c >= longTxTo*n {
				closeTx()
			}
			if c >= n {
				break
			}
		}
		if time.Since(lastMove) > stallAfter {
			return nil, fmt.Errorf("drain stalled: no progress for %s; last relay log: %s", stallAfter, p.Tail(3))
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("drain not done after %s", o.drainTimeout)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	// Every row of the table as filled (ids 1 to n) is published, or deleted,
	// once the last batches commit.
	for i := 0; ; i++ {
		var left int
		if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL AND id <= $1`, o.longRows).Scan(&left); err != nil {
			return nil, err
		}
		if left == 0 {
			break
		}
		if i > 200 {
			return nil, fmt.Errorf("%d of the table's rows still unpublished after the relay counted them all", left)
		}
		time.Sleep(50 * time.Millisecond)
	}
	wEnd := time.Now()
	if err := stopWriters(); err != nil {
		return nil, err
	}
	var tableMiB float64
	if err := e.pool.QueryRow(ctx, `SELECT pg_total_relation_size('outbox') / 1048576.0`).Scan(&tableMiB); err != nil {
		return nil, err
	}
	// From the first sample that saw rows published, as relayDrain times a drain.
	var first counterSample
	for _, s := range samples {
		if s.n > 0 {
			first = s
			break
		}
	}
	first10 := rateBetween(samples, first.n, 0.1*n)
	last10 := rateBetween(samples, 0.9*n, n)
	m := map[string]float64{
		"fill_s":         fillS,
		"first10_per_s":  first10,
		"last10_per_s":   last10,
		"long_tx_per_s":  rateBetween(samples, longTxFrom*n, longTxTo*n),
		"events_per_s":   rateBetween(samples, first.n, n),
		"long_tx_open_s": txClosed.Sub(txOpen).Seconds(),
		"writers_per_s":  float64(inserted.Load()) / wEnd.Sub(wStart).Seconds(),
		"table_mib":      tableMiB,
	}
	// A drain too short for the samples to tell its tenths apart has no ratio.
	if first10 > 0 && last10 > 0 {
		m["last_first"] = last10 / first10
	}
	return m, nil
}
