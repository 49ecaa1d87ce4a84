package controllers

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// flowInterval is the backlog interval of these tests, the schema's minimum.
const flowInterval = 5 * time.Second

// TestFlow runs the reconciler against the real API server and a real
// PostgreSQL outbox table. envtest runs no pods: the tests insert rows,
// mark them published themselves, and set the Deployment's status.
func TestFlow(t *testing.T) {
	r, _ := startManager(t)
	c := adminClient(t)
	t.Run("BurstScalesUpAndBack", func(t *testing.T) { t.Parallel(); testBurstScalesUpAndBack(t, c) })
	t.Run("ScaleToZeroAndBack", func(t *testing.T) { t.Parallel(); testScaleToZeroAndBack(t, c) })
	t.Run("LaggingAndStalled", func(t *testing.T) { t.Parallel(); testLaggingAndStalled(t, c) })
	t.Run("HeldRows", func(t *testing.T) { t.Parallel(); testHeldRows(t, c) })
	t.Run("ObserverFollowsDSNAndDeletion", func(t *testing.T) { t.Parallel(); testObserverLifecycle(t, c, r) })
	t.Run("MissingTableIsReported", func(t *testing.T) { t.Parallel(); testMissingTable(t, c) })
	t.Run("DatabaseTLS", func(t *testing.T) { t.Parallel(); testDatabaseTLS(t, c) })
	t.Run("DatabaseTokenAuth", func(t *testing.T) { t.Parallel(); testDatabaseTokenAuth(t, c) })
	t.Run("ReplicationSlot", func(t *testing.T) { t.Parallel(); testReplicationSlot(t, c) })
	t.Run("BeforeTheFirstReading", func(t *testing.T) { t.Parallel(); testBeforeFirstReading(t, c) })
}

// outboxDB creates a database with an outbox table and returns its DSN and a pool.
func outboxDB(t *testing.T) (string, *pgxpool.Pool) { return outboxDBTB(t) }

