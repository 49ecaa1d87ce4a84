package testenv_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// TestUserBinariesLeaveDevToolingOut guards the line between the binaries
// users run and the development tooling: the manager and the relay must not
// link the test environment, the fixtures, the process runner or the local
// stack, which start databases, brokers and API servers.
func TestUserBinariesLeaveDevToolingOut(t *testing.T) {
	t.Parallel()
	devOnly := []string{"test/testenv", "test/outboxtest", "test/devproc", "test/localcluster"}
	for _, bin := range []string{"./cmd/manager", "./cmd/relay"} {
		cmd := exec.Command("go", "list", "-deps", bin)
		cmd.Dir = testenv.RepoRoot()
		out, err := cmd.Output()
		require.NoError(t, err, "go list -deps %s", bin)
		for _, pkg := range strings.Fields(string(out)) {
			for _, dev := range devOnly {
				require.NotEqual(t, "github.com/outbox-relay/outbox-operator/"+dev, pkg,
					"%s links %s, which is development tooling", bin, pkg)
			}
		}
	}
}
