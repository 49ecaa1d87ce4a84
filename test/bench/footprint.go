package main

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/localcluster"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// runFootprint measures what a fleet of OutboxRelays costs: o.relays
// OutboxRelays in fleetNamespaces namespaces, each team (namespace) with its
// own database user and Secrets, each relay on an outbox table of its own
// with a backlog, all in one real PostgreSQL database, reconciled by the
// manager binary against envtest's kube-apiserver while this process plays
// the kubelets (every Deployment's status set to all replicas ready). It
// measures the time until every OutboxRelay is Ready, and then over a steady
// window: the manager's RSS and CPU, the connections it holds to the
// database, the API requests it makes by verb and resource (from the API
// server's own metrics), and the database time and the sessions (logins)
// its backlog reads cost.
func runFootprint(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	reps, err := repeat(&options{reps: min(o.reps, 1)}, func(int) (map[string]float64, error) { return operatorRun(ctx, o, e) })
	if err != nil {
		return err
	}
	rep.add(scFootprint, fmt.Sprintf("relays=%d", o.relays), map[string]any{"relays": o.relays, "namespaces": fleetNamespaces,
		"steady_window": fleetSteadyWindow.String(), "connections_per_database": controllers.DefaultConnsPerDatabase,
		"secret_refresh": controllers.DefaultSecretRefreshInterval.String(), "backlog_interval": controllers.DefaultBacklogInterval.String()}, reps)
	return nil
}

// fleetNamespaces is how many namespaces (teams, database users) the fleet spans.
const fleetNamespaces = 50

// fleetSteadyWindow is how long the fleet is watched once every OutboxRelay is Ready.
const fleetSteadyWindow = 90 * time.Second

// fleetRows is each fleet table's backlog.
const fleetRows = 20