func outboxDBTB(t testing.TB) (string, *pgxpool.Pool) {
	dsn := testenv.PG().NewDatabase(t)
	pool, err := pgxpool.New(context.Background(), dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = pool.Exec(context.Background(), outbox.SchemaDDL(outbox.Table{Name: "outbox"}))
	require.NoError(t, err)
	return dsn, pool
}

// insertRows inserts n rows of eventType created age ago.
func insertRows(t testing.TB, db *pgxpool.Pool, n int, eventType string, age time.Duration) {
	_, err := db.Exec(context.Background(), `INSERT INTO outbox
        (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
        SELECT gen_random_uuid(), 'Order', 'o' || i, $2, '{}'::jsonb, 'k' || i, now() - make_interval(secs => $3)
        FROM generate_series(1, $1) i`, n, eventType, age.Seconds())
	require.NoError(t, err)
}

// publishAll does what a relay would: mark every waiting row published.
func publishAll(t testing.TB, db *pgxpool.Pool) {
	_, err := db.Exec(context.Background(), `UPDATE outbox SET published_at = now() WHERE published_at IS NULL`)
	require.NoError(t, err)
}

// flowRelay is a relay over dsn's outbox table, read every flowInterval.
func flowRelay(ns, name, dsn string) (*outboxv1alpha1.OutboxRelay, *corev1.Secret) {
	relay, secret := minimalRelay(ns, name)
	secret.StringData["dsn"] = dsn
	relay.Spec.Backlog = &outboxv1alpha1.BacklogSpec{Interval: flowInterval.String()}
	return relay, secret
}

func condOf(o *outboxv1alpha1.OutboxRelay, typ string) metav1.Condition {
	if c := meta.FindStatusCondition(o.Status.Conditions, typ); c != nil {
		return *c
	}
	return metav1.Condition{}
}

func replicasOf(d *appsv1.Deployment) int32 { return ptr.Deref(d.Spec.Replicas, -1) }

// eventWith finds an event on the relay of the type and reason whose note contains text.
func eventWith(t *testing.T, c client.Client, relay *outboxv1alpha1.OutboxRelay, typ, reason, text string) bool {
	var evs eventsv1.EventList
	require.NoError(t, c.List(context.Background(), &evs, client.InNamespace(relay.Namespace)))
	return slices.ContainsFunc(evs.Items, func(e eventsv1.Event) bool {
		return e.Regarding.Name == relay.Name && e.Type == typ && e.Reason == reason && strings.Contains(e.Note, text)
	})
}

// kstatusOf is what kstatus (Flux, kubectl-style waits) makes of the relay.
func kstatusOf(t *testing.T, relay *outboxv1alpha1.OutboxRelay) status.Status {
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(relay)
	require.NoError(t, err)
	res, err := status.Compute(&unstructured.Unstructured{Object: obj})
	require.NoError(t, err)
	t.Logf("kstatus of %s: %s (%s)", relay.Name, res.Status, res.Message)
	return res.Status
}

// A burst of rows scales the Deployment up within two readings; once the
// rows are published it scales back down, but not before the stabilization window.
func testBurstScalesUpAndBack(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	dsn, db := outboxDB(t)
	relay, secret := flowRelay(ns, "burst", dsn)
	const window = 12 * time.Second
	relay.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{
		MinReplicas: ptr.To[int32](1), MaxReplicas: 5, PendingPerReplica: ptr.To[int64](100),
		ScaleDownStabilization: window.String(),
	}
	create(t, c, secret, relay)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog != nil && o.Status.Backlog.Pending == 0
	})
	require.Equal(t, "Progressing", mustHealth(t, o), "pods not ready yet")
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return replicasOf(d) == 1 })
	setDeploymentStatus(t, c, childKey(relay), 1)
	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Ready").Status == metav1.ConditionTrue && condOf(o, "Lagging").Status == metav1.ConditionFalse
	})
	requireHealth(t, o, "Healthy")

	insertRows(t, db, 350, "OrderConfirmed", 0)
	burst := time.Now()
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return replicasOf(d) == 4 })
	took := time.Since(burst)
	t.Logf("350 rows at 100 per replica: 1 → 4 replicas %s after the burst", took.Round(time.Millisecond))
	require.LessOrEqual(t, took, 2*flowInterval, "the Deployment scales up within two readings")
	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.DesiredReplicas == 4 && o.Status.Backlog.Pending == 350
	})
	require.False(t, o.Status.Backlog.Estimated)
	require.Equal(t, "Progressing", mustHealth(t, o), "scaling")
	require.Eventually(t, func() bool {
		return eventWith(t, c, relay, "Normal", outboxv1alpha1.ReasonScaledUp, "scaled 1 → 4: 350 rows waiting, oldest ")
	}, eventually, tick)
	setDeploymentStatus(t, c, childKey(relay), 4)

	publishAll(t, db)
	drained := time.Now()
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool { return o.Status.Backlog.Pending == 0 })
	if time.Since(drained) < window-flowInterval {
		d := &appsv1.Deployment{}
		require.NoError(t, c.Get(context.Background(), childKey(relay), d))
		require.Equal(t, int32(4), replicasOf(d), "no scale-down within the stabilization window")
	}
	waitDeploymentWithin(t, c, relay, window+3*flowInterval, func(d *appsv1.Deployment) bool { return replicasOf(d) == 1 })
	took = time.Since(drained)
	t.Logf("drained: 4 → 1 replicas %s after the rows were published (window %s)", took.Round(time.Millisecond), window)
	require.GreaterOrEqual(t, took, window-flowInterval, "the scale-down waited for the window")
	require.Eventually(t, func() bool {
		return eventWith(t, c, relay, "Normal", outboxv1alpha1.ReasonScaledDown, "scaled 4 → 1: 0 rows waiting")
	}, eventually, tick)
	require.NoError(t, c.Get(context.Background(), key(relay), o))
	require.Equal(t, int32(1), ptr.Deref(o.Spec.Replicas, 0), "the operator never writes the spec")
}

