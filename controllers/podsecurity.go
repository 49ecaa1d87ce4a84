package controllers

import (
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	psaapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

// restricted evaluates a pod against Pod Security's "restricted" level, as
// the API server's admission does in a namespace that enforces it, with the
// checks of the release the operator is built with.
var restricted = func() policy.Evaluator {
	e, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		panic(fmt.Sprintf("pod security checks: %v", err)) // the library's own checks
	}
	return e
}()

// podSecurityErrors says what of a relay pod breaks Pod Security
// "restricted": the relay needs none of it, and whoever may write an
// OutboxRelay would otherwise choose how its pods run, with its Secrets.
// The CRD's rules refuse most of it at apply time; this covers the rest
// (unsafe sysctls, say) and OutboxRelays stored before a rule existed.
func podSecurityErrors(meta *metav1.ObjectMeta, pod *corev1.PodSpec) []string {
	var errs []string
	for _, r := range restricted.EvaluatePod(psaapi.LevelVersion{Level: psaapi.LevelRestricted, Version: psaapi.LatestVersion()}, meta, pod) {
		if !r.Allowed {
			errs = append(errs, fmt.Sprintf("spec.template: the relay pod would break Pod Security restricted: %s (%s)", r.ForbiddenReason, r.ForbiddenDetail))
		}
	}
	slices.Sort(errs)
	return errs
}
