package install

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/Masterminds/semver/v3"
	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/release"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/outbox-relay/outbox-operator/hack/releasekit"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

const releaseNamespace = "outbox-system"

func chartDir() string { return repo("charts", "outbox-operator") }

// loadDevChart is the chart as the tree holds it: between releases a
// development version (x.y.z-dev), which renders only with an image set.
func loadDevChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir())
	require.NoError(t, err)
	return c
}

// loadChart is the chart as `make release` packages it from this tree:
// version and appVersion stamped with the release's version (the tree's,
// without -dev), so the image defaults to the release's own tag.
func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c := loadDevChart(t)
	v := strings.TrimSuffix(c.Metadata.Version, "-dev")
	c.Metadata.Version, c.Metadata.AppVersion = v, "v"+v
	return c
}

// releaseChartDir writes loadChart's chart into a folder, for what takes
// a chart's path (helm lint).
func releaseChartDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	c := loadChart(t)
	require.NoError(t, chartutil.SaveDir(c, dir))
	return filepath.Join(dir, c.Name())
}

// values parses a YAML values document.
func values(t *testing.T, doc string) map[string]any {
	t.Helper()
	v := map[string]any{}
	require.NoError(t, yaml.Unmarshal([]byte(doc), &v))
	return v
}

// render runs `helm install --dry-run --include-crds` for release "outbox"
// in releaseNamespace, on the client side, as Kubernetes 1.37 with the
// Prometheus Operator's API.
func render(t *testing.T, vals map[string]any) ([]*unstructured.Unstructured, string, error) {
	t.Helper()
	return renderChart(t, loadChart(t), vals)
}

// renderChart is render of chart c.
func renderChart(t *testing.T, c *chart.Chart, vals map[string]any) ([]*unstructured.Unstructured, string, error) {
	t.Helper()
	rel, err := dryRun(c, vals)
	if err != nil {
		return nil, "", err
	}
	return decode(t, []byte(rel.Manifest)), rel.Manifest, nil
}

// dryRun is the release render makes of chart c, with its notes.
func dryRun(c *chart.Chart, vals map[string]any) (*release.Release, error) {
	inst := action.NewInstall(&action.Configuration{})
	inst.DryRun, inst.ClientOnly, inst.IncludeCRDs = true, true, true
	inst.ReleaseName, inst.Namespace = "outbox", releaseNamespace
	inst.KubeVersion = &chartutil.KubeVersion{Version: "v1.37.2", Major: "1", Minor: "37"}
	inst.APIVersions = chartutil.VersionSet{"monitoring.coreos.com/v1"}
	return inst.Run(c, vals)
}

func mustRender(t *testing.T, vals map[string]any) ([]*unstructured.Unstructured, string) {
	t.Helper()
	objs, manifest, err := render(t, vals)
	require.NoError(t, err)
	return objs, manifest
}

// TestChartCopiesAreIdentical: the chart ships copies of files generated or
// kept under config/ (Helm reads no file outside a chart); each must be
// byte-identical to its source. `make chart-sync` (run by `make manifests`)
// refreshes them.
func TestChartCopiesAreIdentical(t *testing.T) {
	t.Parallel()
	pairs := map[string]string{
		"files/role.yaml":                      "config/rbac/role.yaml",
		"files/leader_election_role.yaml":      "config/rbac/leader_election_role.yaml",
		"files/digest_key_role.yaml":           "config/rbac/digest_key_role.yaml",
		"files/prometheusrule.yaml":            "config/prometheus/prometheusrule.yaml",
		"files/outbox-operator-dashboard.json": "config/grafana/outbox-operator-dashboard.json",
		"files/metrics_auth_role.yaml":         "config/rbac/metrics_auth_role.yaml",
		"files/metrics_reader_role.yaml":       "config/rbac/metrics_reader_role.yaml",
		"files/outboxrelay_editor_role.yaml":   "config/rbac/outboxrelay_editor_role.yaml",
		"files/outboxrelay_viewer_role.yaml":   "config/rbac/outboxrelay_viewer_role.yaml",
	}
	crds, err := filepath.Glob(repo("config", "crd", "bases", "*.yaml"))
	require.NoError(t, err)
	require.NotEmpty(t, crds)
	for _, src := range crds {
		pairs["files/crds/"+filepath.Base(src)] = "config/crd/bases/" + filepath.Base(src)
	}
	shipped, err := filepath.Glob(filepath.Join(chartDir(), "files", "crds", "*"))
	require.NoError(t, err)
	require.Len(t, shipped, len(crds), "charts/outbox-operator/files/crds holds exactly the CRDs of config/crd/bases")
	for copyPath, src := range pairs {
		want, err := os.ReadFile(repo(src))
		require.NoError(t, err)
		got, err := os.ReadFile(filepath.Join(chartDir(), copyPath))
		require.NoError(t, err)
		require.True(t, string(want) == string(got), "charts/outbox-operator/%s differs from %s: run `make chart-sync`", copyPath, src)
	}
}