// With minReplicas 0 an idle relay runs no pods, and the first waiting row
// brings one back within one reading.
func testScaleToZeroAndBack(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	dsn, db := outboxDB(t)
	relay, secret := flowRelay(ns, "zero", dsn)
	relay.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{
		MinReplicas: ptr.To[int32](0), MaxReplicas: 3, PendingPerReplica: ptr.To[int64](1000),
		ScaleDownStabilization: "5s",
	}
	create(t, c, secret, relay)
	waitDeploymentWithin(t, c, relay, 4*flowInterval, func(d *appsv1.Deployment) bool { return replicasOf(d) == 0 })
	setDeploymentStatus(t, c, childKey(relay), 0)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Ready").Reason == outboxv1alpha1.ReasonScaledToZero && condOf(o, "Ready").Status == metav1.ConditionTrue &&
			condOf(o, "Reconciling").Status == metav1.ConditionFalse && condOf(o, "Lagging").Status == metav1.ConditionFalse
	})
	require.Equal(t, "autoscaled to zero: no row waits", condOf(o, "Ready").Message, "said only after a reading")
	require.Equal(t, int32(0), o.Status.DesiredReplicas)
	requireHealth(t, o, "Healthy")
	require.Equal(t, status.CurrentStatus, kstatusOf(t, o))

	insertRows(t, db, 1, "OrderConfirmed", 0)
	first := time.Now()
	waitDeploymentWithin(t, c, relay, flowInterval+3*time.Second, func(d *appsv1.Deployment) bool { return replicasOf(d) == 1 })
	t.Logf("scaled 0 → 1 %s after the first row", time.Since(first).Round(time.Millisecond))
	require.Eventually(t, func() bool {
		return eventWith(t, c, relay, "Normal", outboxv1alpha1.ReasonScaledUp, "scaled 0 → 1: 1 rows waiting")
	}, eventually, tick)

	publishAll(t, db)
	waitDeploymentWithin(t, c, relay, 5*time.Second+3*flowInterval, func(d *appsv1.Deployment) bool { return replicasOf(d) == 0 })
}

// Rows older than lagThreshold make the relay Lagging, with a Warning
// event, whatever its pods say: with no ready pod (NoReadyReplicas), and
// with ready pods that publish nothing (NotPublishing, a stalled relay).
// Ready turns False and Degraded True; kstatus still sees the spec carried
// out; Argo CD sees Degraded. Publishing the rows recovers, with a Normal event.
func testLaggingAndStalled(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	dsn, db := outboxDB(t)
	relay, secret := flowRelay(ns, "lagging", dsn)
	relay.Spec.LagThreshold = "3s"
	create(t, c, secret, relay)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonFlowing
	})
	insertRows(t, db, 20, "OrderConfirmed", 10*time.Minute)

	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonNoReadyReplicas
	})
	require.Equal(t, metav1.ConditionTrue, condOf(o, "Lagging").Status)
	require.Equal(t, int64(20), o.Status.Backlog.Pending)
	require.GreaterOrEqual(t, o.Status.Backlog.OldestAge.Duration, 10*time.Minute)
	require.Equal(t, "Degraded", mustHealth(t, o))
	require.Equal(t, status.InProgressStatus, kstatusOf(t, o), "pods not ready yet")

	// The pods say they are ready; nothing is published.
	setDeploymentStatus(t, c, childKey(relay), 1)
	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonNotPublishing
	})
	lag := condOf(o, "Lagging")
	for _, want := range []string{"threshold 3s", "20 rows waiting", "0 published in the last minute", "1 ready replicas"} {
		require.Contains(t, lag.Message, want)
	}
	require.Equal(t, metav1.ConditionFalse, condOf(o, "Ready").Status, "Ready does not claim all is well while Lagging")
	require.Equal(t, outboxv1alpha1.ReasonLagging, condOf(o, "Ready").Reason)
	require.Equal(t, "True/Lagging", string(condOf(o, "Degraded").Status)+"/"+condOf(o, "Degraded").Reason)
	require.Equal(t, "True/NotPublishing", string(condOf(o, "Stalled").Status)+"/"+condOf(o, "Stalled").Reason)
	require.Equal(t, status.FailedStatus, kstatusOf(t, o), "a relay that moves nothing needs a human")
	msg := requireHealth(t, o, "Degraded")
	require.Contains(t, msg, "NotPublishing")
	require.Eventually(t, func() bool {
		return eventWith(t, c, relay, "Warning", outboxv1alpha1.ReasonLagging, "rows waiting")
	}, eventually, tick)

	publishAll(t, db)
	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Status == metav1.ConditionFalse
	})
	require.Equal(t, "True/Available", string(condOf(o, "Ready").Status)+"/"+condOf(o, "Ready").Reason)
	require.Equal(t, metav1.ConditionFalse, condOf(o, "Degraded").Status)
	requireHealth(t, o, "Healthy")
	require.Equal(t, status.CurrentStatus, kstatusOf(t, o))
	require.Eventually(t, func() bool {
		return eventWith(t, c, relay, "Normal", outboxv1alpha1.ReasonCaughtUp, "0 rows waiting")
	}, eventually, tick)
	// PostgreSQL's statistics reach other sessions within seconds.
	o = waitRelayWithin(t, c, key(relay), 3*flowInterval, func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog.PublishedPerMinute != nil && *o.Status.Backlog.PublishedPerMinute > 0
	})
	t.Logf("after marking 20 rows: publishedPerMinute %d", *o.Status.Backlog.PublishedPerMinute)
}

