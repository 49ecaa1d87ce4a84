// Package e2e runs the whole system on this machine, as `make demo` does
// (test/localcluster: PostgreSQL, Kafka, and a real one-node cluster:
// kube-apiserver + etcd, kube-controller-manager, kube-scheduler,
// kube-proxy, the kubelet and containerd, with the operator installed from
// config/default and running from the locally built image), and goes
// through the scenarios of an operator's user, in order, against the sample
// OutboxRelay in a namespace that enforces the restricted Pod Security
// Standard.
package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/localcluster"
)

const (
	ns         = "default"
	relayName  = "orders"
	deployName = "orders-relay"
	confirmed  = "orders.confirmed"
	shipped    = "orders.shipped"
	// rate is the order service's confirmations per second.
	rate = 100
	// batchSize is the sample's spec.batchSize: a crash may duplicate one batch.
	batchSize = 50
)

var (
	stack  *localcluster.Stack
	topDir string
)

func TestMain(m *testing.M) { os.Exit(runMain(m)) }

func runMain(m *testing.M) (code int) {
	var err error
	topDir, err = os.MkdirTemp("", "outbox-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer func() {
		if code == 0 {
			os.RemoveAll(topDir)
		} else {
			fmt.Fprintf(os.Stderr, "e2e: logs of the stack (manager, pod runner, relays, PostgreSQL, Kafka, API server) are kept in %s\n", topDir)
		}
	}()
	logf, err := os.Create(filepath.Join(topDir, "e2e.log"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer logf.Close()
	// The images are built from the working tree by the stack, so the test
	// works from a clean clone without `make images`.
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	stack, err = localcluster.Start(ctx, localcluster.Options{
		Dir: filepath.Join(topDir, "stack"),
		Log: slog.New(slog.NewTextHandler(logf, nil)),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: start the local stack:", err)
		return 1
	}
	defer func() {
		if err := stack.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stop the local stack:", err)
			code = 1
		}
	}()
	if err := stack.PrepareOrders(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	// Relay pods must pass the restricted Pod Security Standard: the API
	// server refuses them otherwise.
	if out, err := stack.Kubectl(ctx, "label", "--overwrite", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted"); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err, string(out))
		return 1
	}
	return m.Run()
}

// TestEndToEnd runs the scenarios in order: each starts from the state the
// previous one left, as an operator's user would go through them.
func TestEndToEnd(t *testing.T) {
	db, err := pgxpool.New(context.Background(), stack.OrdersDSN("postgres"))
	require.NoError(t, err)
	t.Cleanup(db.Close)
	col := newCollector(stack.Kafka)
	t.Cleanup(col.close)
	col.watch(t, confirmed)
	t.Cleanup(func() {
		if t.Failed() {
			dumpPodLogs(t)
			dumpFile(t, filepath.Join(topDir, "e2e.log"))
		}
	})
	e := &e2e{db: db, col: col}
	for _, s := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"1_apply_samples_ready_and_exactly_once", e.applySamples},
		{"2_scale_to_3_and_back_while_writing", e.scale},
		{"3_sigkill_a_relay", e.sigkill},
		{"4_rotate_the_dsn_secret", e.rotateDSN},
		{"5_new_event_type_in_the_topic_map", e.newEventType},
		{"6_reapply_is_a_no_op_and_kstatus", e.reapply},
		{"7_drain_respects_the_pdb", e.drain},
		{"8_deleted_pod_is_replaced", e.deletePod},
		{"9_readiness_follows_postgres", e.readiness},
		{"10_rollout_while_writing", e.rollout},
		{"11_autoscale_to_zero_and_back", e.autoscale},
		{"12_delete_the_outboxrelay", e.deleteRelay},
	} {
		if !t.Run(s.name, s.run) {
			t.FailNow() // later scenarios build on this one
		}
	}
	// Over the whole run: everything read from orders.confirmed came from
	// the order service, and the only duplicates are scenario 3's.
	deliveries, distinct := col.total(confirmed)
	t.Logf("orders.confirmed: %d deliveries of %d distinct events over the whole run", deliveries, distinct)
	require.LessOrEqual(t, deliveries-distinct, batchSize)
}

type e2e struct {
	db  *pgxpool.Pool
	col *collector
	// applied is the folder of the manifests last applied.
	applied string
	// kstatusDuringRoll records what kstatus said during scenario 5's roll.
	kstatusDuringRoll map[status.Status]int
}

func (e *e2e) relay(t *testing.T) *outboxv1alpha1.OutboxRelay {
	t.Helper()
	var r outboxv1alpha1.OutboxRelay
	require.NoError(t, stack.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: relayName}, &r))
	return &r
}