// nonDefault turns on every option the chart has.
const nonDefault = `
image: {repository: registry.example/outbox/operator, digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", pullPolicy: Always}
imagePullSecrets: [{name: registry-creds}]
replicaCount: 2
watchNamespaces: [shop, billing]
relay: {image: registry.example/outbox/relay:v2, allowedImages: ["registry.example/outbox/", "ghcr.io/outbox-relay/"]}
resources: {requests: {cpu: 100m, memory: 128Mi}, limits: {memory: 512Mi}}
extraArgs: [--zap-log-level=debug]
podAnnotations: {example.com/team: payments}
podLabels: {team: payments}
nodeSelector: {kubernetes.io/os: linux}
tolerations: [{key: dedicated, operator: Equal, value: ops, effect: NoSchedule}]
priorityClassName: system-cluster-critical
serviceAccount: {annotations: {example.com/role: outbox}}
metrics: {port: 9443, secure: false}
monitoring:
  podMonitor: {enabled: true, labels: {release: prometheus}, interval: 30s}
  relayPodMonitorLabels: {release: prometheus, team: payments}
  prometheusRule: {enabled: true, labels: {release: prometheus}}
  grafanaDashboard: {enabled: true}
`

// TestChartLints runs Helm's linter, strict, on the chart as released
// with the default and the non-default values, and on the tree's chart
// with an image tag.
func TestChartLints(t *testing.T) {
	t.Parallel()
	released := releaseChartDir(t)
	for name, tc := range map[string]struct {
		dir  string
		vals map[string]any
	}{
		"default":             {released, nil},
		"non-default":         {released, values(t, nonDefault)},
		"development, tagged": {chartDir(), values(t, `{image: {tag: v9.9.9}}`)},
		"development, digest": {chartDir(), values(t, `{image: {digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}}`)},
	} {
		lint := action.NewLint()
		lint.Strict = true
		lint.Namespace = releaseNamespace
		res := lint.Run([]string{tc.dir}, tc.vals)
		require.Empty(t, res.Errors, name)
		for _, m := range res.Messages {
			require.Less(t, m.Severity, support.WarningSev, "%s: %s", name, m)
		}
	}
}

