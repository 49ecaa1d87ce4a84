package localcluster

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// This file is everything a stack changes on the machine outside its own
// folder, and how it is undone: only what the stack made (its cgroup
// parent, the iptables chains of its kubelet and kube-proxy, the sysctls
// they and the pods' gateway set, recorded before the first change), also
// after a run that was killed. A machine that is itself a Kubernetes node,
// or has another network where the pods' would go, is refused.

// machineStateFile records, before the stack changes anything, what to undo.
// It lives in /run, which a reboot clears along with the changes it records.
const machineStateFile = "/run/outbox-localcluster.state.json"

// cgroupParent is the cgroup the node's kubelet puts every pod under
// (its cgroupRoot), in each cgroup v1 hierarchy.
const cgroupParent = "outbox-node"

// kubeChainPrefix starts the iptables chains the kubelet and kube-proxy create.
const kubeChainPrefix = "KUBE-"

// changedSysctls are every sysctl the node may change: the six the kubelet
// sets at start-up, and the forwarding the CNI bridge plugin turns on for
// the pods' gateway. (kube-proxy's conntrack settings are turned off in its
// configuration, and it sets route_localnet only for localhost node ports,
// which are off too.)
var changedSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward",
}

// machineState is what the state file records.
type machineState struct {
	// Sysctls are the values of changedSysctls before the stack started.
	Sysctls map[string]string `json:"sysctls"`
	// NodeDir is the node's folder, whose mounts go with it.
	NodeDir string `json:"nodeDir"`
}

// machine names what a stack changes, so that a test can work on its own
// cgroup, chains and sysctls beside a running stack.
type machine struct {
	stateFile   string
	cgroup      string
	chainPrefix string
	sysctls     []string
}

// theMachine is what a stack changes.
var theMachine = machine{stateFile: machineStateFile, cgroup: cgroupParent, chainPrefix: kubeChainPrefix, sysctls: changedSysctls}

// prepare readies the machine for a stack whose node lives in nodeDir; the
// caller holds the machine lock. It undoes what a killed stack left,
// refuses a machine that is a Kubernetes node itself or has a network
// overlapping the pods', records the sysctls, and creates the cgroup parent.
func (m machine) prepare(nodeDir string) error {
	if err := m.recover(); err != nil {
		return fmt.Errorf("undo what an earlier local cluster left: %w", err)
	}
	if chains := m.chains(); len(chains) > 0 {
		return fmt.Errorf("iptables already has %d %s* chains (%s...) that no local cluster made: this machine looks like a Kubernetes node, and a second kube-proxy would rewrite its rules; run the local cluster elsewhere",
			len(chains), m.chainPrefix, chains[0])
	}
	if err := refuseAddressClash(); err != nil {
		return err
	}
	st := machineState{Sysctls: map[string]string{}, NodeDir: nodeDir}
	for _, k := range m.sysctls {
		b, err := os.ReadFile(filepath.Join("/proc/sys", k))
		if err != nil {
			return fmt.Errorf("read sysctl %s: %w", k, err)
		}
		st.Sysctls[k] = string(bytes.TrimSpace(b))
	}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	tmp := m.stateFile + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, m.stateFile); err != nil {
		return err
	}
	return createCgroup(m.cgroup)
}

// recover undoes what the stack recorded in the state file, if there is
// one (a stack that did not stop, or stopped now): kills the processes in
// its cgroup parent and removes it, unmounts what is under its node's
// folder, removes its iptables chains and the rules that jump to them, and
// restores its sysctls. The state file goes once all of that succeeded.
func (m machine) recover() error {
	b, err := os.ReadFile(m.stateFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var st machineState
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("%s: %w", m.stateFile, err)
	}
	killCgroup(m.cgroup)
	var errs []error
	if st.NodeDir != "" {
		errs = append(errs, unmountUnder(st.NodeDir))
	}
	errs = append(errs, removeCgroups(m.cgroup), m.removeChains())
	for k, v := range st.Sysctls {
		if err := os.WriteFile(filepath.Join("/proc/sys", k), []byte(v), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore sysctl %s=%s: %w", k, v, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return os.Remove(m.stateFile)
}

// createCgroup creates name under the root of every cgroup v1 hierarchy (the
// kubelet requires its cgroupRoot to exist); a cpuset cgroup starts with its
// parent's CPUs and memory nodes.
func createCgroup(name string) error {
	for _, root := range cgroupV1Roots() {
		dir := filepath.Join(root, name)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		if filepath.Base(root) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(root, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
					return fmt.Errorf("set %s of cgroup %s: %w", f, dir, err)
				}
			}
		}
	}
	return nil
}

// cgroupV1Roots are the mount points of the cgroup v1 hierarchies.
func cgroupV1Roots() []string { return cgroupRoots("cgroup") }

// cgroupAllRoots are those and the cgroup v2 one of a hybrid layout, where
// the pods' runtime makes cgroups too.
func cgroupAllRoots() []string { return cgroupRoots("cgroup", "cgroup2") }

// cgroupRoots are the mount points of the cgroup file systems of types.
func cgroupRoots(types ...string) []string {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return nil
	}
	defer f.Close()
	var roots []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 3 && slices.Contains(types, fields[2]) {
			roots = append(roots, unescapeMount(fields[1]))
		}
	}
	return roots
}