// waitRolledOut waits until the OutboxRelay reports n of n ready for its
// current generation and exactly n ready pods of one pod template run (no
// other pod, not even a terminating one), which it returns.
func (e *e2e) waitRolledOut(t *testing.T, n int, timeout time.Duration) []localcluster.Pod {
	t.Helper()
	var pods []localcluster.Pod
	var why string
	ok := assertEventually(timeout, func() bool {
		r := e.relay(t)
		c := meta.FindStatusCondition(r.Status.Conditions, outboxv1alpha1.ConditionReady)
		pods = relayPods(t)
		switch {
		case r.Status.ObservedGeneration != r.Generation:
			why = "generation not observed"
		case c == nil || c.Status != metav1.ConditionTrue:
			why = fmt.Sprintf("Ready condition %+v", c)
		case r.Status.Ready != fmt.Sprintf("%d/%d", n, n):
			why = "status.ready " + r.Status.Ready
		case len(pods) != n:
			why = fmt.Sprintf("%d pods", len(pods))
		default:
			for _, p := range pods {
				if !p.Ready || p.Terminating || p.Revision != pods[0].Revision {
					why = fmt.Sprintf("pods %+v", pods)
					return false
				}
			}
			return true
		}
		return false
	})
	require.True(t, ok, "not rolled out to %d replicas within %s: %s", n, timeout, why)
	return pods
}

func assertEventually(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// 1. kubectl apply of config/samples: Ready within 60s, then every event
// written arrives on Kafka exactly once.
func (e *e2e) applySamples(t *testing.T) {
	w := startWriter(t, e.db, rate)
	e.applied = manifests(t, nil)
	start := time.Now()
	out := kubectl(t, "apply", "-f", e.applied)
	require.Contains(t, out, "outboxrelay.outbox.dev/orders created")
	e.waitRolledOut(t, 1, 60*time.Second)
	t.Logf("OutboxRelay Ready %s after kubectl apply", time.Since(start).Round(100*time.Millisecond))
	require.Eventually(t, func() bool { return w.count() >= 2*rate }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// 2. Scale to 3 and back to 1 while writing: no loss, no duplicate.
func (e *e2e) scale(t *testing.T) {
	w := startWriter(t, e.db, rate)
	kubectl(t, "scale", "obr/"+relayName, "--replicas=3")
	e.waitRolledOut(t, 3, 60*time.Second)
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate }, 30*time.Second, 50*time.Millisecond)
	kubectl(t, "scale", "obr/"+relayName, "--replicas=1")
	e.waitRolledOut(t, 1, 60*time.Second)
	n = w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// 3. SIGKILL the relay's container: the kubelet restarts it in the same
// pod; nothing lost, at most one batch duplicated.
func (e *e2e) sigkill(t *testing.T) {
	w := startWriter(t, e.db, rate)
	before := e.waitRolledOut(t, 1, 30*time.Second)[0]
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate/2 }, 30*time.Second, 50*time.Millisecond)
	require.NoError(t, stack.KillContainer(context.Background(), before.ContainerID))
	require.Eventually(t, func() bool {
		pods := relayPods(t)
		return len(pods) == 1 && pods[0].Name == before.Name && pods[0].Ready && pods[0].Restarts == before.Restarts+1
	}, 60*time.Second, 100*time.Millisecond, "the kubelet did not restart the killed relay")
	e.waitRolledOut(t, 1, 30*time.Second)
	n = w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, batchSize)
}

