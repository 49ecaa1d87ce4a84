// Command bundle writes the Operator Lifecycle Manager bundle of a release
// (make bundle): bundle/manifests/ (the ClusterServiceVersion, the CRD, and
// the manifests OLM installs beside the operator: the metrics Service, the
// metrics-reader and aggregated outboxrelay ClusterRoles) and
// bundle/metadata/annotations.yaml, from config/default as kubectl
// kustomize renders it, so the bundle installs what every other way
// installs. test/ops/bundle validates it with the operator framework's own
// validators, OperatorHub's included.
//
//	go run ./hack/bundle -version 0.2.0 -out bundle -kubectl bin/k8s/<v>/kubectl
//
// It is development tooling: the manager and the relay do not link it.
package main

import (
	"context"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/outbox-relay/outbox-operator/hack/releasekit"
)

//go:embed icon.svg
var icon []byte

const (
	packageName = "outbox-operator"
	channel     = "alpha"
	imageRepo   = releasekit.OperatorRepo
	repository  = "https://github.com/outbox-relay/outbox-operator"
)

func main() {
	version := flag.String("version", "", "the release, MAJOR.MINOR.PATCH (required)")
	out := flag.String("out", "bundle", "directory the bundle is written to (replaced)")
	kubectl := flag.String("kubectl", "kubectl", "kubectl that renders config/default")
	image := flag.String("image", "", "the operator image the bundle runs (default "+imageRepo+":v<version>; a digest pins it)")
	flag.Parse()
	if err := run(context.Background(), *version, *out, *kubectl, *image); err != nil {
		fmt.Fprintln(os.Stderr, "bundle:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, version, out, kubectl, image string) error {
	if err := releasekit.CheckVersion(version); err != nil {
		return err
	}
	if image == "" {
		image = imageRepo + ":v" + version
	}
	root, err := repoRoot()
	if err != nil {
		return err
	}
	rendered, err := releasekit.RenderDefault(ctx, root, kubectl, image)
	if err != nil {
		return err
	}
	objs, err := split(rendered)
	if err != nil {
		return err
	}
	samples, err := os.ReadFile(filepath.Join(root, "config", "samples", "outbox_v1alpha1_outboxrelay.yaml"))
	if err != nil {
		return err
	}
	b, err := build(objs, samples, version, image)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(out); err != nil {
		return err
	}
	for name, doc := range b {
		p := filepath.Join(out, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, doc, 0o644); err != nil {
			return err
		}
		fmt.Println(p)
	}
	return nil
}

// object is one rendered manifest.
type object = map[string]any

func split(docs []byte) ([]object, error) {
	var objs []object
	for _, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(docs), -1) {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		o := object{}
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			return nil, err
		}
		objs = append(objs, o)
	}
	return objs, nil
}

func kind(o object) string { s, _ := o["kind"].(string); return s }

func name(o object) string {
	m, _ := o["metadata"].(map[string]any)
	s, _ := m["name"].(string)
	return s
}

// find returns the one object of kind whose name ends with suffix.
func find(objs []object, k, suffix string) (object, error) {
	var found []object
	for _, o := range objs {
		if kind(o) == k && strings.HasSuffix(name(o), suffix) {
			found = append(found, o)
		}
	}
	if len(found) != 1 {
		return nil, fmt.Errorf("config/default renders %d %s named *%s, want one", len(found), k, suffix)
	}
	return found[0], nil
}

