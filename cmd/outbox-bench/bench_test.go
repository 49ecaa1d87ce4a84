package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
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
	flags := "-rows 3000 -reps 1 -latency-duration 4s -seeds-duration 2s -rates 500 -replicas 1,2" +
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
	for _, s := range []string{"ceiling", "drain", "seeds", "scaling", "latency", "breakdown"} {
		require.True(t, seen[s], "scenario %s missing from %s", s, js)
	}
	v, ok := rep.get("drain", "ordering=none batch=500", "events_per_s")
	require.True(t, ok)
	require.Positive(t, v)
	require.NotNil(t, rep.Profile)
	require.NotEmpty(t, rep.Profile.CPUTop)
	require.NotEmpty(t, rep.Targets)

	text, err := os.ReadFile(md)
	require.NoError(t, err)
	require.Contains(t, string(text), genBegin)
	require.Contains(t, string(text), "### Targets\n")
}
