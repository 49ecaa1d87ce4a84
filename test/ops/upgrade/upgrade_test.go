//go:build upgrade

// Package upgrade installs the previous release (releasekit.Latest, built
// from its commit in a git worktree) on a real one-node cluster, runs traffic
// through two OutboxRelays, and upgrades to the working tree's build, once
// by applying the new install manifests and once by `helm upgrade`: nothing
// is lost, no relay rolls more than once, the new CRD is in place and the
// objects the old operator wrote read as the new API. `make test-upgrade`
// runs it (CI runs it as a step of its own).
package upgrade

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/hack/releasekit"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/localcluster"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

const (
	operatorNS  = "outbox-system"
	imageRepo   = "ghcr.io/outbox-relay/outbox-operator"
	placeholder = imageRepo + ":latest" // the image config/ runs
)

// env is the cluster both upgrades run on.
type env struct {
	stack    *localcluster.Stack
	prev     string // the previous release's tag
	prevTree string // its worktree
	work     string
}

func TestUpgradeFromPreviousRelease(t *testing.T) {
	ctx := context.Background()
	root := testenv.RepoRoot()
	prev := releasekit.Latest()
	e := &env{prev: prev.Tag(), work: t.TempDir()}
	e.prevTree = filepath.Join(e.work, "prev")
	run(t, root, "git", "worktree", "add", "--detach", e.prevTree, previousCommit(t, root, prev))
	t.Cleanup(func() { _ = exec.Command("git", "-C", root, "worktree", "remove", "--force", e.prevTree).Run() })
	prevImages := filepath.Join(e.work, "prev-images")
	run(t, e.prevTree, "go", "run", "./hack/images", "-out", prevImages, "-version", e.prev)
	t.Logf("previous release %s built from its commit", e.prev)

	logf, err := os.Create(filepath.Join(e.work, "stack.log"))
	require.NoError(t, err)
	defer logf.Close()
	startCtx, cancel := context.WithTimeout(ctx, 8*time.Minute)
	defer cancel()
	e.stack, err = localcluster.Start(startCtx, localcluster.Options{
		Dir: filepath.Join(e.work, "stack"), Log: slog.New(slog.NewTextHandler(logf, nil)),
		NoOperator: true, ExtraImages: []string{filepath.Join(prevImages, "outbox-operator.tar")},
	})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, e.stack.Close()) })
	require.NoError(t, e.stack.PrepareOrders(ctx))
	payments := outbox.Table{Name: "payments_outbox"}
	require.NoError(t, e.stack.Postgres.Exec(ctx, localcluster.OrdersDatabase, outbox.SchemaDDL(payments)+fmt.Sprintf(
		"GRANT SELECT, UPDATE ON %s TO relay; GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO relay;", payments.Quoted(), payments.HeldTable().Quoted())))
	require.NoError(t, e.stack.Kafka.CreateTopicErr("payments.captured", 2))

	t.Run("install.yaml", func(t *testing.T) {
		// Remove it all (the CRD, so every OutboxRelay, too) for the next
		// way, whether this one passed or not: a manager of this way left
		// running would lead in place of the next way's.
		t.Cleanup(func() {
			for _, image := range []string{imageRepo + ":" + e.prev, e.stack.OperatorImage} {
				m := filepath.Join(e.work, "manifests-"+image[strings.LastIndex(image, ":")+1:]+".yaml")
				if _, err := os.Stat(m); err == nil {
					out, err := e.stack.Kubectl(ctx, "delete", "--wait", "--ignore-not-found", "-f", m)
					require.NoError(t, err, "%s", out)
				}
			}
		})
		e.upgrade(t, "upgrade-kubectl", func(t *testing.T) {
			e.apply(t, e.manifests(t, e.prevTree, imageRepo+":"+e.prev))
			require.NoError(t, e.stack.WaitManager(ctx, 3*time.Minute))
		}, func(t *testing.T) {
			e.apply(t, e.manifests(t, root, e.stack.OperatorImage))
			require.NoError(t, e.stack.WaitManager(ctx, 3*time.Minute))
		})
	})
	t.Run("helm", func(t *testing.T) {
		cfg := e.helm(t)
		e.upgrade(t, "upgrade-helm", func(t *testing.T) {
			chart, err := loader.Load(filepath.Join(e.prevTree, "charts", "outbox-operator"))
			require.NoError(t, err)
			install := action.NewInstall(cfg)
			install.ReleaseName, install.Namespace, install.CreateNamespace = "outbox", operatorNS, true
			_, err = install.Run(chart, map[string]any{"image": map[string]any{"tag": e.prev}})
			require.NoError(t, err)
			e.waitDeployment(t, operatorNS, "outbox-outbox-operator", imageRepo+":"+e.prev)
		}, func(t *testing.T) {
			// A release whose chart installed the CRD from crds/ leaves it to
			// no release; the adoption docs/install.md gives, then the upgrade.
			_, err := e.stack.Kubectl(ctx, "annotate", "--overwrite", "crd", "outboxrelays.outbox.dev",
				"meta.helm.sh/release-name=outbox", "meta.helm.sh/release-namespace="+operatorNS)
			require.NoError(t, err)
			_, err = e.stack.Kubectl(ctx, "label", "--overwrite", "crd", "outboxrelays.outbox.dev", "app.kubernetes.io/managed-by=Helm")
			require.NoError(t, err)
			chart, err := loader.Load(filepath.Join(root, "charts", "outbox-operator"))
			require.NoError(t, err)
			upgrade := action.NewUpgrade(cfg)
			upgrade.Namespace = operatorNS
			tag := e.stack.OperatorImage[strings.LastIndex(e.stack.OperatorImage, ":")+1:]
			_, err = upgrade.Run("outbox", chart, map[string]any{"image": map[string]any{"tag": tag}})
			require.NoError(t, err)
			e.waitDeployment(t, operatorNS, "outbox-outbox-operator", e.stack.OperatorImage)
		})
	})
}

