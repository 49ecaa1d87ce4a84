package controllers

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

const (
	testImage = "example.test/outbox-relay:test"
	// allowedPrefix is the test manager's --allowed-relay-images.
	allowedPrefix = "registry.test/relays/"
	// testSecretRefresh is the test manager's --secret-refresh-interval.
	testSecretRefresh = 2 * time.Second
	// eventually bounds every wait on the controller.
	eventually = 20 * time.Second
	tick       = 50 * time.Millisecond
)

func TestMain(m *testing.M) {
	needs := testenv.NeedKube | testenv.NeedPostgres
	// A fuzzing worker process runs only FuzzSpecRoundTrip, which needs no
	// API server; one per worker would cost seconds each and outlive a
	// fuzzer that is stopped.
	flag.Parse()
	if f := flag.Lookup("test.fuzzworker"); f != nil && f.Value.String() == "true" {
		needs = 0
	}
	code := testenv.Run(m, needs)
	if code == 0 && *writeArgoTestdata {
		if err := saveArgoTestdata(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

func newScheme(t testing.TB) *runtime.Scheme {
	s := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(s))
	require.NoError(t, outboxv1alpha1.AddToScheme(s))
	return s
}

// adminClient reaches the API server directly (no cache), as kubectl does.
func adminClient(t testing.TB) client.Client {
	c, err := client.New(testenv.Kube().Config, client.Options{Scheme: newScheme(t)})
	require.NoError(t, err)
	return c
}

var nsCounter atomic.Int64

// newNamespace gives a test its own namespace. There is no namespace
// controller in envtest, so namespaces are left behind; names never repeat.
func newNamespace(t testing.TB, c client.Client) string {
	name := fmt.Sprintf("t%d-%d", time.Now().UnixNano()%1_000_000, nsCounter.Add(1))
	require.NoError(t, c.Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}))
	return name
}

// startManager runs the reconciler in a manager, as cmd/manager does, until
// the test ends. It returns the reconciler, so tests can drive extra passes,
// and the manager, whose cache tests look into. Images under allowedPrefix
// pass the image allow-list. Its digest key is kept in a Secret of a
// namespace of its own, as an install keeps it.
func startManager(t *testing.T) (*OutboxRelayReconciler, ctrl.Manager) {
	r, mgr, _ := runManager(t, testManager{digestKey: newDigestKeySecret(t)})
	return r, mgr
}

// testManager is what the managers of tests differ in.
type testManager struct {
	// namespaces the manager watches; none: every namespace.
	namespaces []string
	// digestKey is the reconciler's DigestKeySecret.
	digestKey types.NamespacedName
	// podMonitorLabels are the reconciler's PodMonitorLabels.
	podMonitorLabels map[string]string
}

// runManager runs a manager as startManager does, until stop (which waits
// for it to end, and may be called again) or the test ends.
func runManager(t *testing.T, tm testManager) (r *OutboxRelayReconciler, mgr ctrl.Manager, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	opts := ctrl.Options{
		Scheme:                 newScheme(t),
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		// -count=N runs TestController again in the same process.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	}
	for _, ns := range tm.namespaces {
		if opts.Cache.DefaultNamespaces == nil {
			opts.Cache.DefaultNamespaces = map[string]cache.Config{}
		}
		opts.Cache.DefaultNamespaces[ns] = cache.Config{}
	}
	mgr, err := ctrl.NewManager(testenv.Kube().Config, ManagerOptions(opts))
	require.NoError(t, err)
	metrics, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	r = &OutboxRelayReconciler{
		Client:           mgr.GetClient(),
		Recorder:         mgr.GetEventRecorder("outbox-operator"),
		RelayImage:       testImage,
		AllowedImages:    []string{allowedPrefix},
		PodMonitorLabels: tm.podMonitorLabels,
		Flow:             newTestFlowObserver(),
		Metrics:          metrics,
		// testDatabaseTokenAuth logs in with the operator's (fake) identity.
		DatabaseTokenLogins: true,
		// Secrets are read again this often: how soon a rotation rolls the pods.
		SecretRefreshInterval: testSecretRefresh,
		DigestKeySecret:       tm.digestKey,
	}
	require.NoError(t, r.SetupWithManager(ctx, mgr))
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
		})
	}
	t.Cleanup(stop)
	require.True(t, mgr.GetCache().WaitForCacheSync(ctx), "manager cache sync")
	return r, mgr, stop
}

