package localcluster

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
)

// The node's kubelet runs with the cgroupfs driver on cgroup v1 (the
// stack creates its cgroupRoot, cgroupParent, in each v1 hierarchy, and
// cleans up by them), the layout it is built and tested on. On a cgroup v2
// host the kubelet would exit once everything else had started, as that
// cgroup exists in no hierarchy it reads there ("could not read controllers
// for cgroup"); CheckHost says why before anything starts.

// cgroupMountPoint is where the kubelet and runc look for cgroups.
const cgroupMountPoint = "/sys/fs/cgroup"

// cgroup2Magic is the file system type of a cgroup v2 mount (statfs(2)):
// /sys/fs/cgroup of that type is how the kubelet and runc tell a v2 host.
const cgroup2Magic = 0x63677270

// nodeCgroupControllers are the cgroup v1 controllers the kubelet refuses
// to start without.
var nodeCgroupControllers = []string{"cpu", "cpuacct", "cpuset", "memory"}

// CheckHost reports why this machine cannot run the stack's node (nil when
// it can): it needs cgroup v1, that is /sys/fs/cgroup not a cgroup v2
// mount (a v1 or hybrid layout) and the v1 controllers the kubelet needs.
func CheckHost() error {
	if err := checkRoot(os.Geteuid()); err != nil {
		return err
	}
	return checkCgroups(cgroupMountPoint, "/proc/self/mounts")
}

// checkRoot refuses a user other than root (euid): containerd, runc and
// the kubelet mount, make cgroups and network namespaces, and run as root.
func checkRoot(euid int) error {
	if euid != 0 {
		return fmt.Errorf("the local cluster's node (containerd, runc, the kubelet) runs as root, and this process runs as uid %d: run it as root (sudo make demo)", euid)
	}
	return nil
}

// checkCgroups is CheckHost with the cgroup mount point and the mount
// table read from the given paths.
func checkCgroups(mountPoint, mountTable string) error {
	const fix = "boot the machine with systemd.unified_cgroup_hierarchy=0 on the kernel command line " +
		"(systemd 256 and later also need SYSTEMD_CGROUP_ENABLE_LEGACY_FORCE=1 there; a systemd without cgroup v1 support cannot), " +
		"or run the node (make demo, make test-e2e, make test-upgrade) in a VM that boots cgroup v1"
	var st syscall.Statfs_t
	if err := syscall.Statfs(mountPoint, &st); err != nil {
		return fmt.Errorf("the local cluster's node needs cgroup v1 at %s, which cannot be read: %w", mountPoint, err)
	}
	if st.Type == cgroup2Magic {
		return fmt.Errorf("the local cluster's node needs cgroup v1 (its kubelet runs with the cgroupfs driver on the v1 hierarchies), "+
			"but %s is cgroup v2 (unified): %s", mountPoint, fix)
	}
	f, err := os.Open(mountTable)
	if err != nil {
		return fmt.Errorf("read the cgroup mounts: %w", err)
	}
	defer f.Close()
	var mounted []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// device mountpoint type options dump pass; a v1 hierarchy names
		// its controllers among the options.
		fields := strings.Fields(sc.Text())
		if len(fields) >= 4 && fields[2] == "cgroup" {
			mounted = append(mounted, strings.Split(fields[3], ",")...)
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read the cgroup mounts: %w", err)
	}
	var missing []string
	for _, c := range nodeCgroupControllers {
		if !slices.Contains(mounted, c) {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("the local cluster's node needs the cgroup v1 controllers %s mounted (its kubelet refuses to start without them); "+
			"%s is not cgroup v2, but %s lists no cgroup v1 mount of %s: %s",
			strings.Join(nodeCgroupControllers, ", "), mountPoint, mountTable, strings.Join(missing, ", "), fix)
	}
	return nil
}
