package testenv

import (
	"fmt"
	"os"
	"path/filepath"
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

// StartKube starts the API server and etcd and installs the CRDs. Their
// logs, etcd's data and the API server's certificates live under dir, so
// nothing is left in /tmp and a killed run's processes can be found by that
// path. The service range is a /16: every OutboxRelay owns a ClusterIP
// Service, and envtest's default /24 holds only 253 of them.
func StartKube(dir string) (*KubeEnv, error) {
	assets, err := KubeAssetsDir()
	if err != nil {
		return nil, err
	}
	for _, sub := range []string{"etcd", "certs"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o700); err != nil {
			return nil, err
		}
	}
	k := &KubeEnv{AssetsDir: assets}
	env := &envtest.Environment{
		BinaryAssetsDirectory:    assets,
		CRDDirectoryPaths:        []string{filepath.Join(RepoRoot(), "config", "crd", "bases")},
		ErrorIfCRDPathMissing:    true,
		ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
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
	api.CertDir = filepath.Join(dir, "certs")
	api.Configure().Set("service-cluster-ip-range", "10.96.0.0/16")
	env.ControlPlane.Etcd = &envtest.Etcd{DataDir: filepath.Join(dir, "etcd"), Out: k.logs[1], Err: k.logs[1]}
	cfg, err := env.Start()
	if err != nil {
		k.closeLogs()
		return nil, fmt.Errorf("start envtest (kube-apiserver and etcd from %s): %w", assets, err)
	}
	k.Env, k.Config = env, cfg
	return k, nil
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