// TestChartDefaultImageIsItsOwnRelease: the chart never pairs its CRD with
// an operator of another release. Its version and appVersion name one
// release, newer than every recorded one (hack/releasekit). A development
// chart (x.y.z-dev, the tree between releases) refuses to render without
// image.tag or image.digest, naming both; released (as `make release`
// stamps it), it runs the image of its own version.
func TestChartDefaultImageIsItsOwnRelease(t *testing.T) {
	t.Parallel()
	dev := loadDevChart(t)
	require.Equal(t, "v"+dev.Metadata.Version, dev.Metadata.AppVersion, "Chart.yaml: appVersion is v<version>")
	version, err := semver.StrictNewVersion(dev.Metadata.Version)
	require.NoError(t, err, "Chart.yaml version")
	latest := releasekit.Latest()
	require.True(t, version.GreaterThan(semver.MustParse(latest.Version)),
		"Chart.yaml version %s is not newer than the latest release %s: between releases it is the next one's, with -dev (docs/release.md)", version, latest.Version)

	if strings.HasSuffix(dev.Metadata.Version, "-dev") {
		_, _, err := renderChart(t, dev, nil)
		require.Error(t, err, "a development chart rendered with its default image")
		require.ErrorContains(t, err, "development version ("+dev.Metadata.Version)
		require.ErrorContains(t, err, "image.tag or image.digest")
		for _, tc := range []struct{ values, image string }{
			{`{image: {tag: v9.9.9}}`, "ghcr.io/outbox-relay/outbox-operator:v9.9.9"},
			{`{image: {digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}}`,
				"ghcr.io/outbox-relay/outbox-operator@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
		} {
			objs, _, err := renderChart(t, dev, values(t, tc.values))
			require.NoError(t, err, tc.values)
			c := container(t, find(t, objs, "Deployment", ""))
			require.Equal(t, tc.image, c["image"], tc.values)
			require.Equal(t, tc.image, env(t, c)["RELAY_IMAGE"], tc.values)
		}
	}

	released := loadChart(t)
	require.NotContains(t, released.Metadata.AppVersion, "-dev")
	objs, _, err := renderChart(t, released, nil)
	require.NoError(t, err)
	require.Equal(t, "ghcr.io/outbox-relay/outbox-operator:"+released.Metadata.AppVersion, container(t, find(t, objs, "Deployment", ""))["image"])

	// A tag of an older release, as a values file kept from its upgrade
	// pins, is refused, released chart or not: that operator ignores the
	// fields this chart's CRD added. Before, the upgrade went through and
	// the old operator ran on.
	for _, c := range []*chart.Chart{dev, released} {
		_, _, err = renderChart(t, c, values(t, "{image: {tag: v"+latest.Version+"}}"))
		require.ErrorContains(t, err, "image.tag v"+latest.Version+" is an older operator release than this chart's")
		require.ErrorContains(t, err, "Drop image.tag")
		_, _, err = renderChart(t, c, values(t, `{image: {tag: "sha-0123abc"}}`))
		require.NoError(t, err, "a tag that names no release is the user's to choose")
	}
}

func container(t *testing.T, deploy *unstructured.Unstructured) map[string]any {
	t.Helper()
	cs, _, err := unstructured.NestedSlice(deploy.Object, "spec", "template", "spec", "containers")
	require.NoError(t, err)
	require.Len(t, cs, 1)
	return cs[0].(map[string]any)
}

func env(t *testing.T, c map[string]any) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, e := range c["env"].([]any) {
		e := e.(map[string]any)
		v, _ := e["value"].(string)
		out[e["name"].(string)] = v
	}
	return out
}