// 4. The DSN Secret rotated to a second role with the same grants: the
// relays roll onto it and continue; nothing lost.
func (e *e2e) rotateDSN(t *testing.T) {
	const rotated = "relay_rotated"
	ctx := context.Background()
	require.NoError(t, stack.CreateRelayRole(ctx, rotated))
	w := startWriter(t, e.db, rate)
	before := e.waitRolledOut(t, 1, 30*time.Second)[0]
	e.applied = manifests(t, func(name string, b []byte) []byte {
		return []byte(strings.ReplaceAll(string(b), "postgres://relay:relay@", "postgres://"+rotated+":"+rotated+"@"))
	})
	out := kubectl(t, "apply", "-f", e.applied)
	require.Contains(t, out, "secret/orders-outbox-dsn configured")
	require.Contains(t, out, "outboxrelay.outbox.dev/orders unchanged")
	require.Eventually(t, func() bool {
		pods := relayPods(t)
		return len(pods) == 1 && pods[0].Revision != before.Revision && pods[0].Ready
	}, 90*time.Second, 100*time.Millisecond, "the relay did not roll after the Secret changed")
	e.waitRolledOut(t, 1, 60*time.Second)
	// The relay's sessions now belong to the new role only.
	e.requireSessionsOf(t, rotated)
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// 5. A new event type added to the topic map with kubectl apply: the pods
// roll and the new type flows to its topic. Its rows written before the
// change were held by the relay (unroutable) and go out after it.
func (e *e2e) newEventType(t *testing.T) {
	require.NoError(t, stack.Kafka.CreateTopicErr(shipped, 1))
	e.col.watch(t, shipped)
	shippedIDs := e.writeShipped(t, 20)
	before := e.waitRolledOut(t, 1, 30*time.Second)[0]

	rotatedDir := e.applied
	e.applied = manifests(t, func(name string, b []byte) []byte {
		if name == "outbox_v1alpha1_outboxrelay.yaml" {
			return []byte(strings.Replace(string(b), "    OrderCancelled: orders.cancelled\n",
				"    OrderCancelled: orders.cancelled\n    OrderShipped: "+shipped+"\n", 1))
		}
		b, err := os.ReadFile(filepath.Join(rotatedDir, name)) // keep the rotated Secret
		require.NoError(t, err)
		return b
	})
	// Record kstatus while the pods roll.
	seen := map[status.Status]int{}
	stopWatch := make(chan struct{})
	watchDone := make(chan struct{})
	go func() {
		defer close(watchDone)
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(20 * time.Millisecond):
			}
			if s, err := computeKstatus(relayName); err == nil {
				seen[s]++
			}
		}
	}()
	out := kubectl(t, "apply", "-f", e.applied)
	require.Contains(t, out, "outboxrelay.outbox.dev/orders configured")
	require.Eventually(t, func() bool {
		pods := relayPods(t)
		return len(pods) == 1 && pods[0].Revision != before.Revision && pods[0].Ready
	}, 90*time.Second, 100*time.Millisecond, "the relay did not roll after the topic map changed")
	e.waitRolledOut(t, 1, 60*time.Second)
	close(stopWatch)
	<-watchDone
	e.kstatusDuringRoll = seen
	t.Logf("kstatus of the OutboxRelay during the roll (samples every 20ms): %v", seen)
	require.Positive(t, seen[status.InProgressStatus], "kstatus said InProgress while the pods rolled: %v", seen)
	require.Eventually(t, func() bool { s, err := computeKstatus(relayName); return err == nil && s == status.CurrentStatus },
		30*time.Second, 50*time.Millisecond, "kstatus says Current once the roll is done")
	e.requireSessionsOf(t, "relay_rotated") // the rotated DSN was kept

	more := e.writeShipped(t, 20)
	requireDelivered(t, e.col, e.db, shipped, append(shippedIDs, more...), 0)
	missing, _ := e.col.deliveries(confirmed, shippedIDs)
	require.Len(t, missing, len(shippedIDs), "OrderShipped events must not reach %s", confirmed)
}

// writeShipped stores n OrderShipped events with the outbox writer.
func (e *e2e) writeShipped(t *testing.T, n int) []string {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.DefaultTable)
	require.NoError(t, err)
	var ids []string
	for i := 0; i < n; i++ {
		tx, err := e.db.Begin(ctx)
		require.NoError(t, err)
		id := outbox.NewEventID()
		require.NoError(t, w.Store(ctx, tx, outbox.Entry{EventID: id, AggregateType: "Order", AggregateID: fmt.Sprintf("order-%d", i),
			EventType: "OrderShipped", Payload: []byte(`{"shipped":true}`), PartitionKey: fmt.Sprintf("order-%d", i)}))
		require.NoError(t, tx.Commit(ctx))
		ids = append(ids, id)
	}
	return ids
}

// 6. Applying the same manifests again changes nothing, kubectl diff is
// empty, and kstatus judges the OutboxRelay Current once ready and
// InProgress while it rolls out a change.
func (e *e2e) reapply(t *testing.T) {
	ctx := context.Background()
	e.waitRolledOut(t, 1, 30*time.Second)
	rv := resourceVersions(t)
	out := kubectl(t, "apply", "-f", e.applied)
	// Client-side apply always reports a Secret written with stringData as
	// "configured" (the live object holds data, so the patch is never empty);
	// the server finds nothing to change, as the resourceVersions show below.
	require.Contains(t, out, "outboxrelay.outbox.dev/orders unchanged")
	diff, err := stack.Kubectl(ctx, "diff", "-f", e.applied)
	require.NoError(t, err, "kubectl diff found differences:\n%s", diff)
	require.Empty(t, strings.TrimSpace(string(diff)))
	// Nothing was written: not the relay, not a child, not a status.
	require.Never(t, func() bool {
		now := resourceVersions(t)
		for k, v := range rv {
			if now[k] != v {
				t.Logf("%s changed: %s -> %s", k, v, now[k])
				return true
			}
		}
		return false
	}, 3*time.Second, 250*time.Millisecond, "re-applying the same manifests changed an object")
	require.Equal(t, status.CurrentStatus, kstatusOf(t, relayName))

	// A rollout in progress (scaling to 2) is InProgress, then Current.
	kubectl(t, "scale", "obr/"+relayName, "--replicas=2")
	require.Eventually(t, func() bool { return kstatusOf(t, relayName) == status.InProgressStatus },
		10*time.Second, 10*time.Millisecond, "kstatus never said InProgress while scaling to 2")
	e.waitRolledOut(t, 2, 60*time.Second)
	require.Equal(t, status.CurrentStatus, kstatusOf(t, relayName))
}

