package monitoring

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/ops/opstest"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// targetLabels are the labels Prometheus attaches to every series of a
// target (the operator's PodMonitor adds outboxrelay), not the process.
var targetLabels = []string{"job", "instance", "namespace", "pod", "container", "endpoint", "outboxrelay"}

// synthetic are the series Prometheus makes itself for each target.
var synthetic = []string{"up"}

// exposed maps each series name an endpoint serves (a histogram as its
// _bucket, _sum and _count) to its label names.
type exposed map[string]map[string]bool

// scrape reads a Prometheus endpoint into exposed.
func scrape(url string, into exposed) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return fmt.Errorf("parse %s: %w", url, err)
	}
	for name, mf := range families {
		names := []string{name}
		extra := []string(nil)
		switch mf.GetType() {
		case dto.MetricType_HISTOGRAM:
			names = []string{name + "_bucket", name + "_sum", name + "_count"}
			extra = []string{"le"}
		case dto.MetricType_SUMMARY:
			names = []string{name, name + "_sum", name + "_count"}
			extra = []string{"quantile"}
		}
		for _, n := range names {
			if into[n] == nil {
				into[n] = map[string]bool{}
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					into[n][l.GetName()] = true
				}
			}
			if n == name+"_bucket" || len(extra) > 0 && n == name {
				for _, l := range extra {
					into[n][l] = true
				}
			}
		}
	}
	return nil
}

// failOnce fails the relay's first publish as a broker timeout would, so the
// error counter has a series, then passes everything to Kafka.
type failOnce struct {
	w      *kafka.Writer
	failed atomic.Bool
}

func (f *failOnce) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	if f.failed.CompareAndSwap(false, true) {
		return errors.New("injected: request timed out")
	}
	return f.w.WriteMessages(ctx, msgs...)
}

// relayMetrics runs a relay in this process against a fresh outbox table
// until it has published some rows after one failed publish, and scrapes its
// metrics endpoint over HTTP.
func relayMetrics(t *testing.T, into exposed) {
	f := outboxtest.NewFixture(t, 1, "OrderConfirmed")
	f.Insert(20, 4, "OrderConfirmed")
	w := &kafka.Writer{Addr: kafka.TCP(testenv.Broker().Addr()), RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	t.Cleanup(func() { w.Close() })
	x, err := outboxtest.RunRelay(f.Config(), &failOnce{w: w})
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	require.NoError(t, x.WaitPublished(ctx, 20))
	srv := httptest.NewServer(promhttp.HandlerFor(x.Reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	// The backlog gauges are refreshed on their own schedule: wait for them.
	require.Eventually(t, func() bool {
		got := exposed{}
		return scrape(srv.URL, got) == nil && got["outbox_relay_backlog_rows"] != nil &&
			got["outbox_relay_oldest_unpublished_age_seconds"] != nil
	}, 30*time.Second, 200*time.Millisecond)
	require.NoError(t, scrape(srv.URL, into))
}

// managerMetrics runs the manager binary against the test API server with
// its metrics endpoint on, lets it reconcile an OutboxRelay, and scrapes the
// endpoint.
func managerMetrics(t *testing.T, into exposed) {
	dir := t.TempDir()
	bins, err := devproc.Build(filepath.Join(dir, "bin"), "./cmd/manager")
	require.NoError(t, err)
	kubeconfig := filepath.Join(dir, "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, testenv.Kube().Env.KubeConfig, 0o600))
	port, err := testenv.FreePort()
	require.NoError(t, err)
	metricsAddr := "127.0.0.1:" + strconv.Itoa(port)
	p, err := devproc.StartManager(bins[0], kubeconfig, filepath.Join(dir, "manager.log"), "--metrics-bind-address="+metricsAddr, "--metrics-secure=false")
	require.NoError(t, err)
	opstest.Ready(t, p)
	c := opstest.Admin(t)
	ctx := context.Background()
	require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}))
	require.NoError(t, c.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "dsn"},
		StringData: map[string]string{"dsn": "postgres://relay@db/orders"},
	}))
	require.NoError(t, c.Create(ctx, &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "orders"},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: "dsn"},
			Topics:       map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders.confirmed"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"kafka:9092"}},
		},
	}))
	// A logical-replication relay on a real table whose slot exists, and
	// no relay pod: the manager reads the slot itself.
	f := outboxtest.NewFixture(t, 1)
	var db string
	require.NoError(t, f.Pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db))
	slot := outbox.SlotName(db, outbox.Table{Name: "outbox"})
	_, err = f.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot) })
	require.NoError(t, c.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "payments-dsn"},
		StringData: map[string]string{"dsn": f.DSN},
	}))
	require.NoError(t, c.Create(ctx, &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "payments"},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: "payments-dsn"},
			Topics:       map[string]outboxv1alpha1.TopicName{"PaymentTaken": "payments.taken"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"kafka:9092"}},
			Capture:      &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication},
		},
	}))
	require.Eventually(t, func() bool {
		relay := &outboxv1alpha1.OutboxRelay{}
		return c.Get(ctx, client.ObjectKey{Namespace: "shop", Name: "orders"}, relay) == nil && relay.Status.ObservedGeneration > 0
	}, 60*time.Second, 100*time.Millisecond, "the manager reconciles the OutboxRelay")
	require.Eventually(t, func() bool {
		relay := &outboxv1alpha1.OutboxRelay{}
		return c.Get(ctx, client.ObjectKey{Namespace: "shop", Name: "payments"}, relay) == nil && relay.Status.Backlog != nil &&
			relay.Status.Backlog.Slot != nil && relay.Status.Backlog.Slot.RetainedWAL != nil
	}, 60*time.Second, 100*time.Millisecond, "the manager reads the slot")
	require.NoError(t, scrape("http://"+metricsAddr+"/metrics", into))
}

// TestNamedMetricsAreExposed: every metric the rules and the dashboard read
// is one a running relay or a running manager serves, with every label the
// expression matches on or groups by (besides the target's labels).
func TestNamedMetricsAreExposed(t *testing.T) {
	got := exposed{}
	relayMetrics(t, got)
	managerMetrics(t, got)
	for _, s := range synthetic {
		got[s] = map[string]bool{}
	}
	require.Contains(t, got, "outbox_relay_publish_errors_total")
	require.Contains(t, got, "controller_runtime_reconcile_total")

	for _, e := range append(ruleExpressions(t), dashboardExpressions(t)...) {
		sel, err := selectedMetrics(e.expr)
		require.NoError(t, err, e.where)
		for _, s := range sel {
			labels, ok := got[s.metric]
			require.True(t, ok, "%s reads %s, which neither the relay nor the manager exposes", e.where, s.metric)
			for l := range s.labels {
				require.True(t, labels[l] || slices.Contains(targetLabels, l),
					"%s uses label %q of %s, which has only %v", e.where, l, s.metric, slices.Sorted(maps.Keys(labels)))
			}
		}
	}
}