// TestChartDefaultMirrorsConfigDefault: with default values the chart runs
// the manager as config/default does (same command, arguments, ports,
// probes, security contexts, resources and environment, image aside) with the
// same RBAC rules, granted cluster-wide.
func TestChartDefaultMirrorsConfigDefault(t *testing.T) {
	t.Parallel()
	objs, _ := mustRender(t, nil)
	kustomized := decode(t, kubectl(t, nil, "kustomize", "config/default"))

	chartDeploy := find(t, objs, "Deployment", "outbox-outbox-operator")
	kustDeploy := find(t, kustomized, "Deployment", "outbox-operator-controller-manager")
	cc, kc := container(t, chartDeploy), container(t, kustDeploy)
	for _, field := range []string{"command", "args", "ports", "livenessProbe", "readinessProbe", "resources", "securityContext"} {
		require.Equal(t, kc[field], cc[field], "container %s", field)
	}
	require.Equal(t, "ghcr.io/outbox-relay/outbox-operator:"+loadChart(t).Metadata.AppVersion, cc["image"], "released, the image defaults to the chart's appVersion")
	ce, ke := env(t, cc), env(t, kc)
	require.Equal(t, ke["WATCH_NAMESPACE"], ce["WATCH_NAMESPACE"])
	require.Equal(t, cc["image"], ce["RELAY_IMAGE"], "the relay image defaults to the operator's")
	require.Len(t, ce, len(ke))
	for _, field := range []string{"securityContext", "terminationGracePeriodSeconds"} {
		want, _, _ := unstructured.NestedFieldCopy(kustDeploy.Object, "spec", "template", "spec", field)
		got, _, _ := unstructured.NestedFieldCopy(chartDeploy.Object, "spec", "template", "spec", field)
		require.Equal(t, want, got, "pod %s", field)
	}

	for kust, chart := range map[string]string{
		"outbox-operator-manager-role":       "outbox-outbox-operator-manager",
		"outbox-operator-metrics-auth-role":  "outbox-outbox-operator-metrics-auth",
		"outbox-operator-metrics-reader":     "outbox-outbox-operator-metrics-reader",
		"outbox-operator-outboxrelay-editor": "outbox-outbox-operator-outboxrelay-editor",
		"outbox-operator-outboxrelay-viewer": "outbox-outbox-operator-outboxrelay-viewer",
	} {
		k, c := find(t, kustomized, "ClusterRole", kust), find(t, objs, "ClusterRole", chart)
		require.Equal(t, k.Object["rules"], c.Object["rules"], chart)
		for l, v := range k.GetLabels() {
			if strings.HasPrefix(l, "rbac.authorization.k8s.io/") {
				require.Equal(t, v, c.GetLabels()[l], "%s: aggregation label %s", chart, l)
			}
		}
	}
	require.Equal(t, find(t, kustomized, "Role", "outbox-operator-leader-election-role").Object["rules"],
		find(t, objs, "Role", "outbox-outbox-operator-leader-election").Object["rules"], "leader election")
	// The digest key: the same empty Secret, named in the manager's
	// environment, and the same rule on it alone.
	kustKey, chartKey := find(t, kustomized, "Secret", "outbox-operator-digest-key"), find(t, objs, "Secret", "outbox-outbox-operator-digest-key")
	require.Equal(t, kustKey.GetName(), ke["DIGEST_KEY_SECRET"])
	require.Equal(t, chartKey.GetName(), ce["DIGEST_KEY_SECRET"])
	require.Equal(t, chartKey.GetNamespace(), releaseNamespace)
	keyRules := func(role *unstructured.Unstructured, secret string) any {
		rules, _, err := unstructured.NestedSlice(role.Object, "rules")
		require.NoError(t, err)
		require.Len(t, rules, 1)
		require.Equal(t, []any{secret}, rules[0].(map[string]any)["resourceNames"], role.GetName())
		delete(rules[0].(map[string]any), "resourceNames")
		return rules
	}
	require.Equal(t, keyRules(find(t, kustomized, "Role", "outbox-operator-digest-key-role"), kustKey.GetName()),
		keyRules(find(t, objs, "Role", "outbox-outbox-operator-digest-key"), chartKey.GetName()), "the digest key")
	svc := find(t, objs, "Service", "outbox-outbox-operator-metrics")
	require.Equal(t, find(t, kustomized, "Service", "").Object["spec"].(map[string]any)["ports"], svc.Object["spec"].(map[string]any)["ports"], "the metrics Service")
	crb := find(t, objs, "ClusterRoleBinding", "outbox-outbox-operator-manager")
	require.Equal(t, "outbox-outbox-operator-manager", crb.Object["roleRef"].(map[string]any)["name"])
	require.Equal(t, releaseNamespace, crb.Object["subjects"].([]any)[0].(map[string]any)["namespace"])
	for _, kind := range []string{"PodMonitor", "PrometheusRule", "ConfigMap"} {
		for _, o := range objs {
			require.NotEqual(t, kind, o.GetKind(), "monitoring objects are off by default")
		}
	}
	find(t, objs, "CustomResourceDefinition", "outboxrelays.outbox.dev")
}

