package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/test/testenv"
	"github.com/outbox-relay/outbox-operator/version"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m, testenv.NeedKube)) }

func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

func TestParseConfig(t *testing.T) {
	t.Parallel()
	cfg, err := parseConfig(nil, env(nil))
	require.NoError(t, err)
	require.Equal(t, ":8443", cfg.metricsAddr)
	require.True(t, cfg.metricsSecure, "HTTPS with authentication and authorization by default")
	require.True(t, metricsOptions(cfg).SecureServing)
	require.NotNil(t, metricsOptions(cfg).FilterProvider)
	require.Equal(t, ":8081", cfg.probeAddr)
	require.False(t, cfg.leaderElect)
	require.Equal(t, "ghcr.io/outbox-relay/outbox-operator:"+version.Version, cfg.relayImage)
	require.Empty(t, cfg.namespaces)
	require.Nil(t, managerOptions(cfg, runtime.NewScheme()).Cache.DefaultNamespaces, "all namespaces")

	cfg, err = parseConfig(nil, env(map[string]string{"RELAY_IMAGE": "reg/relay:env", "WATCH_NAMESPACE": "a, b,"}))
	require.NoError(t, err)
	require.Equal(t, "reg/relay:env", cfg.relayImage)
	require.Equal(t, []string{"a", "b"}, cfg.namespaces)
	require.Len(t, managerOptions(cfg, runtime.NewScheme()).Cache.DefaultNamespaces, 2)

	cfg, err = parseConfig([]string{"--relay-image=reg/relay:flag", "--leader-elect", "--metrics-bind-address=0"},
		env(map[string]string{"RELAY_IMAGE": "reg/relay:env"}))
	require.NoError(t, err)
	require.Equal(t, "reg/relay:flag", cfg.relayImage, "the flag wins over the environment")
	opts := managerOptions(cfg, runtime.NewScheme())
	require.True(t, opts.LeaderElection)
	require.Equal(t, "outbox-operator.outbox.dev", opts.LeaderElectionID)
	cfg, err = parseConfig([]string{"--leader-elect", "--leader-election-id=payments.outbox-operator"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, "payments.outbox-operator", managerOptions(cfg, runtime.NewScheme()).LeaderElectionID)
	_, err = parseConfig([]string{"--leader-election-id=Payments"}, env(nil))
	require.ErrorContains(t, err, `--leader-election-id: "Payments" is not a Lease name`)
	require.Equal(t, "0", opts.Metrics.BindAddress)

	cfg, err = parseConfig([]string{"--allowed-relay-images= registry.example/relays/ ,,ghcr.io/acme/relay@"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, []string{"registry.example/relays/", "ghcr.io/acme/relay@"}, cfg.allowedImages)
	cfg, err = parseConfig(nil, env(nil))
	require.NoError(t, err)
	require.Empty(t, cfg.allowedImages, "no allow-list by default: the relay image's repository only")
	require.Equal(t, controllers.DefaultSecretRefreshInterval, cfg.secretRefresh)
	_, err = parseConfig([]string{"--secret-refresh-interval=100ms"}, env(nil))
	require.ErrorContains(t, err, "--secret-refresh-interval: 100ms is outside 1s..24h")
	require.Equal(t, controllers.DefaultConnsPerDatabase, cfg.connsPerDatabase)
	require.False(t, cfg.databaseTokenLogins, "the operator's own cloud identity logs in nowhere by default")
	cfg, err = parseConfig([]string{"--database-token-logins"}, env(nil))
	require.NoError(t, err)
	require.True(t, cfg.databaseTokenLogins)
	_, err = parseConfig([]string{"--backlog-connections-per-database=0"}, env(nil))
	require.ErrorContains(t, err, "--backlog-connections-per-database: 0 is outside 1..100")

	// The labels of the relays' PodMonitors: valid labels, none of the
	// operator's own.
	cfg, err = parseConfig([]string{"--relay-podmonitor-labels= release=prometheus,, team=payments "}, env(nil))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"release": "prometheus", "team": "payments"}, cfg.podMonitorLabels)
	for bad, want := range map[string]string{
		"release":                         `"release" is not KEY=VALUE`,
		"bad key=x":                       `"bad key=x": the key is not a label key`,
		"release=not valid":               `"release=not valid": the value is not a label value`,
		"app.kubernetes.io/managed-by=me": `"app.kubernetes.io/managed-by=me": app.kubernetes.io/managed-by is a label the operator sets`,
	} {
		_, err = parseConfig([]string{"--relay-podmonitor-labels=" + bad}, env(nil))
		require.ErrorContains(t, err, "--relay-podmonitor-labels: "+want, bad)
	}

	// The digest key's Secret: by name in the pod's namespace, as the
	// installs set it, or namespace/name; none by default.
	require.Zero(t, cfg.digestKeySecret)
	cfg, err = parseConfig(nil, env(map[string]string{"DIGEST_KEY_SECRET": "outbox-operator-digest-key", "POD_NAMESPACE": "outbox-system"}))
	require.NoError(t, err)
	require.Equal(t, types.NamespacedName{Namespace: "outbox-system", Name: "outbox-operator-digest-key"}, cfg.digestKeySecret)
	cfg, err = parseConfig([]string{"--digest-key-secret=ops/key"}, env(map[string]string{"DIGEST_KEY_SECRET": "x", "POD_NAMESPACE": "outbox-system"}))
	require.NoError(t, err)
	require.Equal(t, types.NamespacedName{Namespace: "ops", Name: "key"}, cfg.digestKeySecret, "the flag wins")
	for _, bad := range []string{"key", "/key", "ops/", "a/b/c"} {
		_, err = parseConfig([]string{"--digest-key-secret=" + bad}, env(nil))
		require.ErrorContains(t, err, "--digest-key-secret: ", bad)
	}

	// Secrets: never read through a cache, so no informer can hold them.
	opts = managerOptions(cfg, runtime.NewScheme())
	require.Len(t, opts.Client.Cache.DisableFor, 1)
	require.IsType(t, &corev1.Secret{}, opts.Client.Cache.DisableFor[0])
	// The children's informers hold only what the operator made.
	require.Len(t, opts.Cache.ByObject, 3)
	for o, by := range opts.Cache.ByObject {
		require.NotEqual(t, "Secret", reflect.TypeOf(o).Elem().Name(), "no Secret informer to configure")
		require.Equal(t, "app.kubernetes.io/managed-by=outbox-operator", by.Label.String(), "%T", o)
	}

	_, err = parseConfig([]string{"--relay-image="}, env(nil))
	require.ErrorContains(t, err, "relay-image")
	_, err = parseConfig([]string{"stray"}, env(nil))
	require.ErrorContains(t, err, "unexpected arguments")
	_, err = parseConfig([]string{"--no-such-flag"}, env(nil))
	require.Error(t, err)
}

