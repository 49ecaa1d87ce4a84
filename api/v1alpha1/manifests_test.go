package v1alpha1_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// controllerGen is the controller-gen the Makefile pins ($CONTROLLER_GEN
// under make, else the cached binary under bin/tools).
func controllerGen(t *testing.T) string {
	if p := os.Getenv("CONTROLLER_GEN"); p != "" {
		return p
	}
	matches, err := filepath.Glob(filepath.Join(testenv.RepoRoot(), "bin", "tools", "controller-gen-*", "controller-gen"))
	require.NoError(t, err)
	require.NotEmpty(t, matches, "controller-gen not found; run `make deps` (it installs it under bin/tools)")
	return matches[len(matches)-1]
}

// TestCommittedManifestsAreFresh regenerates the CRD and the RBAC role into
// a temporary folder, as `make manifests` does, and compares them byte for
// byte with what config/ holds: a changed marker without `make manifests`
// fails here.
func TestCommittedManifestsAreFresh(t *testing.T) {
	root := testenv.RepoRoot()
	out := t.TempDir()
	cmd := exec.Command(controllerGen(t), "rbac:roleName=manager-role", "crd",
		"paths=./api/...", "paths=./controllers/...",
		"output:crd:artifacts:config="+filepath.Join(out, "crd"),
		"output:rbac:artifacts:config="+filepath.Join(out, "rbac"))
	cmd.Dir = root
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "controller-gen: %s", b)

	for gen, committed := range map[string]string{
		"crd/outbox.dev_outboxrelays.yaml": "config/crd/bases/outbox.dev_outboxrelays.yaml",
		"rbac/role.yaml":                   "config/rbac/role.yaml",
	} {
		want, err := os.ReadFile(filepath.Join(out, gen))
		require.NoError(t, err)
		got, err := os.ReadFile(filepath.Join(root, committed))
		require.NoError(t, err, "%s is missing; run `make manifests`", committed)
		require.True(t, bytes.Equal(want, got), "%s is stale; run `make manifests` and commit it\n%s", committed, firstDiff(want, got))
	}
	entries, err := os.ReadDir(filepath.Join(out, "crd"))
	require.NoError(t, err)
	require.Len(t, entries, 1, "one CRD is generated")
}

// firstDiff shows the first line where the generated and committed files differ.
func firstDiff(want, got []byte) string {
	w, g := strings.Split(string(want), "\n"), strings.Split(string(got), "\n")
	for i := 0; i < max(len(w), len(g)); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return fmt.Sprintf("line %d: generated %q, committed %q", i+1, wl, gl)
		}
	}
	return "no line differs"
}