// TestChartNonDefaultValues checks what each non-default value changes.
func TestChartNonDefaultValues(t *testing.T) {
	t.Parallel()
	objs, _ := mustRender(t, values(t, nonDefault))
	deploy := find(t, objs, "Deployment", "")
	c := container(t, deploy)
	image := "registry.example/outbox/operator@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	require.Equal(t, image, c["image"])
	require.Equal(t, "Always", c["imagePullPolicy"])
	require.Equal(t, []any{"--leader-elect", "--metrics-bind-address=:9443", "--metrics-secure=false", "--health-probe-bind-address=:8081",
		"--relay-podmonitor-labels=release=prometheus,team=payments", "--allowed-relay-images=registry.example/outbox/,ghcr.io/outbox-relay/", "--zap-log-level=debug"}, c["args"])
	e := env(t, c)
	require.Equal(t, "registry.example/outbox/relay:v2", e["RELAY_IMAGE"])
	require.Equal(t, "shop,billing", e["WATCH_NAMESPACE"])
	replicas, _, _ := unstructured.NestedFieldCopy(deploy.Object, "spec", "replicas")
	require.EqualValues(t, 2, replicas)
	pod, _, _ := unstructured.NestedMap(deploy.Object, "spec", "template", "spec")
	require.Equal(t, "system-cluster-critical", pod["priorityClassName"])
	require.Equal(t, map[string]any{"kubernetes.io/os": "linux"}, pod["nodeSelector"])
	require.Len(t, pod["tolerations"], 1)
	require.Equal(t, []any{map[string]any{"name": "registry-creds"}}, pod["imagePullSecrets"])
	labels, _, _ := unstructured.NestedStringMap(deploy.Object, "spec", "template", "metadata", "labels")
	require.Equal(t, "payments", labels["team"])

	// Namespaced: a Role and RoleBinding in each watched namespace; no
	// cluster-wide grant to the manager (the aggregated outboxrelay roles
	// grant users, not the manager).
	for _, o := range objs {
		if o.GetKind() == "ClusterRoleBinding" {
			t.Fatalf("a cluster-wide binding in namespaced mode: %s", o.GetName())
		}
		if o.GetKind() == "ClusterRole" {
			require.Contains(t, o.GetName(), "-outboxrelay-", "only the aggregated roles are cluster-wide: %s", o.GetName())
		}
	}
	var roleNamespaces []string
	for _, o := range objs {
		if o.GetKind() == "Role" && strings.HasSuffix(o.GetName(), "-manager") {
			roleNamespaces = append(roleNamespaces, o.GetNamespace())
			rules, _, _ := unstructured.NestedSlice(o.Object, "rules")
			require.NotEmpty(t, rules)
		}
	}
	require.ElementsMatch(t, []string{"shop", "billing"}, roleNamespaces)

	pm := find(t, objs, "PodMonitor", "")
	require.Equal(t, "prometheus", pm.GetLabels()["release"])
	endpoints, _, _ := unstructured.NestedSlice(pm.Object, "spec", "podMetricsEndpoints")
	require.Equal(t, "30s", endpoints[0].(map[string]any)["interval"])
	require.Equal(t, true, endpoints[0].(map[string]any)["honorLabels"], "the operator's gauges keep the relay's namespace label")
	jobLabel, _, _ := unstructured.NestedString(pm.Object, "spec", "jobLabel")
	require.Equal(t, "outbox-operator", labels[jobLabel], `the rules find the manager as job="outbox-operator"`)
	rule := find(t, objs, "PrometheusRule", "")
	var src map[string]any
	b, err := os.ReadFile(repo("config", "prometheus", "prometheusrule.yaml"))
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(b, &src))
	require.Equal(t, src["spec"], rule.Object["spec"], "the chart's rules are config/prometheus's")
	cm := find(t, objs, "ConfigMap", "")
	require.Equal(t, "1", cm.GetLabels()["grafana_dashboard"])
	dash, err := os.ReadFile(repo("config", "grafana", "outbox-operator-dashboard.json"))
	require.NoError(t, err)
	require.JSONEq(t, string(dash), cm.Object["data"].(map[string]any)["outbox-operator.json"].(string))
}

// TestChartMetricsOff: metrics.enabled=false turns the endpoint off and
// drops the port and the metrics Service; asking for a ServiceMonitor or
// PodMonitor with it fails, naming both values, instead of rendering none.
func TestChartMetricsOff(t *testing.T) {
	t.Parallel()
	objs, _ := mustRender(t, values(t, `{metrics: {enabled: false}}`))
	c := container(t, find(t, objs, "Deployment", ""))
	require.Contains(t, c["args"], "--metrics-bind-address=0")
	for _, p := range c["ports"].([]any) {
		require.NotEqual(t, "metrics", p.(map[string]any)["name"])
	}
	for _, o := range objs {
		require.NotContains(t, []string{"Service", "ServiceMonitor", "PodMonitor"}, o.GetKind())
	}
	for _, monitor := range []string{"serviceMonitor", "podMonitor"} {
		_, _, err := render(t, values(t, `{metrics: {enabled: false, secure: false}, monitoring: {`+monitor+`: {enabled: true}}}`))
		require.Error(t, err, monitor)
		require.ErrorContains(t, err, "monitoring."+monitor+".enabled=true needs metrics.enabled=true")
	}
}

