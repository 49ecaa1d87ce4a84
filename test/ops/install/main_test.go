// Package install tests the Helm chart (charts/outbox-operator) and the
// release bundle (make installer) against a real API server.
package install

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedKube))
}

// repo is the main repository's top folder.
func repo(parts ...string) string {
	return filepath.Join(append([]string{testenv.RepoRoot()}, parts...)...)
}

// installMonitoringCRDs installs the Prometheus Operator's PodMonitor and
// PrometheusRule CRDs, which the chart's monitoring objects need.
func installMonitoringCRDs(t *testing.T) {
	t.Helper()
	_, err := envtest.InstallCRDs(testenv.Kube().Config, envtest.CRDInstallOptions{
		Paths: []string{repo("test", "ops", "testdata", "crds")}, ErrorIfPathMissing: true,
	})
	require.NoError(t, err)
}

// adminClient reaches the API server as admin.
func adminClient(t *testing.T) client.Client {
	t.Helper()
	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	c, err := client.New(testenv.Kube().Config, client.Options{Scheme: scheme})
	require.NoError(t, err)
	return c
}

// ensureNamespace creates a namespace unless it exists.
func ensureNamespace(t *testing.T, name string) {
	t.Helper()
	err := adminClient(t).Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
}

// kubectl runs the kubectl built with the API server against it, from the
// repository's top folder.
func kubectl(t *testing.T, stdin []byte, args ...string) []byte {
	t.Helper()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, testenv.Kube().Env.KubeConfig, 0o600))
	cmd := exec.Command(filepath.Join(testenv.Kube().AssetsDir, "kubectl"), append([]string{"--kubeconfig", kubeconfig}, args...)...)
	cmd.Dir = testenv.RepoRoot()
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "kubectl %v: %s", args, stderr.String())
	return out
}

// decode splits a multi-document YAML stream into objects, skipping empty documents.
func decode(t *testing.T, manifest []byte) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	d := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifest), 4096)
	for {
		u := &unstructured.Unstructured{}
		err := d.Decode(&u.Object)
		if err != nil {
			require.ErrorContains(t, err, "EOF")
			return objs
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
}

// find returns the one object of kind (and name, when not empty).
func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	var found []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind && (name == "" || o.GetName() == name) {
			found = append(found, o)
		}
	}
	require.Len(t, found, 1, "want one %s %q among %s", kind, name, kinds(objs))
	return found[0]
}

// kinds lists kind/name of objs, for messages.
func kinds(objs []*unstructured.Unstructured) []string {
	var out []string
	for _, o := range objs {
		out = append(out, fmt.Sprintf("%s/%s", o.GetKind(), o.GetName()))
	}
	return out
}
