package install

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// TestInstaller runs `make installer` and checks dist/install.yaml: exactly
// what `kubectl kustomize config/default` renders but for the pinned image,
// which both the manager and its default relay image use; then a user's
// `kubectl apply --server-side -f install.yaml` installs a working manager
// Deployment.
func TestInstaller(t *testing.T) {
	const img = "registry.example/outbox/operator:v9.8.7"
	dist := t.TempDir()
	cmd := exec.Command("make", "-s", "--no-print-directory", "installer", "IMG="+img, "DIST="+dist)
	cmd.Dir = testenv.RepoRoot()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Run(), out.String())
	bundle, err := os.ReadFile(filepath.Join(dist, "install.yaml"))
	require.NoError(t, err)

	kustomized := kubectl(t, nil, "kustomize", "config/default")
	require.Equal(t, strings.ReplaceAll(string(kustomized), "ghcr.io/outbox-relay/outbox-operator:latest", img), string(bundle))
	require.Equal(t, 2, strings.Count(string(bundle), img), "the manager image and RELAY_IMAGE")
	require.NotContains(t, string(bundle), ":latest")

	objs := decode(t, bundle)
	find(t, objs, "Namespace", "outbox-system")
	find(t, objs, "CustomResourceDefinition", "outboxrelays.outbox.dev")
	find(t, objs, "ClusterRole", "outbox-operator-manager-role")

	applied := kubectl(t, bundle, "apply", "--server-side", "--force-conflicts", "-f", "-")
	require.Contains(t, string(applied), "deployment.apps/outbox-operator-controller-manager serverside-applied")
	d := &appsv1.Deployment{}
	require.NoError(t, adminClient(t).Get(context.Background(),
		client.ObjectKey{Namespace: "outbox-system", Name: "outbox-operator-controller-manager"}, d))
	c := d.Spec.Template.Spec.Containers[0]
	require.Equal(t, img, c.Image)
	relayImage := ""
	for _, e := range c.Env {
		if e.Name == "RELAY_IMAGE" {
			relayImage = e.Value
		}
	}
	require.Equal(t, img, relayImage)
}

// TestMonitoringKustomizations renders config/prometheus and config/grafana
// with kustomize and applies them, server-side with dry run, to an API server
// that has the Prometheus Operator's CRDs.
func TestMonitoringKustomizations(t *testing.T) {
	installMonitoringCRDs(t)
	ensureNamespace(t, "outbox-system")
	for dir, want := range map[string]string{
		"config/prometheus": "prometheusrule.monitoring.coreos.com/outbox-operator serverside-applied (server dry run)",
		"config/grafana":    "configmap/outbox-operator-dashboard serverside-applied (server dry run)",
	} {
		rendered := kubectl(t, nil, "kustomize", dir)
		out := kubectl(t, rendered, "apply", "--server-side", "--dry-run=server", "-f", "-")
		require.Contains(t, string(out), want, dir)
	}
}

// TestInstallerNeedsAnImage: `make installer` has no default image (a
// release's would run an older operator than this tree's CRD); without IMG
// it fails, saying so, and writes nothing.
func TestInstallerNeedsAnImage(t *testing.T) {
	t.Parallel()
	dist := t.TempDir()
	cmd := exec.Command("make", "-s", "--no-print-directory", "installer", "DIST="+dist)
	cmd.Dir = testenv.RepoRoot()
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IMG=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "%s", out)
	require.Contains(t, string(out), "make installer IMG=")
	require.NoFileExists(t, filepath.Join(dist, "install.yaml"))
}