// TestChartAppliesToAPIServer applies what the chart renders, server-side
// with dry run, to the API server: it accepts every object, with default
// and non-default values.
func TestChartAppliesToAPIServer(t *testing.T) {
	installMonitoringCRDs(t)
	for _, ns := range []string{releaseNamespace, "shop", "billing"} {
		ensureNamespace(t, ns)
	}
	cases := map[string]string{"non-default": nonDefault}
	for _, tc := range chartCases {
		if tc.err == "" {
			cases[tc.name] = tc.values
		}
	}
	for name, vals := range cases {
		_, manifest := mustRender(t, values(t, vals))
		// Server-side apply validates every field against the API server's
		// own OpenAPI schema (unknown or mistyped fields are refused).
		out := kubectl(t, []byte(manifest), "apply", "--server-side", "--dry-run=server", "--force-conflicts", "--validate=strict", "-f", "-")
		require.Contains(t, string(out), "serverside-applied (server dry run)", name)
	}
}

// TestNamespacedChartConfines installs the chart for real with one watched
// namespace and checks, as the manager's service account, that it may read
// Secrets and manage Deployments there and read no Secret anywhere else.
func TestNamespacedChartConfines(t *testing.T) {
	const ns = "orders-team"
	ensureNamespace(t, releaseNamespace)
	ensureNamespace(t, ns)
	objs, manifest := mustRender(t, values(t, `{watchNamespaces: [orders-team]}`))
	manifest = strings.ReplaceAll(manifest, "outbox-outbox-operator", "confined-outbox-operator") // its own names
	kubectl(t, []byte(manifest), "apply", "--server-side", "--force-conflicts", "-f", "-")
	require.NotEmpty(t, objs)

	asSA := rest.CopyConfig(testenv.Kube().Config)
	asSA.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + releaseNamespace + ":confined-outbox-operator"}
	c, err := client.New(asSA, client.Options{Scheme: adminClient(t).Scheme()})
	require.NoError(t, err)
	ctx := context.Background()
	err = c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "any"}, &corev1.Secret{})
	require.True(t, apierrors.IsNotFound(err), "a Secret in the watched namespace: want NotFound, got %v", err)
	err = c.Get(ctx, client.ObjectKey{Namespace: "default", Name: "any"}, &corev1.Secret{})
	require.True(t, apierrors.IsForbidden(err), "a Secret elsewhere: want Forbidden, got %v", err)
	err = c.List(ctx, &corev1.SecretList{})
	require.True(t, apierrors.IsForbidden(err), "Secrets of every namespace: want Forbidden, got %v", err)
	// In its own namespace, which it does not watch: its digest key's
	// Secret, which it may fill, and no other.
	key := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: releaseNamespace, Name: "confined-outbox-operator-digest-key"}, key))
	key.Data = map[string][]byte{"key": []byte("0123456789abcdef0123456789abcdef")}
	require.NoError(t, c.Update(ctx, key), "the manager fills its digest key")
	err = c.Get(ctx, client.ObjectKey{Namespace: releaseNamespace, Name: "any"}, &corev1.Secret{})
	require.True(t, apierrors.IsForbidden(err), "another Secret of the release namespace: want Forbidden, got %v", err)
}

