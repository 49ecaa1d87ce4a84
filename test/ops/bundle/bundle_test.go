// Package bundle checks the Operator Lifecycle Manager bundle that
// hack/bundle (make bundle) writes, with the operator framework's own
// validation library: the bundle, CSV and CRD validators, and OperatorHub's.
package bundle

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/operator-framework/api/pkg/manifests"
	"github.com/operator-framework/api/pkg/validation"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// TestBundleValidates writes a bundle and runs the validators OperatorHub
// runs on a submission; any error, or any warning but one, fails the test.
// The one: the deprecated-APIs check flags any RBAC rule on events.k8s.io
// "events", because events.k8s.io/v1beta1 was removed in 1.25; a rule has no
// version, and the manager records events through events.k8s.io/v1.
func TestBundleValidates(t *testing.T) {
	t.Parallel()
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	require.NotEmpty(t, assets, "KUBEBUILDER_ASSETS (make test sets it) holds the kubectl that renders config/default")
	dir := t.TempDir()
	cmd := exec.Command("go", "run", "./hack/bundle", "-version", "1.2.3", "-out", dir, "-kubectl", filepath.Join(assets, "kubectl"))
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)

	bundle, err := manifests.GetBundleFromDir(filepath.Join(dir, "manifests"))
	require.NoError(t, err)
	require.Equal(t, "outbox-operator.v1.2.3", bundle.CSV.GetName())
	require.Len(t, bundle.V1CRDs, 1)

	validators := validation.DefaultBundleValidators.WithValidators(
		validation.OperatorHubV2Validator, validation.StandardCapabilitiesValidator,
		validation.StandardCategoriesValidator, validation.GoodPracticesValidator,
		validation.AlphaDeprecatedAPIsValidator)
	results := validators.Validate(bundle, map[string]string{"k8s-version": "1.37"})
	var problems []string
	for _, r := range results {
		for _, e := range r.Errors {
			problems = append(problems, "error: "+e.Error())
		}
		for _, w := range r.Warnings {
			if strings.Contains(w.Error(), "deprecated and removed in v1.25") && strings.Contains(w.Error(), "Migrate the API(s) for events:") {
				continue // events.k8s.io/v1 (see above)
			}
			problems = append(problems, "warning: "+w.Error())
		}
	}
	require.Empty(t, problems, strings.Join(problems, "\n"))

	// What the CSV says of itself: the release's image, every install mode,
	// the sample as alm-examples, and the manager watching OLM's target
	// namespaces.
	csv := bundle.CSV
	require.Equal(t, "ghcr.io/outbox-relay/outbox-operator:v1.2.3", csv.Annotations["containerImage"])
	require.Len(t, csv.Spec.InstallModes, 4)
	for _, m := range csv.Spec.InstallModes {
		require.True(t, m.Supported, m.Type)
	}
	require.Contains(t, csv.Annotations["alm-examples"], `"kind":"OutboxRelay"`)
	deploy := csv.Spec.InstallStrategy.StrategySpec.DeploymentSpecs[0].Spec
	c := deploy.Template.Spec.Containers[0]
	require.Equal(t, "ghcr.io/outbox-relay/outbox-operator:v1.2.3", c.Image)
	var watch string
	for _, e := range c.Env {
		if e.Name == "WATCH_NAMESPACE" {
			require.NotNil(t, e.ValueFrom)
			watch = e.ValueFrom.FieldRef.FieldPath
		}
	}
	require.Equal(t, "metadata.annotations['olm.targetNamespaces']", watch)

	// OLM grants clusterPermissions cluster-wide in every install mode: the
	// manager's reads of Secrets and ConfigMaps, and its writes, must be
	// permissions, which OLM scopes to the target namespaces.
	strategy := csv.Spec.InstallStrategy.StrategySpec
	for _, p := range strategy.ClusterPermissions {
		for _, rule := range p.Rules {
			for _, res := range rule.Resources {
				require.Contains(t, []string{"tokenreviews", "subjectaccessreviews"}, res,
					"clusterPermissions grant %v on %s cluster-wide in every install mode", rule.Verbs, res)
			}
		}
	}
	var readsSecrets bool
	for _, p := range strategy.Permissions {
		for _, rule := range p.Rules {
			if slices.Contains(rule.Resources, "secrets") && slices.Contains(rule.Verbs, "get") {
				readsSecrets = true
			}
		}
	}
	require.True(t, readsSecrets, "the manager reads the DSN Secrets of the target namespaces: permissions must grant get on secrets")

	annotations, err := os.ReadFile(filepath.Join(dir, "metadata", "annotations.yaml"))
	require.NoError(t, err)
	var meta struct {
		Annotations map[string]string `json:"annotations"`
	}
	require.NoError(t, yaml.UnmarshalStrict(annotations, &meta))
	require.Equal(t, "outbox-operator", meta.Annotations["operators.operatorframework.io.bundle.package.v1"])
	require.Equal(t, "registry+v1", meta.Annotations["operators.operatorframework.io.bundle.mediatype.v1"])
}