func operatorRun(ctx context.Context, o *options, e *benchEnv) (map[string]float64, error) {
	logf("creating %d outbox tables with %d rows each, and %d database users", o.relays, fleetRows, fleetNamespaces)
	dsn, err := e.pg.CreateDatabase(ctx, "fleet")
	if err != nil {
		return nil, err
	}
	defer e.pg.DropDatabase(context.Background(), "fleet") //nolint:errcheck // best effort
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	team := func(i int) string { return fmt.Sprintf("team%02d", i%fleetNamespaces) }
	for i := range fleetNamespaces {
		if _, err := pool.Exec(ctx, `DO $$ BEGIN CREATE ROLE `+team(i)+` LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`); err != nil {
			return nil, err
		}
	}
	for i := range o.relays {
		t := outbox.Table{Name: fmt.Sprintf("outbox_%04d", i)}
		_, err := pool.Exec(ctx, outbox.SchemaDDL(t)+fmt.Sprintf(`
			INSERT INTO %[1]s (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
			SELECT gen_random_uuid(), 'Order', 'o' || g, '%[3]s', '{}', 'k' || g FROM generate_series(1, %[4]d) g;
			GRANT SELECT ON %[1]s, %[5]s TO %[2]s;`, t.Quoted(), team(i), eventType, fleetRows, t.HeldTable().Quoted()))
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", t, err)
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		return nil, err
	}

	logf("starting kube-apiserver and etcd (envtest)")
	kube, err := testenv.StartKube(filepath.Join(e.work, "kube"))
	if err != nil {
		return nil, err
	}
	defer kube.Close() //nolint:errcheck // best effort at the end
	kubeconfig := filepath.Join(e.work, "kubeconfig")
	if err := kube.WriteKubeconfig(kubeconfig); err != nil {
		return nil, err
	}
	c, err := client.New(kube.Config, client.Options{Scheme: localcluster.Scheme()})
	if err != nil {
		return nil, err
	}
	ns := func(i int) string { return fmt.Sprintf("fleet-%02d", i%fleetNamespaces) }
	for i := range fleetNamespaces {
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns(i)}}); err != nil {
			return nil, err
		}
	}
	// The manager binary as users run it, in its own process so its RSS is
	// the manager's alone; error-level logs only, so logging does not weigh
	// on the measurement.
	logPath := filepath.Join(e.work, "manager.log")
	mgr, err := devproc.StartManager(e.managerBin, kubeconfig, logPath, "--zap-log-level=error")
	if err != nil {
		return nil, err
	}
	defer mgr.Stop(30 * time.Second)
	if err := mgr.WaitReady(ctx, 60*time.Second); err != nil {
		return nil, fmt.Errorf("manager: %w; see %s", err, logPath)
	}

	// The operator's connections to the fleet database, sampled all along.
	var connsPeak, connsSteady atomic.Int64
	steady := atomic.Bool{}
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampleCtx.Err() == nil {
			var n int64
			if err := pool.QueryRow(sampleCtx, `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = 'outbox-operator' AND datname = 'fleet'`).Scan(&n); err == nil {
				if n > connsPeak.Load() {
					connsPeak.Store(n)
				}
				if steady.Load() && n > connsSteady.Load() {
					connsSteady.Store(n)
				}
			}
			select {
			case <-sampleCtx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	defer func() { stopSampling(); <-sampled }()

	start := time.Now()
	// Create the Secrets and OutboxRelays from 8 clients, as an apply of many files would.
	var wg sync.WaitGroup
	errs := make(chan error, o.relays)
	work := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				name := fmt.Sprintf("relay-%04d", i)
				u, _ := url.Parse(dsn)
				u.User = url.User(team(i))
				sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns(i), Name: name + "-dsn"},
					StringData: map[string]string{"dsn": u.String()}}
				r := &outboxv1alpha1.OutboxRelay{ObjectMeta: metav1.ObjectMeta{Namespace: ns(i), Name: name},
					Spec: outboxv1alpha1.OutboxRelaySpec{
						DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: sec.Name},
						Table:        fmt.Sprintf("outbox_%04d", i),
						Topics:       map[string]outboxv1alpha1.TopicName{eventType: "orders.confirmed"},
						Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"kafka.example:9092"}},
						// No relay pod runs: the backlog stays, and must not read as lag.
						LagThreshold: "24h",
					}}
				if err := c.Create(ctx, sec); err != nil {
					errs <- err
					continue
				}
				if err := c.Create(ctx, r); err != nil {
					errs <- err
				}
			}
		}()
	}
	for i := range o.relays {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		return nil, fmt.Errorf("create OutboxRelays: %w", err)
	}
	created := time.Since(start)
	logf("created %d OutboxRelays and Secrets in %d namespaces in %s", o.relays, fleetNamespaces, created.Round(time.Millisecond))

	// Play the kubelets until every OutboxRelay is Ready with its backlog read.
	deadline := time.Now().Add(5 * time.Minute)
	for {
		if mgr.HasExited() {
			return nil, fmt.Errorf("manager exited: %s", mgr.Tail(10))
		}
		var ready, read int
		for i := range fleetNamespaces {
			if err := markDeploymentsReady(ctx, c, ns(i)); err != nil {
				return nil, err
			}
			var list outboxv1alpha1.OutboxRelayList
			if err := c.List(ctx, &list, client.InNamespace(ns(i))); err != nil {
				return nil, err
			}
			for _, r := range list.Items {
				cond := meta.FindStatusCondition(r.Status.Conditions, outboxv1alpha1.ConditionReady)
				if cond != nil && cond.Status == metav1.ConditionTrue && cond.ObservedGeneration == r.Generation {
					ready++
				}
				if b := r.Status.Backlog; b != nil && b.Pending == fleetRows {
					read++
				}
			}
		}
		if ready == o.relays && read == o.relays {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("after 5 minutes %d of %d OutboxRelays Ready, %d with their backlog read; see %s", ready, o.relays, read, logPath)
		}
		time.Sleep(500 * time.Millisecond)
	}
	readyAfter := time.Since(start)
	cpuReady, _ := cpuSeconds(mgr.Pid())
	logf("%d OutboxRelays Ready, backlogs read, after %s; watching them for %s", o.relays, readyAfter.Round(time.Millisecond), fleetSteadyWindow)

	// The steady window: nothing changes; the operator only reads backlogs.
	steady.Store(true)
	apiBefore, err := apiRequests(ctx, kube.Config)
	if err != nil {
		return nil, err
	}
	var activeBefore, activeAfter float64
	var sessionsBefore, sessionsAfter int64
	if err := pool.QueryRow(ctx, `SELECT active_time, sessions FROM pg_stat_database WHERE datname = 'fleet'`).Scan(&activeBefore, &sessionsBefore); err != nil {
		return nil, err
	}
	cpu0, _ := cpuSeconds(mgr.Pid())
	t0 := time.Now()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(fleetSteadyWindow):
	}
	window := time.Since(t0).Seconds()
	cpu1, _ := cpuSeconds(mgr.Pid())
	apiAfter, err := apiRequests(ctx, kube.Config)
	if err != nil {
		return nil, err
	}
	if err := pool.QueryRow(ctx, `SELECT active_time, sessions FROM pg_stat_database WHERE datname = 'fleet'`).Scan(&activeAfter, &sessionsAfter); err != nil {
		return nil, err
	}
	rss, hwm, err := memKiB(mgr.Pid())
	if err != nil {
		return nil, err
	}
	perS := func(verb, resource string) float64 {
		return (apiAfter[verb+" "+resource] - apiBefore[verb+" "+resource]) / window
	}
	var writes float64
	for k, v := range apiAfter {
		verb, resource, _ := strings.Cut(k, " ")
		if verb != "GET" && verb != "LIST" && verb != "WATCH" && fleetResource(resource) {
			writes += v - apiBefore[k]
		}
	}
	m := map[string]float64{
		"created_s":                  created.Seconds(),
		"ready_s":                    readyAfter.Seconds(),
		"manager_rss_mib":            rss / 1024,
		"manager_peak_rss_mib":       hwm / 1024,
		"manager_cpu_s":              cpuReady,
		"manager_steady_millicores":  1000 * (cpu1 - cpu0) / window,
		"db_conns_peak":              float64(connsPeak.Load()),
		"db_conns_steady":            float64(connsSteady.Load()),
		"db_ms_per_s":                (activeAfter - activeBefore) / window,
		"db_sessions_per_s":          float64(sessionsAfter-sessionsBefore) / window,
		"secret_gets_per_s":          perS("GET", "secrets"),
		"status_patches_per_s":       perS("PATCH", "outboxrelays/status"),
		"deployment_writes_per_s":    perS("PATCH", "deployments") + perS("UPDATE", "deployments"),
		"fleet_writes_per_s":         writes / window,
		"fleet_reads_per_s":          perS("GET", "outboxrelays") + perS("GET", "deployments") + perS("GET", "secrets"),
		"secret_gets_long_run_per_s": float64(o.relays) / controllers.DefaultSecretRefreshInterval.Seconds(),
	}
	logf("fleet: Ready in %.1f s; steady: RSS %.1f MiB, %.0f millicores, %0.f connections (peak %.0f), %.2f ms/s of database time, %.2f sessions opened/s, %.2f Secret GETs/s, %.2f writes/s",
		m["ready_s"], m["manager_rss_mib"], m["manager_steady_millicores"], m["db_conns_steady"], m["db_conns_peak"], m["db_ms_per_s"], m["db_sessions_per_s"], m["secret_gets_per_s"], m["fleet_writes_per_s"])
	return m, nil
}

