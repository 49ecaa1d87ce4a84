package install

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/ops/opstest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// TestChartRunsTheManager installs the chart for one watched namespace and
// runs the manager binary with the arguments and environment of the chart's
// Deployment, as the chart's service account (impersonated): with nothing
// but the chart's RBAC it takes the leader Lease, builds an OutboxRelay's
// relay Deployment and its PodMonitor, writes its status and fills its
// digest key.
func TestChartRunsTheManager(t *testing.T) {
	const ns, sa = "team-run", "run-outbox-operator"
	installMonitoringCRDs(t)
	ensureNamespace(t, releaseNamespace)
	ensureNamespace(t, ns)
	objs, manifest := mustRender(t, values(t, `{watchNamespaces: [team-run]}`))
	manifest = strings.ReplaceAll(manifest, "outbox-outbox-operator", sa) // its own names
	kubectl(t, []byte(manifest), "apply", "--server-side", "--force-conflicts", "-f", "-")

	// The manager's command line and environment, as the chart renders them.
	c := container(t, find(t, objs, "Deployment", ""))
	var args []string
	for _, a := range c["args"].([]any) {
		args = append(args, a.(string))
	}
	args = append(args, "--metrics-bind-address=0", "--leader-election-namespace="+releaseNamespace) // out of cluster
	environ := os.Environ()
	for name, value := range env(t, c) {
		environ = append(environ, name+"="+strings.ReplaceAll(value, "outbox-outbox-operator", sa))
	}
	environ = append(environ, "POD_NAMESPACE="+releaseNamespace) // what the downward API gives it in the cluster

	dir := t.TempDir()
	kc, err := clientcmd.Load(testenv.Kube().Env.KubeConfig)
	require.NoError(t, err)
	for _, user := range kc.AuthInfos {
		user.Impersonate = "system:serviceaccount:" + releaseNamespace + ":" + sa
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	require.NoError(t, clientcmd.WriteToFile(*kc, kubeconfig))
	bins, err := devproc.Build(filepath.Join(dir, "bin"), "./cmd/manager")
	require.NoError(t, err)
	p, err := devproc.Start(devproc.Options{
		Binary: bins[0], Args: args, Env: append(environ, "KUBECONFIG="+kubeconfig),
		AddrFlag: "--health-probe-bind-address", LogPath: filepath.Join(dir, "manager.log"),
	})
	require.NoError(t, err)
	opstest.Ready(t, p)
	admin := opstest.Admin(t)
	ctx := context.Background()
	require.NoError(t, admin.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "dsn"}, StringData: map[string]string{"dsn": "postgres://relay@db/orders"},
	}))
	require.NoError(t, admin.Create(ctx, &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "orders"},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: "dsn"},
			Topics:       map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders.confirmed"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"kafka:9092"}},
			Monitoring:   &outboxv1alpha1.MonitoringSpec{PodMonitor: true},
		},
	}))

	const wait, tick = 60 * time.Second, 100 * time.Millisecond
	require.Eventually(t, func() bool {
		return admin.Get(ctx, client.ObjectKey{Namespace: releaseNamespace, Name: "outbox-operator.outbox.dev"}, &coordinationv1.Lease{}) == nil
	}, wait, tick, "the manager takes the leader Lease in the release namespace")
	require.Eventually(t, func() bool {
		return admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders-relay"}, &appsv1.Deployment{}) == nil
	}, wait, tick, "the manager builds the relay Deployment")
	pm := &unstructured.Unstructured{}
	pm.SetAPIVersion("monitoring.coreos.com/v1")
	pm.SetKind("PodMonitor")
	require.Eventually(t, func() bool {
		return admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders-relay"}, pm) == nil
	}, wait, tick, "and the PodMonitor")
	require.Eventually(t, func() bool {
		relay := &outboxv1alpha1.OutboxRelay{}
		if admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders"}, relay) != nil {
			return false
		}
		c := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionMonitoring)
		return c != nil && c.Status == metav1.ConditionTrue
	}, wait, tick, "and writes the status")
	key := &corev1.Secret{}
	require.NoError(t, admin.Get(ctx, client.ObjectKey{Namespace: releaseNamespace, Name: sa + "-digest-key"}, key))
	require.Len(t, key.Data["key"], 32, "and fills its digest key's Secret")
}
