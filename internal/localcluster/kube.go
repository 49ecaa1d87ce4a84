package localcluster

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/internal/testenv"
)

// Scheme knows the built-in types and OutboxRelay.
func Scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := outboxv1alpha1.AddToScheme(s); err != nil {
		panic(err)
	}
	return s
}

// Kube is kube-apiserver and etcd started through envtest with the CRDs
// installed. Unlike testenv.StartKube, it keeps etcd's data and the API
// server's certificates under the stack's folder, so a run that was killed
// leaves nothing in /tmp and its processes can be found by that path.
type Kube struct {
	// Env is the envtest environment.
	Env *envtest.Environment
	// Config is the admin REST config.
	Config *rest.Config
	// AssetsDir holds kube-apiserver, etcd and kubectl.
	AssetsDir string

	logs []*os.File
}

// AssetsDir finds the kube-apiserver, etcd and kubectl binaries (make deps-kube).
func AssetsDir() (string, error) {
	if v := os.Getenv("KUBEBUILDER_ASSETS"); v != "" {
		if _, err := os.Stat(filepath.Join(v, "kube-apiserver")); err != nil {
			return "", fmt.Errorf("KUBEBUILDER_ASSETS=%s has no kube-apiserver; run `make deps-kube`", v)
		}
		return v, nil
	}
	matches, _ := filepath.Glob(filepath.Join(testenv.RepoRoot(), "bin", "k8s", "*", "kube-apiserver"))
	if len(matches) == 0 {
		return "", fmt.Errorf("kube-apiserver not found under bin/k8s; run `make deps-kube`")
	}
	return filepath.Dir(matches[len(matches)-1]), nil
}

// StartKube starts etcd and the API server with their files under dir and
// installs the CRDs from config/crd/bases.
func StartKube(dir string) (*Kube, error) {
	assets, err := AssetsDir()
	if err != nil {
		return nil, err
	}
	for _, sub := range []string{"etcd", "certs"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o700); err != nil {
			return nil, err
		}
	}
	k := &Kube{AssetsDir: assets}
	env := &envtest.Environment{
		BinaryAssetsDirectory:    assets,
		CRDDirectoryPaths:        []string{filepath.Join(testenv.RepoRoot(), "config", "crd", "bases")},
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
	env.ControlPlane.Etcd = &envtest.Etcd{DataDir: filepath.Join(dir, "etcd"), Out: k.logs[1], Err: k.logs[1]}
	cfg, err := env.Start()
	if err != nil {
		k.closeLogs()
		return nil, fmt.Errorf("start kube-apiserver and etcd from %s: %w", assets, err)
	}
	k.Env, k.Config = env, cfg
	return k, nil
}

// WriteKubeconfig writes a kubeconfig for a user in system:masters.
func (k *Kube) WriteKubeconfig(path string) error {
	u, err := k.Env.AddUser(envtest.User{Name: "demo-admin", Groups: []string{"system:masters"}}, nil)
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
func (k *Kube) Close() error {
	defer k.closeLogs()
	return k.Env.Stop()
}

func (k *Kube) closeLogs() {
	for _, f := range k.logs {
		f.Close()
	}
}
