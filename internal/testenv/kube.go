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
// the project's CRDs (config/crd/bases) installed.
type KubeEnv struct {
	// Env is the envtest environment; Env.Config reaches the API server as admin.
	Env *envtest.Environment
	// Config is the admin REST config.
	Config *rest.Config
	// AssetsDir holds kube-apiserver, etcd and kubectl.
	AssetsDir string

	logs []*os.File
}

// StartKube starts the API server and etcd from KUBEBUILDER_ASSETS (or the
// newest bin/k8s/* folder) and installs the CRDs.
func StartKube(dir string) (*KubeEnv, error) {
	assets, err := findDir("KUBEBUILDER_ASSETS", "make deps-kube", "kube-apiserver",
		filepath.Join(RepoRoot(), "bin", "k8s", "*"))
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver and etcd: %w", err)
	}
	if _, err := os.Stat(filepath.Join(assets, "etcd")); err != nil {
		return nil, fmt.Errorf("etcd not found in %s; run `make deps-kube`", assets)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
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
			return nil, err
		}
		k.logs = append(k.logs, f)
	}
	api := env.ControlPlane.GetAPIServer()
	api.Out, api.Err = k.logs[0], k.logs[0]
	etcd := env.ControlPlane.Etcd
	if etcd == nil {
		etcd = &envtest.Etcd{}
		env.ControlPlane.Etcd = etcd
	}
	etcd.Out, etcd.Err = k.logs[1], k.logs[1]
	cfg, err := env.Start()
	if err != nil {
		k.closeLogs()
		return nil, fmt.Errorf("start envtest (kube-apiserver and etcd from %s): %w", assets, err)
	}
	k.Env, k.Config = env, cfg
	return k, nil
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