func resourceVersions(t *testing.T) map[string]string {
	t.Helper()
	ctx := context.Background()
	out := map[string]string{}
	for name, obj := range map[string]client.Object{
		"outboxrelay": &outboxv1alpha1.OutboxRelay{}, "deployment": &appsv1.Deployment{}, "service": &corev1.Service{},
	} {
		key := types.NamespacedName{Namespace: ns, Name: deployName}
		if name == "outboxrelay" {
			key.Name = relayName
		}
		require.NoError(t, stack.Client.Get(ctx, key, obj))
		out[name] = obj.GetResourceVersion()
		if r, ok := obj.(*outboxv1alpha1.OutboxRelay); ok {
			// Each backlog reading that changes its numbers rewrites
			// status.backlog and the Lagging message; nothing else may change.
			r.Status.Backlog = nil
			if c := meta.FindStatusCondition(r.Status.Conditions, outboxv1alpha1.ConditionLagging); c != nil {
				c.Message = ""
			}
			b, err := json.Marshal(struct {
				Spec   outboxv1alpha1.OutboxRelaySpec
				Status outboxv1alpha1.OutboxRelayStatus
			}{r.Spec, r.Status})
			require.NoError(t, err)
			out[name] = string(b)
		}
	}
	var sec corev1.Secret
	require.NoError(t, stack.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "orders-outbox-dsn"}, &sec))
	out["secret"] = sec.ResourceVersion
	return out
}

// 11. Autoscaling down to zero and back with real relays: with no row
// waiting the operator scales the relay to zero pods; the first orders bring
// one back within about one backlog reading, and every event arrives once.
// Removing spec.autoscaling hands the count back to spec.replicas.
func (e *e2e) autoscale(t *testing.T) {
	const interval = 5 * time.Second
	kubectl(t, "patch", "obr/"+relayName, "--type=merge", "-p",
		`{"spec":{"backlog":{"interval":"5s"},"autoscaling":{"minReplicas":0,"maxReplicas":3,"pendingPerReplica":2000,"scaleDownStabilization":"5s"}}}`)
	require.Eventually(t, func() bool {
		r := e.relay(t)
		c := meta.FindStatusCondition(r.Status.Conditions, outboxv1alpha1.ConditionReady)
		return len(relayPods(t)) == 0 && r.Status.DesiredReplicas == 0 &&
			c != nil && c.Status == metav1.ConditionTrue && c.Reason == outboxv1alpha1.ReasonScaledToZero
	}, 60*time.Second, 100*time.Millisecond, "an idle autoscaled relay did not scale to zero")
	r := e.relay(t)
	require.NotNil(t, r.Status.Backlog)
	require.Zero(t, r.Status.Backlog.Pending)

	w := startWriter(t, e.db, rate)
	start := time.Now()
	e.waitRolledOut(t, 1, 60*time.Second)
	t.Logf("scaled 0 → 1 with a ready relay %s after the first orders (backlog interval %s)", time.Since(start).Round(100*time.Millisecond), interval)
	require.Less(t, time.Since(start), 2*interval+10*time.Second)
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
	e.burst(t, interval)
	r = e.relay(t)
	require.Equal(t, int32(2), *r.Spec.Replicas, "the operator never writes the spec")

	kubectl(t, "patch", "obr/"+relayName, "--type=json", "-p", `[{"op":"remove","path":"/spec/autoscaling"},{"op":"remove","path":"/spec/backlog"}]`)
	e.waitRolledOut(t, 2, 60*time.Second)
}

