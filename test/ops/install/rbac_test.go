package install

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// secretGrants lists, for every Role and ClusterRole in objs, the verbs a
// rule grants on Secrets (core group, "secrets" or "*").
func secretGrants(t *testing.T, objs []*unstructured.Unstructured) map[string][]string {
	return grantsOn(t, objs, "", "secrets")
}

// grantsOn lists, for every Role and ClusterRole in objs, the verbs a rule
// grants on resource of group (or "*").
func grantsOn(t *testing.T, objs []*unstructured.Unstructured, group, resource string) map[string][]string {
	t.Helper()
	grants := map[string][]string{}
	for _, o := range objs {
		if o.GetKind() != "Role" && o.GetKind() != "ClusterRole" {
			continue
		}
		rules, _, err := unstructured.NestedSlice(o.Object, "rules")
		require.NoError(t, err)
		for _, r := range rules {
			rule := r.(map[string]any)
			strs := func(field string) []string {
				v, _, _ := unstructured.NestedStringSlice(rule, field)
				return v
			}
			groups, resources := strs("apiGroups"), strs("resources")
			if (slices.Contains(groups, group) || slices.Contains(groups, "*")) &&
				(slices.Contains(resources, resource) || slices.Contains(resources, "*")) {
				name := o.GetKind() + "/" + o.GetName()
				grants[name] = append(grants[name], strs("verbs")...)
			}
		}
	}
	return grants
}

// No install this repository ships (config/default, config/namespaced, the
// chart with its defaults and with watchNamespaces) may list or watch
// Secrets, anywhere: the operator gets only the Secrets an OutboxRelay
// names. A rule that grants more fails here, whatever file it comes from.
func TestRenderedRBACNeverListsOrWatchesSecrets(t *testing.T) {
	t.Parallel()
	renders := map[string][]*unstructured.Unstructured{
		"config/default":    decode(t, kubectl(t, nil, "kustomize", "config/default")),
		"config/namespaced": decode(t, kubectl(t, nil, "kustomize", "config/namespaced")),
	}
	renders["chart"], _ = mustRender(t, nil)
	renders["chart, watchNamespaces"], _ = mustRender(t, values(t, "watchNamespaces: [shop, billing]"))
	for install, objs := range renders {
		grants := secretGrants(t, objs)
		require.NotEmpty(t, grants, "%s: the operator reads the Secrets it is pointed at", install)
		for role, verbs := range grants {
			for _, v := range verbs {
				require.Equal(t, "get", v, "%s: %s grants %q on Secrets; get is all the operator needs", install, role, v)
			}
		}
	}
}

// The manager's leader election takes a Lease lock, which gets, creates
// and updates its Lease: no install grants more on Leases, so the
// manager's service account cannot delete another program's Lease in its
// namespace.
func TestRenderedRBACGrantsOnLeasesOnlyWhatALeaseLockUses(t *testing.T) {
	t.Parallel()
	renders := map[string][]*unstructured.Unstructured{
		"config/default":    decode(t, kubectl(t, nil, "kustomize", "config/default")),
		"config/namespaced": decode(t, kubectl(t, nil, "kustomize", "config/namespaced")),
	}
	renders["chart"], _ = mustRender(t, nil)
	for install, objs := range renders {
		grants := grantsOn(t, objs, "coordination.k8s.io", "leases")
		require.NotEmpty(t, grants, "%s: leader election needs its Lease", install)
		for role, verbs := range grants {
			require.ElementsMatch(t, []string{"get", "create", "update"}, verbs, "%s: %s", install, role)
		}
	}
}