// upgrade installs the previous release (before), creates two
// OutboxRelays in ns with writers on both tables, upgrades (after) while
// they write, and checks the invariants of an upgrade.
func (e *env) upgrade(t *testing.T, ns string, before, after func(*testing.T)) {
	ctx := context.Background()
	before(t)
	_, err := e.stack.Kubectl(ctx, "create", "namespace", ns)
	require.NoError(t, err)
	dsn := fmt.Sprintf("postgres://relay:relay@%s/%s?sslmode=disable",
		net.JoinHostPort(e.stack.Postgres.Host, strconv.Itoa(e.stack.Postgres.Port)), localcluster.OrdersDatabase)
	relays := fmt.Sprintf(`apiVersion: v1
kind: Secret
metadata: {name: dsn, namespace: %[1]s}
stringData: {dsn: %[2]q}
---
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: %[1]s}
spec:
  dsnSecretRef: {name: dsn}
  table: outbox
  topics: {OrderConfirmed: orders.confirmed}
  kafka: {brokers: [%[3]q]}
  pollInterval: 50ms
---
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: payments, namespace: %[1]s}
spec:
  dsnSecretRef: {name: dsn}
  table: payments_outbox
  topics: {PaymentCaptured: payments.captured}
  kafka: {brokers: [%[3]q]}
  pollInterval: 50ms
`, ns, dsn, e.stack.Kafka.Addr())
	e.apply(t, []byte(relays))
	for _, name := range []string{"orders", "payments"} {
		e.waitDeployment(t, ns, name+"-relay", "")
	}
	db, err := pgxpool.New(ctx, e.stack.OrdersDSN("postgres"))
	require.NoError(t, err)
	defer db.Close()
	w := startWriters(db)
	w.waitFor(t, 50) // traffic before the upgrade
	revisions := map[string]int{}
	for _, name := range []string{"orders", "payments"} {
		revisions[name] = e.revision(t, ns, name+"-relay")
	}

	after(t)
	for _, name := range []string{"orders", "payments"} {
		e.waitDeployment(t, ns, name+"-relay", e.stack.OperatorImage)
	}
	w.waitFor(t, w.count()+50) // traffic after the upgrade
	ids := w.stop()
	for table, n := range map[string]int{"outbox": len(ids["outbox"]), "payments_outbox": len(ids["payments_outbox"])} {
		require.Greater(t, n, 20, "rows written to %s", table)
	}

	// Nothing lost: every row is published, and on its topic.
	require.Eventually(t, func() bool {
		var n int
		err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL) + (SELECT count(*) FROM payments_outbox WHERE published_at IS NULL)`).Scan(&n)
		return err == nil && n == 0
	}, 2*time.Minute, 200*time.Millisecond, "every row written is published")
	for table, topic := range map[string]string{"outbox": "orders.confirmed", "payments_outbox": "payments.captured"} {
		seen := map[string]bool{}
		for _, m := range e.stack.Kafka.Consume(t, topic, len(ids[table]), time.Minute) {
			for _, h := range m.Headers {
				if h.Key == "event_id" {
					seen[string(h.Value)] = true
				}
			}
		}
		for _, id := range ids[table] {
			require.True(t, seen[id], "event %s of %s reached %s", id, table, topic)
		}
	}
	// No relay rolled more than once (the new relay image rolls each once).
	for _, name := range []string{"orders", "payments"} {
		rolls := e.revision(t, ns, name+"-relay") - revisions[name]
		require.LessOrEqual(t, rolls, 1, "%s rolled more than once", name)
		t.Logf("%s: rolled %d time(s) by the upgrade", name, rolls)
	}
	t.Logf("rows written and delivered: %d to orders.confirmed, %d to payments.captured", len(ids["outbox"]), len(ids["payments_outbox"]))
	// The relays published through the upgrade, not only after it: no row
	// waited a minute. Before, a relay stopped for the whole upgrade passed,
	// as long as its backlog drained within two minutes after.
	var waited float64
	require.NoError(t, db.QueryRow(ctx, `SELECT COALESCE(max(extract(epoch FROM published_at - created_at)), 0)::float8
		FROM (SELECT published_at, created_at FROM outbox UNION ALL SELECT published_at, created_at FROM payments_outbox) r`).Scan(&waited))
	t.Logf("the longest a row waited to be published: %.1f s", waited)
	require.Less(t, waited, time.Minute.Seconds(), "a row waited a minute or more: the relays stopped publishing during the upgrade")

	// A manager restart after the upgrade rolls no relay: the new manager
	// recognizes the relays' Secret values by the digests they record.
	// Before, nothing here checked it: the one roll allowed above was
	// always spent on the new relay image.
	upgraded := map[string]int{}
	for _, name := range []string{"orders", "payments"} {
		upgraded[name] = e.revision(t, ns, name+"-relay")
	}
	e.restartManager(t)
	require.Never(t, func() bool {
		for name, rev := range upgraded {
			if e.revision(t, ns, name+"-relay") != rev {
				return true
			}
		}
		return false
	}, 20*time.Second, time.Second, "a manager restart rolled a relay")
	// The new CRD, and the old operator's objects read as the new API.
	crd := &unstructured.Unstructured{}
	crd.SetGroupVersionKind(apiextensionsv1.SchemeGroupVersion.WithKind("CustomResourceDefinition"))
	require.NoError(t, e.stack.Client.Get(ctx, client.ObjectKey{Name: "outboxrelays.outbox.dev"}, crd))
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "crd", "bases", "outbox.dev_outboxrelays.yaml"))
	require.NoError(t, err)
	want := map[string]any{}
	require.NoError(t, yaml.Unmarshal(b, &want))
	require.Equal(t, schemaOf(t, want), schemaOf(t, crd.Object), "the cluster serves the new CRD's schema")
	for _, name := range []string{"orders", "payments"} {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(outboxv1alpha1.GroupVersion.WithKind("OutboxRelay"))
		require.NoError(t, e.stack.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, u))
		raw, err := json.Marshal(u.Object)
		require.NoError(t, err)
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		relay := &outboxv1alpha1.OutboxRelay{}
		require.NoError(t, dec.Decode(relay), "%s reads as the new API", name)
		require.NotEmpty(t, relay.Status.Conditions, name)
	}
}

// restartManager deletes the manager's pods and waits until a new one is
// ready.
func (e *env) restartManager(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	manager := client.MatchingLabels{"app.kubernetes.io/component": "manager"}
	var pods corev1.PodList
	require.NoError(t, e.stack.Client.List(ctx, &pods, client.InNamespace(operatorNS), manager))
	old := map[string]bool{}
	for _, p := range pods.Items {
		old[p.Name] = true
	}
	out, err := e.stack.Kubectl(ctx, "delete", "pod", "-n", operatorNS, "-l", "app.kubernetes.io/component=manager", "--wait")
	require.NoError(t, err, "%s", out)
	require.Eventually(t, func() bool {
		var pods corev1.PodList
		if e.stack.Client.List(ctx, &pods, client.InNamespace(operatorNS), manager) != nil {
			return false
		}
		for _, p := range pods.Items {
			for _, c := range p.Status.Conditions {
				if !old[p.Name] && c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					return true
				}
			}
		}
		return false
	}, 3*time.Minute, 500*time.Millisecond, "a new manager pod ready")
}

// schemaOf is the first version's schema of a CRD, as JSON values.
func schemaOf(t *testing.T, crd map[string]any) any {
	t.Helper()
	versions, _, err := unstructured.NestedSlice(crd, "spec", "versions")
	require.NoError(t, err)
	require.NotEmpty(t, versions)
	raw, err := json.Marshal(versions[0].(map[string]any)["schema"])
	require.NoError(t, err)
	var v any
	require.NoError(t, json.Unmarshal(raw, &v))
	return v
}

// manifests renders config/default of tree with the image pinned, and
// keeps a copy for the cleanup.
func (e *env) manifests(t *testing.T, tree, image string) []byte {
	out := run(t, tree, e.stack.KubectlPath(), "kustomize", "config/default")
	m := []byte(strings.ReplaceAll(out, placeholder, image))
	require.NoError(t, os.WriteFile(filepath.Join(e.work, "manifests-"+image[strings.LastIndex(image, ":")+1:]+".yaml"), m, 0o644))
	return m
}

func (e *env) apply(t *testing.T, manifest []byte) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "m.yaml")
	require.NoError(t, os.WriteFile(p, manifest, 0o644))
	out, err := e.stack.Kubectl(context.Background(), "apply", "--server-side", "-f", p) // as docs/install.md says: a conflict is a user's too
	require.NoError(t, err, "%s", out)
}

// waitDeployment waits until ns/name runs image (any when empty) on every
// replica, up to date and available.
func (e *env) waitDeployment(t *testing.T, ns, name, image string) {
	t.Helper()
	d := &appsv1.Deployment{}
	require.Eventually(t, func() bool {
		if e.stack.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, d) != nil || d.Spec.Replicas == nil {
			return false
		}
		s := d.Status
		return (image == "" || d.Spec.Template.Spec.Containers[0].Image == image) && s.ObservedGeneration >= d.Generation &&
			s.UpdatedReplicas == *d.Spec.Replicas && s.AvailableReplicas == *d.Spec.Replicas && s.Replicas == *d.Spec.Replicas
	}, 4*time.Minute, 500*time.Millisecond, "Deployment %s/%s running %s", ns, name, image)
}

// revision is the Deployment's rollout count (deployment.kubernetes.io/revision).
func (e *env) revision(t *testing.T, ns, name string) int {
	d := &appsv1.Deployment{}
	require.NoError(t, e.stack.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, d))
	n, err := strconv.Atoi(d.Annotations["deployment.kubernetes.io/revision"])
	require.NoError(t, err)
	return n
}

// helm is a Helm configuration for the stack's cluster.
func (e *env) helm(t *testing.T) *action.Configuration {
	flags := genericclioptions.NewConfigFlags(false)
	flags.KubeConfig = &e.stack.Kubeconfig
	ns := operatorNS
	flags.Namespace = &ns
	cfg := &action.Configuration{}
	require.NoError(t, cfg.Init(flags, operatorNS, "secret", func(format string, v ...any) { t.Logf(format, v...) }))
	return cfg
}

// writers insert rows into both outbox tables until stopped.
type writers struct {
	stopCh chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	ids    map[string][]string
}

func startWriters(db *pgxpool.Pool) *writers {
	w := &writers{stopCh: make(chan struct{}), ids: map[string][]string{}}
	for table, eventType := range map[string]string{"outbox": "OrderConfirmed", "payments_outbox": "PaymentCaptured"} {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			for i := 0; ; i++ {
				select {
				case <-w.stopCh:
					return
				case <-time.After(20 * time.Millisecond):
				}
				var id string
				err := db.QueryRow(context.Background(), `INSERT INTO `+table+` (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
					VALUES (gen_random_uuid(), 'Agg', $1, $2, '{"n": 1}', $1) RETURNING event_id::text`, strconv.Itoa(i%7), eventType).Scan(&id)
				if err == nil {
					w.mu.Lock()
					w.ids[table] = append(w.ids[table], id)
					w.mu.Unlock()
				}
			}
		}()
	}
	return w
}

// count is how many rows the writers wrote to the smaller table.
func (w *writers) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return min(len(w.ids["outbox"]), len(w.ids["payments_outbox"]))
}

// waitFor waits until each table got at least n rows.
func (w *writers) waitFor(t *testing.T, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return w.count() >= n }, time.Minute, 50*time.Millisecond, "writers wrote %d rows to each table", n)
}

func (w *writers) stop() map[string][]string {
	close(w.stopCh)
	w.wg.Wait()
	return w.ids
}

func run(t *testing.T, dir string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "%s %v: %s", name, args, stderr.String())
	return string(out)
}

// previousCommit is the commit release r was cut from, made present in the
// clone: CI checks out main alone (no tags, perhaps shallow), so the commit
// comes from the release list, fetched from origin when the history stops
// short of it. Where the tag is present it must name the same commit.
func previousCommit(t *testing.T, root string, r releasekit.Release) string {
	t.Helper()
	if out, err := exec.Command("git", "-C", root, "rev-parse", "--verify", "--quiet", r.Tag()+"^{commit}").Output(); err == nil {
		require.Equal(t, r.Commit, strings.TrimSpace(string(out)), "tag %s names another commit than releasekit.Releases records", r.Tag())
	}
	if exec.Command("git", "-C", root, "cat-file", "-e", r.Commit+"^{commit}").Run() != nil {
		out, err := exec.Command("git", "-C", root, "fetch", "--quiet", "origin", r.Commit).CombinedOutput()
		require.NoError(t, err, "release %s: commit %s is not in this clone and origin did not give it: %s", r.Tag(), r.Commit, out)
	}
	return r.Commit
}