// newDigestKeySecret creates the empty Secret an install creates for the
// operator's digest key, in a namespace of its own.
func newDigestKeySecret(t *testing.T) types.NamespacedName {
	c := adminClient(t)
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: newNamespace(t, c), Name: "digest-key"}}
	require.NoError(t, c.Create(context.Background(), s))
	return client.ObjectKeyFromObject(s)
}

// readSamples decodes every manifest under config/samples, moved into ns.
func readSamples(t testing.TB, ns string) []*unstructured.Unstructured {
	dir := filepath.Join(testenv.RepoRoot(), "config", "samples")
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	require.NoError(t, err)
	var objs []*unstructured.Unstructured
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(string(b)), 4096)
		for {
			u := &unstructured.Unstructured{}
			if err := dec.Decode(&u.Object); err != nil {
				require.ErrorContains(t, err, "EOF", f)
				break
			}
			if len(u.Object) == 0 {
				continue
			}
			require.Equal(t, "default", u.GetNamespace(), "%s: samples live in namespace default", f)
			u.SetNamespace(ns)
			objs = append(objs, u)
		}
	}
	require.NotEmpty(t, objs)
	return objs
}

// minimalRelay is a valid OutboxRelay with few fields set, and its Secret.
func minimalRelay(ns, name string) (*outboxv1alpha1.OutboxRelay, *corev1.Secret) {
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-dsn"},
		StringData: map[string]string{"dsn": "postgres://relay@db/" + name},
	}
	relay := &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: secret.Name},
			Topics:       map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders.confirmed"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"127.0.0.1:9092"}},
		},
	}
	return relay, secret
}

func key(o client.Object) client.ObjectKey { return client.ObjectKeyFromObject(o) }

func childKey(relay *outboxv1alpha1.OutboxRelay) client.ObjectKey {
	return client.ObjectKey{Namespace: relay.Namespace, Name: childName(relay)}
}

// waitDeployment waits until the relay's Deployment satisfies ok, and returns it.
func waitDeployment(t *testing.T, c client.Client, relay *outboxv1alpha1.OutboxRelay, ok func(*appsv1.Deployment) bool) *appsv1.Deployment {
	t.Helper()
	d := &appsv1.Deployment{}
	require.Eventually(t, func() bool {
		return c.Get(context.Background(), childKey(relay), d) == nil && ok(d)
	}, eventually, tick, "Deployment %s never reached the expected state", childKey(relay))
	return d
}

// waitRelay waits until the OutboxRelay satisfies ok, and returns it.
func waitRelay(t *testing.T, c client.Client, k client.ObjectKey, ok func(*outboxv1alpha1.OutboxRelay) bool) *outboxv1alpha1.OutboxRelay {
	t.Helper()
	relay := &outboxv1alpha1.OutboxRelay{}
	require.Eventually(t, func() bool {
		return c.Get(context.Background(), k, relay) == nil && ok(relay)
	}, eventually, tick, "OutboxRelay %s never reached the expected state", k)
	return relay
}

// readyReason is the Ready condition's reason once it describes the current generation.
func readyReason(relay *outboxv1alpha1.OutboxRelay) string {
	for _, c := range relay.Status.Conditions {
		if c.Type == outboxv1alpha1.ConditionReady && c.ObservedGeneration == relay.Generation {
			return c.Reason
		}
	}
	return ""
}

// setDeploymentStatus does what the Deployment controller and kubelets would:
// report every replica of the current template updated, available and ready.
func setDeploymentStatus(t *testing.T, c client.Client, k client.ObjectKey, ready int32) {
	t.Helper()
	require.Eventually(t, func() bool {
		d := &appsv1.Deployment{}
		if err := c.Get(context.Background(), k, d); err != nil {
			return false
		}
		want := *d.Spec.Replicas
		d.Status = appsv1.DeploymentStatus{
			ObservedGeneration: d.Generation,
			Replicas:           want,
			UpdatedReplicas:    want,
			ReadyReplicas:      ready,
			AvailableReplicas:  ready,
		}
		if ready < want {
			d.Status.UnavailableReplicas = want - ready
		}
		return c.Status().Update(context.Background(), d) == nil // retry on conflict
	}, eventually, tick)
}
