// Package layout checks the repository's layout: the product (the API, the
// operator, the relay, the writer library, the contract between them and
// the two shipped binaries) sits at the top and imports nothing of the
// development tooling under test/, hack/ and examples/.
package layout

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

const module = "github.com/outbox-relay/outbox-operator"

// product are the shipped packages, with everything below them.
var product = []string{"./api/...", "./controllers/...", "./relay/...", "./outbox/...", "./relayconfig/...", "./dbauth/...", "./kafkaauth/...", "./cmd/manager", "./cmd/relay"}

// tooling are the roots of what is not shipped.
var tooling = []string{module + "/test/", module + "/hack/", module + "/examples/", module + "/cmd/demo"}

func TestProductImportsNoTooling(t *testing.T) {
	cmd := exec.Command("go", append([]string{"list", "-deps", "-f", "{{.ImportPath}}"}, product...)...)
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	require.NoError(t, err)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, module+"/relayconfig", "the listing covers the product")
	for _, d := range deps {
		for _, root := range tooling {
			require.False(t, strings.HasPrefix(d, root), "a shipped package depends on %s, which is development tooling", d)
		}
	}
}

// graphBegin and graphEnd fence the package graph in docs/architecture.md.
const (
	graphBegin = "<!-- package graph: go list; test/layout keeps it true -->"
	graphEnd   = "<!-- end of package graph -->"
)

// docs/architecture.md draws the imports among the shipped packages; the
// drawing is what `go list` says, or this test fails and prints the true one.
func TestArchitectureGraphIsTrue(t *testing.T) {
	cmd := exec.Command("go", append([]string{"list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}"}, product...)...)
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	require.NoError(t, err)
	var b strings.Builder
	b.WriteString(graphBegin + "\n```mermaid\nflowchart LR\n")
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		from := strings.TrimPrefix(f[0], module+"/")
		for _, imp := range f[1:] {
			if to, ok := strings.CutPrefix(imp, module+"/"); ok {
				fmt.Fprintf(&b, "  %s --> %s\n", strings.ReplaceAll(from, "/", "_")+`["`+from+`"]`, strings.ReplaceAll(to, "/", "_")+`["`+to+`"]`)
			}
		}
	}
	b.WriteString("```\n" + graphEnd)
	doc, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "docs", "architecture.md"))
	require.NoError(t, err)
	require.Contains(t, string(doc), b.String(), "docs/architecture.md's package graph differs from the code; the true one:\n%s", b.String())
}
