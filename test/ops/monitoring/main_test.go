// Package monitoring tests the monitoring kit: the alerting rules of
// config/prometheus (promtool's rule unit tests) and the dashboard of
// config/grafana — every expression parses with Prometheus' own parser and
// names only metrics a running relay and a running manager expose.
package monitoring

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka|testenv.NeedKube))
}

// repo is the main repository's top folder.
func repo(parts ...string) string {
	return filepath.Join(append([]string{testenv.RepoRoot()}, parts...)...)
}