// Rows of an unmapped type and rows with a NULL column are held, not
// pending: they neither scale the relay nor make it Lagging.
func testHeldRows(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	dsn, db := outboxDB(t)
	_, err := db.Exec(context.Background(), `ALTER TABLE outbox ALTER COLUMN partition_key DROP NOT NULL`)
	require.NoError(t, err)
	insertRows(t, db, 3, "OrderShipped", time.Hour)
	insertRows(t, db, 2, "OrderConfirmed", time.Hour)
	_, err = db.Exec(context.Background(), `UPDATE outbox SET partition_key = NULL WHERE event_type = 'OrderConfirmed'`)
	require.NoError(t, err)
	insertRows(t, db, 4, "OrderConfirmed", 0)
	relay, secret := flowRelay(ns, "held", dsn)
	relay.Spec.LagThreshold = "1m"
	relay.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](0), MaxReplicas: 5, PendingPerReplica: ptr.To[int64](1)}
	create(t, c, secret, relay)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool { return o.Status.Backlog != nil })
	require.Equal(t, int64(4), o.Status.Backlog.Pending)
	require.Equal(t, outboxv1alpha1.HeldRows{Unroutable: 3, Invalid: 2}, o.Status.Backlog.Held)
	require.Less(t, o.Status.Backlog.OldestAge.Duration, time.Minute, "held rows do not age the backlog")
	require.Equal(t, outboxv1alpha1.ReasonFlowing, condOf(o, "Lagging").Reason)
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return replicasOf(d) == 4 })
}

