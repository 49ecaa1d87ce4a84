package localcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// node is a real Kubernetes node and the control-plane processes beside the
// API server: containerd (with Debian's runc and CNI plugins), the kubelet,
// kube-controller-manager, kube-scheduler and kube-proxy, all built from
// their Go modules (make deps-node). Pods are real containers from images
// imported into containerd; nothing is pulled.
type node struct {
	dir   string // everything of the node lives here
	bin   string // testenv.NodeAssetsDir
	sock  string // containerd's socket
	procs []*devproc.Proc
}

// containerdNamespace is the containerd namespace the CRI plugin uses.
const containerdNamespace = "k8s.io"

// startNode starts the node against kube (which must serve at HostIP) with
// the image tarballs imported, and waits until the node is Ready.
func startNode(ctx context.Context, dir string, kube *testenv.KubeEnv, images []string, pauseImage string) (n *node, err error) {
	bin, err := testenv.NodeAssetsDir()
	if err != nil {
		return nil, err
	}
	for _, tool := range []string{"runc", "iptables", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s not found: run `make deps-node` (it installs Debian's runc, containernetworking-plugins and iptables)", tool)
		}
	}
	if _, err := os.Stat(filepath.Join(cniBinDir, "bridge")); err != nil {
		return nil, fmt.Errorf("CNI plugins not found in %s: run `make deps-node`", cniBinDir)
	}
	n = &node{dir: dir, bin: bin, sock: filepath.Join(dir, "containerd", "containerd.sock")}
	defer func() {
		if err != nil {
			n.close()
			n = nil
		}
	}()
	for _, sub := range []string{"containerd", "kubelet", "pod-logs", "cni/net.d", "cni/ipam", "config", "logs"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return n, err
		}
	}
	kubeconfigs := map[string]envtest.User{
		"kubelet":                 {Name: "system:node:" + NodeName, Groups: []string{"system:nodes", "system:masters"}},
		"kube-controller-manager": {Name: "system:kube-controller-manager", Groups: []string{"system:masters"}},
		"kube-scheduler":          {Name: "system:kube-scheduler", Groups: []string{"system:masters"}},
		"kube-proxy":              {Name: "system:kube-proxy", Groups: []string{"system:masters"}},
	}
	for name, u := range kubeconfigs {
		au, err := kube.Env.AddUser(u, nil)
		if err != nil {
			return n, fmt.Errorf("%s credentials: %w", name, err)
		}
		b, err := au.KubeConfig()
		if err != nil {
			return n, err
		}
		if err := os.WriteFile(n.path("config", name+".kubeconfig"), b, 0o600); err != nil {
			return n, err
		}
	}
	if err := writeCNIConfig(n.path("cni", "net.d"), n.path("cni", "ipam")); err != nil {
		return n, err
	}
	if err := n.startContainerd(ctx, pauseImage); err != nil {
		return n, err
	}
	for _, img := range images {
		if out, err := n.ctr(ctx, "images", "import", "--platform", "linux/amd64", img); err != nil {
			return n, fmt.Errorf("import %s into containerd: %w: %s", img, err, out)
		}
	}
	if err := n.startControlPlane(kube); err != nil {
		return n, err
	}
	if err := n.startKubelet(); err != nil {
		return n, err
	}
	c, err := client.New(kube.Config, client.Options{Scheme: Scheme()})
	if err != nil {
		return n, err
	}
	if err := n.waitReady(ctx, c, 3*time.Minute); err != nil {
		return n, err
	}
	return n, nil
}

// cniBinDir is where Debian's containernetworking-plugins installs the plugins.
const cniBinDir = "/usr/lib/cni"

func (n *node) path(elem ...string) string { return filepath.Join(append([]string{n.dir}, elem...)...) }

