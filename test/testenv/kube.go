package testenv

import (
	"cmp"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// KubeEnv is a real kube-apiserver and etcd started through envtest, with
// the project's CRDs (config/crd/bases) installed. It is the one way the
// tests, the local stack (make demo, e2e) and the benchmark start them.
type KubeEnv struct {
	// Env is the envtest environment; Env.Config reaches the API server as admin.
	Env *envtest.Environment
	// Config is the admin REST config.
	Config *rest.Config
	// AssetsDir holds kube-apiserver, etcd and kubectl.
	AssetsDir string
	// CertDir holds the API server's certificates; with KubeOptions.Host,
	// ServingCAFile and the service-account signing key (sa-signer.key)
	// that a kube-controller-manager needs.
	CertDir string

	logs []*os.File
}

// KubeAssetsDir finds kube-apiserver, etcd and kubectl: KUBEBUILDER_ASSETS,
// or the newest bin/k8s/* folder (make deps-kube).
func KubeAssetsDir() (string, error) {
	assets, err := findDir("KUBEBUILDER_ASSETS", "make deps-kube", "kube-apiserver",
		filepath.Join(RepoRoot(), "bin", "k8s", "*"))
	if err != nil {
		return "", fmt.Errorf("kube-apiserver and etcd: %w", err)
	}
	if _, err := os.Stat(filepath.Join(assets, "etcd")); err != nil {
		return "", fmt.Errorf("etcd not found in %s; run `make deps-kube`", assets)
	}
	return assets, nil
}

// KubeOptions make the API server the control plane of a local node. The
// zero value serves on loopback, as envtest does.
type KubeOptions struct {
	// Host is the address the API server listens at and advertises (the
	// endpoint of the kubernetes Service).
	Host string
	// ServiceCIDR is the Service network; its first address (the
	// kubernetes Service's ClusterIP) is put in the serving certificate.
	ServiceCIDR string
	// NoCRDs leaves the project's CRDs out: the caller installs an
	// operator with its own (the upgrade test, a previous release's).
	NoCRDs bool
}

// DefaultServiceCIDR is the Service network of the API server StartKube runs.
const DefaultServiceCIDR = "10.96.0.0/16"

// StartKube starts the API server and etcd and installs the CRDs. Their
// logs, etcd's data and the API server's certificates live under dir, so
// nothing is left in /tmp and a killed run's processes can be found by that
// path. The service range is a /16: every OutboxRelay owns a ClusterIP
// Service, and envtest's default /24 holds only 253 of them.
func StartKube(dir string, opts ...KubeOptions) (*KubeEnv, error) {
	var o KubeOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	o.ServiceCIDR = cmp.Or(o.ServiceCIDR, DefaultServiceCIDR)
	assets, err := KubeAssetsDir()
	if err != nil {
		return nil, err
	}
	for _, sub := range []string{"etcd", "certs"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o700); err != nil {
			return nil, err
		}
	}
	k := &KubeEnv{AssetsDir: assets, CertDir: filepath.Join(dir, "certs")}
	env := &envtest.Environment{
		BinaryAssetsDirectory:    assets,
		CRDDirectoryPaths:        []string{filepath.Join(RepoRoot(), "config", "crd", "bases")},
		ErrorIfCRDPathMissing:    !o.NoCRDs,
		ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	if o.NoCRDs {
		env.CRDDirectoryPaths = nil
	}
	for _, name := range []string{"kube-apiserver.log", "etcd.log"} {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			k.closeLogs()
			return nil, err
		}
		k.logs = append(k.logs, f)
	}
	api := env.ControlPlane.GetAPIServer()
	api.Out, api.Err = k.logs[0], k.logs[0]
	api.CertDir = k.CertDir
	api.Configure().Set("service-cluster-ip-range", o.ServiceCIDR)
	if o.Host != "" {
		if err := k.serveForNode(api, o); err != nil {
			k.closeLogs()
			return nil, err
		}
	}
	env.ControlPlane.Etcd = &envtest.Etcd{DataDir: filepath.Join(dir, "etcd"), Out: k.logs[1], Err: k.logs[1]}
	cfg, err := env.Start()
	if err != nil {
		k.closeLogs()
		return nil, fmt.Errorf("start envtest (kube-apiserver and etcd from %s): %w", assets, err)
	}
	k.Env, k.Config = env, cfg
	return k, nil
}

// serveForNode makes the API server reachable from a node's pods: it
// listens at o.Host with a certificate that names o.Host, the kubernetes
// Service's ClusterIP and its DNS names, and admits pods with their service
// account tokens (envtest turns that off, having no controller to create
// service accounts; a node's kube-controller-manager does).
func (k *KubeEnv) serveForNode(api *envtest.APIServer, o KubeOptions) error {
	host := net.ParseIP(o.Host)
	if host == nil {
		return fmt.Errorf("KubeOptions.Host %q is not an IP address", o.Host)
	}
	_, svc, err := net.ParseCIDR(o.ServiceCIDR)
	if err != nil {
		return fmt.Errorf("KubeOptions.ServiceCIDR %q: %w", o.ServiceCIDR, err)
	}
	clusterIP := slices.Clone(svc.IP.To4())
	clusterIP[3]++
	port, err := FreePort()
	if err != nil {
		return err
	}
	ca, err := writeServingCerts(k.CertDir, []net.IP{host, net.IPv4(127, 0, 0, 1), clusterIP},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"})
	if err != nil {
		return fmt.Errorf("API server certificates: %w", err)
	}
	api.SecureServing.Address, api.SecureServing.Port, api.SecureServing.CA = o.Host, strconv.Itoa(port), ca
	api.Configure().
		Set("advertise-address", o.Host).
		Set("disable-admission-plugins", "").
		Set("kubelet-preferred-address-types", "InternalIP")
	return nil
}

// WriteKubeconfig writes a kubeconfig for a user in system:masters.
func (k *KubeEnv) WriteKubeconfig(path string) error {
	u, err := k.Env.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fmt.Errorf("add admin user: %w", err)
	}
	b, err := u.KubeConfig()
	if err != nil {
		return fmt.Errorf("admin kubeconfig: %w", err)
	}
	return os.WriteFile(path, b, 0o600)
}

// Close stops the API server and etcd.
func (k *KubeEnv) Close() error {
	defer k.closeLogs()
	return k.Env.Stop()
}

func (k *KubeEnv) closeLogs() {
	for _, f := range k.logs {
		f.Close()
	}
}

// NodeAssetsDir finds what a local node runs beside the API server (kubelet,
// kube-controller-manager, kube-scheduler, kube-proxy, containerd and its
// runc shim): OUTBOX_NODE_ASSETS, or the newest bin/node/* folder (make
// deps-node).
func NodeAssetsDir() (string, error) {
	dir, err := findDir("OUTBOX_NODE_ASSETS", "make deps-node", "kubelet",
		filepath.Join(RepoRoot(), "bin", "node", "*"))
	if err != nil {
		return "", fmt.Errorf("kubelet and containerd: %w", err)
	}
	for _, b := range []string{"kube-controller-manager", "kube-scheduler", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("%s not found in %s; run `make deps-node`", b, dir)
		}
	}
	return dir, nil
}
