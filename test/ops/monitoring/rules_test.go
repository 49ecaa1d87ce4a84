package monitoring

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// promtool finds the promtool `make test-ops` builds into bin/tools
// ($PROMTOOL).
func promtool(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("PROMTOOL"); p != "" {
		_, err := os.Stat(p)
		require.NoError(t, err, "PROMTOOL=%s; run `make test-ops`, which builds it", p)
		return p
	}
	found, _ := filepath.Glob(repo("bin", "tools", "promtool-*", "promtool"))
	require.NotEmpty(t, found, "promtool not found in bin/tools; run `make test-ops`, which builds it")
	return found[len(found)-1]
}

// TestAlertRules checks the rules of config/prometheus with promtool and runs
// their unit tests (config/prometheus/tests/rules_test.yaml) with
// `promtool test rules`: Prometheus' own rule evaluation over the series the
// tests give, alert by alert, labels and annotations included.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	b, err := os.ReadFile(repo("config", "prometheus", "prometheusrule.yaml"))
	require.NoError(t, err)
	var pr struct {
		Spec map[string]any `json:"spec"`
	}
	require.NoError(t, yaml.Unmarshal(b, &pr))
	rules, err := yaml.Marshal(pr.Spec) // a rule file is the PrometheusRule's spec: groups
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), rules, 0o644))
	tests, err := os.ReadFile(repo("config", "prometheus", "tests", "rules_test.yaml"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rules_test.yaml"), tests, 0o644))

	for _, args := range [][]string{
		{"check", "rules", "--lint=all", "--lint-fatal", "rules.yaml"},
		{"test", "rules", "rules_test.yaml"},
	} {
		cmd := exec.Command(promtool(t), args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %v:\n%s", args, out)
		t.Logf("promtool %v:\n%s", args, out)
	}
}
