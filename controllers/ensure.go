package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"strconv"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// This file writes the children: one way for all of them (a spec-hash
// annotation plus a merge patch of the fields the operator owns).

// inputs builds and checks the relay's settings and reads the referenced
// Secrets: what the children are built from, or the problem that keeps
// them from being built. current is the relay's Deployment as it runs (nil
// when none), whose record of the Secrets' data readSecrets starts from.
func (r *OutboxRelayReconciler) inputs(ctx context.Context, relay *outboxv1alpha1.OutboxRelay, current *appsv1.Deployment) (relayconfig.Command, secretInputs, *problem, error) {
	s, err := checkSpec(relay, r.images())
	if err != nil {
		return s, secretInputs{}, &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: err.Error()}, nil
	}
	in, prob, err := r.readSecrets(ctx, relay, recordOf(current))
	kafkaFiles(&s, in)
	return s, in, prob, err
}

func (r *OutboxRelayReconciler) images() images {
	return images{fallback: r.RelayImage, allowed: r.AllowedImages}
}

// childProblemSeen is the problem the latest write of a relay's children
// found (a refusal, a name taken, a spec the API server refuses), and
// what those children were.
type childProblemSeen struct {
	children string // childrenOf
	at       time.Time
	prob     *problem
}

// childrenOf says what a relay's children are built from: the relay (its
// UID and generation) and the desired Deployment (its spec hash, which the
// Secrets' data feed, and its replicas).
func childrenOf(relay *outboxv1alpha1.OutboxRelay, desired *appsv1.Deployment) string {
	return fmt.Sprint(relay.UID, "/", relay.Generation, "/", desired.Annotations[specHashAnnotation], "/", *desired.Spec.Replicas)
}

// ensureChildren ensures every child from the inputs: s, the relay's
// settings checked by inputs, and in, the Secrets. current is the
// relay's Deployment as it runs (nil when none). It returns the Deployment
// as written, or a nil Deployment and the problem that kept it from writing
// the children. The same children are not written again within
// secretRetryInterval of a write that found a problem: every backlog
// reading wakes the relay, and a thousand relays under one quota or
// admission policy would otherwise send a refused write each at every
// reading. A change of the relay or its Secrets, or of the replicas, is
// written at once.
func (r *OutboxRelayReconciler) ensureChildren(ctx context.Context, relay *outboxv1alpha1.OutboxRelay, s relayconfig.Command, in secretInputs, current *appsv1.Deployment) (*appsv1.Deployment, *problem, error) {
	desired := relayDeployment(relay, r.images(), s, in, current)
	key, children := client.ObjectKeyFromObject(relay), childrenOf(relay, desired)
	if v, ok := r.childProblems.Load(key); ok {
		if last := v.(childProblemSeen); last.children == children && time.Since(last.at) < secretRetryInterval {
			return nil, last.prob, nil
		}
	}
	r.childProblems.Delete(key)
	deploy, prob, err := r.writeChildren(ctx, relay, desired)
	if prob != nil {
		r.childProblems.Store(key, childProblemSeen{children: children, at: time.Now(), prob: prob})
	}
	return deploy, prob, err
}