// killCgroup kills every process in the cgroup name and below (the pods'
// containers of a node that was not stopped).
func killCgroup(name string) {
	var pids []int
	for _, root := range cgroupAllRoots() {
		_ = filepath.WalkDir(filepath.Join(root, name), func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() && d.Name() == "cgroup.procs" {
				b, _ := os.ReadFile(path)
				for _, f := range strings.Fields(string(b)) {
					if pid, err := strconv.Atoi(f); err == nil {
						pids = append(pids, pid)
					}
				}
			}
			return nil
		})
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if len(pids) > 0 {
		time.Sleep(500 * time.Millisecond)
	}
}

// removeCgroups removes the cgroup name and its children from every
// hierarchy, deepest first (a cgroup can be removed only once empty).
func removeCgroups(name string) error {
	var errs []error
	for _, root := range cgroupAllRoots() {
		var dirs []string
		_ = filepath.WalkDir(filepath.Join(root, name), func(path string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, path)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := syscall.Rmdir(dirs[i]); err != nil && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// iptablesFamilies are the iptables front ends, IPv4 and IPv6.
var iptablesFamilies = []string{"iptables", "ip6tables"}

// chains lists the chains named with the machine's prefix, in every table.
func (m machine) chains() []string {
	var out []string
	for _, family := range iptablesFamilies {
		save, err := exec.Command(family + "-save").Output()
		if err != nil {
			continue // no such family here
		}
		for _, line := range strings.Split(string(save), "\n") {
			if strings.HasPrefix(line, ":"+m.chainPrefix) {
				out = append(out, strings.Fields(line[1:])[0])
			}
		}
	}
	return out
}

// removeChains removes the chains named with the machine's prefix and the
// rules of other chains that jump to them, table by table, each table in
// one iptables-restore --noflush transaction: no other rule is touched,
// and a rule another program adds meanwhile is not lost (as it would be by
// restoring a whole saved table).
func (m machine) removeChains() error {
	jump := regexp.MustCompile(`\s-[jg]\s+` + regexp.QuoteMeta(m.chainPrefix))
	var errs []string
	for _, family := range iptablesFamilies {
		save, err := exec.Command(family + "-save").Output()
		if err != nil {
			continue
		}
		var in bytes.Buffer
		for _, block := range strings.Split(string(save), "\n*")[1:] {
			lines := strings.Split(block, "\n")
			table := strings.TrimSpace(lines[0])
			var deletes, chains []string
			for _, l := range lines[1:] {
				switch {
				case strings.HasPrefix(l, ":"+m.chainPrefix):
					chains = append(chains, strings.Fields(l[1:])[0])
				case strings.HasPrefix(l, "-A ") && !strings.HasPrefix(l, "-A "+m.chainPrefix) && jump.MatchString(l):
					deletes = append(deletes, "-D "+l[3:])
				}
			}
			if len(deletes)+len(chains) == 0 {
				continue
			}
			fmt.Fprintf(&in, "*%s\n", table)
			for _, d := range deletes {
				in.WriteString(d + "\n")
			}
			for _, c := range chains {
				fmt.Fprintf(&in, "-F %s\n", c)
			}
			for _, c := range chains {
				fmt.Fprintf(&in, "-X %s\n", c)
			}
			in.WriteString("COMMIT\n")
		}
		if in.Len() == 0 {
			continue
		}
		cmd := exec.Command(family+"-restore", "--noflush")
		cmd.Stdin = &in
		if out, err := cmd.CombinedOutput(); err != nil {
			errs = append(errs, fmt.Sprintf("%s-restore --noflush: %v: %s", family, err, out))
		}
	}
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "; "))
	}
	return nil
}

// refuseAddressClash refuses PodCIDR when an interface other than the
// stack's bridge has an address in it or a route into it leaves through
// one: the pods' network would hide that network from this machine.
func refuseAddressClash() error {
	pods := mustCIDR(PodCIDR)
	ifaces, err := net.Interfaces()
	if err != nil {
		return err
	}
	for _, iface := range ifaces {
		if iface.Name == BridgeName {
			continue
		}
		addrs, _ := iface.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && (pods.Contains(n.IP) || n.Contains(pods.IP)) {
				return fmt.Errorf("the pods' network %s overlaps %s on interface %s: the local cluster would cut this machine off from it", PodCIDR, n, iface.Name)
			}
		}
	}
	routes, err := os.ReadFile("/proc/net/route")
	if err != nil {
		return nil // no IPv4 routing table to check
	}
	for _, line := range strings.Split(string(routes), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 8 || f[0] == BridgeName {
			continue
		}
		dst, mask := hexIP(f[1]), hexIP(f[7])
		if dst == nil || mask == nil || dst.IsUnspecified() { // the default route overlaps everything
			continue
		}
		n := &net.IPNet{IP: dst, Mask: net.IPMask(mask)}
		if pods.Contains(n.IP) || n.Contains(pods.IP) {
			return fmt.Errorf("the pods' network %s overlaps the route to %s via %s: the local cluster would hide that network", PodCIDR, n, f[0])
		}
	}
	return nil
}

// hexIP decodes an address of /proc/net/route (little-endian hex).
func hexIP(s string) net.IP {
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != 4 {
		return nil
	}
	ip := make(net.IP, 4)
	binary.BigEndian.PutUint32(ip, binary.LittleEndian.Uint32(b))
	return ip
}