// The observer reconnects when the DSN changes, closes its connection, and
// the relay's metrics go, when the OutboxRelay is deleted.
func testObserverLifecycle(t *testing.T, c client.Client, r *OutboxRelayReconciler) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	dsn, db := outboxDB(t)
	dsn2, db2 := outboxDB(t)
	insertRows(t, db, 7, "OrderConfirmed", 0)
	insertRows(t, db2, 9, "OrderConfirmed", 0)
	relay, secret := flowRelay(ns, "lifecycle", dsn)
	create(t, c, secret, relay)
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog != nil && o.Status.Backlog.Pending == 7
	})
	operatorSessions := func(db *pgxpool.Pool) int {
		var n int
		require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
            WHERE application_name = 'outbox-operator' AND datname = current_database()`).Scan(&n))
		return n
	}
	require.Equal(t, 1, operatorSessions(db), "one connection per OutboxRelay")
	series := func() map[string]float64 { return relaySeries(t, r.Metrics, ns, relay.Name) }
	require.Eventually(t, func() bool { return series()["outbox_operator_backlog_rows"] == 7 }, eventually, tick)
	require.Equal(t, 1.0, series()["outbox_operator_desired_replicas"])
	require.Equal(t, 0.0, series()["outbox_operator_lagging"])

	update(t, c, secret, func(s *corev1.Secret) { s.Data["dsn"] = []byte(dsn2) })
	// Until the new database is read, status shows no backlog rather than the old one's.
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog != nil && o.Status.Backlog.Pending == 9
	})
	require.Eventually(t, func() bool { return operatorSessions(db) == 0 }, eventually, tick, "the old DSN's connection is closed")
	require.Equal(t, 1, operatorSessions(db2))

	require.NoError(t, c.Delete(ctx, relay))
	require.Eventually(t, func() bool {
		return !r.Flow.observing(key(relay)) && operatorSessions(db2) == 0 && len(series()) == 0
	}, eventually, tick, "deleting the OutboxRelay closes its connection and drops its metrics")
}

// A backlog the operator cannot read is Lagging Unknown with PostgreSQL's
// reason; once the relay is rolled out, Argo CD shows it Degraded.
func testMissingTable(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	relay, secret := flowRelay(ns, "notable", testenv.PG().NewDatabase(t))
	relay.Spec.Table = "app.outbox"
	create(t, c, secret, relay)
	waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	setDeploymentStatus(t, c, childKey(relay), 1)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonBacklogUnavailable &&
			condOf(o, "Reconciling").Status == metav1.ConditionFalse
	})
	require.Equal(t, metav1.ConditionUnknown, condOf(o, "Lagging").Status)
	require.Equal(t, `PostgreSQL refused the backlog query: relation "app.outbox" does not exist (SQLSTATE 42P01)`, condOf(o, "Lagging").Message)
	require.Nil(t, o.Status.Backlog)
	require.Equal(t, "True/Available", string(condOf(o, "Ready").Status)+"/"+condOf(o, "Ready").Reason)
	require.Contains(t, requireHealth(t, o, "Degraded"), "does not exist")
}

// Until the first reading the relay is Lagging Unknown / Observing, and
// Argo CD sees it Progressing even with every pod ready. The database here
// accepts connections and never answers, so the first reading takes the
// whole connect timeout.
func testBeforeFirstReading(t *testing.T, c client.Client) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		var held []net.Conn
		defer func() {
			for _, conn := range held {
				conn.Close()
			}
		}()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, conn)
		}
	}()
	ns := newNamespace(t, c)
	relay, secret := flowRelay(ns, "first", "postgres://relay@"+ln.Addr().String()+"/orders")
	create(t, c, secret, relay)
	waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	setDeploymentStatus(t, c, childKey(relay), 1)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Ready").Status == metav1.ConditionTrue
	})
	require.Equal(t, "Unknown/Observing", string(condOf(o, "Lagging").Status)+"/"+condOf(o, "Lagging").Reason)
	require.Equal(t, "Waiting for the operator to read the backlog", requireHealth(t, o, "Progressing"))
	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonBacklogUnavailable
	})
	require.Contains(t, condOf(o, "Lagging").Message, "cannot reach PostgreSQL with the DSN in Secret first-dsn")
}

// relaySeries are the operator's gauges for one relay, by metric name (and
// reason, for the held rows).
func relaySeries(t *testing.T, m *Metrics, ns, name string) map[string]float64 {
	reg := prometheus.NewPedanticRegistry()
	for _, v := range []*prometheus.GaugeVec{m.backlog, m.oldestAge, m.held, m.desired, m.ready, m.lagging, m.slotRetained, m.slotMaxRetained} {
		require.NoError(t, reg.Register(v))
	}
	families, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, f := range families {
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range s.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["namespace"] != ns || labels["name"] != name {
				continue
			}
			k := f.GetName()
			if r, ok := labels["reason"]; ok {
				k += "{" + r + "}"
			}
			out[k] = s.GetGauge().GetValue()
		}
	}
	return out
}

// mustHealth is the Argo CD health of o (kept for the testdata like requireHealth's).
func mustHealth(t *testing.T, o *outboxv1alpha1.OutboxRelay) string {
	s, msg := argoHealth(t, o)
	if *writeArgoTestdata {
		keepArgoCase(t, o, s, msg)
	}
	return s
}

// waitDeploymentWithin is waitDeployment with its own bound.
func waitDeploymentWithin(t *testing.T, c client.Client, relay *outboxv1alpha1.OutboxRelay, within time.Duration, ok func(*appsv1.Deployment) bool) *appsv1.Deployment {
	t.Helper()
	d := &appsv1.Deployment{}
	require.Eventually(t, func() bool {
		return c.Get(context.Background(), childKey(relay), d) == nil && ok(d)
	}, within, tick, "Deployment %s never reached the expected state within %s", childKey(relay), within)
	return d
}

// waitRelayWithin is waitRelay with its own bound.
func waitRelayWithin(t *testing.T, c client.Client, k client.ObjectKey, within time.Duration, ok func(*outboxv1alpha1.OutboxRelay) bool) *outboxv1alpha1.OutboxRelay {
	t.Helper()
	relay := &outboxv1alpha1.OutboxRelay{}
	require.Eventually(t, func() bool {
		return c.Get(context.Background(), k, relay) == nil && ok(relay)
	}, within, tick, "OutboxRelay %s never reached the expected state within %s", k, within)
	return relay
}

// spec.database.tls: the operator's backlog reads talk TLS to PostgreSQL
// whatever the DSN says (sslmode=disable here) and verify the server
// against the CA: with the right CA (from a ConfigMap) the backlog is read;
// with another (from a Secret) the status says the certificate is not
// signed by it.
func testDatabaseTLS(t *testing.T, c client.Client) {
	ctx := context.Background()
	pg, ca, db := tlsOutboxDB(t, "")
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/orders?sslmode=disable", pg.Port)
	insertRows(t, db, 3, "OrderConfirmed", 0)

	ns := newNamespace(t, c)
	other, err := testenv.NewCA("someone-else")
	require.NoError(t, err)
	wrong, secret := flowRelay(ns, "wrong-ca", dsn)
	wrong.Spec.Database = &outboxv1alpha1.DatabaseSpec{TLS: &outboxv1alpha1.DatabaseTLS{
		CA: outboxv1alpha1.CABundleSource{SecretRef: &outboxv1alpha1.KeyReference{Name: "pg-ca-other"}}}}
	create(t, c, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pg-ca-other"}, Data: map[string][]byte{"ca.crt": other.PEM}}, secret, wrong)
	o := waitRelay(t, c, key(wrong), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonBacklogUnavailable
	})
	require.Equal(t, "PostgreSQL's certificate is not signed by spec.database.tls.ca", condOf(o, "Lagging").Message)

	right, secret2 := flowRelay(ns, "right-ca", dsn)
	secret2.Name = "right-dsn"
	right.Spec.DSNSecretRef.Name = "right-dsn"
	right.Spec.Database = &outboxv1alpha1.DatabaseSpec{TLS: &outboxv1alpha1.DatabaseTLS{
		CA: outboxv1alpha1.CABundleSource{ConfigMapRef: &outboxv1alpha1.KeyReference{Name: "pg-ca"}}}}
	create(t, c, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pg-ca"}, Data: map[string]string{"ca.crt": string(ca.PEM)}}, secret2, right)
	o = waitRelay(t, c, key(right), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog != nil && o.Status.Backlog.Pending == 3
	})
	require.Equal(t, metav1.ConditionFalse, condOf(o, "Lagging").Status)
	var sessions int
	var allTLS bool
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*), COALESCE(bool_and(s.ssl), false) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
		WHERE a.application_name = 'outbox-operator'`).Scan(&sessions, &allTLS))
	require.Positive(t, sessions, "the operator's backlog session")
	require.True(t, allTLS, "over TLS, although the DSN says sslmode=disable")
}