// writeChildren writes the children, the Deployment as desired.
func (r *OutboxRelayReconciler) writeChildren(ctx context.Context, relay *outboxv1alpha1.OutboxRelay, desired *appsv1.Deployment) (*appsv1.Deployment, *problem, error) {
	deploy, err := ensure(ctx, r.Client, r.APIReader, relay, desired, &appsv1.Deployment{},
		func(cur, want *appsv1.Deployment) bool {
			// The record of the Secrets' data is written also when the
			// template stays (a Deployment an earlier operator wrote).
			rec, ok := want.Annotations[secretVersionsAnnotation]
			return *cur.Spec.Replicas != *want.Spec.Replicas || cur.Spec.Paused || (ok && cur.Annotations[secretVersionsAnnotation] != rec)
		},
		deploymentOwned,
		func(cur, want *appsv1.Deployment) {
			cur.Spec.Replicas = want.Spec.Replicas
			// Paused (kubectl rollout pause) would hold back every later
			// change of the template, a Secret's rotation too, with no
			// condition ever Stalled (the progress deadline is not checked
			// while paused): outbox.dev/reconcile: disabled is the way to
			// keep the operator's hands off.
			cur.Spec.Paused = false
			cur.Spec.RevisionHistoryLimit = want.Spec.RevisionHistoryLimit
			restarted, wasRestarted := cur.Spec.Template.Annotations[restartedAtAnnotation]
			cur.Spec.Template = *want.Spec.Template.DeepCopy()
			if _, own := want.Spec.Template.Annotations[restartedAtAnnotation]; wasRestarted && !own {
				// kubectl rollout restart (or Argo CD's restart of the
				// Deployment) stamped it: dropping the stamp would roll
				// the pods once more, at the next scale.
				cur.Spec.Template.Annotations[restartedAtAnnotation] = restarted
			}
			// Keep the API server's rollingUpdate defaults when the type stays.
			if cur.Spec.Strategy.Type != want.Spec.Strategy.Type {
				cur.Spec.Strategy = want.Spec.Strategy
			}
		})
	if prob, err := childProblem(err); prob != nil || err != nil {
		if prob != nil && prob.reason == outboxv1alpha1.ReasonInvalidSpec {
			prob.message = inRelayTerms(prob.message, desired, relay.Spec.Template)
		}
		return nil, prob, err
	}
	_, err = ensure(ctx, r.Client, r.APIReader, relay, relayService(relay), &corev1.Service{}, nil,
		func(s *corev1.Service) any { return []any{s.Spec.Type, s.Spec.Selector, s.Spec.Ports} },
		func(cur, want *corev1.Service) {
			cur.Spec.Type = want.Spec.Type
			cur.Spec.Selector = want.Spec.Selector
			cur.Spec.Ports = want.Spec.Ports
		})
	if prob, err := childProblem(err); prob != nil || err != nil {
		return nil, prob, err
	}
	if prob, err := childProblem(r.ensurePDB(ctx, relay)); prob != nil || err != nil {
		return nil, prob, err
	}
	return deploy, nil, nil
}

// deploymentOwned is what of a Deployment the operator owns beyond its
// replicas: what its live hash covers.
func deploymentOwned(d *appsv1.Deployment) any {
	return []any{d.Spec.Template, d.Spec.Strategy.Type, d.Spec.RevisionHistoryLimit}
}

// ensurePDB writes the PodDisruptionBudget, or deletes the one this relay
// owns when it runs fewer than two replicas.
func (r *OutboxRelayReconciler) ensurePDB(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) error {
	if want := relayPDB(relay); want != nil {
		_, err := ensure(ctx, r.Client, r.APIReader, relay, want, &policyv1.PodDisruptionBudget{}, nil,
			func(p *policyv1.PodDisruptionBudget) any { return p.Spec },
			func(cur, want *policyv1.PodDisruptionBudget) { cur.Spec = want.Spec })
		return err
	}
	cur := &policyv1.PodDisruptionBudget{}
	err := r.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, cur)
	if apierrors.IsNotFound(err) || (err == nil && !metav1.IsControlledBy(cur, relay) && !orphanOf(cur, relay)) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("get PodDisruptionBudget %s: %w", childName(relay), err)
	}
	if err := r.Delete(ctx, cur, client.Preconditions{UID: &cur.UID}); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("delete PodDisruptionBudget %s: %w", cur.Name, err)
	}
	return nil
}

// currentDeployment is the relay's Deployment as the cache has it, or nil
// when there is none or another owner controls it. An orphan this relay
// will adopt (ensure) counts as its own: its replicas, its pods' mode and
// its Secrets' record are what the relay goes on from. Before, it counted
// as none, so adopting an autoscaled relay's Deployment scaled it down to
// the minimum, and one whose ordering changed rolled without Recreate.
func (r *OutboxRelayReconciler) currentDeployment(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) (*appsv1.Deployment, error) {
	d := &appsv1.Deployment{}
	err := r.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, d)
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("get Deployment %s: %w", childName(relay), err)
	case !metav1.IsControlledBy(d, relay) && !orphanOf(d, relay):
		return nil, nil
	}
	return d, nil
}

