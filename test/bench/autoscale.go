package main

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/localcluster"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// runAutoscale drains a burst of o.burstRows rows with the operator running
// the relay pods: once with spec.replicas 1, once with spec.autoscaling
// from 0 to o.autoscaleMax replicas. It starts the local cluster (its own
// PostgreSQL and Kafka, a node, the operator installed as users install
// it), so it runs once per case.
func runAutoscale(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	logf("starting the local cluster")
	stack, err := localcluster.Start(ctx, localcluster.Options{Dir: filepath.Join(e.work, "cluster"),
		Progress: func(s string) { logf("  %s", s) }})
	if err != nil {
		return err
	}
	defer stack.Close() //nolint:errcheck // best effort at the end
	const ns = "bench"
	if err := stack.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		return err
	}
	results := map[bool]map[string]float64{}
	for _, auto := range []bool{false, true} {
		m, err := burstRun(ctx, o, stack, ns, auto)
		if err != nil {
			return fmt.Errorf("%s: %w", autoscaleCase(auto), err)
		}
		logf("autoscale %s: burst of %d drained in %.1f s, %.1f replica-seconds (peak %.0f replicas); back to the minimum after %.1f s, %.1f replica-seconds in all",
			autoscaleCase(auto), o.burstRows, m["drain_s"], m["replica_s_drain"], m["peak_replicas"], m["settled_s"], m["replica_s_settled"])
		results[auto] = m
		params := map[string]any{"autoscaling": auto, "burst_rows": o.burstRows, "interval": o.autoscaleInterval.String(),
			"batch": relayconfig.DefaultBatchSize}
		if auto {
			params["min_replicas"], params["max_replicas"] = 0, o.autoscaleMax
			params["pending_per_replica"], params["scale_down_stabilization"] = pendingPerReplica(o), o.autoscaleDown.String()
		} else {
			params["replicas"] = 1
		}
		rep.add(scAutoscale, autoscaleCase(auto), params, []map[string]float64{m})
	}
	if f, a := results[false], results[true]; f != nil && a != nil {
		for k, what := range map[string]string{"drain_s": "time to drain", "replica_s_drain": "replica-seconds to drain"} {
			v := a[k] / f[k]
			rep.Ratios[autoscaleRatio(o, what)] = ratioResult{Median: v, Rounds: []float64{v}}
		}
	}
	return nil
}

// autoscaleRatio names a ratio of the autoscaled relay's figure to the fixed one's.
func autoscaleRatio(o *options, what string) string {
	return fmt.Sprintf("autoscale 0..%d / fixed 1 replica: %s", o.autoscaleMax, what)
}

func autoscaleCase(auto bool) string {
	if auto {
		return "autoscaling"
	}
	return "fixed"
}

// pendingPerReplica is the autoscaled relay's target: the whole burst asks
// for twice maxReplicas, so it scales to the maximum at once.
func pendingPerReplica(o *options) int64 { return max(1, int64(o.burstRows/(2*o.autoscaleMax))) }

