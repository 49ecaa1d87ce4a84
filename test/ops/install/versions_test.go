package install

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// pinned are the versions the operator is built and tested with (README,
// "Versions and their pairing"). Helm's SDK must not move them: neither in
// the main go.mod nor in this module's build, which compiles the operator's
// packages next to Helm and Prometheus.
var pinned = map[string]string{
	"k8s.io/api":                     "v0.37.2",
	"k8s.io/apimachinery":            "v0.37.2",
	"k8s.io/client-go":               "v0.37.2",
	"sigs.k8s.io/controller-runtime": "v0.25.2",
}

func TestKubernetesVersionsPinned(t *testing.T) {
	t.Parallel()
	// The build list of this module's workspace (test binaries carry no
	// module versions to read).
	built := map[string]string{}
	for path := range pinned {
		cmd := exec.Command("go", "list", "-m", "-f", "{{.Version}}", path)
		cmd.Dir = repo("test", "ops")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		built[path] = strings.TrimSpace(string(out))
	}
	gomod, err := os.ReadFile(repo("go.mod"))
	require.NoError(t, err)
	for path, version := range pinned {
		require.Equal(t, version, built[path], "the build list of test/ops: %s", path)
		require.Regexp(t, regexp.MustCompile(`(?m)^\s*`+regexp.QuoteMeta(path)+` `+regexp.QuoteMeta(version)+`$`), string(gomod),
			"go.mod requires %s %s", path, version)
	}
}
