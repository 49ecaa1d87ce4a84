package install

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/outbox-relay/outbox-operator/controllers"
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
// names, and gets and updates one more, its digest key's, which the same
// install creates in the manager's namespace (a Role naming that Secret
// alone). A rule that grants more fails here, whatever file it comes from.
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
				if v != "get" {
					require.Equal(t, "update", v, "%s: %s grants %q on Secrets; get is all the operator needs, and update of its digest key", install, role, v)
				}
			}
		}
		var digestKeyRules int
		for _, o := range objs {
			rules, _, _ := unstructured.NestedSlice(o.Object, "rules")
			for _, r := range rules {
				verbs, _, _ := unstructured.NestedStringSlice(r.(map[string]any), "verbs")
				if !slices.Contains(verbs, "update") {
					continue
				}
				resources, _, _ := unstructured.NestedStringSlice(r.(map[string]any), "resources")
				if !slices.Contains(resources, "secrets") && !slices.Contains(resources, "*") {
					continue
				}
				digestKeyRules++
				require.Equal(t, "Role", o.GetKind(), "%s: %s: update on Secrets in one namespace only", install, o.GetName())
				names, _, _ := unstructured.NestedStringSlice(r.(map[string]any), "resourceNames")
				require.Len(t, names, 1, "%s: %s: update on one named Secret only", install, o.GetName())
				secret := find(t, objs, "Secret", names[0])
				require.Equal(t, secret.GetNamespace(), o.GetNamespace(), "%s: %s: the Secret it names is the install's own", install, o.GetName())
				require.Empty(t, secret.Object["data"], "%s: the install creates the digest key's Secret empty", install)
				require.Equal(t, find(t, objs, "Deployment", "").GetNamespace(), o.GetNamespace(), "%s: in the manager's namespace", install)
			}
		}
		require.Equal(t, 1, digestKeyRules, "%s: one rule updates a Secret: the digest key's", install)
	}
}

// The manager's leader election takes a Lease lock, which gets, creates
// and updates its Lease: no install grants more on Leases, so the
// manager's service account cannot delete another program's Lease in its
// namespace, and get and update name the manager's own Lease, so it cannot
// take over another's either (an OLM install for all namespaces grants the
// rules cluster-wide).
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
		for _, o := range objs {
			if o.GetKind() != "Role" && o.GetKind() != "ClusterRole" {
				continue
			}
			rules, _, _ := unstructured.NestedSlice(o.Object, "rules")
			for _, r := range rules {
				rule := r.(map[string]any)
				resources, _, _ := unstructured.NestedStringSlice(rule, "resources")
				verbs, _, _ := unstructured.NestedStringSlice(rule, "verbs")
				if !slices.Contains(resources, "leases") || !slices.ContainsFunc(verbs, func(v string) bool { return v == "get" || v == "update" }) {
					continue
				}
				names, _, _ := unstructured.NestedStringSlice(rule, "resourceNames")
				require.Equal(t, []string{controllers.LeaderElectionID}, names, "%s: %s: get and update of the manager's own Lease only", install, o.GetName())
			}
		}
	}
}
