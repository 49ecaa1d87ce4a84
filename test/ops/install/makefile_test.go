package install

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMakefileTargetsArePhony: every target `make help` lists (a rule with a
// "## " description) is declared .PHONY, so a file or folder of its name
// never makes it a no-op.
func TestMakefileTargetsArePhony(t *testing.T) {
	t.Parallel()
	mk, err := os.ReadFile(repo("Makefile"))
	require.NoError(t, err)
	phony := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\.PHONY:(.*)$`).FindAllSubmatch(mk, -1) {
		for _, name := range strings.Fields(string(m[1])) {
			phony[name] = true
		}
	}
	targets := regexp.MustCompile(`(?m)^([A-Za-z0-9_-]+):[^=\n]*## `).FindAllSubmatch(mk, -1)
	require.NotEmpty(t, targets)
	for _, m := range targets {
		require.True(t, phony[string(m[1])], "Makefile: target %s is not .PHONY", m[1])
	}
}

// TestDepsKafkaUpdatesAptLists runs `make deps-kafka` on a PATH without java
// and mvn, where apt-get is a stub that logs its arguments (and "installs"
// both, as stubs): on a fresh image apt's package lists are empty, so it must update
// them before it installs.
func TestDepsKafkaUpdatesAptLists(t *testing.T) {
	t.Parallel()
	bin, libs := t.TempDir(), filepath.Join(t.TempDir(), "libs")
	log := filepath.Join(t.TempDir(), "apt.log")
	for _, tool := range []string{"bash", "env", "id", "rm", "touch", "mkdir", "cat", "chmod"} {
		p, err := exec.LookPath(tool)
		require.NoError(t, err)
		require.NoError(t, os.Symlink(p, filepath.Join(bin, tool)))
	}
	script := func(name, body string) {
		require.NoError(t, os.WriteFile(filepath.Join(bin, name), []byte("#!"+filepath.Join(bin, "bash")+"\n"+body+"\n"), 0o755))
	}
	script("sudo", `exec "$@"`)
	script("apt-get", `echo "$*" >>`+log+`
if [ "$1" = install ]; then
	printf '#!%s\nexit 0\n' "$(command -v bash)" >`+filepath.Join(bin, "java")+`
	printf '#!%s\nmkdir -p %s\n' "$(command -v bash)" `+libs+` >`+filepath.Join(bin, "mvn")+`
	chmod +x `+filepath.Join(bin, "java")+` `+filepath.Join(bin, "mvn")+`
fi`)
	makeBin, err := exec.LookPath("make")
	require.NoError(t, err)
	cmd := exec.Command(makeBin, "-s", "--no-print-directory", "deps-kafka", "KAFKA_LIBS="+libs)
	cmd.Dir = repo()
	cmd.Env = []string{"PATH=" + bin, "HOME=" + t.TempDir()}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	calls, err := os.ReadFile(log)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(calls)), "\n")
	require.Len(t, lines, 2, "apt-get calls: %q", lines)
	require.Equal(t, "update -q", lines[0])
	require.Equal(t, "install -y -q openjdk-17-jre-headless maven", lines[1])
	require.FileExists(t, filepath.Join(libs, ".complete"))
}