// hasLabels reports whether cur carries every label of want, with its value.
func hasLabels(cur, want client.Object) bool {
	for k, v := range want.GetLabels() {
		if got, ok := cur.GetLabels()[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// orphanOf reports whether obj has no controller and carries relay's
// children's labels: the operator made it for an OutboxRelay of relay's
// name that was deleted with its children orphaned.
func orphanOf(obj client.Object, relay *outboxv1alpha1.OutboxRelay) bool {
	if metav1.GetControllerOf(obj) != nil {
		return false
	}
	for k, v := range commonLabels(relay) {
		if obj.GetLabels()[k] != v {
			return false
		}
	}
	return true
}

// deploymentPath is a path into a Deployment's pod template that one of
// an OutboxRelay's fields fills (the list index in group 2, when it has one).
var deploymentPath = regexp.MustCompile(`spec\.template\.spec\.(containers\[0\]\.(?:envFrom|env|volumeMounts|resources|securityContext)|volumes|nodeSelector|tolerations|topologySpreadConstraints|affinity|imagePullSecrets|securityContext|serviceAccountName)(?:\[(\d+)\])?`)

// inRelayTerms rewrites the paths an API server's refusal of Deployment d
// quotes into the OutboxRelay's fields they came from, the list indexes
// counted without the relay's own entries, which come first (an env index
// of the container counted the relay's own variables). A path of the
// relay's own entries stays as it is.
func inRelayTerms(msg string, d *appsv1.Deployment, tmpl *outboxv1alpha1.RelayPodTemplate) string {
	c, pod := &d.Spec.Template.Spec.Containers[0], &d.Spec.Template.Spec
	fields := map[string]struct {
		path string
		own  int // the relay's own entries before the spec's
	}{
		"containers[0].env":             {"spec.template.container.env", len(c.Env) - len(containerTemplate(tmpl).Env)},
		"containers[0].envFrom":         {"spec.template.container.envFrom", len(c.EnvFrom) - len(containerTemplate(tmpl).EnvFrom)},
		"containers[0].volumeMounts":    {"spec.template.container.volumeMounts", len(c.VolumeMounts) - len(containerTemplate(tmpl).VolumeMounts)},
		"volumes":                       {"spec.template.pod.volumes", len(pod.Volumes) - len(podTemplate(tmpl).Volumes)},
		"nodeSelector":                  {"spec.nodeSelector", 0},
		"tolerations":                   {"spec.tolerations", 0},
		"topologySpreadConstraints":     {"spec.template.pod.topologySpreadConstraints", 0},
		"affinity":                      {"spec.affinity", 0},
		"imagePullSecrets":              {"spec.imagePullSecrets", 0},
		"securityContext":               {"spec.template.pod.securityContext", 0},
		"serviceAccountName":            {"spec.template.pod.serviceAccountName", 0},
		"containers[0].resources":       {"spec.resources", 0},
		"containers[0].securityContext": {"spec.template.container.securityContext", 0},
	}
	// The security contexts hold the operator's defaults too: a refusal
	// of one the spec does not set is of those (beside a legacy seccomp
	// annotation, say), and keeps the Deployment's path.
	if podTemplate(tmpl).SecurityContext == nil {
		delete(fields, "securityContext")
	}
	if containerTemplate(tmpl).SecurityContext == nil {
		delete(fields, "containers[0].securityContext")
	}
	return deploymentPath.ReplaceAllStringFunc(msg, func(p string) string {
		m := deploymentPath.FindStringSubmatch(p)
		f, ok := fields[m[1]]
		if !ok {
			return p
		}
		if m[2] == "" {
			return f.path
		}
		i, err := strconv.Atoi(m[2])
		if err != nil || i < f.own {
			return p
		}
		return fmt.Sprintf("%s[%d]", f.path, i-f.own)
	})
}

// conflictError: a child's name is taken by an object another owner controls.
type conflictError struct{ msg string }

func (e *conflictError) Error() string { return e.msg }

// childProblem sorts an error from writing a child: the API server refusing
// what the spec produced is InvalidSpec (retrying cannot help), a name taken
// by someone else is a conflict, a refusal for another reason (an admission
// webhook's, 400 or 403, a quota's or RBAC's, 403) is ChildRefused, which
// the status shows (before, it was taken for transient: the relay kept
// an empty status, and each pass logged the same error), anything else is
// transient.
func childProblem(err error) (*problem, error) {
	var conflict *conflictError
	switch {
	case err == nil:
		return nil, nil
	case errors.As(err, &conflict):
		return &problem{reason: outboxv1alpha1.ReasonResourceConflict, message: conflict.msg}, nil
	case apierrors.IsInvalid(err):
		return &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: err.Error()}, nil
	case apierrors.IsForbidden(err), apierrors.IsBadRequest(err):
		return &problem{reason: outboxv1alpha1.ReasonChildRefused, message: "the API server refused it: " + err.Error(), requeue: true}, nil
	default:
		return nil, err
	}
}

// ensure creates want (controlled by relay), or patches the existing object
// when its spec-hash annotation differs from want's, it lacks one of want's
// labels, drifted says it changed underneath us, or the fields owned picks
// out no longer hash to its live-hash label (someone edited them by
// hand). merge copies the fields the operator owns from want into the
// existing object; fields the API server defaulted stay, so an unchanged
// relay causes no write at all. After a write that changed the owned
// fields, ensure records their hash as stored (recordLive). c's
// cache holds only objects with the operator's label (childSelector): when
// the create finds the name taken, ensure reads the object from the API
// server with uncached (a child that lost its label gets it back; another
// owner's object is a conflict).
func ensure[T client.Object](ctx context.Context, c client.Client, uncached client.Reader, relay *outboxv1alpha1.OutboxRelay,
	want, cur T, drifted func(cur, want T) bool, owned func(T) any, merge func(cur, want T)) (T, error) {
	kind := fmt.Sprintf("%T", want)[1:]
	key := client.ObjectKeyFromObject(want)
	err := c.Get(ctx, key, cur)
	if apierrors.IsNotFound(err) {
		if err := controllerutil.SetControllerReference(relay, want, c.Scheme()); err != nil {
			return want, fmt.Errorf("own %s %s: %w", kind, want.GetName(), err)
		}
		err = c.Create(ctx, want)
		if err == nil {
			return want, recordLive(ctx, c, want, owned, kind)
		}
		if !apierrors.IsAlreadyExists(err) {
			return want, fmt.Errorf("create %s %s: %w", kind, want.GetName(), err)
		}
		err = uncached.Get(ctx, key, cur)
	}
	if err != nil {
		return cur, fmt.Errorf("get %s %s: %w", kind, want.GetName(), err)
	}
	adopt := false
	if !metav1.IsControlledBy(cur, relay) {
		if !orphanOf(cur, relay) {
			return cur, &conflictError{fmt.Sprintf("%s %s exists and is not controlled by this OutboxRelay", kind, cur.GetName())}
		}
		// No controller, and this relay's labels: the operator made it for
		// an OutboxRelay of this name that was deleted with its children
		// orphaned (kubectl delete --cascade=orphan), and this one takes
		// it over, its pods running on. Before, it was a conflict until
		// someone deleted it.
		adopt = true
	}
	if !adopt && cur.GetAnnotations()[specHashAnnotation] == want.GetAnnotations()[specHashAnnotation] &&
		hasLabels(cur, want) && (drifted == nil || !drifted(cur, want)) &&
		(owned == nil || cur.GetLabels()[liveHashLabel] == hashOf(owned(cur))) {
		return cur, nil
	}
	patch := client.MergeFromWithOptions(cur.DeepCopyObject().(client.Object), client.MergeFromWithOptimisticLock{})
	if adopt {
		if err := controllerutil.SetControllerReference(relay, cur, c.Scheme()); err != nil {
			return cur, fmt.Errorf("own %s %s: %w", kind, cur.GetName(), err)
		}
	}
	labels, annotations := cur.GetLabels(), cur.GetAnnotations()
	if labels == nil {
		labels = map[string]string{}
	}
	if annotations == nil {
		annotations = map[string]string{}
	}
	maps.Copy(labels, want.GetLabels())
	maps.Copy(annotations, want.GetAnnotations())
	cur.SetLabels(labels)
	cur.SetAnnotations(annotations)
	merge(cur, want)
	if err := c.Patch(ctx, cur, patch); err != nil {
		return cur, fmt.Errorf("patch %s %s: %w", kind, cur.GetName(), err)
	}
	return cur, recordLive(ctx, c, cur, owned, kind)
}

// recordLive sets obj's live-hash label to the hash of its owned fields
// as the API server returned them from the operator's write, unless it
// already holds it. It takes no optimistic lock: the Deployment controller
// writes the object at once (its revision, its status), and a lock would
// make this patch fail at nearly every write. It needs none: the hash is
// of what the operator wrote, so an edit of those fields made since does
// not match it, and the next pass undoes the edit.
func recordLive[T client.Object](ctx context.Context, c client.Client, obj T, owned func(T) any, kind string) error {
	if owned == nil {
		return nil
	}
	live := hashOf(owned(obj))
	if obj.GetLabels()[liveHashLabel] == live {
		return nil
	}
	patch := client.MergeFrom(obj.DeepCopyObject().(client.Object))
	labels := maps.Clone(obj.GetLabels())
	if labels == nil {
		labels = map[string]string{}
	}
	labels[liveHashLabel] = live
	obj.SetLabels(labels)
	if err := c.Patch(ctx, obj, patch); err != nil {
		return fmt.Errorf("record the live hash of %s %s: %w", kind, obj.GetName(), err)
	}
	return nil
}