// testTokenProviders are the token providers of the suite's operator, by
// AWS region: a test registers its own under a region of its own (the
// operator's cloud identity, faked).
var testTokenProviders sync.Map

// newTestFlowObserver is the suite's observer, its token providers faked.
func newTestFlowObserver() *FlowObserver {
	o := NewFlowObserver()
	o.TokenProvider = func(_ context.Context, method relayconfig.DatabaseAuth, region string) (dbauth.Provider, error) {
		if p, ok := testTokenProviders.Load(region); ok && method == relayconfig.DatabaseAuthAWSRDSIAM {
			return p.(dbauth.Provider), nil
		}
		return nil, fmt.Errorf("no identity for %s in %q", method, region)
	}
	return o
}

// With spec.database.auth the operator's backlog reads log in with a token
// of the operator's own identity (here a fake provider that sets the
// token as the role's password, over TLS only): the backlog is read as
// the token's user; without TLS the method is refused in status, naming
// why, and the token never leaves the operator.
func testDatabaseTokenAuth(t *testing.T, c client.Client) {
	ctx := context.Background()
	pg, ca, admin := tlsOutboxDB(t, `CREATE ROLE observer_iam LOGIN; GRANT SELECT ON ALL TABLES IN SCHEMA public TO observer_iam;`)
	require.NoError(t, pg.RequirePassword("observer_iam"))
	insertRows(t, admin, 4, "OrderConfirmed", 0)
	var issued atomic.Int32
	testTokenProviders.Store("xx-test-1", dbauth.ProviderFunc(func(ctx context.Context, tg dbauth.Target) (dbauth.Token, error) {
		tok := fmt.Sprintf("op-token-%d", issued.Add(1))
		_, err := admin.Exec(ctx, fmt.Sprintf(`ALTER ROLE %s PASSWORD '%s'`, tg.User, tok))
		return dbauth.Token{Value: tok, Expiry: time.Now().Add(15 * time.Minute)}, err
	}))
	auth := &outboxv1alpha1.DatabaseAuth{Method: outboxv1alpha1.DatabaseAuthAWSRDSIAM, AWS: &outboxv1alpha1.AWSDatabaseAuth{Region: "xx-test-1"}}
	dsn := fmt.Sprintf("postgres://observer_iam@127.0.0.1:%d/orders?sslmode=disable", pg.Port)

	ns := newNamespace(t, c)
	plain, secret := flowRelay(ns, "token-plain", dsn)
	plain.Spec.Database = &outboxv1alpha1.DatabaseSpec{Auth: auth}
	create(t, c, secret, plain)
	o := waitRelay(t, c, key(plain), func(o *outboxv1alpha1.OutboxRelay) bool {
		return condOf(o, "Lagging").Reason == outboxv1alpha1.ReasonBacklogUnavailable
	})
	require.Contains(t, condOf(o, "Lagging").Message, "must use TLS without a plain-text fallback")
	require.Zero(t, issued.Load(), "no token was fetched for a connection without TLS")

	tlsRelay, secret2 := flowRelay(ns, "token-tls", dsn)
	secret2.Name = "token-dsn"
	tlsRelay.Spec.DSNSecretRef.Name = "token-dsn"
	tlsRelay.Spec.Database = &outboxv1alpha1.DatabaseSpec{Auth: auth, TLS: &outboxv1alpha1.DatabaseTLS{
		CA: outboxv1alpha1.CABundleSource{ConfigMapRef: &outboxv1alpha1.KeyReference{Name: "pg-ca"}}}}
	create(t, c, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pg-ca"}, Data: map[string]string{"ca.crt": string(ca.PEM)}}, secret2, tlsRelay)
	o = waitRelay(t, c, key(tlsRelay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog != nil && o.Status.Backlog.Pending == 4
	})
	require.Equal(t, metav1.ConditionFalse, condOf(o, "Lagging").Status)
	require.Positive(t, issued.Load())
	var sessions int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-operator' AND usename = 'observer_iam'`).Scan(&sessions))
	require.Positive(t, sessions, "the backlog session logged in as the token's user")

	var d appsv1.Deployment
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "token-tls-relay"}, &d))
	require.Subset(t, d.Spec.Template.Spec.Containers[0].Args, []string{"--database-auth=aws-rds-iam", "--database-auth-aws-region=xx-test-1"})
}

