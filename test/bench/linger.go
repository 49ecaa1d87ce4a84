package main

import (
	"context"
	"fmt"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// lingerModes are what the linger-cost scenario holds against pollFixed:
// adaptive polling at the default linger first, then at 10 ms and 20 ms.
var lingerModes = []string{pollAdaptive, pollLinger10, pollLinger20}

// What the linger-cost scenario compares, per event (lingerRatio).
const (
	lingerCPU    = "relay CPU per event"
	lingerClaims = "relay claim transactions per event"
	lingerP50    = "p50"
	lingerP99    = "p99"
)

// lingerRatio names the median over the rounds of what (lingerCPU, ...) in
// mode a against mode b at rate.
func lingerRatio(what, a, b string, rate int) string {
	return fmt.Sprintf("%s, %s / %s at %d/s", what, a, b, rate)
}

// runLinger measures what adaptive polling's wait after a partial claim
// (--linger) costs at the first rate, against a relay polling every 200 ms,
// in rounds that run each setting in turn, so that each ratio (relay CPU
// and claim transactions per event, and the p50 and p99 of the longer
// lingers against the default's) is taken within a round on this shared machine.
func runLinger(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	rate := o.rates[0]
	results := map[string][]map[string]float64{}
	ratios := map[string][]float64{}
	for round := range o.reps {
		byMode := map[string]map[string]float64{}
		for _, name := range append(lingerModes, pollFixed) {
			m, ok := captureModeNamed(name)
			if !ok {
				return fmt.Errorf("linger: no capture mode %q", name)
			}
			res, err := latencyRun(ctx, o, e, rate, relayconfig.DefaultPollInterval, false, m.args...)
			if err != nil {
				return fmt.Errorf("linger round %d, %s: %w", round+1, name, err)
			}
			logf("linger round %d %s at %d/s: p50 %.1f ms, p99 %.1f ms, relay CPU %.0f ms/1k events, claims/1k events %.0f",
				round+1, name, rate, res["p50_ms"], res["p99_ms"], res["relay_cpu_ms_per_1k"], res["relay_claims_per_1k"])
			byMode[name] = res
			results[name] = append(results[name], res)
		}
		ratio := func(what, key, a, b string) {
			name := lingerRatio(what, a, b, rate)
			ratios[name] = append(ratios[name], byMode[a][key]/byMode[b][key])
		}
		for _, name := range lingerModes {
			ratio(lingerCPU, "relay_cpu_ms_per_1k", name, pollFixed)
			ratio(lingerClaims, "relay_claims_per_1k", name, pollFixed)
		}
		for _, name := range lingerModes[1:] {
			ratio(lingerP50, "p50_ms", name, pollAdaptive)
			ratio(lingerP99, "p99_ms", name, pollAdaptive)
		}
	}
	for _, name := range append(lingerModes, pollFixed) {
		rep.add(scLinger, fmt.Sprintf("rate=%d %s", rate, name), map[string]any{"mode": name, "rate": rate, "duration_s": o.latencyFor.Seconds()}, results[name])
	}
	for name, rs := range ratios {
		rep.Ratios[name] = ratioResult{Median: median(rs), Rounds: rs}
	}
	return nil
}