// burst writes burstRows events in one transaction to an autoscaled relay
// (0..3 replicas, 2000 rows per replica): `kubectl get obr` shows the
// backlog and the replicas following it: the reading after the commit
// scales straight to 3, the backlog drains, and after the stabilisation
// window the relay is back to zero pods. Every event arrives.
func (e *e2e) burst(t *testing.T, interval time.Duration) {
	const burstRows = 30000
	require.Eventually(t, func() bool { return len(relayPods(t)) == 0 && e.relay(t).Status.DesiredReplicas == 0 },
		60*time.Second, 100*time.Millisecond, "the relay did not scale back to zero before the burst")
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.DefaultTable)
	require.NoError(t, err)
	tx, err := e.db.Begin(ctx)
	require.NoError(t, err)
	ids := make([]string, burstRows)
	for i := range ids {
		ids[i] = outbox.NewEventID()
		require.NoError(t, w.Store(ctx, tx, outbox.Entry{EventID: ids[i], AggregateType: "Order", AggregateID: fmt.Sprintf("burst-%d", i),
			EventType: "OrderConfirmed", Payload: []byte(`{"burst":true}`), PartitionKey: fmt.Sprintf("burst-%d", i%64)}))
	}
	require.NoError(t, tx.Commit(ctx))
	start := time.Now()

	// What a user watching `kubectl get obr` sees: NAME READY BACKLOG LAG STATUS AGE.
	var seen []string
	var sawBacklog, sawThree, scaledUpIn time.Duration
	ok := assertEventually(3*time.Minute, func() bool {
		out, err := stack.Kubectl(ctx, "get", "obr", relayName, "--no-headers")
		if err != nil {
			return false
		}
		f := strings.Fields(string(out))
		if len(f) != 6 {
			t.Logf("kubectl get obr: %q", out)
			return false
		}
		line := strings.Join(f[:4], " ")
		if len(seen) == 0 || seen[len(seen)-1] != line {
			seen = append(seen, line)
		}
		if f[2] != "0" && f[2] != "<none>" && sawBacklog == 0 {
			sawBacklog = time.Since(start)
		}
		if strings.HasSuffix(f[1], "/3") && sawThree == 0 {
			sawThree = time.Since(start)
		}
		if scaledUpIn == 0 && e.relay(t).Status.DesiredReplicas == 3 {
			scaledUpIn = time.Since(start)
		}
		return sawBacklog > 0 && sawThree > 0 && f[1] == "0/0" && f[2] == "0"
	})
	t.Logf("kubectl get obr %s after a burst of %d rows (each distinct line, NAME READY BACKLOG LAG):\n  %s",
		relayName, burstRows, strings.Join(seen, "\n  "))
	require.True(t, ok, "kubectl get obr did not show the backlog rise, 3 replicas, then 0/0 with an empty backlog")
	require.Less(t, scaledUpIn, 2*interval+5*time.Second, "scaling to 3 took longer than two backlog readings")
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// 12. Deleting the OutboxRelay: its children carry controller owner
// references to it, so the garbage collector deletes them, and the pods go.
func (e *e2e) deleteRelay(t *testing.T) {
	ctx := context.Background()
	r := e.relay(t)
	pods := e.waitRolledOut(t, 2, 30*time.Second)
	for _, obj := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}} {
		require.NoError(t, stack.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: deployName}, obj))
		ref := metav1.GetControllerOf(obj)
		require.NotNil(t, ref, "%T has no controller reference", obj)
		require.Equal(t, r.UID, ref.UID, "%T is not controlled by the OutboxRelay", obj)
		require.Equal(t, "OutboxRelay", ref.Kind)
		require.True(t, ref.BlockOwnerDeletion != nil && *ref.BlockOwnerDeletion, "%T: blockOwnerDeletion", obj)
	}
	kubectl(t, "delete", "obr/"+relayName, "--wait=true")
	for _, obj := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}} {
		require.Eventually(t, func() bool {
			err := stack.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: deployName}, obj)
			return apierrors.IsNotFound(err)
		}, 60*time.Second, 100*time.Millisecond, "the garbage collector did not delete the %T", obj)
	}
	require.Eventually(t, func() bool {
		var list corev1.PodList
		require.NoError(t, stack.Client.List(ctx, &list, client.InNamespace(ns)))
		for _, p := range list.Items {
			for _, old := range pods {
				if p.Name == old.Name {
					return false
				}
			}
		}
		return true
	}, 90*time.Second, 100*time.Millisecond, "the relay pods were not deleted")
}

// relayPods lists the sample relay's pods.
func relayPods(t *testing.T) []localcluster.Pod {
	t.Helper()
	pods, err := stack.Pods(context.Background(), ns, deployName)
	require.NoError(t, err)
	return pods
}

// relaySelector is the label selector of the sample relay's pods.
func relaySelector(t *testing.T) string {
	t.Helper()
	var d appsv1.Deployment
	require.NoError(t, stack.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: deployName}, &d))
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	require.NoError(t, err)
	return sel.String()
}