// With spec.capture LogicalReplication the operator reads the relays'
// slot (named after the DSN's database and the table) into
// status.backlog.slot: absent before a relay makes it, then the WAL it
// retains. A Poll relay shows only a slot left behind (by a switch from
// logical replication, or a relay deleted), which holds back the
// database's WAL with no relay to give it up, and Lagging's message names
// the statement that drops it.
func testReplicationSlot(t *testing.T, c client.Client) {
	ctx := context.Background()
	dsn, db := outboxDB(t)
	cfg, err := pgx.ParseConfig(dsn)
	require.NoError(t, err)
	slot := outbox.SlotName(cfg.Database, outbox.Table{Name: "outbox"})
	t.Cleanup(func() {
		_, _ = db.Exec(context.Background(), `SELECT pg_drop_replication_slot($1) FROM pg_replication_slots WHERE slot_name = $1`, slot)
	})
	insertRows(t, db, 2, "OrderConfirmed", 0)
	ns := newNamespace(t, c)
	relay, secret := flowRelay(ns, "streams", dsn)
	relay.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication}
	create(t, c, secret, relay)
	o := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog != nil && o.Status.Backlog.Slot != nil
	})
	require.Equal(t, outboxv1alpha1.SlotStatus{Name: slot}, *o.Status.Backlog.Slot, "no slot yet")
	polls, secret2 := flowRelay(ns, "polls", dsn)
	create(t, c, secret2, polls)
	p := waitRelay(t, c, key(polls), func(o *outboxv1alpha1.OutboxRelay) bool { return o.Status.Backlog != nil })
	require.Nil(t, p.Status.Backlog.Slot, "a polling relay shows no slot while none is left behind")

	_, err = db.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	require.NoError(t, err)
	insertRows(t, db, 500, "OrderConfirmed", 0) // WAL the slot holds back
	o = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		s := o.Status.Backlog.Slot
		return s != nil && s.Exists && s.RetainedWAL != nil && s.RetainedWAL.Value() > 0
	})
	require.False(t, o.Status.Backlog.Slot.Active, "no relay streams in envtest")
	require.GreaterOrEqual(t, o.Status.Backlog.Slot.RetainedWAL.Value(), o.Status.Backlog.Slot.ConfirmedLag.Value())

	p = waitRelay(t, c, key(polls), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.Backlog.Slot != nil && strings.Contains(condOf(o, "Lagging").Message, "pg_drop_replication_slot")
	})
	require.True(t, p.Status.Backlog.Slot.Exists)
	require.Equal(t, slot, p.Status.Backlog.Slot.Name)
	require.Contains(t, condOf(p, "Lagging").Message, fmt.Sprintf("replication slot %s, left by logical replication, holds back", slot))
	require.Contains(t, condOf(p, "Lagging").Message, fmt.Sprintf("SELECT pg_drop_replication_slot('%s')", slot))
}

// tlsOutboxDB starts a PostgreSQL with TLS on (its CA returned), creates
// the database orders with an outbox table and then runs more, and returns
// a pool on it as the superuser, over plain text.
func tlsOutboxDB(t *testing.T, more string) (*testenv.PostgresCluster, *testenv.CA, *pgxpool.Pool) {
	ctx := context.Background()
	pg, ca, err := testenv.StartPostgresTLS(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Close() })
	_, err = pg.CreateDatabase(ctx, "orders")
	require.NoError(t, err)
	require.NoError(t, pg.Exec(ctx, "orders", outbox.SchemaDDL(outbox.Table{Name: "outbox"})+more))
	db, err := pgxpool.New(ctx, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/orders?sslmode=disable", pg.Port))
	require.NoError(t, err)
	t.Cleanup(db.Close)
	return pg, ca, db
}
