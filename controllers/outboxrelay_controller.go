package controllers

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// SecretRetryInterval is how soon a relay waiting for a Secret is looked at
// again even without a Secret event.
const SecretRetryInterval = 30 * time.Second

// secretIndexKey indexes OutboxRelays by the names of the Secrets they reference.
const secretIndexKey = ".spec.secretNames"

// OutboxRelayReconciler turns an OutboxRelay into a relay Deployment, a
// metrics Service and (with more than one replica) a PodDisruptionBudget.
type OutboxRelayReconciler struct {
	client.Client
	// Recorder records events on OutboxRelays.
	Recorder events.EventRecorder
	// RelayImage is the relay image for OutboxRelays that name none.
	RelayImage string
}

// problem is why a relay cannot run as specified: it becomes the Ready reason.
type problem struct {
	reason, message string
	// requeue: a dependency may appear without an event we watch.
	requeue bool
}

// +kubebuilder:rbac:groups=outbox.dev,resources=outboxrelays,verbs=get;list;watch
// +kubebuilder:rbac:groups=outbox.dev,resources=outboxrelays/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=outbox.dev,resources=outboxrelays/finalizers,verbs=update
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile brings one OutboxRelay's children to the desired state and reports its status.
func (r *OutboxRelayReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	relay := &outboxv1alpha1.OutboxRelay{}
	if err := r.Get(ctx, req.NamespacedName, relay); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !relay.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil // owner references hand the children to the garbage collector
	}
	original := relay.DeepCopy()

	deploy, prob, err := r.ensureChildren(ctx, relay)
	if err != nil {
		return ctrl.Result{}, err
	}
	if deploy == nil { // children left as they are: report the Deployment that runs
		if deploy, err = r.currentDeployment(ctx, relay); err != nil {
			return ctrl.Result{}, err
		}
	}
	relay.Status = computeStatus(relay, deploy, prob)
	r.recordProblem(original, relay, prob)
	if !equality.Semantic.DeepEqual(original.Status, relay.Status) {
		if err := r.Status().Patch(ctx, relay, client.MergeFrom(original)); err != nil {
			return ctrl.Result{}, fmt.Errorf("write status of %s: %w", req.NamespacedName, err)
		}
	}
	if prob != nil && prob.requeue {
		return ctrl.Result{RequeueAfter: SecretRetryInterval}, nil
	}
	return ctrl.Result{}, nil
}

// ensureChildren validates the spec, reads the referenced Secrets and ensures
// every child. It returns the Deployment as written, or a nil Deployment and
// the problem that kept it from writing the children.
func (r *OutboxRelayReconciler) ensureChildren(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) (*appsv1.Deployment, *problem, error) {
	if err := validateSpec(relay); err != nil {
		return nil, &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: err.Error()}, nil
	}
	in, prob, err := r.readSecrets(ctx, relay)
	if err != nil || prob != nil {
		return nil, prob, err
	}
	desired, err := relayDeployment(relay, r.RelayImage, in)
	if err != nil {
		return nil, &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: err.Error()}, nil
	}
	deploy, err := ensure(ctx, r.Client, relay, desired, &appsv1.Deployment{},
		func(cur, want *appsv1.Deployment) bool { return *cur.Spec.Replicas != *want.Spec.Replicas },
		func(cur, want *appsv1.Deployment) {
			cur.Spec.Replicas = want.Spec.Replicas
			cur.Spec.RevisionHistoryLimit = want.Spec.RevisionHistoryLimit
			cur.Spec.Template = want.Spec.Template
		})
	if prob, err := childProblem(err); prob != nil || err != nil {
		return nil, prob, err
	}
	_, err = ensure(ctx, r.Client, relay, relayService(relay), &corev1.Service{}, nil,
		func(cur, want *corev1.Service) {
			cur.Spec.Type = want.Spec.Type
			cur.Spec.Selector = want.Spec.Selector
			cur.Spec.Ports = want.Spec.Ports
		})
	if prob, err := childProblem(err); prob != nil || err != nil {
		return nil, prob, err
	}
	if err := r.ensurePDB(ctx, relay); err != nil {
		if prob, err := childProblem(err); prob != nil || err != nil {
			return nil, prob, err
		}
	}
	return deploy, nil, nil
}

