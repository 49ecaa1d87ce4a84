package install

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// chartCase is one combination of values: what it must render, checked
// on the rendered objects, or the error Helm must give.
type chartCase struct {
	name, values string
	check        func(t *testing.T, objs []*unstructured.Unstructured)
	err          string
}

// chartCases cover each convention of the chart's values, alone and
// together; TestChartValuesTable checks what they render and
// TestChartAppliesToAPIServer has the API server validate each.
var chartCases = []chartCase{
	{name: "default", values: `{}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		sa := find(t, objs, "ServiceAccount", "outbox-outbox-operator")
		require.Equal(t, true, sa.Object["automountServiceAccountToken"])
		crd := find(t, objs, "CustomResourceDefinition", "outboxrelays.outbox.dev")
		require.Equal(t, "keep", crd.GetAnnotations()["helm.sh/resource-policy"], "the CRD outlives the release")
		require.Equal(t, "Helm", crd.GetLabels()["app.kubernetes.io/managed-by"], "a template, so helm upgrade updates it")
		c := container(t, find(t, objs, "Deployment", ""))
		require.Contains(t, c["args"], "--metrics-bind-address=:8443")
		require.NotContains(t, c["args"], "--metrics-secure=false", "HTTPS with authentication by default")
		find(t, objs, "Service", "outbox-outbox-operator-metrics")
		binding := find(t, objs, "ClusterRoleBinding", "outbox-outbox-operator-metrics-auth")
		require.Equal(t, "outbox-outbox-operator", subject(t, binding, 0)["name"])
		find(t, objs, "ClusterRole", "outbox-outbox-operator-metrics-reader")
		editor := find(t, objs, "ClusterRole", "outbox-outbox-operator-outboxrelay-editor")
		require.Equal(t, "true", editor.GetLabels()["rbac.authorization.k8s.io/aggregate-to-edit"])
		viewer := find(t, objs, "ClusterRole", "outbox-outbox-operator-outboxrelay-viewer")
		require.Equal(t, "true", viewer.GetLabels()["rbac.authorization.k8s.io/aggregate-to-view"])
		none(t, objs, "PodDisruptionBudget", "ServiceMonitor", "PodMonitor", "Secret/outbox-outbox-operator-metrics-cert")
		key := find(t, objs, "Secret", "outbox-outbox-operator-digest-key") // the manager's digest key, made empty
		require.Equal(t, "keep", key.GetAnnotations()["helm.sh/resource-policy"], "uninstall leaves the key, so a reinstall rolls no relay")
		require.NotContains(t, c["args"], "--metrics-cert-dir=/etc/outbox-operator/metrics-cert", "as config/default: no certificate without a ServiceMonitor")
		for _, o := range objs {
			require.NotContains(t, fmt.Sprint(o.Object), "insecureSkipVerify", "%s/%s", o.GetKind(), o.GetName())
		}
	}},
	// A Service's name is at most 63 characters: the metrics Service's
	// suffix goes on a base cut to fit. Before, a release name of 40
	// characters or more made a name the API server refuses.
	{name: "longest fullname", values: `{fullnameOverride: ` + strings.Repeat("r", 63) + `}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		svc := find(t, objs, "Service", strings.Repeat("r", 55)+"-metrics")
		require.LessOrEqual(t, len(svc.GetName()), 63)
	}},
	// Without leader election, an upgrade must not run the old and the new
	// manager side by side, as a rolling update would.
	{name: "leader election off", values: `{leaderElection: {enabled: false}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		deploy := find(t, objs, "Deployment", "")
		strategy, _, _ := unstructured.NestedString(deploy.Object, "spec", "strategy", "type")
		require.Equal(t, "Recreate", strategy)
		require.NotContains(t, container(t, deploy)["args"], "--leader-elect")
	}},
	// A second release in the namespace of another leads with a Lease of
	// its own, which its Role names alone. Before, the Lease's name was
	// fixed: the second release's manager never led, and reconciled none
	// of its namespaces.
	{name: "leader election id", values: `{leaderElection: {id: payments.outbox-operator}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		require.Contains(t, container(t, find(t, objs, "Deployment", ""))["args"], "--leader-election-id=payments.outbox-operator")
		rules, _, _ := unstructured.NestedSlice(find(t, objs, "Role", "outbox-outbox-operator-leader-election").Object, "rules")
		require.Equal(t, []any{"payments.outbox-operator"}, rules[0].(map[string]any)["resourceNames"])
		require.Equal(t, []any{"get", "update"}, rules[0].(map[string]any)["verbs"])
	}},
	{name: "fullnameOverride", values: `{fullnameOverride: relays}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		for _, o := range objs {
			if o.GetKind() != "CustomResourceDefinition" {
				require.True(t, strings.HasPrefix(o.GetName(), "relays"), "%s/%s", o.GetKind(), o.GetName())
			}
		}
		require.Equal(t, "relays", podSpec(t, objs)["serviceAccountName"])
	}},
	{name: "nameOverride", values: `{nameOverride: relays}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		find(t, objs, "Deployment", "outbox-relays")
	}},
	{name: "existing service account", values: `{serviceAccount: {create: false, name: ops-sa, automount: false}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		none(t, objs, "ServiceAccount")
		pod := podSpec(t, objs)
		require.Equal(t, "ops-sa", pod["serviceAccountName"])
		require.Equal(t, false, pod["automountServiceAccountToken"])
		require.Equal(t, "ops-sa", subject(t, find(t, objs, "ClusterRoleBinding", "outbox-outbox-operator-manager"), 0)["name"])
	}},
	{name: "existing service account without a name", values: `{serviceAccount: {create: false}}`,
		err: "serviceAccount.name is required when serviceAccount.create is false"},
	{name: "metrics certificate from a Secret", values: `{metrics: {certSecret: manager-metrics-tls}, extraVolumes: [{name: x, emptyDir: {}}], extraVolumeMounts: [{name: x, mountPath: /x}]}`,
		check: func(t *testing.T, objs []*unstructured.Unstructured) {
			c := container(t, find(t, objs, "Deployment", "outbox-outbox-operator"))
			require.Contains(t, c["args"], "--metrics-cert-dir=/etc/outbox-operator/metrics-cert")
			require.Contains(t, c["volumeMounts"], map[string]any{"name": "metrics-cert", "mountPath": "/etc/outbox-operator/metrics-cert", "readOnly": true})
			require.Len(t, c["volumeMounts"], 2, "the extra mount too")
			vols := podSpec(t, objs)["volumes"].([]any)
			require.Contains(t, vols, map[string]any{"name": "metrics-cert", "secret": map[string]any{"secretName": "manager-metrics-tls"}})
			require.Len(t, vols, 2, "the extra volume too")
		}},
	{name: "metrics certificate without HTTPS", values: `{metrics: {certSecret: manager-metrics-tls, secure: false}}`,
		err: "metrics.certSecret is the certificate of HTTPS"},
	{name: "any relay image", values: `{relay: {allowedImages: ["*"]}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		require.Contains(t, container(t, find(t, objs, "Deployment", "outbox-outbox-operator"))["args"], "--allowed-relay-images=*")
	}},
	{name: "relay images by whole parts", values: `{relay: {allowedImages: [registry.example/relays, "ghcr.io/acme/"]}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		require.Contains(t, container(t, find(t, objs, "Deployment", "outbox-outbox-operator"))["args"], "--allowed-relay-images=registry.example/relays,ghcr.io/acme/")
	}},
	{name: "no RBAC", values: `{rbac: {create: false}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		none(t, objs, "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
	}},
	{name: "no aggregated roles", values: `{rbac: {aggregateToDefaultRoles: false}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		for _, o := range objs {
			require.NotContains(t, o.GetName(), "outboxrelay-", "%s/%s", o.GetKind(), o.GetName())
		}
	}},
	{name: "CRD not installed", values: `{crds: {install: false}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		none(t, objs, "CustomResourceDefinition")
	}},
	{name: "CRD not kept", values: `{crds: {keep: false}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		require.NotContains(t, find(t, objs, "CustomResourceDefinition", "").GetAnnotations(), "helm.sh/resource-policy")
	}},
	{name: "replicas", values: `{replicaCount: 3, podDisruptionBudget: {minAvailable: 2}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		pdb := find(t, objs, "PodDisruptionBudget", "outbox-outbox-operator")
		require.EqualValues(t, 2, pdb.Object["spec"].(map[string]any)["minAvailable"])
		require.Equal(t, "AlwaysAllow", pdb.Object["spec"].(map[string]any)["unhealthyPodEvictionPolicy"], "unready managers do not block a drain")
	}},
	{name: "plain metrics", values: `{metrics: {secure: false}, monitoring: {podMonitor: {enabled: true}}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		require.Contains(t, container(t, find(t, objs, "Deployment", ""))["args"], "--metrics-secure=false")
		none(t, objs, "ClusterRoleBinding/outbox-outbox-operator-metrics-auth")
		find(t, objs, "PodMonitor", "")
	}},
	{name: "PodMonitor on HTTPS", values: `{monitoring: {podMonitor: {enabled: true}}}`,
		err: "monitoring.podMonitor scrapes plain HTTP: with metrics.secure (the default) use monitoring.serviceMonitor"},
	{name: "ServiceMonitor and readers", values: `{monitoring: {serviceMonitor: {enabled: true, labels: {release: prometheus}}},
	  metrics: {readers: [{name: prometheus-k8s, namespace: monitoring}]}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		ep := serviceMonitorEndpoint(t, objs)
		require.Equal(t, "https", ep["scheme"])
		require.Equal(t, "/var/run/secrets/kubernetes.io/serviceaccount/token", ep["bearerTokenFile"])
		require.Equal(t, true, ep["honorLabels"])
		readers := find(t, objs, "ClusterRoleBinding", "outbox-outbox-operator-metrics-reader")
		require.Equal(t, "prometheus-k8s", subject(t, readers, 0)["name"])
		require.Equal(t, "monitoring", subject(t, readers, 0)["namespace"])
		// By default Prometheus verifies the certificate the chart issues.
		require.Equal(t, map[string]any{
			"ca":         map[string]any{"secret": map[string]any{"name": "outbox-outbox-operator-metrics-cert", "key": "ca.crt"}},
			"serverName": "outbox-outbox-operator-metrics.outbox-system.svc",
		}, ep["tlsConfig"])
		requireServesVerifiably(t, objs, "outbox-outbox-operator-metrics-cert")
	}},
	{name: "ServiceMonitor verifying metrics.certSecret", values: `{metrics: {certSecret: manager-metrics-tls}, monitoring: {serviceMonitor: {enabled: true}}}`,
		check: func(t *testing.T, objs []*unstructured.Unstructured) {
			none(t, objs, "Secret/outbox-outbox-operator-metrics-cert")
			require.Equal(t, map[string]any{
				"ca":         map[string]any{"secret": map[string]any{"name": "manager-metrics-tls", "key": "ca.crt"}},
				"serverName": "outbox-outbox-operator-metrics.outbox-system.svc",
			}, serviceMonitorEndpoint(t, objs)["tlsConfig"])
			require.Contains(t, podSpec(t, objs)["volumes"], map[string]any{"name": "metrics-cert", "secret": map[string]any{"secretName": "manager-metrics-tls"}})
		}},
	{name: "ServiceMonitor with TLS fields of its own", values: `{metrics: {certSecret: manager-metrics-tls},
	  monitoring: {serviceMonitor: {enabled: true, tlsConfig: {ca: {configMap: {name: corp-ca, key: ca.pem}}, serverName: metrics.example}}}}`,
		check: func(t *testing.T, objs []*unstructured.Unstructured) {
			require.Equal(t, map[string]any{
				"ca":         map[string]any{"configMap": map[string]any{"name": "corp-ca", "key": "ca.pem"}},
				"serverName": "metrics.example",
			}, serviceMonitorEndpoint(t, objs)["tlsConfig"], "each field set replaces the chart's, whole")
		}},
	{name: "ServiceMonitor without verifying, opted in", values: `{monitoring: {serviceMonitor: {enabled: true, tlsConfig: {insecureSkipVerify: true}}}}`,
		check: func(t *testing.T, objs []*unstructured.Unstructured) {
			require.Equal(t, map[string]any{"insecureSkipVerify": true}, serviceMonitorEndpoint(t, objs)["tlsConfig"])
			none(t, objs, "Secret/outbox-outbox-operator-metrics-cert")
			require.NotContains(t, container(t, find(t, objs, "Deployment", ""))["args"], "--metrics-cert-dir=/etc/outbox-operator/metrics-cert",
				"no certificate is issued that nothing verifies")
		}},
	{name: "ServiceMonitor over plain HTTP", values: `{metrics: {secure: false}, monitoring: {serviceMonitor: {enabled: true}}}`,
		check: func(t *testing.T, objs []*unstructured.Unstructured) {
			ep := serviceMonitorEndpoint(t, objs)
			require.NotContains(t, ep, "tlsConfig")
			require.NotContains(t, ep, "scheme")
			none(t, objs, "Secret/outbox-outbox-operator-metrics-cert")
		}},
	{name: "OpenShift restricted-v2", values: `{podSecurityContext: {runAsUser: null, runAsGroup: null}}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		sc := podSpec(t, objs)["securityContext"].(map[string]any)
		require.NotContains(t, sc, "runAsUser", "the platform assigns the user")
		require.Equal(t, true, sc["runAsNonRoot"])
	}},
	{name: "spread, env and volumes", values: `{
	  topologySpreadConstraints: [{maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway,
	    labelSelector: {matchLabels: {app.kubernetes.io/name: outbox-operator}}}],
	  extraEnv: [{name: HTTPS_PROXY, value: "http://proxy:3128"}],
	  extraVolumes: [{name: ca, configMap: {name: corp-ca}}],
	  extraVolumeMounts: [{name: ca, mountPath: /etc/ssl/corp, readOnly: true}]}`, check: func(t *testing.T, objs []*unstructured.Unstructured) {
		pod := podSpec(t, objs)
		require.Len(t, pod["topologySpreadConstraints"], 1)
		require.Len(t, pod["volumes"], 1)
		c := container(t, find(t, objs, "Deployment", ""))
		require.Equal(t, "http://proxy:3128", env(t, c)["HTTPS_PROXY"])
		require.Len(t, c["volumeMounts"], 1)
	}},
}

// TestChartValuesTable renders each combination and checks it.
func TestChartValuesTable(t *testing.T) {
	t.Parallel()
	for _, tc := range chartCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			objs, _, err := render(t, values(t, tc.values))
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			tc.check(t, objs)
		})
	}
}

func podSpec(t *testing.T, objs []*unstructured.Unstructured) map[string]any {
	t.Helper()
	pod, _, err := unstructured.NestedMap(find(t, objs, "Deployment", "").Object, "spec", "template", "spec")
	require.NoError(t, err)
	return pod
}

func subject(t *testing.T, binding *unstructured.Unstructured, i int) map[string]any {
	t.Helper()
	subjects, _, err := unstructured.NestedSlice(binding.Object, "subjects")
	require.NoError(t, err)
	require.Greater(t, len(subjects), i)
	return subjects[i].(map[string]any)
}

// none checks that objs hold no object of the kinds (or kind/name).
func none(t *testing.T, objs []*unstructured.Unstructured, kinds ...string) {
	t.Helper()
	for _, o := range objs {
		for _, k := range kinds {
			require.NotEqual(t, k, o.GetKind(), "%s/%s", o.GetKind(), o.GetName())
			require.NotEqual(t, k, o.GetKind()+"/"+o.GetName())
		}
	}
}

// serviceMonitorEndpoint is the one endpoint of the chart's ServiceMonitor.
func serviceMonitorEndpoint(t *testing.T, objs []*unstructured.Unstructured) map[string]any {
	t.Helper()
	eps, _, err := unstructured.NestedSlice(find(t, objs, "ServiceMonitor", "outbox-outbox-operator").Object, "spec", "endpoints")
	require.NoError(t, err)
	require.Len(t, eps, 1)
	return eps[0].(map[string]any)
}

// requireServesVerifiably checks that the manager serves the certificate of
// the Secret secret that the chart renders, and that a client holding the
// ServiceMonitor's CA and server name verifies it.
func requireServesVerifiably(t *testing.T, objs []*unstructured.Unstructured, secret string) {
	t.Helper()
	c := container(t, find(t, objs, "Deployment", "outbox-outbox-operator"))
	require.Contains(t, c["args"], "--metrics-cert-dir=/etc/outbox-operator/metrics-cert")
	require.Contains(t, c["volumeMounts"], map[string]any{"name": "metrics-cert", "mountPath": "/etc/outbox-operator/metrics-cert", "readOnly": true})
	require.Contains(t, podSpec(t, objs)["volumes"], map[string]any{"name": "metrics-cert", "secret": map[string]any{"secretName": secret}})

	s := find(t, objs, "Secret", secret)
	require.Equal(t, "kubernetes.io/tls", s.Object["type"])
	data := map[string][]byte{}
	for k, v := range s.Object["data"].(map[string]any) {
		b, err := base64.StdEncoding.DecodeString(v.(string))
		require.NoError(t, err, k)
		data[k] = b
	}
	tlsConfig := serviceMonitorEndpoint(t, objs)["tlsConfig"].(map[string]any)
	ca := tlsConfig["ca"].(map[string]any)["secret"].(map[string]any)
	require.Equal(t, secret, ca["name"])
	require.Contains(t, data, ca["key"])
	requireVerifies(t, data["tls.crt"], data["tls.key"], data[ca["key"].(string)], tlsConfig["serverName"].(string))
}

// requireVerifies: certPEM and keyPEM are a pair, and a client that trusts
// only caPEM accepts certPEM for serverName.
func requireVerifies(t *testing.T, certPEM, keyPEM, caPEM []byte, serverName string) {
	t.Helper()
	_, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err, "tls.crt and tls.key are a pair")
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(caPEM), "ca.crt holds a certificate")
	block, _ := pem.Decode(certPEM)
	require.NotNil(t, block)
	cert, err := x509.ParseCertificate(block.Bytes)
	require.NoError(t, err)
	_, err = cert.Verify(x509.VerifyOptions{Roots: roots, DNSName: serverName, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	require.NoError(t, err, "a client trusting ca.crt verifies the served certificate as %s", serverName)
}
