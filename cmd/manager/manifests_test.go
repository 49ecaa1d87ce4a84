package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/internal/testenv"
)

// kubectl runs the kubectl built with the API server against it.
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

// TestDeployManifestsApply renders config/default with kustomize and applies
// it, then the samples, with kubectl to the real API server, as a user would.
func TestDeployManifestsApply(t *testing.T) {
	rendered := kubectl(t, nil, "kustomize", "config/default")
	kubectl(t, rendered, "apply", "--server-side", "--force-conflicts", "-f", "-")

	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, outboxv1alpha1.AddToScheme(scheme))
	c, err := client.New(testenv.Kube().Config, client.Options{Scheme: scheme})
	require.NoError(t, err)
	ctx := context.Background()

	d := &appsv1.Deployment{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: "outbox-system", Name: "outbox-operator-controller-manager"}, d))
	require.Equal(t, "outbox-operator-controller-manager", d.Spec.Template.Spec.ServiceAccountName)
	require.Equal(t, []string{"/manager"}, d.Spec.Template.Spec.Containers[0].Command)

	crb := &rbacv1.ClusterRoleBinding{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Name: "outbox-operator-manager-rolebinding"}, crb))
	require.Equal(t, "outbox-operator-manager-role", crb.RoleRef.Name)
	require.Equal(t, "outbox-system", crb.Subjects[0].Namespace)
	role := &rbacv1.ClusterRole{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Name: crb.RoleRef.Name}, role))
	for _, rule := range role.Rules {
		if len(rule.Resources) == 1 && rule.Resources[0] == "secrets" {
			require.ElementsMatch(t, []string{"get", "list", "watch"}, rule.Verbs, "read-only on Secrets")
		}
	}

	kubectl(t, nil, "apply", "-f", "config/samples")
	relay := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: "default", Name: "orders"}, relay))
	require.Len(t, relay.Spec.Topics, 2)
	out := kubectl(t, nil, "get", "obr", "orders", "-n", "default")
	for _, col := range []string{"READY", "TABLE", "TOPICS", "STATUS", "REASON", "AGE", "outbox"} {
		require.Contains(t, string(out), col)
	}
}
