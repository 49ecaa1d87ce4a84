package localcluster

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// CleanDir makes dir ready for a fresh stack: it stops processes an earlier
// run left behind in it (found by their command lines naming dir, such as
// PostgreSQL's data folder or etcd's --data-dir, which survive a run that was
// killed with SIGKILL), kills the containers of its node and removes the
// node's mounts, cgroups, iptables rules and bridge, then removes the folder.
func CleanDir(dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	pids := processesUsing(dir)
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGTERM)
	}
	deadline := time.Now().Add(15 * time.Second)
	for _, pid := range pids {
		for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if syscall.Kill(pid, 0) == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	// The node's leftovers are the machine's (cgroups, iptables, the
	// bridge, sysctls): only clean them while no other stack runs.
	if release, ok := tryLockMachine(); ok {
		err := errors.Join(cleanNodeLeftovers(filepath.Join(dir, "node")), removeBridge(), theMachine.recover())
		release()
		if err != nil {
			return fmt.Errorf("clean up the node of an earlier run in %s: %w", dir, err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}

// stackCommands are the programs a stack runs; nothing else is stopped (a
// `tail -f` of a log in dir, say).
var stackCommands = map[string]bool{
	"postgres": true, "java": true, "etcd": true, "kube-apiserver": true,
	"kubelet": true, "containerd": true, "kube-controller-": true, "kube-scheduler": true, "kube-proxy": true,
}

// processesUsing lists the stack's processes whose command line mentions dir.
func processesUsing(dir string) []int {
	entries, _ := os.ReadDir("/proc")
	needle := []byte(dir + string(filepath.Separator))
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if bytes.Contains(b, needle) && stackCommands[string(bytes.TrimSpace(comm))] {
			out = append(out, pid)
		}
	}
	return out
}