// fleetResource reports whether resource is one the operator works on.
func fleetResource(resource string) bool {
	base, _, _ := strings.Cut(resource, "/")
	switch base {
	case "secrets", "outboxrelays", "deployments", "services", "poddisruptionbudgets", "events":
		return true
	}
	return false
}

// apiRequests reads the API server's apiserver_request_total, summed by
// "VERB resource[/subresource]".
func apiRequests(ctx context.Context, cfg *rest.Config) (map[string]float64, error) {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	body, err := cs.RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the API server's metrics: %w", err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("parse the API server's metrics: %w", err)
	}
	out := map[string]float64{}
	f := families["apiserver_request_total"]
	if f == nil {
		return out, nil
	}
	for _, m := range f.GetMetric() {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		r := l["resource"]
		if l["subresource"] != "" {
			r += "/" + l["subresource"]
		}
		out[l["verb"]+" "+r] += m.GetCounter().GetValue()
	}
	return out, nil
}

// markDeploymentsReady does what the Deployment controller and kubelets
// would: report every replica of each Deployment's current template ready.
func markDeploymentsReady(ctx context.Context, c client.Client, ns string) error {
	var list appsv1.DeploymentList
	if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return err
	}
	for i := range list.Items {
		d := &list.Items[i]
		want := int32(1)
		if d.Spec.Replicas != nil {
			want = *d.Spec.Replicas
		}
		if d.Status.ObservedGeneration == d.Generation && d.Status.ReadyReplicas == want && d.Status.UpdatedReplicas == want {
			continue
		}
		d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: want, UpdatedReplicas: want,
			ReadyReplicas: want, AvailableReplicas: want}
		if err := c.Status().Update(ctx, d); err != nil && !apierrors.IsConflict(err) {
			return fmt.Errorf("set status of Deployment %s: %w", d.Name, err)
		}
	}
	return nil
}
