// Package layout checks the repository's layout: the product (the API, the
// operator, the relay, the writer library, the contract between them and
// the two shipped binaries) sits at the top and imports nothing of the
// development tooling under test/, hack/ and examples/.
package layout

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

const module = "github.com/outbox-relay/outbox-operator"

// product are the shipped packages, with everything below them.
var product = []string{"./api/...", "./controllers/...", "./relay/...", "./outbox/...", "./relayconfig/...", "./cmd/manager", "./cmd/relay"}

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
