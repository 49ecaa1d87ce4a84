package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/testenv"
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
			require.Equal(t, []string{"get"}, rule.Verbs, "get only on Secrets: no list or watch")
		}
	}

	kubectl(t, nil, "apply", "-f", "config/samples")
	relay := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: "default", Name: "orders"}, relay))
	require.Len(t, relay.Spec.Topics, 2)
	out := kubectl(t, nil, "get", "obr", "orders", "-n", "default")
	// The Ready condition's status shows by default: READY counts pods, and
	// a relay whose pods are ready may itself not be.
	require.Equal(t, []string{"NAME", "READY", "BACKLOG", "LAG", "STATUS", "AGE"}, strings.Fields(strings.SplitN(string(out), "\n", 2)[0]))
	out = kubectl(t, nil, "get", "obr", "orders", "-n", "default", "-o", "wide")
	require.Equal(t, []string{"NAME", "READY", "BACKLOG", "LAG", "LAGGING", "DESIRED", "TABLE", "TOPICS", "STATUS", "REASON", "AGE"},
		strings.Fields(strings.SplitN(string(out), "\n", 2)[0]))
	require.Contains(t, string(out), "outbox")
}

// TestNamespacedOverlayIsEnough renders config/namespaced, applies it, and
// runs the manager as that overlay's service account (impersonated): with
// nothing but the overlay's Roles in one namespace it reconciles an
// OutboxRelay there and fills its digest key, and it cannot read a Secret
// anywhere else. Its one
// cluster-wide grant is the metrics authentication (it may create
// TokenReviews and SubjectAccessReviews, so --metrics-secure can check who
// scrapes); the metrics-reader and aggregated roles are there, as in
// config/default.
func TestNamespacedOverlayIsEnough(t *testing.T) {
	const ns, sa = "outbox-relays", "outbox-operator-controller-manager"
	ctx := context.Background()
	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, outboxv1alpha1.AddToScheme(scheme))
	admin, err := client.New(testenv.Kube().Config, client.Options{Scheme: scheme})
	require.NoError(t, err)
	require.NoError(t, admin.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))

	rendered := kubectl(t, nil, "kustomize", "config/namespaced")
	require.NotContains(t, string(rendered), "kind: Namespace\n", "the overlay leaves the namespace alone")
	kubectl(t, rendered, "apply", "--server-side", "--force-conflicts", "-f", "-")
	crbs := &rbacv1.ClusterRoleBindingList{}
	require.NoError(t, admin.List(ctx, crbs))
	var clusterWide []string
	for _, b := range crbs.Items {
		for _, s := range b.Subjects {
			if s.Kind == rbacv1.ServiceAccountKind && s.Namespace == ns && s.Name == sa {
				clusterWide = append(clusterWide, b.Name+" -> "+b.RoleRef.Name)
			}
		}
	}
	require.Equal(t, []string{"outbox-operator-metrics-auth-rolebinding -> outbox-operator-metrics-auth-role"}, clusterWide,
		"the manager's one cluster-wide grant is the metrics authentication")
	for name, aggregate := range map[string]string{
		"outbox-operator-metrics-auth-role":  "",
		"outbox-operator-metrics-reader":     "",
		"outbox-operator-outboxrelay-editor": "rbac.authorization.k8s.io/aggregate-to-edit",
		"outbox-operator-outboxrelay-viewer": "rbac.authorization.k8s.io/aggregate-to-view",
	} {
		role := &rbacv1.ClusterRole{}
		require.NoError(t, admin.Get(ctx, client.ObjectKey{Name: name}, role), name)
		if aggregate != "" {
			require.Equal(t, "true", role.Labels[aggregate], "%s: %s", name, aggregate)
		}
	}
	d := &appsv1.Deployment{}
	require.NoError(t, admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: sa}, d))
	watch, digestKey := "", ""
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		switch e.Name {
		case "WATCH_NAMESPACE":
			watch = e.Value
		case "DIGEST_KEY_SECRET":
			digestKey = e.Value
		}
	}
	require.Equal(t, ns, watch)
	require.Equal(t, "outbox-operator-digest-key", digestKey, "the overlay names its digest key's Secret")
	binding := &rbacv1.RoleBinding{}
	require.NoError(t, admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "outbox-operator-manager-rolebinding"}, binding))
	require.Equal(t, "Role", binding.RoleRef.Kind)

	asSA := rest.CopyConfig(testenv.Kube().Config)
	asSA.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + ns + ":" + sa}
	saClient, err := client.New(asSA, client.Options{Scheme: scheme})
	require.NoError(t, err)
	err = saClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: "any"}, &corev1.Secret{})
	require.True(t, apierrors.IsForbidden(err), "a Secret outside the namespace: want Forbidden, got %v", err)
	// What --metrics-secure asks of the API server for every scrape.
	require.NoError(t, saClient.Create(ctx, &authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: "a-scraper-token"}}),
		"the manager checks a scraper's token")
	require.NoError(t, saClient.Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User: "system:serviceaccount:monitoring:prometheus", NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"},
	}}), "the manager checks a scraper's permission")

	cfg, err := parseConfig([]string{"--metrics-bind-address=0", "--health-probe-bind-address=0",
		"--leader-elect", "--leader-election-namespace=" + ns, "--relay-image=reg/relay:test"},
		env(map[string]string{"WATCH_NAMESPACE": watch, "DIGEST_KEY_SECRET": digestKey, "POD_NAMESPACE": ns}))
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- run(runCtx, cfg, asSA, func(o *ctrl.Options) {
			o.Controller.SkipNameValidation = ptr.To(true) // TestManagerRuns has run one in this process
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("the manager did not stop within 30s")
		}
	})

	createOrdersRelay(ctx, t, admin, ns)
	require.Eventually(t, func() bool {
		return admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders-relay"}, &appsv1.Deployment{}) == nil
	}, 60*time.Second, 100*time.Millisecond, "the manager, with the overlay's Role only, creates the relay Deployment")
	key := &corev1.Secret{}
	require.NoError(t, admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: digestKey}, key))
	require.Len(t, key.Data["key"], 32, "and fills its digest key's Secret")
	require.Eventually(t, func() bool {
		relay := &outboxv1alpha1.OutboxRelay{}
		if admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders"}, relay) != nil {
			return false
		}
		for _, c := range relay.Status.Conditions {
			if c.Type == outboxv1alpha1.ConditionReady {
				return strings.Contains(c.Reason, outboxv1alpha1.ReasonDeploymentUnavailable)
			}
		}
		return false
	}, 30*time.Second, 100*time.Millisecond, "and writes its status")
}