// build returns the bundle's files by path: the CSV, the CRD and the extra
// manifests under manifests/, the annotations under metadata/.
func build(objs []object, samples []byte, version, image string) (map[string][]byte, error) {
	files := map[string][]byte{}
	add := func(path string, v any) error {
		b, err := yaml.Marshal(v)
		files[path] = b
		return err
	}
	crd, err := find(objs, "CustomResourceDefinition", "outboxrelays.outbox.dev")
	if err != nil {
		return nil, err
	}
	deploy, err := find(objs, "Deployment", "controller-manager")
	if err != nil {
		return nil, err
	}
	sa, err := find(objs, "ServiceAccount", "controller-manager")
	if err != nil {
		return nil, err
	}
	managerRole, err := find(objs, "ClusterRole", "manager-role")
	if err != nil {
		return nil, err
	}
	metricsAuth, err := find(objs, "ClusterRole", "metrics-auth-role")
	if err != nil {
		return nil, err
	}
	leader, err := find(objs, "Role", "leader-election-role")
	if err != nil {
		return nil, err
	}
	digestKey, err := find(objs, "Role", "digest-key-role")
	if err != nil {
		return nil, err
	}
	errs := []error{add("manifests/outbox.dev_outboxrelays.yaml", crd)}
	// What OLM installs beside the operator, as config/default does.
	for _, extra := range []struct{ kind, suffix, file string }{
		{"Service", "controller-manager-metrics", "outbox-operator-metrics_v1_service.yaml"},
		// Created empty; the manager fills it with its digest key.
		{"Secret", "digest-key", "outbox-operator-digest-key_v1_secret.yaml"},
		{"ClusterRole", "metrics-reader", "outbox-operator-metrics-reader_rbac.authorization.k8s.io_v1_clusterrole.yaml"},
		{"ClusterRole", "outboxrelay-editor", "outbox-operator-outboxrelay-editor_rbac.authorization.k8s.io_v1_clusterrole.yaml"},
		{"ClusterRole", "outboxrelay-viewer", "outbox-operator-outboxrelay-viewer_rbac.authorization.k8s.io_v1_clusterrole.yaml"},
	} {
		o, err := find(objs, extra.kind, extra.suffix)
		if err != nil {
			return nil, err
		}
		delete(o["metadata"].(map[string]any), "namespace") // OLM installs into the operator's namespace
		errs = append(errs, add("manifests/"+extra.file, o))
	}

	spec := deploy["spec"].(map[string]any)
	// OLM says which namespaces the operator serves in olm.targetNamespaces
	// (empty for all): WATCH_NAMESPACE reads it.
	for _, c := range spec["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any) {
		for _, e := range c.(map[string]any)["env"].([]any) {
			if e := e.(map[string]any); e["name"] == "WATCH_NAMESPACE" {
				delete(e, "value")
				e["valueFrom"] = map[string]any{"fieldRef": map[string]any{"fieldPath": "metadata.annotations['olm.targetNamespaces']"}}
			}
		}
	}
	example := object{}
	if err := yaml.Unmarshal(samples, &example); err != nil {
		return nil, err
	}
	delete(example["metadata"].(map[string]any), "namespace")
	examples, err := json.Marshal([]object{example})
	if err != nil {
		return nil, err
	}
	csvName := packageName + ".v" + version
	csv := object{
		"apiVersion": "operators.coreos.com/v1alpha1",
		"kind":       "ClusterServiceVersion",
		"metadata": map[string]any{
			"name": csvName,
			"annotations": map[string]any{
				"alm-examples":   string(examples),
				"capabilities":   "Basic Install",
				"categories":     "Streaming & Messaging,Database",
				"containerImage": image,
				"description":    "Runs transactional-outbox relays: rows a service writes to its PostgreSQL outbox table in the same transaction as its business data are published to Kafka, in order per key, none lost.",
				"repository":     repository,
				"support":        "outbox-relay",
			},
		},
		"spec": map[string]any{
			"displayName":    "Outbox Operator",
			"description":    description,
			"version":        version,
			"maturity":       channel,
			"minKubeVersion": "1.30.0",
			"provider":       map[string]any{"name": "outbox-relay", "url": repository},
			"maintainers":    []any{map[string]any{"name": "outbox-relay maintainers", "email": "maintainers@outbox.dev"}},
			"links": []any{
				map[string]any{"name": "Documentation", "url": repository + "/tree/main/docs"},
				map[string]any{"name": "Source", "url": repository},
			},
			"keywords": []any{"outbox", "transactional outbox", "kafka", "postgresql", "event-driven", "cdc"},
			"icon":     []any{map[string]any{"base64data": base64.StdEncoding.EncodeToString(icon), "mediatype": "image/svg+xml"}},
			"installModes": []any{
				map[string]any{"type": "OwnNamespace", "supported": true},
				map[string]any{"type": "SingleNamespace", "supported": true},
				map[string]any{"type": "MultiNamespace", "supported": true},
				map[string]any{"type": "AllNamespaces", "supported": true},
			},
			"customresourcedefinitions": map[string]any{"owned": []any{map[string]any{
				"name": "outboxrelays.outbox.dev", "version": "v1alpha1", "kind": "OutboxRelay",
				"displayName": "Outbox Relay",
				"description": "A relay publishing one PostgreSQL outbox table's rows to Kafka: the DSN Secret, the table, the topic map, batching, ordering, retention and scaling.",
				"resources": []any{
					map[string]any{"kind": "Deployment", "version": "v1"},
					map[string]any{"kind": "Service", "version": "v1"},
					map[string]any{"kind": "PodDisruptionBudget", "version": "v1"},
					map[string]any{"kind": "Secret", "version": "v1"},
				},
				"specDescriptors": []any{
					map[string]any{"path": "replicas", "displayName": "Replicas", "description": "Relay pods to run.", "x-descriptors": []any{"urn:alm:descriptor:com.tectonic.ui:podCount"}},
					map[string]any{"path": "dsnSecretRef.name", "displayName": "DSN Secret", "description": "The Secret holding the PostgreSQL connection string.", "x-descriptors": []any{"urn:alm:descriptor:io.kubernetes:Secret"}},
					map[string]any{"path": "suspend", "displayName": "Suspend", "description": "Run no relay pods; rows wait in the table.", "x-descriptors": []any{"urn:alm:descriptor:com.tectonic.ui:booleanSwitch"}},
				},
				"statusDescriptors": []any{
					map[string]any{"path": "conditions", "displayName": "Conditions", "description": "Ready, Lagging, Degraded, Stalled, Reconciling, Progressing.", "x-descriptors": []any{"urn:alm:descriptor:io.kubernetes.conditions"}},
					map[string]any{"path": "ready", "displayName": "Ready", "description": "Ready replicas / desired replicas.", "x-descriptors": []any{"urn:alm:descriptor:text"}},
				},
			}}},
			"install": map[string]any{
				"strategy": "deployment",
				"spec": map[string]any{
					"deployments": []any{map[string]any{"name": name(deploy), "label": deploy["metadata"].(map[string]any)["labels"], "spec": spec}},
					// OLM grants clusterPermissions cluster-wide whatever the
					// install mode, and permissions in each target namespace
					// (cluster-wide only for AllNamespaces): the manager's
					// rules, which let it read Secrets, are permissions, so
					// a namespaced install cannot read a Secret elsewhere.
					// Only the metrics authentication, which reads nothing,
					// is cluster-wide.
					"clusterPermissions": []any{map[string]any{
						"serviceAccountName": name(sa),
						"rules":              metricsAuth["rules"],
					}},
					"permissions": []any{map[string]any{
						"serviceAccountName": name(sa),
						"rules":              slices.Concat(managerRole["rules"].([]any), leader["rules"].([]any), digestKey["rules"].([]any)),
					}},
				},
			},
		},
	}
	errs = append(errs, add("manifests/"+packageName+".clusterserviceversion.yaml", csv))
	errs = append(errs, add("metadata/annotations.yaml", map[string]any{"annotations": annotations}))
	return files, errors.Join(errs...)
}