// env is the node processes' environment: the node's binaries first (the
// runc shim must be on containerd's PATH), then the system's (runc,
// iptables, mount).
func (n *node) env() []string {
	return append(slices.DeleteFunc(os.Environ(), func(s string) bool { return strings.HasPrefix(s, "PATH=") }),
		"PATH="+n.bin+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
}

func (n *node) start(name string, args ...string) (*devproc.Proc, error) {
	p, err := devproc.Start(devproc.Options{
		Binary:  filepath.Join(n.bin, name),
		Args:    args,
		Env:     n.env(),
		LogPath: n.path("logs", name+".log"),
	})
	if err != nil {
		return nil, err
	}
	n.procs = append(n.procs, p)
	return p, nil
}

// startContainerd writes containerd's configuration and starts it. Two
// settings are required on machines like this one: root lacks
// CAP_SYS_RESOURCE, so containerd must not raise a container's OOM score
// adjustment (restrict_oom_score_adj; without it every sandbox fails with
// "can't get final child's PID from pipe: EOF"), and cgroups are v1 with the
// cgroupfs driver (SystemdCgroup = false).
func (n *node) startContainerd(ctx context.Context, pauseImage string) error {
	conf := fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
disabled_plugins = ['io.containerd.nri.v1.nri']

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = %[5]q

  [plugins.'io.containerd.cri.v1.runtime']
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = %[6]q
          Root = %[7]q
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = [%[8]q]
      conf_dir = %[9]q

  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
`, n.path("containerd", "root"), n.path("containerd", "state"), n.sock, n.sock+".ttrpc", pauseImage,
		runcPath(), n.path("containerd", "runc"), cniBinDir, n.path("cni", "net.d"))
	cfg := n.path("config", "containerd.toml")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return err
	}
	p, err := n.start("containerd", "--config", cfg)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := n.ctr(ctx, "version"); err == nil {
			return nil
		}
		if p.HasExited() || time.Now().After(deadline) {
			return fmt.Errorf("containerd did not start: %s (log %s)", p.Tail(5), n.path("logs", "containerd.log"))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func runcPath() string {
	if p, err := exec.LookPath("runc"); err == nil {
		return p
	}
	return "/usr/sbin/runc"
}

// ctr runs containerd's client in the CRI plugin's namespace.
func (n *node) ctr(ctx context.Context, args ...string) ([]byte, error) {
	// ctr needs an absolute socket path.
	cmd := exec.CommandContext(ctx, filepath.Join(n.bin, "ctr"), append([]string{"-a", n.sock, "-n", containerdNamespace}, args...)...)
	return cmd.CombinedOutput()
}

// startControlPlane starts kube-controller-manager, kube-scheduler and
// kube-proxy. The controller manager signs service-account tokens with the
// API server's key, publishes the serving CA as kube-root-ca.crt, and runs
// each controller with its own service account, without which the node
// controller never lifts the node's not-ready taint.
func (n *node) startControlPlane(kube *testenv.KubeEnv) error {
	if _, err := n.start("kube-controller-manager",
		"--kubeconfig="+n.path("config", "kube-controller-manager.kubeconfig"),
		"--use-service-account-credentials=true",
		"--service-account-private-key-file="+filepath.Join(kube.CertDir, "sa-signer.key"),
		"--root-ca-file="+filepath.Join(kube.CertDir, testenv.ServingCAFile),
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=0",
		"--controllers=*",
	); err != nil {
		return err
	}
	port, err := testenv.FreePort()
	if err != nil {
		return err
	}
	if _, err := n.start("kube-scheduler",
		"--kubeconfig="+n.path("config", "kube-scheduler.kubeconfig"),
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port="+strconv.Itoa(port),
	); err != nil {
		return err
	}
	healthz, err := testenv.FreePort()
	if err != nil {
		return err
	}
	metrics, err := testenv.FreePort()
	if err != nil {
		return err
	}
	proxyConf := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: %q
hostnameOverride: %q
clusterCIDR: %q
healthzBindAddress: 127.0.0.1:%d
metricsBindAddress: 127.0.0.1:%d
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
iptables:
  localhostNodePorts: false
`, n.path("config", "kube-proxy.kubeconfig"), NodeName, PodCIDR, healthz, metrics)
	cfg := n.path("config", "kube-proxy.yaml")
	if err := os.WriteFile(cfg, []byte(proxyConf), 0o644); err != nil {
		return err
	}
	_, err = n.start("kube-proxy", "--config="+cfg)
	return err
}

