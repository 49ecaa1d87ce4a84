package localcluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A v1 layout, as Debian's systemd mounts it in hybrid mode.
const v1Mounts = `tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/cpuset cgroup rw,nosuid,nodev,noexec,relatime,cpuset 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,nosuid,nodev,noexec,relatime,pids 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0
`

// TestCheckHostRefusesCgroupV2 runs the node's host check against mount
// tables and mount points of each kind: a cgroup v2 /sys/fs/cgroup (a real
// cgroup2 mount of this machine stands in for it) and a v1 layout missing a
// controller are refused, naming what is needed, what was found and the
// fix; a v1 or hybrid layout passes.
func TestCheckHostRefusesCgroupV2(t *testing.T) {
	t.Parallel()
	table := func(content string) string {
		p := filepath.Join(t.TempDir(), "mounts")
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
		return p
	}
	notCgroup2 := t.TempDir() // any other file system: a v1 layout's tmpfs

	require.NoError(t, checkCgroups(notCgroup2, table(v1Mounts)), "a hybrid layout")
	var v1Only []string
	for _, l := range strings.SplitAfter(v1Mounts, "\n") {
		if !strings.HasPrefix(l, "cgroup2 ") {
			v1Only = append(v1Only, l)
		}
	}
	require.NoError(t, checkCgroups(notCgroup2, table(strings.Join(v1Only, ""))), "a v1 layout")

	err := checkCgroups(notCgroup2, table(strings.ReplaceAll(v1Mounts, ",memory ", ",nomemory ")))
	require.ErrorContains(t, err, "needs the cgroup v1 controllers cpu, cpuacct, cpuset, memory mounted")
	require.ErrorContains(t, err, "lists no cgroup v1 mount of memory:")
	require.ErrorContains(t, err, "systemd.unified_cgroup_hierarchy=0")

	err = checkCgroups(notCgroup2, table("cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"))
	require.ErrorContains(t, err, "lists no cgroup v1 mount of cpu, cpuacct, cpuset, memory:", "no v1 hierarchy at all")

	var v2 string
	for _, r := range cgroupRoots("cgroup2") {
		v2 = r
	}
	if v2 == "" {
		t.Log("this machine mounts no cgroup2 file system to stand in for a v2 /sys/fs/cgroup")
		return
	}
	err = checkCgroups(v2, table(v1Mounts))
	require.ErrorContains(t, err, "needs cgroup v1")
	require.ErrorContains(t, err, v2+" is cgroup v2 (unified)")
	require.ErrorContains(t, err, "systemd.unified_cgroup_hierarchy=0")
}

// A user other than root is refused before anything starts, by uid.
func TestCheckHostRefusesAUserOtherThanRoot(t *testing.T) {
	t.Parallel()
	require.NoError(t, checkRoot(0))
	require.ErrorContains(t, checkRoot(1000), "runs as uid 1000: run it as root")
}

// TestCheckHostHere: on this machine the check gives the verdict its mount
// table gives, so it passes on a v1 or hybrid host such as the one the node
// is built and tested on, and refuses a v2 one.
func TestCheckHostHere(t *testing.T) {
	t.Parallel()
	unified := false
	for _, r := range cgroupRoots("cgroup2") {
		unified = unified || r == cgroupMountPoint
	}
	err := checkCgroups(cgroupMountPoint, "/proc/self/mounts") // CheckHost's cgroup verdict, whoever runs the test
	if unified {
		require.ErrorContains(t, err, cgroupMountPoint+" is cgroup v2")
		return
	}
	require.NoError(t, err)
}
