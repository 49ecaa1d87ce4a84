package localcluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// What a killed stack left is undone by the next start, and only that: its
// pods' processes and cgroups, mounts under its node's folder, its chains
// and the rules that jump to them (a rule of someone else's stays), and
// the sysctls it changed, back to the values recorded before the change.
// The test works on a cgroup, chain prefix and sysctl of its own (a dummy
// interface's), so it can run beside a stack.
func TestRecoverUndoesOnlyWhatAKilledStackLeft(t *testing.T) {
	suffix := strconv.Itoa(os.Getpid() % 100000)
	iface := "obxt" + suffix
	run(t, "ip", "link", "add", iface, "type", "bridge")
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", iface).Run() })
	sysctl := "net/ipv4/conf/" + iface + "/forwarding"
	m := machine{stateFile: filepath.Join(t.TempDir(), "state.json"), cgroup: "outbox-test-" + suffix,
		chainPrefix: "OBXT" + suffix + "-", sysctls: []string{sysctl}}
	t.Cleanup(func() { _ = removeCgroups(m.cgroup) })
	nodeDir := t.TempDir()
	writeSysctl(t, sysctl, "0")

	// The stack starts: the state is recorded before anything changes.
	require.NoError(t, m.prepare(nodeDir))
	require.FileExists(t, m.stateFile)
	for _, root := range cgroupV1Roots() {
		require.DirExists(t, filepath.Join(root, m.cgroup))
	}

	// What it changes, and is then killed: a pod's process in a cgroup under
	// its parent, a mount under its node's folder, a chain with a jump to
	// it, the sysctl. Beside it, someone else's rule.
	pod := filepath.Join("/sys/fs/cgroup/pids", m.cgroup, "kubepods", "pod1")
	require.NoError(t, os.MkdirAll(pod, 0o755))
	sleep := exec.Command("sleep", "600")
	require.NoError(t, sleep.Start())
	exited := make(chan error, 1)
	go func() { exited <- sleep.Wait() }()
	require.NoError(t, os.WriteFile(filepath.Join(pod, "cgroup.procs"), []byte(strconv.Itoa(sleep.Process.Pid)), 0o644))
	mnt := filepath.Join(nodeDir, "kubelet", "pods", "x")
	require.NoError(t, os.MkdirAll(mnt, 0o755))
	require.NoError(t, syscall.Mount("tmpfs", mnt, "tmpfs", 0, ""))
	chain := m.chainPrefix + "SERVICES"
	run(t, "iptables", "-N", chain)
	run(t, "iptables", "-A", chain, "-s", "203.0.113.7/32", "-j", "RETURN")
	run(t, "iptables", "-A", "INPUT", "-s", "203.0.113.7/32", "-j", chain)
	foreign := []string{"INPUT", "-s", "203.0.113.8/32", "-m", "comment", "--comment", "not-the-stacks " + m.chainPrefix, "-j", "ACCEPT"}
	run(t, "iptables", append([]string{"-A"}, foreign...)...)
	t.Cleanup(func() { _ = exec.Command("iptables", append([]string{"-D"}, foreign...)...).Run() })
	writeSysctl(t, sysctl, "1")
	require.NotEmpty(t, m.chains())

	// The next start undoes it.
	require.NoError(t, m.prepare(nodeDir), "recovers, then finds nothing of another node")
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Fatal("the pod's process survived")
	}
	require.NoDirExists(t, pod)
	for _, root := range cgroupAllRoots() {
		require.NoDirExists(t, filepath.Join(root, m.cgroup, "kubepods"))
	}
	require.NotContains(t, mounts(t), mnt)
	require.Empty(t, m.chains())
	save, err := exec.Command("iptables-save", "-t", "filter").Output()
	require.NoError(t, err)
	require.NotContains(t, string(save), "203.0.113.7/32", "the jump to the chain went")
	require.Contains(t, string(save), "203.0.113.8/32", "someone else's rule stayed")
	require.Equal(t, "0", readSysctl(t, sysctl), "restored to the value recorded before the first change")

	// A clean stop removes the record; chains it did not make refuse a start.
	require.NoError(t, m.recover())
	require.NoFileExists(t, m.stateFile)
	run(t, "iptables", "-N", chain)
	t.Cleanup(func() { _ = exec.Command("iptables", "-X", chain).Run() })
	require.ErrorContains(t, m.prepare(nodeDir), "looks like a Kubernetes node")
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	require.NoError(t, err, "%s %v: %s", name, args, out)
}

func writeSysctl(t *testing.T, k, v string) {
	t.Helper()
	require.NoError(t, os.WriteFile(filepath.Join("/proc/sys", k), []byte(v), 0o644))
}

func readSysctl(t *testing.T, k string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc/sys", k))
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

func mounts(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	return string(b)
}

// The pods' network is refused when it would overlap one of the machine's.
func TestAddressClashIsRefused(t *testing.T) {
	iface := fmt.Sprintf("obxc%d", os.Getpid()%100000)
	run(t, "ip", "link", "add", iface, "type", "bridge")
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", iface).Run() })
	require.NoError(t, refuseAddressClash())
	run(t, "ip", "addr", "add", "10.213.40.1/24", "dev", iface)
	require.ErrorContains(t, refuseAddressClash(), "overlaps 10.213.40.1/24 on interface "+iface)
}
