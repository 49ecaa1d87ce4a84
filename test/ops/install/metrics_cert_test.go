package install

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// TestChartKeepsItsMetricsCertificate installs the chart with a
// ServiceMonitor through Helm against the API server, then upgrades it:
// the upgrade finds the Secret the install issued and keeps it, so neither
// the manager's certificate nor the CA Prometheus verifies it with changes
// with each helm upgrade; and the live ServiceMonitor's CA and server name
// verify the live certificate.
func TestChartKeepsItsMetricsCertificate(t *testing.T) {
	const ns, name = "metrics-cert", "certs"
	installMonitoringCRDs(t)
	ensureNamespace(t, ns)
	cfg := helmConfig(t, ns)
	vals := values(t, `{crds: {install: false}, rbac: {create: false}, monitoring: {serviceMonitor: {enabled: true}}}`)

	install := action.NewInstall(cfg)
	install.ReleaseName, install.Namespace = name, ns
	_, err := install.Run(loadChart(t), vals)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = action.NewUninstall(cfg).Run(name) })
	ctx := context.Background()
	secretKey := client.ObjectKey{Namespace: ns, Name: name + "-outbox-operator-metrics-cert"}
	issued := &corev1.Secret{}
	require.NoError(t, adminClient(t).Get(ctx, secretKey, issued))

	upgrade := action.NewUpgrade(cfg)
	upgrade.Namespace = ns
	_, err = upgrade.Run(name, loadChart(t), vals)
	require.NoError(t, err)
	kept := &corev1.Secret{}
	require.NoError(t, adminClient(t).Get(ctx, secretKey, kept))
	require.Equal(t, issued.Data, kept.Data, "helm upgrade keeps the certificate it issued")

	sm := &unstructured.Unstructured{}
	sm.SetAPIVersion("monitoring.coreos.com/v1")
	sm.SetKind("ServiceMonitor")
	require.NoError(t, adminClient(t).Get(ctx, client.ObjectKey{Namespace: ns, Name: name + "-outbox-operator"}, sm))
	eps, _, err := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
	require.NoError(t, err)
	tlsConfig := eps[0].(map[string]any)["tlsConfig"].(map[string]any)
	require.NotContains(t, tlsConfig, "insecureSkipVerify")
	ca := tlsConfig["ca"].(map[string]any)["secret"].(map[string]any)
	require.Equal(t, secretKey.Name, ca["name"])
	requireVerifies(t, kept.Data["tls.crt"], kept.Data["tls.key"], kept.Data[ca["key"].(string)], tlsConfig["serverName"].(string))
}

// TestChartWarnsOfUnverifiedScrapes: scraping without verifying is an
// opt-in that the install's notes warn about; the default says nothing.
func TestChartWarnsOfUnverifiedScrapes(t *testing.T) {
	t.Parallel()
	rel, err := dryRun(loadChart(t), values(t, `{monitoring: {serviceMonitor: {enabled: true, tlsConfig: {insecureSkipVerify: true}}}}`))
	require.NoError(t, err)
	require.Contains(t, rel.Info.Notes, "WARNING: monitoring.serviceMonitor.tlsConfig.insecureSkipVerify is true")
	rel, err = dryRun(loadChart(t), values(t, `{monitoring: {serviceMonitor: {enabled: true}}}`))
	require.NoError(t, err)
	require.NotContains(t, rel.Info.Notes, "WARNING")
}

// helmConfig is a Helm configuration (releases stored as Secrets in ns)
// for the test API server.
func helmConfig(t *testing.T, ns string) *action.Configuration {
	t.Helper()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, testenv.Kube().Env.KubeConfig, 0o600))
	flags := genericclioptions.NewConfigFlags(false)
	flags.KubeConfig = &kubeconfig
	flags.Namespace = &ns
	cfg := &action.Configuration{}
	require.NoError(t, cfg.Init(flags, ns, "secret", t.Logf))
	return cfg
}
