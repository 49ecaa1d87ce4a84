package main

import (
	"context"
	"fmt"
	"slices"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// benchCase is one measured configuration of a throughput scenario.
type benchCase struct {
	scenario, name string
	params         map[string]any
	run            func(ctx context.Context) (map[string]float64, error)
	reps           []map[string]float64
	failed         string // why the case stopped, when it failed
}

// runRounds measures the throughput scenarios (ceiling, drain, seeds,
// scaling) in rounds: each round runs every case once, and the rounds
// repeat, so a slow minute of this shared machine lands on all cases alike
// instead of on one. Ratios between cases are taken within each round, and
// their median is reported.
func runRounds(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	want := func(s string) bool { return slices.Contains(o.scenarios, s) }
	var cases []*benchCase
	if want(scCeiling) {
		type tc struct{ batch, loops int }
		var tcs []tc
		for _, b := range o.batches {
			tcs = append(tcs, tc{b, 1})
		}
		// Four loops at batch 50 show where the database saturates (scaling).
		tcs = append(tcs, tc{50, 4})
		for _, c := range tcs {
			cases = append(cases, &benchCase{scenario: scCeiling, name: fmt.Sprintf("batch=%d loops=%d", c.batch, c.loops),
				params: map[string]any{"batch": c.batch, "loops": c.loops},
				run: func(ctx context.Context) (map[string]float64, error) {
					if err := e.freshTable(ctx, o.rows); err != nil {
						return nil, err
					}
					if err := ceilingLoops(ctx, e.dsn, c.batch, c.loops); err != nil {
						return nil, err
					}
					done, rate, err := e.drainSpan(ctx)
					if err != nil {
						return nil, err
					}
					if done != o.rows {
						return nil, fmt.Errorf("ceiling marked %d of %d rows", done, o.rows)
					}
					return map[string]float64{"events_per_s": rate}, nil
				}})
		}
	}
	for _, mode := range o.orderings {
		if !want(scDrain) && !want(scScaling) {
			break
		}
		ok, msg, err := orderingAvailable(ctx, o, e, mode)
		if err != nil {
			return err
		}
		if !ok {
			for _, s := range []string{scDrain, scScaling} {
				if want(s) {
					rep.note(s, "ordering="+mode, "not available: "+msg)
				}
			}
			continue
		}
		if want(scDrain) {
			for _, b := range o.batches {
				cases = append(cases, &benchCase{scenario: scDrain, name: fmt.Sprintf("ordering=%s batch=%d", mode, b),
					params: map[string]any{"ordering": mode, "batch": b, "replicas": 1},
					run:    func(ctx context.Context) (map[string]float64, error) { return relayDrain(ctx, o, e, b, 1, mode) }})
			}
		}
		if want(scScaling) {
			for _, n := range o.replicas {
				cases = append(cases, &benchCase{scenario: scScaling, name: fmt.Sprintf("ordering=%s replicas=%d", mode, n),
					params: map[string]any{"ordering": mode, "batch": 50, "replicas": n},
					run:    func(ctx context.Context) (map[string]float64, error) { return relayDrain(ctx, o, e, 50, n, mode) }})
			}
		}
	}
	if want(scRetention) {
		// Mark against delete at batch 500, both timed by the relay's own
		// counter (deleted rows leave no published_at to time them by).
		for _, onPublish := range relayconfig.OnPublishes {
			cases = append(cases, &benchCase{scenario: scRetention, name: "on-publish=" + string(onPublish) + " batch=500",
				params: map[string]any{"on_publish": string(onPublish), "batch": 500, "ordering": "none"},
				run: func(ctx context.Context) (map[string]float64, error) {
					m, err := relayDrain(ctx, o, e, 500, 1, "none", flagArg(relayconfig.FlagOnPublish, onPublish))
					if err == nil {
						m["events_per_s"] = m["counter_events_per_s"]
					}
					return m, err
				}})
		}
	}
	if want(scCompression) {
		// Each codec kafka-go offers, at batch 500: drain rate, and the
		// topic's size on the broker's disk for the same 200,000 rows.
		for _, codec := range relayconfig.Compressions {
			cases = append(cases, &benchCase{scenario: scCompression, name: "codec=" + string(codec),
				params: map[string]any{"codec": string(codec), "batch": 500, "ordering": "none"},
				run: func(ctx context.Context) (map[string]float64, error) {
					return relayDrain(ctx, o, e, 500, 1, "none", flagArg(relayconfig.FlagCompression, codec))
				}})
		}
	}
	if want(scHeaders) {
		cases = append(cases, headersCases(o, e)...)
	}
	if want(scNaive) {
		const batch = 50
		cases = append(cases, &benchCase{scenario: scNaive, name: fmt.Sprintf("batch=%d", batch),
			params: map[string]any{"batch": batch, "duration_s": o.seedsFor.Seconds()},
			run: func(ctx context.Context) (map[string]float64, error) {
				if err := e.freshTable(ctx, o.rows); err != nil {
					return nil, err
				}
				topic, err := e.newTopic(o, scNaive)
				if err != nil {
					return nil, err
				}
				defer e.deleteTopic(topic)
				if err := naiveShape(ctx, e, topic, batch, o.seedsFor); err != nil {
					return nil, err
				}
				done, rate, err := e.drainSpan(ctx)
				return map[string]float64{"events_per_s": rate, "rows": float64(done)}, err
			}})
	}
	for round := range o.reps {
		logf("-- round %d of %d", round+1, o.reps)
		for _, c := range cases {
			if err := ctx.Err(); err != nil {
				return err
			}
			if c.failed != "" {
				continue
			}
			m, err := c.run(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return err
				}
				// Report the failure with the case and go on with the others.
				c.failed = fmt.Sprintf("failed in round %d: %v", round+1, err)
				logf("%s %s: %s", c.scenario, c.name, c.failed)
				rep.note(c.scenario, c.name, c.failed)
				continue
			}
			c.reps = append(c.reps, m)
			extra := ""
			if v, ok := m["cpu_s_per_10k"]; ok {
				extra = fmt.Sprintf(", %.2f CPU s/10k", v)
			}
			logf("%s %s: %.0f events/s%s", c.scenario, c.name, m["events_per_s"], extra)
		}
	}
	for _, c := range cases {
		if c.failed == "" {
			rep.add(c.scenario, c.name, c.params, c.reps)
		}
	}
	// Ratios within each round, then their median.
	find := func(scenario, name string) *benchCase {
		for _, c := range cases {
			if c.scenario == scenario && c.name == name {
				return c
			}
		}
		return nil
	}
	ratio := func(key string, num, den *benchCase) {
		if num == nil || den == nil || num.failed != "" || den.failed != "" {
			return
		}
		var vs []float64
		for i := range min(len(num.reps), len(den.reps)) {
			vs = append(vs, num.reps[i]["events_per_s"]/den.reps[i]["events_per_s"])
		}
		rep.Ratios[key] = ratioResult{Median: median(vs), Rounds: vs}
	}
	for _, b := range o.batches {
		ratio(fmt.Sprintf("drain none batch %d / ceiling batch %d", b, b), find(scDrain, fmt.Sprintf("ordering=none batch=%d", b)), find(scCeiling, fmt.Sprintf("batch=%d loops=1", b)))
		ratio(fmt.Sprintf("drain partition-key batch %d / ceiling batch %d", b, b), find(scDrain, fmt.Sprintf("ordering=partition-key batch=%d", b)), find(scCeiling, fmt.Sprintf("batch=%d loops=1", b)))
	}
	ratio("drain none batch 50 / naive shape", find(scDrain, "ordering=none batch=50"), find(scNaive, "batch=50"))
	for _, mode := range o.orderings {
		for _, n := range o.replicas {
			ratio(fmt.Sprintf("scaling %s %d replicas / 1", mode, n), find(scScaling, fmt.Sprintf("ordering=%s replicas=%d", mode, n)), find(scScaling, fmt.Sprintf("ordering=%s replicas=1", mode)))
		}
	}
	for _, n := range []int{1, 4} {
		ratio(fmt.Sprintf("scaling partition-key / none %d replicas", n), find(scScaling, fmt.Sprintf("ordering=partition-key replicas=%d", n)), find(scScaling, fmt.Sprintf("ordering=none replicas=%d", n)))
	}
	for _, codec := range relayconfig.Compressions {
		ratio(fmt.Sprintf("compression %s / none", codec), find(scCompression, "codec="+string(codec)), find(scCompression, "codec=none"))
	}
	plain := find(scHeaders, headersCaseName(false, false))
	ratio("headers with / without, batch 500", find(scHeaders, headersCaseName(true, false)), plain)
	ratio("headers tracing on / off, batch 500", find(scHeaders, headersCaseName(false, true)), plain)
	ratio("headers with and tracing on / neither, batch 500", find(scHeaders, headersCaseName(true, true)), plain)
	ratio("retention delete / mark batch 500", find(scRetention, "on-publish=delete batch=500"), find(scRetention, "on-publish=mark batch=500"))
	ratio("ceiling batch 50 4 loops / 1 loop", find(scCeiling, "batch=50 loops=4"), find(scCeiling, "batch=50 loops=1"))
	return nil
}