// requireSessionsOf waits until the relays' PostgreSQL sessions all belong
// to role: the pods run with the DSN of the Secret as it is now.
func (e *e2e) requireSessionsOf(t *testing.T, role string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var other, own int
		err := e.db.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE usename <> $1), count(*) FILTER (WHERE usename = $1)
			FROM pg_stat_activity WHERE datname = $2 AND usename LIKE 'relay%'`, role, localcluster.OrdersDatabase).Scan(&other, &own)
		return err == nil && other == 0 && own > 0
	}, 60*time.Second, 100*time.Millisecond, "relay sessions do not all belong to role %s", role)
}

// 7. kubectl drain of the node respects the relay's PodDisruptionBudget
// (at most one relay unavailable): one of the two relays is evicted, its
// replacement cannot be scheduled on the cordoned node, and the eviction of
// the other is refused until the drain times out; events keep flowing
// through the relay that stays. Uncordoning brings the second one back.
func (e *e2e) drain(t *testing.T) {
	ctx := context.Background()
	e.waitRolledOut(t, 2, 60*time.Second)
	w := startWriter(t, e.db, rate)
	minReady := make(chan int, 1)
	stop := make(chan struct{})
	go func() {
		least := 2
		for {
			select {
			case <-stop:
				minReady <- least
				return
			case <-time.After(100 * time.Millisecond):
			}
			ready := 0
			if pods, err := stack.Pods(ctx, ns, deployName); err == nil {
				for _, p := range pods {
					if p.Ready && !p.Terminating {
						ready++
					}
				}
				least = min(least, ready)
			}
		}
	}()
	out, err := stack.Kubectl(ctx, "drain", localcluster.NodeName, "--pod-selector="+relaySelector(t),
		"--ignore-daemonsets", "--delete-emptydir-data", "--timeout=30s")
	close(stop)
	least := <-minReady
	t.Cleanup(func() { _, _ = stack.Kubectl(ctx, "uncordon", localcluster.NodeName) })
	require.Error(t, err, "the drain evicted both relays: %s", out)
	require.Contains(t, string(out), "disruption budget", "the drain was not held back by the PodDisruptionBudget")
	require.Equal(t, 1, least, "ready relays during the drain (the PDB allows one to be evicted, never both)")
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate/2 }, 30*time.Second, 50*time.Millisecond)
	kubectl(t, "uncordon", localcluster.NodeName)
	e.waitRolledOut(t, 2, 90*time.Second)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// 8. A deleted relay pod is replaced by the ReplicaSet; nothing is lost.
func (e *e2e) deletePod(t *testing.T) {
	before := e.waitRolledOut(t, 2, 60*time.Second)
	w := startWriter(t, e.db, rate)
	kubectl(t, "delete", "pod", before[0].Name, "--wait=false")
	require.Eventually(t, func() bool {
		pods := relayPods(t)
		if len(pods) != 2 {
			return false
		}
		for _, p := range pods {
			if p.Name == before[0].Name || !p.Ready {
				return false
			}
		}
		return true
	}, 90*time.Second, 100*time.Millisecond, "the ReplicaSet did not replace the deleted pod")
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate/2 }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// 9. The kubelet's probes drive readiness: when the relays' PostgreSQL
// goes away (their role may no longer log in, their sessions are ended),
// /readyz fails (at once for an unreachable database; a relay that could
// reach it but published nothing would fail after spec.stallTimeout, set
// short here) and both pods turn not ready, and so does the OutboxRelay,
// without a restart (/healthz still passes). When it comes back they turn
// ready again and every event arrives.
func (e *e2e) readiness(t *testing.T) {
	ctx := context.Background()
	const role = "relay_rotated" // the DSN since scenario 4
	kubectl(t, "patch", "obr/"+relayName, "--type=merge", "-p", `{"spec":{"stallTimeout":"5s"}}`)
	before := e.waitRolledOut(t, 2, 90*time.Second)
	w := startWriter(t, e.db, rate)
	_, err := e.db.Exec(ctx, `ALTER ROLE `+role+` NOLOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = e.db.Exec(ctx, `ALTER ROLE `+role+` LOGIN`) })
	_, err = e.db.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
	require.NoError(t, err)
	start := time.Now()
	require.Eventually(t, func() bool {
		pods := relayPods(t)
		if len(pods) != 2 {
			return false
		}
		for _, p := range pods {
			if p.Ready {
				return false
			}
		}
		return e.relay(t).Status.Ready == "0/2"
	}, 60*time.Second, 200*time.Millisecond, "the relays stayed ready without their database")
	t.Logf("both relays not ready %s after their database went away (readiness probe every 2s)", time.Since(start).Round(100*time.Millisecond))
	for i, p := range relayPods(t) {
		require.Equal(t, before[i].Restarts, p.Restarts, "a relay without its database was restarted: its liveness must not depend on it")
	}
	_, err = e.db.Exec(ctx, `ALTER ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	e.waitRolledOut(t, 2, 90*time.Second)
	ids := w.stop(t)
	// A batch published but not yet marked when its session was ended is
	// published again: at most one per relay and batch in flight.
	requireDelivered(t, e.col, e.db, confirmed, ids, 2*2*batchSize)
}

// 10. A spec change rolls the pods out through the Deployment controller
// (kubectl rollout status follows it) while orders keep coming; nothing is
// lost or duplicated.
func (e *e2e) rollout(t *testing.T) {
	before := e.waitRolledOut(t, 2, 60*time.Second)
	w := startWriter(t, e.db, rate)
	n := w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate/2 }, 30*time.Second, 50*time.Millisecond)
	kubectl(t, "patch", "obr/"+relayName, "--type=merge", "-p", `{"spec":{"pollInterval":"100ms"}}`)
	out := kubectl(t, "rollout", "status", "deployment/"+deployName, "--timeout=120s")
	require.Contains(t, out, "successfully rolled out")
	after := e.waitRolledOut(t, 2, 60*time.Second)
	require.NotEqual(t, before[0].Revision, after[0].Revision, "the spec change made no new pod template")
	n = w.count()
	require.Eventually(t, func() bool { return w.count() >= n+rate/2 }, 30*time.Second, 50*time.Millisecond)
	ids := w.stop(t)
	requireDelivered(t, e.col, e.db, confirmed, ids, 0)
}

// dumpPodLogs prints the tails of the pods' logs (the manager's among them)
// and of the node's processes.
func dumpPodLogs(t *testing.T) {
	for _, dir := range []string{filepath.Join(stack.Dir, "node", "pod-logs"), filepath.Join(stack.Dir, "node", "logs")} {
		_ = filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				dumpFile(t, path)
			}
			return nil
		})
	}
}

// TestRelayPodTemplate: on the real node, a relay whose spec.template names
// a service account (with its token mounted), adds environment from a
// ConfigMap and a mounted ConfigMap volume, and overrides part of the
// security context runs and publishes, with every addition in its pod and
// the restricted Pod Security Standard still met (the namespace enforces it).
func TestRelayPodTemplate(t *testing.T) {
	ctx := context.Background()
	dir := manifests(t, func(name string, b []byte) []byte {
		if name != "outbox_v1alpha1_outboxrelay.yaml" {
			return b
		}
		b = []byte(strings.Replace(string(b), "name: orders\n", "name: templated\n", 1))
		return append(b, []byte(`  template:
    metadata:
      labels: {team: payments}
    pod:
      serviceAccountName: relay-identity
      automountServiceAccountToken: true
      securityContext: {runAsUser: 65000}
      volumes:
        - {name: settings, configMap: {name: relay-settings}}
    container:
      env:
        - {name: AWS_REGION, value: eu-west-1}
      envFrom:
        - configMapRef: {name: relay-settings}
      volumeMounts:
        - {name: settings, mountPath: /etc/settings, readOnly: true}
`)...)
	})
	kubectl(t, "create", "serviceaccount", "relay-identity", "-n", ns)
	kubectl(t, "create", "configmap", "relay-settings", "--from-literal=HTTPS_PROXY=", "-n", ns)
	kubectl(t, "apply", "-f", dir)
	t.Cleanup(func() {
		_, _ = stack.Kubectl(context.Background(), "delete", "obr", "templated", "-n", ns)
		_, _ = stack.Kubectl(context.Background(), "delete", "serviceaccount", "relay-identity", "-n", ns)
		_, _ = stack.Kubectl(context.Background(), "delete", "configmap", "relay-settings", "-n", ns)
	})
	var pods []localcluster.Pod
	require.Eventually(t, func() bool {
		var err error
		pods, err = stack.Pods(ctx, ns, "templated-relay")
		return err == nil && len(pods) == 1 && pods[0].Ready
	}, 2*time.Minute, 500*time.Millisecond, "the templated relay's pod is ready (it reached PostgreSQL and Kafka)")
	out := kubectl(t, "get", "pod", pods[0].Name, "-n", ns, "-o", "json")
	for _, want := range []string{`"serviceAccountName": "relay-identity"`, `"automountServiceAccountToken": true`, `"team": "payments"`,
		`"name": "AWS_REGION"`, `"mountPath": "/etc/settings"`, `"mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"`,
		`"runAsUser": 65000`, `"readOnlyRootFilesystem": true`} {
		require.Contains(t, out, want)
	}
}

// TestNamespaceEditorsManageOutboxRelays: on the real node, whose
// controller manager aggregates ClusterRoles, the installed
// outboxrelay-editor and -viewer roles reach the built-in edit and view
// roles: a user bound to edit in a namespace may create OutboxRelays there,
// one bound to view may read them and not create them.
func TestNamespaceEditorsManageOutboxRelays(t *testing.T) {
	kubectl(t, "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", "default")
	kubectl(t, "create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob", "-n", "default")
	t.Cleanup(func() {
		_, _ = stack.Kubectl(context.Background(), "delete", "rolebinding", "alice-edit", "bob-view", "-n", "default")
	})
	canI := func(user, verb string) string {
		out, _ := stack.Kubectl(context.Background(), "auth", "can-i", verb, "outboxrelays.outbox.dev", "--as="+user, "-n", "default")
		return strings.TrimSpace(string(out))
	}
	require.Eventually(t, func() bool { return canI("alice", "create") == "yes" }, 30*time.Second, 200*time.Millisecond,
		"edit aggregates outboxrelay-editor")
	require.Equal(t, "yes", canI("alice", "delete"))
	require.Eventually(t, func() bool { return canI("bob", "list") == "yes" }, 30*time.Second, 200*time.Millisecond,
		"view aggregates outboxrelay-viewer")
	require.Equal(t, "no", canI("bob", "create"))
	require.Equal(t, "no", canI("carol", "get"), "no binding, no access")
}

// TestLogicalReplicationOnTheNode: an OutboxRelay with spec.capture
// LogicalReplication on the real node, its role granted REPLICATION and
// the publication made by the table's owner (as docs/relay.md says): its
// pod streams from the slot through the pod network, and the operator
// shows the slot active in status.backlog.slot.
func TestLogicalReplicationOnTheNode(t *testing.T) {
	ctx := context.Background()
	slot := outbox.SlotName(localcluster.OrdersDatabase, outbox.Table{Name: "outbox"})
	// Two transactions: in one, the GRANT's update of the table's catalog
	// row made an autovacuum's ANALYZE of the table wait for it, while the
	// CREATE PUBLICATION waited for the autovacuum's lock on the table, and
	// PostgreSQL ended the test's statement as a deadlock.
	require.NoError(t, stack.Postgres.Exec(ctx, localcluster.OrdersDatabase, `DO $$ DECLARE r text; BEGIN
		FOR r IN SELECT rolname FROM pg_roles WHERE rolname LIKE 'relay%' LOOP
			EXECUTE format('ALTER ROLE %I REPLICATION', r);
			EXECUTE format('GRANT INSERT ON outbox TO %I', r); -- writer deletes put rows back
		END LOOP; END $$`))
	// A DBA makes the publication and gives it to the relay's role, which
	// marks it before its writers may delete (outbox.WriterDeletesMark).
	require.NoError(t, stack.Postgres.Exec(ctx, localcluster.OrdersDatabase, `CREATE PUBLICATION `+slot+` FOR TABLE outbox WITH (publish = 'insert, delete')`))
	require.NoError(t, stack.Postgres.Exec(ctx, localcluster.OrdersDatabase, `ALTER PUBLICATION `+slot+` OWNER TO `+localcluster.RelayRole))
	dir := manifests(t, func(name string, b []byte) []byte {
		if name != "outbox_v1alpha1_outboxrelay.yaml" {
			return b
		}
		b = []byte(strings.Replace(string(b), "name: orders\n", "name: streaming\n", 1))
		return append(b, []byte("  capture: {mode: LogicalReplication, maxRetainedWAL: 1Gi}\n")...)
	})
	kubectl(t, "apply", "-f", dir)
	t.Cleanup(func() {
		_, _ = stack.Kubectl(context.Background(), "delete", "obr", "streaming", "-n", ns, "--wait")
		_ = stack.Postgres.Exec(context.Background(), localcluster.OrdersDatabase,
			`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, slot)
	})
	var o outboxv1alpha1.OutboxRelay
	require.Eventually(t, func() bool {
		err := stack.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "streaming"}, &o)
		s := o.Status.Backlog
		return err == nil && s != nil && s.Slot != nil && s.Slot.Exists && s.Slot.Active
	}, 3*time.Minute, time.Second, "the streaming pod holds the slot %s", slot)
	require.Equal(t, slot, o.Status.Backlog.Slot.Name)
	out := kubectl(t, "get", "deploy", "streaming-relay", "-n", ns, "-o", "jsonpath={.spec.template.spec.containers[0].args}")
	require.Contains(t, out, "--capture=logical-replication")
	require.Contains(t, out, "--max-retained-wal=1073741824")

	// Writer deletes: the rows are gone at commit and reach Kafka from the
	// stream alone.
	kubectl(t, "patch", "obr", "streaming", "-n", ns, "--type", "merge", "-p", `{"spec":{"capture":{"writerDeletes":true}}}`)
	require.Eventually(t, func() bool {
		out, err := stack.Kubectl(ctx, "get", "deploy", "streaming-relay", "-n", ns, "-o", "jsonpath={.spec.template.spec.containers[0].args}")
		return err == nil && strings.Contains(string(out), "--writer-deletes")
	}, time.Minute, time.Second, "the relay pods run with --writer-deletes")
	kubectl(t, "rollout", "status", "deploy/streaming-relay", "-n", ns, "--timeout=3m")
	db, err := pgxpool.New(ctx, stack.OrdersDSN("postgres"))
	require.NoError(t, err)
	t.Cleanup(db.Close)
	// The writer deletes only while a relay with writer deletes streams
	// (outbox.DeleteOnStoreCondition): wait for the new pod to. Its session
	// may connect before the old pod's has let the slot go, so wait on the
	// writers' own condition, not on the session.
	require.Eventually(t, func() bool {
		on, err := outbox.DeletesOnStore(ctx, db, outbox.Table{Name: "outbox"})
		return err == nil && on
	}, 3*time.Minute, time.Second, "a pod of the new template streams from the slot")
	col := newCollector(stack.Kafka)
	t.Cleanup(col.close)
	col.watch(t, confirmed)
	w, err := outbox.NewWriter("outbox", outbox.WithDeleteOnStore())
	require.NoError(t, err)
	var ids []string
	for i := range 20 {
		e := outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order", AggregateID: fmt.Sprintf("wd-%d", i),
			EventType: "OrderConfirmed", Payload: []byte(`{"writer_deletes": true}`), PartitionKey: fmt.Sprintf("wd-%d", i)}
		require.NoError(t, pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return w.Store(ctx, tx, e) }))
		ids = append(ids, e.EventID)
	}
	var left int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE event_id::text = ANY($1)`, ids).Scan(&left))
	require.Zero(t, left, "the writer deleted its rows in the storing transaction")
	require.Eventually(t, func() bool {
		missing, _ := col.deliveries(confirmed, ids)
		return len(missing) == 0
	}, time.Minute, 100*time.Millisecond, "every event reached Kafka from the stream")
}