// TestChartRefusesBadValues: values.schema.json makes Helm refuse values
// that would install a broken operator, naming the value.
func TestChartRefusesBadValues(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ values, want string }{
		{`{imageTag: v1}`, "additional properties 'imageTag' not allowed"},
		{`{image: {tag: "v1 beta"}}`, "/image/tag"},
		{`{image: {digest: "sha256:abc"}}`, "/image/digest"},
		{`{image: {pullPolicy: Sometimes}}`, "/image/pullPolicy"},
		{`{replicaCount: -1}`, "/replicaCount"},
		{`{replicaCount: "2"}`, "/replicaCount"},
		{`{replicaCount: 2, leaderElection: {enabled: false}}`, "/replicaCount"},
		{`{leaderElection: {id: Payments}}`, "/leaderElection/id"},
		{`{watchNamespaces: [Shop]}`, "/watchNamespaces/0"},
		{`{watchNamespaces: shop}`, "/watchNamespaces"},
		{`{relay: {allowedImages: ["a/,b/"]}}`, "/relay/allowedImages/0"},
		{`{resources: {limits: {memory: lots}}}`, "/resources/limits/memory"},
		{`{extraArgs: [-v]}`, "/extraArgs/0"},
		{`{metrics: {port: 8081}}`, "/metrics/port"},
		{`{metrics: {port: 70000}}`, "/metrics/port"},
		{`{monitoring: {podMonitor: {enabled: "yes"}}}`, "/monitoring/podMonitor/enabled"},
		{`{monitoring: {podMonitor: {interval: 30}}}`, "/monitoring/podMonitor/interval"},
		{`{monitoring: {serviceMonitor: {enabled: true, port: 1}}}`, "additional properties 'port' not allowed"},
		{`{serviceAccount: {name: Bad_Name}}`, "/serviceAccount/name"},
		{`{crds: {keep: "yes"}}`, "/crds/keep"},
		{`{rbac: {create: 0}}`, "/rbac/create"},
		{`{extraEnv: [{name: WATCH_NAMESPACE, value: x}]}`, "/extraEnv/0/name"},
		{`{extraEnv: [{name: DIGEST_KEY_SECRET, value: x}]}`, "/extraEnv/0/name"},
		{`{metrics: {readers: [{name: prometheus}]}}`, "/metrics/readers/0"},
		{`{podDisruptionBudget: {minAvailable: half}}`, "/podDisruptionBudget/minAvailable"},
		{`{podLabels: {app.kubernetes.io/name: other}}`, "invalid propertyName 'app.kubernetes.io/name'"},
		{`{monitoring: {relayPodMonitorLabels: {app.kubernetes.io/managed-by: me}}}`, "invalid propertyName 'app.kubernetes.io/managed-by'"},
		{`{monitoring: {relayPodMonitorLabels: {"bad key": x}}}`, "invalid propertyName 'bad key'"},
		{`{monitoring: {relayPodMonitorLabels: {release: "not valid"}}}`, "/monitoring/relayPodMonitorLabels/release"},
	} {
		_, _, err := render(t, values(t, tc.values))
		require.Error(t, err, tc.values)
		require.ErrorContains(t, err, "values don't meet the specifications of the schema", tc.values)
		require.ErrorContains(t, err, tc.want, tc.values)
	}

	// A flag the chart sets from a value of its own is refused in
	// extraArgs: a second --leader-election-id, say, would name a Lease the
	// rendered Role does not grant, and the manager would never lead.
	vals := values(t, nonDefault)
	for k, v := range values(t, `{leaderElection: {id: payments-outbox}, database: {tokenLogins: true}, extraArgs: []}`) {
		vals[k] = v
	}
	var flags []any
	for _, v := range []map[string]any{vals, values(t, `{image: {tag: v9.9.9}, metrics: {certSecret: metrics-tls}}`)} {
		objs, _, err := render(t, v)
		require.NoError(t, err)
		containers, found, err := unstructured.NestedSlice(find(t, objs, "Deployment", "").Object, "spec", "template", "spec", "containers")
		require.NoError(t, err)
		require.True(t, found)
		flags = append(flags, containers[0].(map[string]any)["args"].([]any)...)
	}
	require.GreaterOrEqual(t, len(flags), 11, "every flag the chart can set: %v", flags)
	// And those it sets through the environment, or grants RBAC for: the
	// Lease's namespace is the release's (the leader-election Role's).
	flags = append(flags, "--relay-image", "--digest-key-secret", "--leader-election-namespace")
	for _, f := range flags {
		name, _, _ := strings.Cut(f.(string), "=")
		for _, arg := range []string{name, name + "=x"} {
			_, _, err := render(t, map[string]any{"image": map[string]any{"tag": "v9.9.9"}, "extraArgs": []any{arg}})
			require.ErrorContains(t, err, "/extraArgs/0", "%s is the chart's", arg)
		}
	}
	_, _, err := render(t, values(t, `{image: {tag: v9.9.9}, extraArgs: [--leader-elect-extra=1, --zap-log-level=debug]}`))
	require.NoError(t, err, "a flag that only begins like one of the chart's")
}