// annotations say what the bundle is (metadata/annotations.yaml).
var annotations = map[string]string{
	"operators.operatorframework.io.bundle.mediatype.v1":       "registry+v1",
	"operators.operatorframework.io.bundle.manifests.v1":       "manifests/",
	"operators.operatorframework.io.bundle.metadata.v1":        "metadata/",
	"operators.operatorframework.io.bundle.package.v1":         packageName,
	"operators.operatorframework.io.bundle.channels.v1":        channel,
	"operators.operatorframework.io.bundle.channel.default.v1": channel,
}

const description = `The outbox operator runs transactional-outbox relays. A service writes its event into an outbox
table in the same PostgreSQL transaction as its business write; an OutboxRelay names that table,
the Secret with its DSN and a map from event types to Kafka topics, and the operator runs relay pods
that claim unpublished rows (FOR UPDATE SKIP LOCKED, so replicas share the work), publish them and
mark them published.

* Nothing lost, at least once: a row is marked only after Kafka acknowledged it.
* Per-key order with any number of replicas (spec.ordering: PartitionKey).
* Rows Kafka refuses are held and reported, or sent to a dead-letter topic; they never block the rows behind them.
* Status: the backlog, the oldest waiting row, Lagging against spec.lagThreshold; Prometheus metrics and alerts.
* Autoscaling from the backlog, retention of published rows, CloudEvents, tracing.
`

func repoRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		return "", fmt.Errorf("find the module root: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}