// burstRun creates a database with an outbox table, a topic and an
// OutboxRelay for it (fixed at one replica, or autoscaled), waits for its
// resting state (one ready replica, or zero), inserts the burst in one
// transaction and follows the relay's Deployment until the table is drained
// and, when autoscaled, back at zero replicas. Replica-seconds are the
// Deployment's status.replicas (pods that exist) integrated over time.
func burstRun(ctx context.Context, o *options, stack *localcluster.Stack, ns string, auto bool) (map[string]float64, error) {
	name := "burst-" + autoscaleCase(auto)
	db := "burst_" + autoscaleCase(auto)
	dsn, err := stack.Postgres.CreateDatabase(ctx, db)
	if err != nil {
		return nil, err
	}
	// The relay pods reach the database at the cluster's address for them.
	podDSN, err := url.Parse(dsn)
	if err != nil {
		return nil, err
	}
	podDSN.Host = net.JoinHostPort(stack.Postgres.Host, strconv.Itoa(stack.Postgres.Port))
	// The pods log in with a password as a relay role, never as the superuser.
	const role = "bench_relay"
	podDSN.User = url.UserPassword(role, role)
	defer stack.Postgres.DropDatabase(context.Background(), db) //nolint:errcheck // best effort
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	table := outbox.Table{Name: "outbox"}
	if _, err := pool.Exec(ctx, outbox.SchemaDDL(table)); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN CREATE ROLE %[1]s LOGIN PASSWORD '%[1]s'; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
		GRANT SELECT, UPDATE ON %[2]s TO %[1]s; GRANT SELECT, INSERT, UPDATE, DELETE ON %[3]s TO %[1]s`,
		role, table.Quoted(), table.HeldTable().Quoted())); err != nil {
		return nil, err
	}
	topic := stack.Kafka.UniqueTopic("bench", name)
	if err := stack.Kafka.CreateTopicErr(topic, o.partitions); err != nil {
		return nil, err
	}
	defer stack.Kafka.DeleteTopic(topic) //nolint:errcheck // best effort

	c := stack.Client
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-dsn"},
		StringData: map[string]string{outboxv1alpha1.DefaultDSNKey: podDSN.String()}}
	obr := &outboxv1alpha1.OutboxRelay{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: sec.Name},
			Table:        table.Name,
			Topics:       map[string]outboxv1alpha1.TopicName{eventType: outboxv1alpha1.TopicName(topic)},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{outboxv1alpha1.BrokerAddress(stack.Kafka.Addr())}},
			Backlog:      &outboxv1alpha1.BacklogSpec{Interval: o.autoscaleInterval.String()},
			Replicas:     ptr.To[int32](1),
		}}
	if auto {
		obr.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](0), MaxReplicas: int32(o.autoscaleMax),
			PendingPerReplica: ptr.To(pendingPerReplica(o)), ScaleDownStabilization: o.autoscaleDown.String()}
	}
	if err := c.Create(ctx, sec); err != nil {
		return nil, err
	}
	defer c.Delete(context.Background(), sec) //nolint:errcheck // best effort
	if err := c.Create(ctx, obr); err != nil {
		return nil, err
	}
	defer func() {
		// Scale to zero first: relay processes must not outlive the case.
		bg := context.Background()
		patch := client.MergeFrom(obr.DeepCopy())
		obr.Spec.Suspend = true
		if err := c.Patch(bg, obr, patch); err == nil {
			_ = waitDeployment(bg, c, obr, time.Minute, func(d *appsv1.Deployment) bool { return d.Status.Replicas == 0 })
		}
		_ = c.Delete(bg, obr)
	}()
	resting := func(d *appsv1.Deployment) bool { return d.Status.ReadyReplicas == 1 }
	if auto {
		resting = func(d *appsv1.Deployment) bool {
			return d.Spec.Replicas != nil && *d.Spec.Replicas == 0 && d.Status.Replicas == 0
		}
	}
	if err := waitDeployment(ctx, c, obr, 3*time.Minute, resting); err != nil {
		return nil, fmt.Errorf("waiting for the relay's resting state: %w", err)
	}
	if auto {
		// The relay reached zero just after a backlog reading: half an
		// interval on, the burst meets the next reading half an interval
		// later, as a burst at a random time does on average.
		time.Sleep(o.autoscaleInterval / 2)
	}

	if err := outboxtest.InsertRows(ctx, pool, o.burstRows, 1000, eventType); err != nil {
		return nil, err
	}
	start := time.Now()
	var (
		replicaS, replicaSDrain, drainS, firstReadyS, peak float64
		prev                                               int32
		last                                               = start
	)
	settleBy := start.Add(o.drainTimeout)
	for {
		d, err := relayDeployment(ctx, c, obr)
		if err != nil {
			return nil, err
		}
		now := time.Now()
		replicaS += float64(prev) * now.Sub(last).Seconds()
		last = now
		if d != nil {
			prev = d.Status.Replicas
			peak = max(peak, float64(prev))
			if firstReadyS == 0 && d.Status.ReadyReplicas > 0 {
				firstReadyS = now.Sub(start).Seconds()
			}
		}
		if drainS == 0 {
			var waiting bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)`).Scan(&waiting); err != nil {
				return nil, err
			}
			if !waiting {
				drainS, replicaSDrain = now.Sub(start).Seconds(), replicaS
				if !auto {
					break
				}
				// Then wait for the scale-down: the stabilization window and a reading or two.
				settleBy = now.Add(o.autoscaleDown + 3*o.autoscaleInterval + time.Minute)
			}
		}
		if drainS > 0 && prev == 0 {
			break
		}
		if now.After(settleBy) {
			if drainS == 0 {
				return nil, fmt.Errorf("burst not drained after %s", o.drainTimeout)
			}
			return nil, fmt.Errorf("still %d replicas %s after the drain", prev, now.Sub(start.Add(time.Duration(drainS*float64(time.Second)))).Round(time.Second))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return map[string]float64{
		"drain_s":           drainS,
		"replica_s_drain":   replicaSDrain,
		"peak_replicas":     peak,
		"first_ready_s":     firstReadyS,
		"settled_s":         last.Sub(start).Seconds(),
		"replica_s_settled": replicaS,
		"events_per_s":      float64(o.burstRows) / drainS,
	}, nil
}

// relayDeployment is the Deployment obr controls, nil before there is one.
func relayDeployment(ctx context.Context, c client.Client, obr *outboxv1alpha1.OutboxRelay) (*appsv1.Deployment, error) {
	var list appsv1.DeploymentList
	if err := c.List(ctx, &list, client.InNamespace(obr.Namespace)); err != nil {
		return nil, err
	}
	for i := range list.Items {
		if metav1.IsControlledBy(&list.Items[i], obr) {
			return &list.Items[i], nil
		}
	}
	return nil, nil
}

// waitDeployment waits until obr's Deployment exists and ok says so.
func waitDeployment(ctx context.Context, c client.Client, obr *outboxv1alpha1.OutboxRelay, timeout time.Duration, ok func(*appsv1.Deployment) bool) error {
	deadline := time.Now().Add(timeout)
	for {
		d, err := relayDeployment(ctx, c, obr)
		if err != nil {
			return err
		}
		if d != nil && ok(d) {
			return nil
		}
		if time.Now().After(deadline) {
			if d == nil {
				return fmt.Errorf("no Deployment after %s", timeout)
			}
			return fmt.Errorf("after %s the Deployment has %d replicas (%d ready) of %d", timeout, d.Status.Replicas, d.Status.ReadyReplicas, ptr.Deref(d.Spec.Replicas, 1))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}