// startKubelet writes the kubelet's configuration and starts it. Its API
// takes no anonymous request: callers are authenticated and authorized by
// the API server (token and subject access reviews). The machine
// is cgroup v1 (failCgroupV1: false, the cgroupfs driver), and the kubelet
// must not ask for an OOM score adjustment root may not set here
// (oomScoreAdj: 0). Eviction thresholds are low: the node shares a
// developer's disk.
func (n *node) startKubelet() error {
	port, err := testenv.FreePort()
	if err != nil {
		return err
	}
	healthz, err := testenv.FreePort()
	if err != nil {
		return err
	}
	conf := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %[1]s
port: %[2]d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[3]d
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: /%[6]s
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
containerRuntimeEndpoint: unix://%[4]s
podLogsDir: %[5]q
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%%
  nodefs.inodesFree: 1%%
  imagefs.available: 1%%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
protectKernelDefaults: false
syncFrequency: 10s
fileCheckFrequency: 10s
`, HostIP, port, healthz, n.sock, n.path("pod-logs"), cgroupParent)
	cfg := n.path("config", "kubelet.yaml")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return err
	}
	_, err = n.start("kubelet",
		"--config="+cfg,
		"--kubeconfig="+n.path("config", "kubelet.kubeconfig"),
		"--root-dir="+n.path("kubelet"),
		"--cert-dir="+n.path("kubelet", "pki"),
		"--hostname-override="+NodeName,
		"--node-ip="+HostIP,
	)
	return err
}

// waitReady waits for the node to register and turn Ready.
func (n *node) waitReady(ctx context.Context, c client.Client, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	why := "not registered"
	for {
		var nd corev1.Node
		if err := c.Get(ctx, types.NamespacedName{Name: NodeName}, &nd); err == nil {
			why = "no Ready condition"
			for _, cond := range nd.Status.Conditions {
				if cond.Type == corev1.NodeReady {
					if cond.Status == corev1.ConditionTrue && len(nd.Spec.Taints) == 0 {
						return nil
					}
					why = fmt.Sprintf("Ready=%s (%s), taints %v", cond.Status, cond.Message, nd.Spec.Taints)
				}
			}
		}
		for _, p := range n.procs {
			if p.HasExited() {
				return fmt.Errorf("%s exited: %s (logs in %s)", filepath.Base(p.Cmd.Path), p.Tail(5), n.path("logs"))
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("node %s not ready within %s: %s (logs in %s)", NodeName, timeout, why, n.path("logs"))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// close stops the node and undoes what it did to the machine: the
// Kubernetes processes stop in reverse order (the kubelet before the
// containers, so that it restarts nothing), every container and runc shim
// is killed, containerd stops, and the mounts, cgroups and iptables rules
// they left are removed.
func (n *node) close() error {
	for i := len(n.procs) - 1; i >= 0; i-- {
		if strings.HasSuffix(n.procs[i].Cmd.Path, "/containerd") {
			killPods(n.dir)
		}
		n.procs[i].Stop(10 * time.Second)
	}
	return cleanNodeLeftovers(n.dir)
}

// cleanNodeLeftovers removes what a node under dir leaves on the machine,
// also after a run that was killed: the processes in its cgroup parent (the
// pods' containers) and the runc shims of its containerd, mounts under dir,
// its cgroups, and the iptables chains of its kubelet and kube-proxy. It is
// idempotent. The sysctls are restored by the machine's recover, after the
// bridge (the servers bound to HostIP stop after the node).
func cleanNodeLeftovers(dir string) error {
	killPods(dir)
	return errors.Join(unmountUnder(dir), removeCgroups(cgroupParent), theMachine.removeChains())
}

// killPods kills every process in the node's cgroup parent (the containers
// of a node that was not stopped) and the runc shims of a containerd whose
// socket is under dir.
func killPods(dir string) {
	killCgroup(cgroupParent)
	var pids []int
	entries, _ := os.ReadDir("/proc")
	needle := []byte(dir + string(filepath.Separator))
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if strings.HasPrefix(string(comm), "containerd-shim") && bytes.Contains(cmdline, needle) {
			pids = append(pids, pid)
		}
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if len(pids) > 0 {
		time.Sleep(500 * time.Millisecond)
	}
}

// unmountUnder detaches every mount point under dir, deepest first: the
// kubelet's bind mount of its root folder, pods' volumes, containers'
// root filesystems, sandboxes' network namespaces.
func unmountUnder(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		p := unescapeMount(f[4])
		if p == dir || strings.HasPrefix(p, dir+"/") {
			points = append(points, p)
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var out strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				out.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		out.WriteByte(s[i])
	}
	return out.String()
}