// ensurePDB writes the PodDisruptionBudget, or deletes the one this relay
// owns when it runs fewer than two replicas.
func (r *OutboxRelayReconciler) ensurePDB(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) error {
	if want := relayPDB(relay); want != nil {
		_, err := ensure(ctx, r.Client, relay, want, &policyv1.PodDisruptionBudget{}, nil,
			func(cur, want *policyv1.PodDisruptionBudget) { cur.Spec = want.Spec })
		return err
	}
	cur := &policyv1.PodDisruptionBudget{}
	err := r.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: ChildName(relay)}, cur)
	if apierrors.IsNotFound(err) || (err == nil && !metav1.IsControlledBy(cur, relay)) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("get PodDisruptionBudget %s: %w", ChildName(relay), err)
	}
	if err := r.Delete(ctx, cur, client.Preconditions{UID: &cur.UID}); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("delete PodDisruptionBudget %s: %w", cur.Name, err)
	}
	return nil
}

// conflictError: a child's name is taken by an object another owner controls.
type conflictError struct{ msg string }

func (e *conflictError) Error() string { return e.msg }

// childProblem sorts an error from writing a child: the API server refusing
// what the spec produced is InvalidSpec (retrying cannot help), a name taken
// by someone else is a conflict, anything else is transient.
func childProblem(err error) (*problem, error) {
	var conflict *conflictError
	switch {
	case err == nil:
		return nil, nil
	case errors.As(err, &conflict):
		return &problem{reason: outboxv1alpha1.ReasonResourceConflict, message: conflict.msg}, nil
	case apierrors.IsInvalid(err):
		return &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: err.Error()}, nil
	default:
		return nil, err
	}
}

// ensure creates want, or patches the existing object when its spec-hash
// annotation differs from want's or drifted says it changed underneath us.
// merge copies the fields the operator owns from want into the existing
// object; fields the API server defaulted stay, so an unchanged relay
// causes no write at all.
func ensure[T client.Object](ctx context.Context, c client.Client, relay *outboxv1alpha1.OutboxRelay,
	want, cur T, drifted func(cur, want T) bool, merge func(cur, want T)) (T, error) {
	kind := fmt.Sprintf("%T", want)[1:]
	err := c.Get(ctx, client.ObjectKeyFromObject(want), cur)
	if apierrors.IsNotFound(err) {
		if err := c.Create(ctx, want); err != nil {
			return want, fmt.Errorf("create %s %s: %w", kind, want.GetName(), err)
		}
		return want, nil
	}
	if err != nil {
		return cur, fmt.Errorf("get %s %s: %w", kind, want.GetName(), err)
	}
	if !metav1.IsControlledBy(cur, relay) {
		return cur, &conflictError{fmt.Sprintf("%s %s exists and is not controlled by this OutboxRelay", kind, cur.GetName())}
	}
	if cur.GetAnnotations()[SpecHashAnnotation] == want.GetAnnotations()[SpecHashAnnotation] &&
		(drifted == nil || !drifted(cur, want)) {
		return cur, nil
	}
	patch := client.MergeFromWithOptions(cur.DeepCopyObject().(client.Object), client.MergeFromWithOptimisticLock{})
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
	return cur, nil
}

func (r *OutboxRelayReconciler) currentDeployment(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) (*appsv1.Deployment, error) {
	d := &appsv1.Deployment{}
	err := r.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: ChildName(relay)}, d)
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("get Deployment %s: %w", ChildName(relay), err)
	case !metav1.IsControlledBy(d, relay):
		return nil, nil
	}
	return d, nil
}

