package releasekit

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Every recorded release has a valid version, a full commit hash, its
// section in CHANGELOG.md and, where the clone has its tag, the tag's commit.
func TestReleasesRecordTheirCommits(t *testing.T) {
	root := testenv.RepoRoot()
	changelog, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	require.NoError(t, err)
	hash := regexp.MustCompile(`^[0-9a-f]{40}$`)
	require.NotEmpty(t, Releases)
	for _, r := range Releases {
		require.NoError(t, CheckVersion(r.Version))
		require.Regexp(t, hash, r.Commit, "release %s", r.Tag())
		require.Contains(t, string(changelog), "## ["+r.Version+"]", "CHANGELOG.md has no section for %s", r.Tag())
		out, err := exec.Command("git", "-C", root, "rev-parse", "--verify", "--quiet", r.Tag()+"^{commit}").Output()
		if err != nil {
			t.Logf("%s: no tag in this clone; the recorded commit is all there is", r.Tag())
			continue
		}
		require.Equal(t, r.Commit, strings.TrimSpace(string(out)), "tag %s names another commit than Releases records", r.Tag())
	}
	require.Equal(t, Releases[len(Releases)-1], Latest())
}

// A release version is MAJOR.MINOR.PATCH with an optional pre-release, and
// never the tree's development version (-dev), whose chart would refuse to
// render with its default image.
func TestCheckVersion(t *testing.T) {
	for _, v := range []string{"0.2.0", "1.10.3", "0.2.0-rc.1"} {
		require.NoError(t, CheckVersion(v), v)
	}
	for _, v := range []string{"v0.2.0", "0.2", "0.2.0-dev", "01.2.3"} {
		require.Error(t, CheckVersion(v), v)
	}
}