func get(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestManagerRuns starts the manager as main does (leader election, one
// watched namespace, probes, metrics) against the real API server.
func TestManagerRuns(t *testing.T) {
	ctx := context.Background()
	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, outboxv1alpha1.AddToScheme(scheme))
	c, err := client.New(testenv.Kube().Config, client.Options{Scheme: scheme})
	require.NoError(t, err)
	watched, ignored := "watched", "ignored"
	for _, ns := range []string{watched, ignored} {
		require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	}

	metricsPort, err := testenv.FreePort()
	require.NoError(t, err)
	probePort, err := testenv.FreePort()
	require.NoError(t, err)
	certDir := t.TempDir() // as a cert-manager Secret mounted there holds it
	caPEM, err := testenv.WriteTLSPair(certDir, []net.IP{net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	cfg, err := parseConfig([]string{
		fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", metricsPort),
		"--metrics-cert-dir=" + certDir,
		fmt.Sprintf("--health-probe-bind-address=127.0.0.1:%d", probePort),
		"--leader-elect", "--leader-election-namespace=default",
		"--relay-image=reg/relay:test",
		"--allowed-relay-images=reg/relays/",
	}, env(map[string]string{"WATCH_NAMESPACE": watched}))
	require.NoError(t, err)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(runCtx, cfg, testenv.Kube().Config) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("the manager did not stop within 30s")
		}
	})

	probes := fmt.Sprintf("http://127.0.0.1:%d", probePort)
	require.Eventually(t, func() bool { code, _ := get(probes + "/healthz"); return code == http.StatusOK }, 30*time.Second, 100*time.Millisecond)
	require.Eventually(t, func() bool { code, _ := get(probes + "/readyz"); return code == http.StatusOK }, 30*time.Second, 100*time.Millisecond)

	lease := &coordinationv1.Lease{}
	require.Eventually(t, func() bool {
		return c.Get(ctx, client.ObjectKey{Namespace: "default", Name: "outbox-operator.outbox.dev"}, lease) == nil &&
			lease.Spec.HolderIdentity != nil
	}, 30*time.Second, 100*time.Millisecond, "the manager takes the leader-election Lease")

	// A relay in an unwatched namespace is created first and must stay untouched.
	for _, ns := range []string{ignored, watched} {
		createOrdersRelay(ctx, t, c, ns)
	}
	d := &appsv1.Deployment{}
	require.Eventually(t, func() bool {
		return c.Get(ctx, client.ObjectKey{Namespace: watched, Name: "orders-relay"}, d) == nil
	}, 30*time.Second, 100*time.Millisecond)
	require.Equal(t, "reg/relay:test", d.Spec.Template.Spec.Containers[0].Image)
	require.Eventually(t, func() bool {
		relay := &outboxv1alpha1.OutboxRelay{}
		return c.Get(ctx, client.ObjectKey{Namespace: watched, Name: "orders"}, relay) == nil && relay.Status.ObservedGeneration > 0
	}, 30*time.Second, 100*time.Millisecond)

	ignoredRelay := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: ignored, Name: "orders"}, ignoredRelay))
	require.Zero(t, ignoredRelay.Status.ObservedGeneration, "a relay outside WATCH_NAMESPACE is not reconciled")
	err = c.Get(ctx, client.ObjectKey{Namespace: ignored, Name: "orders-relay"}, &appsv1.Deployment{})
	require.True(t, client.IgnoreNotFound(err) == nil && err != nil, "no Deployment outside WATCH_NAMESPACE")

	// /metrics is HTTPS, for clients the API server authenticates and
	// authorizes: nobody without a token, a service account only with the
	// metrics-reader rule.
	metricsURL := fmt.Sprintf("https://127.0.0.1:%d/metrics", metricsPort)
	code, _ := getTLS(metricsURL, "")
	require.Equal(t, http.StatusUnauthorized, code, "no token")
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(caPEM))
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	resp, err := hc.Get(metricsURL)
	require.NoError(t, err, "/metrics serves the certificate of --metrics-cert-dir, which a client verifies")
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	stranger := serviceAccountToken(ctx, t, c, "default", "stranger")
	code, _ = getTLS(metricsURL, stranger)
	require.Equal(t, http.StatusForbidden, code, "a service account without the metrics-reader rule")
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "test-metrics-reader"},
		Rules: []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}}}
	require.NoError(t, c.Create(ctx, role))
	require.NoError(t, c.Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "test-metrics-reader"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "default", Name: "scraper"}}}))
	reader := serviceAccountToken(ctx, t, c, "default", "scraper") // asked only now: the filter caches denials for 30 s
	var body string
	require.Eventually(t, func() bool { code, body = getTLS(metricsURL, reader); return code == http.StatusOK }, 30*time.Second, 200*time.Millisecond,
		"the reader may scrape: %d %s", code, body)
	require.Contains(t, body, `controller_runtime_reconcile_total{controller="outboxrelay"`)
}

// getTLS GETs url over TLS (the manager's certificate is self-signed) with
// token as the bearer token when it is not empty.
func getTLS(url, token string) (int, string) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0, err.Error()
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // the test trusts the self-signed certificate
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// serviceAccountToken creates service account ns/name and returns a token
// of it from the TokenRequest API.
func serviceAccountToken(ctx context.Context, t *testing.T, c client.Client, ns, name string) string {
	t.Helper()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	require.NoError(t, c.Create(ctx, sa))
	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}
	require.NoError(t, c.SubResource("token").Create(ctx, sa, tr))
	require.NotEmpty(t, tr.Status.Token)
	return tr.Status.Token
}

// createOrdersRelay creates a DSN Secret and an OutboxRelay "orders" using it in ns.
func createOrdersRelay(ctx context.Context, t *testing.T, c client.Client, ns string) {
	t.Helper()
	require.NoError(t, c.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "dsn"},
		StringData: map[string]string{"dsn": "postgres://x"},
	}))
	require.NoError(t, c.Create(ctx, &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "orders"},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: "dsn"},
			Topics:       map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders.confirmed"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"127.0.0.1:9092"}},
		},
	}))
}