// readSecrets checks that every referenced Secret and key exists and hashes
// their data, so the pod template changes when a Secret does.
func (r *OutboxRelayReconciler) readSecrets(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) (secretInputs, *problem, error) {
	var in secretInputs
	h := sha256.New()
	get := func(field, name string) (*corev1.Secret, *problem, error) {
		s := &corev1.Secret{}
		err := r.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: name}, s)
		if apierrors.IsNotFound(err) {
			return nil, &problem{reason: outboxv1alpha1.ReasonSecretNotFound, requeue: true,
				message: fmt.Sprintf("Secret %s (%s) not found", name, field)}, nil
		}
		if err != nil {
			return nil, nil, fmt.Errorf("get Secret %s: %w", name, err)
		}
		return s, nil, nil
	}
	hashKeys := func(field string, s *corev1.Secret, keys ...string) *problem {
		for _, k := range keys {
			v, ok := s.Data[k]
			if !ok {
				return &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
					message: fmt.Sprintf("Secret %s has no key %q (%s)", s.Name, k, field)}
			}
			fmt.Fprintf(h, "%s/%s/%d:", s.Name, k, len(v))
			h.Write(v)
		}
		return nil
	}

	ref := relay.Spec.DSNSecretRef
	s, prob, err := get("spec.dsnSecretRef", ref.Name)
	if prob != nil || err != nil {
		return in, prob, err
	}
	if prob := hashKeys("spec.dsnSecretRef.key", s, cmp.Or(ref.Key, "dsn")); prob != nil {
		return in, prob, nil
	}
	if tls := relay.Spec.Kafka.TLS; tls != nil && tls.SecretRef != nil {
		s, prob, err := get("spec.kafka.tls.secretRef", tls.SecretRef.Name)
		if prob != nil || err != nil {
			return in, prob, err
		}
		_, in.TLSCA = s.Data["ca.crt"]
		_, hasCert := s.Data["tls.crt"]
		_, hasKey := s.Data["tls.key"]
		if hasCert != hasKey {
			return in, &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
				message: fmt.Sprintf("Secret %s (spec.kafka.tls.secretRef) must hold both tls.crt and tls.key, or neither", s.Name)}, nil
		}
		in.TLSClientCert = hasCert
		// The whole Secret is mounted, so all of it counts.
		hashKeys("spec.kafka.tls.secretRef", s, slices.Sorted(maps.Keys(s.Data))...)
	}
	if sasl := relay.Spec.Kafka.SASL; sasl != nil {
		ref := sasl.CredentialsSecretRef
		s, prob, err := get("spec.kafka.sasl.credentialsSecretRef", ref.Name)
		if prob != nil || err != nil {
			return in, prob, err
		}
		if prob := hashKeys("spec.kafka.sasl.credentialsSecretRef", s,
			cmp.Or(ref.UsernameKey, "username"), cmp.Or(ref.PasswordKey, "password")); prob != nil {
			return in, prob, nil
		}
	}
	in.Hash = hex.EncodeToString(h.Sum(nil))[:16]
	return in, nil, nil
}

// recordProblem emits a Warning event when the relay newly has a problem (or
// a new generation still has it), so events do not repeat on every resync.
func (r *OutboxRelayReconciler) recordProblem(before, after *outboxv1alpha1.OutboxRelay, prob *problem) {
	if prob == nil || r.Recorder == nil {
		return
	}
	old := meta.FindStatusCondition(before.Status.Conditions, outboxv1alpha1.ConditionReady)
	if old != nil && old.Reason == prob.reason && old.Message == prob.message &&
		before.Status.ObservedGeneration == after.Generation {
		return
	}
	r.Recorder.Eventf(after, nil, corev1.EventTypeWarning, prob.reason, "Reconcile", "%s", prob.message)
}

// referencedSecrets are the names of the Secrets a relay references.
func referencedSecrets(relay *outboxv1alpha1.OutboxRelay) []string {
	names := []string{relay.Spec.DSNSecretRef.Name}
	if tls := relay.Spec.Kafka.TLS; tls != nil && tls.SecretRef != nil {
		names = append(names, tls.SecretRef.Name)
	}
	if sasl := relay.Spec.Kafka.SASL; sasl != nil {
		names = append(names, sasl.CredentialsSecretRef.Name)
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// relaysForSecret maps a Secret to the relays in its namespace that reference it.
func (r *OutboxRelayReconciler) relaysForSecret(ctx context.Context, secret client.Object) []reconcile.Request {
	var relays outboxv1alpha1.OutboxRelayList
	if err := r.List(ctx, &relays, client.InNamespace(secret.GetNamespace()),
		client.MatchingFields{secretIndexKey: secret.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "list OutboxRelays referencing a Secret", "secret", client.ObjectKeyFromObject(secret))
		return nil
	}
	reqs := make([]reconcile.Request, len(relays.Items))
	for i := range relays.Items {
		reqs[i].NamespacedName = client.ObjectKeyFromObject(&relays.Items[i])
	}
	return reqs
}

// SetupWithManager registers the controller, its watches and the Secret index.
func (r *OutboxRelayReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if err := mgr.GetFieldIndexer().IndexField(ctx, &outboxv1alpha1.OutboxRelay{}, secretIndexKey,
		func(o client.Object) []string { return referencedSecrets(o.(*outboxv1alpha1.OutboxRelay)) }); err != nil {
		return fmt.Errorf("index OutboxRelays by Secret: %w", err)
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&outboxv1alpha1.OutboxRelay{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Watches(&corev1.Secret{}, handler.EnqueueRequestsFromMapFunc(r.relaysForSecret)).
		Named("outboxrelay").
		Complete(r)
}
