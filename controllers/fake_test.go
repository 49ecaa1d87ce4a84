package controllers

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// fakeDSN is the DSN of fakeRelay's Secret; nothing listens there.
const fakeDSN = "postgres://relay:pw@db.example:5432/orders"

// fakeRelay is an OutboxRelay shop/orders and its DSN Secret on a fake
// API server (funcs intercept its calls), with a reconciler over it: for
// reconcile passes that need no envtest, database or broker.
func fakeRelay(t *testing.T, funcs interceptor.Funcs, edit func(*outboxv1alpha1.OutboxRelay)) (client.Client, *OutboxRelayReconciler, *outboxv1alpha1.OutboxRelay) {
	t.Helper()
	relay := &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Name: "orders", Namespace: "shop", Generation: 1},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: "dsn", Key: "dsn"},
			Table:        "outbox",
			Topics:       map[string]outboxv1alpha1.TopicName{"A": "a"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"k:9092"}},
			Replicas:     ptr.To[int32](1),
		},
	}
	if edit != nil {
		edit(relay)
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "dsn", Namespace: "shop"}, Data: map[string][]byte{"dsn": []byte(fakeDSN)}}
	c := fake.NewClientBuilder().WithScheme(newScheme(t)).WithObjects(relay, secret).WithStatusSubresource(relay).
		WithInterceptorFuncs(funcs).Build()
	r := &OutboxRelayReconciler{Client: c, APIReader: c, RelayImage: "ghcr.io/x/relay:v1",
		secrets: newSecretCache(0, nil), configMaps: newConfigMapCache(0), Flow: NewFlowObserver()}
	return c, r, relay
}

// fakeDeployment is relay's Deployment as c has it.
func fakeDeployment(t *testing.T, c client.Client, relay *outboxv1alpha1.OutboxRelay) *appsv1.Deployment {
	t.Helper()
	d := &appsv1.Deployment{}
	require.NoError(t, c.Get(context.Background(), types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, d))
	return d
}

// kubectl rollout restart stamps the Deployment's pod template; the next
// change the operator writes (a scale, here) keeps the stamp, so the pods
// roll once, not again at the scale.
func TestRolloutRestartStampSurvivesAScale(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	d := &appsv1.Deployment{}
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, d))
	d.Spec.Template.Annotations[restartedAtAnnotation] = "2026-12-03T10:00:00Z"
	require.NoError(t, c.Update(ctx, d))

	require.NoError(t, c.Get(ctx, key, relay))
	relay.Spec.Replicas = ptr.To[int32](3) // kubectl scale
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, d))
	require.EqualValues(t, 3, *d.Spec.Replicas, "scaled")
	require.Equal(t, "2026-12-03T10:00:00Z", d.Spec.Template.Annotations[restartedAtAnnotation], "the restart's stamp stays")
	require.NotEmpty(t, d.Spec.Template.Annotations[configHashAnnotation])

	require.NoError(t, c.Get(ctx, key, relay))
	relay.Spec.PodAnnotations = map[string]string{restartedAtAnnotation: "2026-12-03T11:00:00Z"} // Argo CD's restart action
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, d))
	require.Equal(t, "2026-12-03T11:00:00Z", d.Spec.Template.Annotations[restartedAtAnnotation], "the spec's stamp wins")
}

// An oldestAge target multiplies the replicas that ran when the reading
// was taken, once per reading: the reconcile that the replicas' own write
// triggers, over the same reading, asks for the same count. Before, each
// pass multiplied the count the last one wrote, and one reading of 15 s
// against 10 s climbed 2, 3, 5, 8, 12, 18, 20.
func TestOldestAgeScalesOncePerReading(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.Replicas = nil
		o.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{MaxReplicas: 20, OldestAge: "10s"}
	})
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	table, err := outbox.ParseTable("outbox")
	require.NoError(t, err)
	reading := func() *backlogSample {
		return &backlogSample{at: time.Now(), read: 5, groups: []typeCount{{eventType: ptr.To("A"), n: 5, age: 15}}}
	}
	r.Flow.relays[key] = &relayFlow{target: flowTarget{dsn: fakeDSN, auth: dbAuth{method: relayconfig.DatabaseAuthPassword}, table: table,
		interval: 15 * time.Second}, latest: reading()}
	replicas := func() int32 { return *fakeDeployment(t, c, relay).Spec.Replicas }
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key}) // creates the Deployment: 1 × 1.5
	require.NoError(t, err)
	first := replicas()
	for range 8 {
		_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
	}
	require.EqualValues(t, 2, replicas(), "one reading of 15 s against 10 s with %d running", first)

	r.Flow.mu.Lock()
	r.Flow.relays[key].latest = reading() // the next reading: still 15 s, now with 2 running
	r.Flow.mu.Unlock()
	for range 8 {
		_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
	}
	require.EqualValues(t, 3, replicas())
}

// A relay that no backlog reading wakes (no observer here) comes back when
// its Secret's entry is due, however much of the fifth it was stretched
// by: the pass it asked for reads a rotated DSN and rolls the pods. Before,
// it came back after exactly the refresh interval, found the entry still
// valid, and the rotation waited for the next interval.
func TestRequeueReadsRotatedSecretWhenDue(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, nil)
	r.Flow = nil
	r.secrets = newSecretCache(time.Second, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	dsn := types.NamespacedName{Namespace: relay.Namespace, Name: relay.Spec.DSNSecretRef.Name}
	configHash := func() string { return fakeDeployment(t, c, relay).Spec.Template.Annotations[configHashAnnotation] }
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	before := configHash()
	r.secrets.mu.Lock()
	stretched := *r.secrets.entries[dsn] // the most of the fifth
	stretched.expires = stretched.read.Add(r.secrets.refresh * 6 / 5)
	r.secrets.entries[dsn] = &stretched
	r.secrets.mu.Unlock()
	res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Positive(t, res.RequeueAfter)

	s := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, dsn, s))
	s.Data["dsn"] = []byte(fakeDSN + "?rotated")
	require.NoError(t, c.Update(ctx, s))
	<-time.After(res.RequeueAfter)
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NotEqual(t, before, configHash(), "the rotation rolls the pods at the pass the relay asked for")
}

// The Deployment controller writes a Deployment the moment the operator
// has (its revision, its status): recording the live hash must not fail
// for it. Before, that write took an optimistic lock, conflicted, and
// failed the pass, which skipped the Service, the PDB and the status.
func TestLiveHashIsRecordedBesideTheDeploymentController(t *testing.T) {
	t.Parallel()
	var controllerWrites int
	funcs := interceptor.Funcs{
		Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			if err := c.Create(ctx, obj, opts...); err != nil {
				return err
			}
			return deploymentControllerWrites(ctx, c, obj, &controllerWrites)
		},
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			if err := c.Patch(ctx, obj, patch, opts...); err != nil {
				return err
			}
			return deploymentControllerWrites(ctx, c, obj, &controllerWrites)
		},
	}
	c, r, relay := fakeRelay(t, funcs, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	d := fakeDeployment(t, c, relay)
	require.NotEmpty(t, d.Labels[liveHashLabel])
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}, &corev1.Service{}),
		"the pass went on to the Service")

	require.NoError(t, c.Get(ctx, key, relay))
	relay.Spec.BatchSize = ptr.To[int32](77)
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	d = fakeDeployment(t, c, relay)
	require.Contains(t, d.Spec.Template.Spec.Containers[0].Args, "--batch-size=77")
	require.Equal(t, hashOf(deploymentOwned(d)), d.Labels[liveHashLabel])
	require.Positive(t, controllerWrites)
}

// The API server refusing a child for a reason other than its content (an
// admission webhook, 400 or 403; a ResourceQuota, 403) is a problem the
// status names, Stalled, retried at the Secret retry interval. Before, it
// was taken for transient: the relay kept an empty status, and each pass
// failed with the same error.
func TestChildRefusedByTheAPIServerIsInTheStatus(t *testing.T) {
	t.Parallel()
	for name, refusal := range map[string]error{
		"webhook": apierrors.NewBadRequest(`admission webhook "policy.example" denied the request: images must be signed`),
		"quota": apierrors.NewForbidden(schema.GroupResource{Group: "apps", Resource: "deployments"}, "orders-relay",
			errors.New("exceeded quota: pods, requested: 1, used: 10, limited: 10")),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			funcs := interceptor.Funcs{Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
				if _, ok := obj.(*appsv1.Deployment); ok {
					return refusal
				}
				return c.Create(ctx, obj, opts...)
			}}
			c, r, relay := fakeRelay(t, funcs, nil)
			ctx := context.Background()
			key := client.ObjectKeyFromObject(relay)
			res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
			require.NoError(t, err)
			require.Equal(t, secretRetryInterval, res.RequeueAfter)
			require.NoError(t, c.Get(ctx, key, relay))
			ready := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady)
			require.NotNil(t, ready)
			require.Equal(t, metav1.ConditionFalse, ready.Status)
			require.Equal(t, outboxv1alpha1.ReasonChildRefused, ready.Reason)
			require.Contains(t, ready.Message, refusal.Error())
			require.True(t, meta.IsStatusConditionTrue(relay.Status.Conditions, outboxv1alpha1.ConditionStalled))
			require.Equal(t, relay.Generation, relay.Status.ObservedGeneration)
		})
	}
}

// A pass that read an OutboxRelay older than the API server's (the cache
// had not seen the last pass's status write yet) does not write the status
// it computed from it: the patch is made over the resourceVersion it read,
// conflicts, and the pass runs again shortly. Before, it reset the
// conditions' transition times, sent their events again, and left out of
// its patch what it found equal to the old copy.
func TestStaleReadDoesNotOverwriteTheStatus(t *testing.T) {
	t.Parallel()
	var stale atomic.Pointer[outboxv1alpha1.OutboxRelay]
	c, r, relay := fakeRelay(t, interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
		if o, ok := obj.(*outboxv1alpha1.OutboxRelay); ok && stale.Load() != nil {
			stale.Load().DeepCopyInto(o)
			return nil
		}
		return c.Get(ctx, key, obj, opts...)
	}}, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	before := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, key, before)) // no status yet
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	written := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, key, written))
	ready := meta.FindStatusCondition(written.Status.Conditions, outboxv1alpha1.ConditionReady)
	require.NotNil(t, ready)

	stale.Store(before)
	res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, statusConflictRetry, res.RequeueAfter, "the pass runs again")
	stale.Store(nil)
	now := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, key, now))
	require.Equal(t, written.ResourceVersion, now.ResourceVersion, "nothing written over the newer status")
}

// A refused child is not written again at every pass: every backlog
// reading wakes the relay, and a thousand relays under one quota would send
// a refused write each at every reading. It is tried again after
// secretRetryInterval, or at once when the relay changes. Before, each
// pass wrote it again.
func TestRefusedChildIsNotWrittenAtEveryPass(t *testing.T) {
	t.Parallel()
	var creates atomic.Int32
	refusal := apierrors.NewForbidden(schema.GroupResource{Group: "apps", Resource: "deployments"}, "orders-relay",
		errors.New("exceeded quota: pods, requested: 1, used: 10, limited: 10"))
	c, r, relay := fakeRelay(t, interceptor.Funcs{Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
		if _, ok := obj.(*appsv1.Deployment); ok {
			creates.Add(1)
			return refusal
		}
		return c.Create(ctx, obj, opts...)
	}}, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	reason := func() string {
		require.NoError(t, c.Get(ctx, key, relay))
		return meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Reason
	}
	for range 5 {
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
		require.Equal(t, outboxv1alpha1.ReasonChildRefused, reason())
	}
	require.Equal(t, int32(1), creates.Load(), "written once in five passes")

	v, _ := r.childProblems.Load(key)
	seen := v.(childProblemSeen)
	seen.at = seen.at.Add(-secretRetryInterval)
	r.childProblems.Store(key, seen)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, int32(2), creates.Load(), "written again after secretRetryInterval")

	relay.Spec.BatchSize = ptr.To[int32](77)
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, int32(3), creates.Load(), "written at once for a changed spec")
	require.Equal(t, outboxv1alpha1.ReasonChildRefused, reason())
}

// An OutboxRelay deleted with its children orphaned (kubectl delete
// --cascade=orphan) and applied again takes its children over: they carry
// its labels and no controller. Before, each was a ResourceConflict until
// someone deleted it. An object with the name and another controller, or
// without the relay's labels, stays a conflict.
func TestOrphanedChildrenAreAdopted(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Replicas = ptr.To[int32](2) })
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	child := types.NamespacedName{Namespace: relay.Namespace, Name: childName(relay)}
	children := []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}}
	for _, obj := range children {
		require.NoError(t, c.Get(ctx, child, obj))
		obj.SetOwnerReferences(nil) // as the garbage collector leaves an orphan
		require.NoError(t, c.Update(ctx, obj))
	}
	template := fakeDeployment(t, c, relay).Spec.Template.DeepCopy()
	require.NoError(t, c.Delete(ctx, relay))
	relay.ObjectMeta = metav1.ObjectMeta{Name: relay.Name, Namespace: relay.Namespace, Generation: 1, UID: "second"}
	require.NoError(t, c.Create(ctx, relay))

	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	for _, obj := range children {
		require.NoError(t, c.Get(ctx, child, obj))
		require.True(t, metav1.IsControlledBy(obj, relay), "%T adopted", obj)
	}
	require.Equal(t, *template, fakeDeployment(t, c, relay).Spec.Template, "its pods run on: the template is unchanged")
	require.NotEqual(t, outboxv1alpha1.ReasonResourceConflict, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Reason)

	// Without the relay's labels, an object of the name stays a conflict.
	svc := &corev1.Service{}
	require.NoError(t, c.Get(ctx, child, svc))
	svc.OwnerReferences, svc.Labels = nil, map[string]string{"app": "mine"}
	require.NoError(t, c.Update(ctx, svc))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	require.Equal(t, outboxv1alpha1.ReasonResourceConflict, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Reason)
	require.NoError(t, c.Get(ctx, child, svc))
	require.Empty(t, svc.OwnerReferences, "left alone")
	require.NoError(t, c.Delete(ctx, svc))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)

	// An orphaned PodDisruptionBudget of a relay that now runs one
	// replica goes, as the relay's own would.
	pdb := &policyv1.PodDisruptionBudget{}
	require.NoError(t, c.Get(ctx, child, pdb))
	pdb.OwnerReferences = nil
	require.NoError(t, c.Update(ctx, pdb))
	require.NoError(t, c.Get(ctx, key, relay))
	relay.Spec.Replicas = ptr.To[int32](1)
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.True(t, apierrors.IsNotFound(c.Get(ctx, child, &policyv1.PodDisruptionBudget{})), "the orphaned PDB is deleted")

	// Another controller's Deployment of the name stays a conflict.
	d := fakeDeployment(t, c, relay)
	d.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "other", UID: "other", Controller: ptr.To(true)}}
	require.NoError(t, c.Update(ctx, d))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	require.Equal(t, outboxv1alpha1.ReasonResourceConflict, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Reason)
}

// An adopted Deployment is the relay's from the first pass: an autoscaled
// relay's replicas stay as they run until a reading says otherwise, and a
// relay re-created with another ordering rolls its pods with Recreate, so
// pods of both orderings never run together. Before, the orphan counted as
// no Deployment: the first pass scaled it to the minimum and rolled it
// with RollingUpdate.
func TestAdoptedDeploymentIsTheRelaysFromTheFirstPass(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.Replicas = nil
		o.Spec.Autoscaling = &outboxv1alpha1.AutoscalingSpec{MinReplicas: ptr.To[int32](1), MaxReplicas: 8, OldestAge: "10s"}
	})
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	d := fakeDeployment(t, c, relay)
	d.Spec.Replicas = ptr.To[int32](4) // scaled up under load
	d.OwnerReferences = nil            // as the garbage collector leaves an orphan
	require.NoError(t, c.Update(ctx, d))
	require.NoError(t, c.Delete(ctx, relay))
	relay.ObjectMeta = metav1.ObjectMeta{Name: relay.Name, Namespace: relay.Namespace, Generation: 1, UID: "second"}
	relay.Spec.Ordering = outboxv1alpha1.OrderingPartitionKey
	require.NoError(t, c.Create(ctx, relay))

	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	d = fakeDeployment(t, c, relay)
	require.True(t, metav1.IsControlledBy(d, relay), "adopted")
	require.Equal(t, int32(4), *d.Spec.Replicas, "no reading yet: the running count stays")
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, d.Spec.Strategy.Type, "the ordering changed with the adoption")
}

// deploymentControllerWrites stands in for the Deployment controller: after
// a write of a Deployment's spec, it stamps the revision, a write of its
// own that moves the resourceVersion.
func deploymentControllerWrites(ctx context.Context, c client.WithWatch, obj client.Object, writes *int) error {
	d, ok := obj.(*appsv1.Deployment)
	if !ok {
		return nil
	}
	cur := &appsv1.Deployment{}
	if err := c.Get(ctx, client.ObjectKeyFromObject(d), cur); err != nil {
		return err
	}
	if cur.Annotations["deployment.kubernetes.io/revision"] == cur.Annotations[specHashAnnotation] {
		return nil // this write was the annotation's own
	}
	if cur.Annotations == nil {
		cur.Annotations = map[string]string{}
	}
	cur.Annotations["deployment.kubernetes.io/revision"] = cur.Annotations[specHashAnnotation]
	*writes++
	return c.Update(ctx, cur)
}

// seedReading gives relay's observer (fakeRelay's target, not started) a
// latest reading of 7 rows waiting, the oldest 15 s old, and a slot
// holding back 1 MiB of WAL.
func seedReading(t *testing.T, r *OutboxRelayReconciler, key types.NamespacedName) {
	t.Helper()
	table, err := outbox.ParseTable("outbox")
	require.NoError(t, err)
	r.Flow.mu.Lock()
	defer r.Flow.mu.Unlock()
	r.Flow.relays[key] = &relayFlow{target: flowTarget{dsn: fakeDSN, auth: dbAuth{method: relayconfig.DatabaseAuthPassword}, table: table,
		interval: 15 * time.Second}, latest: &backlogSample{at: time.Now(), read: 7, groups: []typeCount{{eventType: ptr.To("A"), n: 7, age: 15}},
		slot: &outboxv1alpha1.SlotStatus{Name: "outbox", Exists: true, RetainedWAL: ptr.To(resource.MustParse("1Mi"))}}}
}

// fakeObservedRelay is fakeRelay with metrics, reconciled once with a
// backlog reading at hand (seedReading), and a reader of its series.
func fakeObservedRelay(t *testing.T, edit func(*outboxv1alpha1.OutboxRelay)) (client.Client, *OutboxRelayReconciler, *outboxv1alpha1.OutboxRelay, func() map[string]float64) {
	t.Helper()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, edit)
	var err error
	r.Metrics, err = NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	key := client.ObjectKeyFromObject(relay)
	seedReading(t, r, key)
	_, err = r.Reconcile(context.Background(), ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	return c, r, relay, func() map[string]float64 { return relaySeries(t, r.Metrics, key.Namespace, key.Name) }
}

// A paused relay is not observed: its backlog is not read (the observer
// would wake passes that discard what it read, log in with a DSN the
// operator is not to keep, and after a rotation the old one), and its
// gauges go, as after a manager restart, rather than freeze at the last
// pass's values. Resumed, it is observed and reported again.
func TestPausedRelayIsNotObserved(t *testing.T) {
	t.Parallel()
	c, r, relay, series := fakeObservedRelay(t, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	var err error
	require.True(t, r.Flow.observing(key))
	require.Equal(t, 7.0, series()["outbox_operator_backlog_rows"])

	require.NoError(t, c.Get(ctx, key, relay))
	relay.Annotations = map[string]string{outboxv1alpha1.ReconcileAnnotation: outboxv1alpha1.ReconcileDisabled}
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.False(t, r.Flow.observing(key), "a paused relay's backlog is not read")
	require.Empty(t, series(), "a paused relay has no gauges")

	// Paused for longer than a running manager keeps a reading.
	require.NoError(t, c.Get(ctx, key, relay))
	relay.Status.Backlog.ObservedAt = metav1.NewTime(time.Now().Add(-backlogRenewal - outboxv1alpha1.DefaultLagThreshold))
	require.NoError(t, c.Status().Update(ctx, relay))
	require.NoError(t, c.Get(ctx, key, relay))
	delete(relay.Annotations, outboxv1alpha1.ReconcileAnnotation)
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.True(t, r.Flow.observing(key), "resumed, it is observed again")
	require.Equal(t, 1.0, series()["outbox_operator_desired_replicas"])
	require.Equal(t, -1.0, series()["outbox_operator_lagging"], "not read yet since it resumed")
}

// A manager that starts, or takes the lead, keeps each relay's Lagging
// verdict until its own first reading: a relay found lagging stays not
// Ready, and its status is not written. Before, every relay went Lagging
// Unknown (Observing) meanwhile, a stalled one Ready, and each status was
// written twice (up to a minute per relay with a thousand relays).
func TestNewManagerKeepsTheVerdictUntilItsFirstReading(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	seedReading(t, r, key)
	r.Flow.relays[key].latest.groups[0].age = 600 // the oldest row waits 10 min
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	d := fakeDeployment(t, c, relay)
	d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: 1, UpdatedReplicas: 1, ReadyReplicas: 1, AvailableReplicas: 1}
	require.NoError(t, c.Status().Update(ctx, d))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	lag := *meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
	require.Equal(t, metav1.ConditionTrue, lag.Status)
	require.Equal(t, metav1.ConditionFalse, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Status)
	written := relay.ResourceVersion

	next := &OutboxRelayReconciler{Client: c, APIReader: c, RelayImage: r.RelayImage,
		secrets: newSecretCache(0, nil), configMaps: newConfigMapCache(0), Flow: NewFlowObserver()}
	_, err = next.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	require.Equal(t, lag, *meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging), "the last verdict stands")
	require.Equal(t, metav1.ConditionFalse, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Status, "a lagging relay is not Ready")
	require.Equal(t, written, relay.ResourceVersion, "nothing to write")
}

// A relay whose children cannot be written (here a Deployment of its name
// that it does not own) is still observed: Lagging says what the reading
// says, not that the backlog is not read. Before, it said the backlog was
// not read while status.backlog showed each new reading.
func TestChildConflictKeepsTheReading(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	theirs := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: relay.Namespace, Name: childName(relay)}}
	require.NoError(t, c.Create(ctx, theirs))
	seedReading(t, r, key)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, key, relay))
	require.Equal(t, outboxv1alpha1.ReasonResourceConflict, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Reason)
	require.True(t, r.Flow.observing(key))
	require.NotNil(t, relay.Status.Backlog)
	require.EqualValues(t, 7, relay.Status.Backlog.Pending)
	lag := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
	require.NotContains(t, lag.Message, "not read", "the backlog is read: %s", lag.Message)
}

// A relay with a problem (here its DSN Secret deleted) is not observed,
// and the backlog last read goes from its status and gauges: nothing reads
// it any more, and the slot's WAL may grow while the gauge an alert judges
// stood at the last reading. Lagging says the backlog is not read.
func TestProblemClearsTheBacklog(t *testing.T) {
	t.Parallel()
	c, r, relay, series := fakeObservedRelay(t, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication}
	})
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	var err error
	require.NoError(t, c.Get(ctx, key, relay))
	require.NotNil(t, relay.Status.Backlog)
	require.Equal(t, 7.0, series()["outbox_operator_backlog_rows"])
	require.Equal(t, float64(1<<20), series()["outbox_operator_slot_retained_wal_bytes"])

	dsn := types.NamespacedName{Namespace: relay.Namespace, Name: relay.Spec.DSNSecretRef.Name}
	require.NoError(t, c.Delete(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: dsn.Namespace, Name: dsn.Name}}))
	r.secrets.stale(dsn, 0)
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.False(t, r.Flow.observing(key))
	require.NoError(t, c.Get(ctx, key, relay))
	require.Equal(t, outboxv1alpha1.ReasonSecretNotFound, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Reason)
	require.Nil(t, relay.Status.Backlog, "no backlog is read: the last reading does not stand in status")
	lag := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
	require.Equal(t, metav1.ConditionUnknown, lag.Status)
	require.Contains(t, lag.Message, "the backlog is not read")
	s := series()
	for _, name := range []string{"outbox_operator_backlog_rows", "outbox_operator_oldest_waiting_age_seconds",
		"outbox_operator_slot_retained_wal_bytes", "outbox_operator_slot_max_retained_wal_bytes", "outbox_operator_rows_held{too_large}"} {
		require.NotContains(t, s, name, "nor in the gauges")
	}
	require.Equal(t, -1.0, s["outbox_operator_lagging"])
}

// Backlog reads that keep failing do not leave the last reading in status
// and the gauges for good: once it is older than a manager that reads would
// still show (backlogRenewal plus lagThreshold), it goes, whether it is this
// manager's or, after a restart, the previous manager's in status. Before,
// it stayed for as long as the reads failed, and the alerts judged it.
func TestFailingReadsClearAnOldReading(t *testing.T) {
	t.Parallel()
	old := time.Now().Add(-backlogRenewal - outboxv1alpha1.DefaultLagThreshold - time.Second)
	for name, restarted := range map[string]bool{"this manager's reading": false, "a previous manager's reading": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c, r, relay, series := fakeObservedRelay(t, nil)
			ctx := context.Background()
			key := client.ObjectKeyFromObject(relay)
			require.Equal(t, 7.0, series()["outbox_operator_backlog_rows"])
			fail := func(at time.Time) {
				r.Flow.mu.Lock()
				defer r.Flow.mu.Unlock()
				f := r.Flow.relays[key]
				f.lastErr = "cannot reach PostgreSQL"
				if restarted {
					f.latest = nil
				} else {
					f.latest.at = at
				}
			}
			if restarted {
				require.NoError(t, c.Get(ctx, key, relay))
				relay.Status.Backlog.ObservedAt = metav1.NewTime(time.Now().Add(-time.Minute))
				require.NoError(t, c.Status().Update(ctx, relay))
			}
			fail(time.Now().Add(-time.Minute))
			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
			require.NoError(t, err)
			require.NoError(t, c.Get(ctx, key, relay))
			require.NotNil(t, relay.Status.Backlog, "a recent reading stays through a failed read")
			require.Equal(t, 7.0, series()["outbox_operator_backlog_rows"])

			if restarted {
				relay.Status.Backlog.ObservedAt = metav1.NewTime(old)
				require.NoError(t, c.Status().Update(ctx, relay))
			}
			fail(old)
			_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
			require.NoError(t, err)
			require.NoError(t, c.Get(ctx, key, relay))
			require.Nil(t, relay.Status.Backlog, "an old reading goes")
			require.NotContains(t, series(), "outbox_operator_backlog_rows", "nor stays in the gauges")
			lag := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionLagging)
			require.Equal(t, outboxv1alpha1.ReasonBacklogUnavailable, lag.Reason)
		})
	}
}

// The Kafka TLS volume holds only the keys the relay reads, those the
// Secret has: a Strimzi KafkaUser Secret also holds user.p12 and
// user.password, which no relay pod needs. A Secret with none of them
// mounts nothing, as an empty list of keys would mount them all.
func TestKafkaTLSVolumeHoldsOnlyTheKeysRead(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		data map[string][]byte
		want []corev1.KeyToPath // nil: no volume
	}{
		"CA and client certificate": {
			data: map[string][]byte{"ca.crt": []byte("ca"), "tls.crt": []byte("c"), "tls.key": []byte("k"), "user.p12": []byte("p"), "user.password": []byte("pw")},
			want: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}, {Key: "tls.crt", Path: "tls.crt"}, {Key: "tls.key", Path: "tls.key"}},
		},
		"CA only": {
			data: map[string][]byte{"ca.crt": []byte("ca"), "ca.password": []byte("pw")},
			want: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}},
		},
		"client certificate only": {
			data: map[string][]byte{"tls.crt": []byte("c"), "tls.key": []byte("k"), "user.password": []byte("pw")},
			want: []corev1.KeyToPath{{Key: "tls.crt", Path: "tls.crt"}, {Key: "tls.key", Path: "tls.key"}},
		},
		"none of them": {data: map[string][]byte{"user.password": []byte("pw")}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c, r, relay := fakeRelay(t, interceptor.Funcs{}, func(o *outboxv1alpha1.OutboxRelay) {
				o.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{SecretRef: &outboxv1alpha1.SecretReference{Name: "kafka-user"}}
			})
			ctx := context.Background()
			require.NoError(t, c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: relay.Namespace, Name: "kafka-user"}, Data: tc.data}))
			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(relay)})
			require.NoError(t, err)
			pod := fakeDeployment(t, c, relay).Spec.Template.Spec
			if tc.want == nil {
				require.Empty(t, pod.Volumes)
				require.Empty(t, pod.Containers[0].VolumeMounts)
				return
			}
			require.Len(t, pod.Volumes, 1)
			require.Equal(t, "kafka-user", pod.Volumes[0].Secret.SecretName)
			require.Equal(t, tc.want, pod.Volumes[0].Secret.Items)
			require.Equal(t, []corev1.VolumeMount{{Name: "kafka-tls", MountPath: "/etc/relay/tls", ReadOnly: true}}, pod.Containers[0].VolumeMounts)
		})
	}
}

// A scale-down the API server refuses while the relay's children cannot be
// written is reported with the relay's problem, and the pass writes the
// status all the same: before, the pass ended on the error and the status
// never said what was wrong.
func TestRefusedScaleDownIsReportedInTheStatus(t *testing.T) {
	t.Parallel()
	refuse := false
	c, r, relay := fakeRelay(t, interceptor.Funcs{
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			if _, ok := obj.(*appsv1.Deployment); ok && refuse {
				return apierrors.NewForbidden(appsv1.Resource("deployments"), obj.GetName(), errors.New("denied by policy"))
			}
			return c.Patch(ctx, obj, patch, opts...)
		},
	}, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Replicas = ptr.To[int32](3) })
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.EqualValues(t, 3, *fakeDeployment(t, c, relay).Spec.Replicas)

	secret := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: "shop", Name: "dsn"}, secret))
	secret.Data = map[string][]byte{"other": []byte("x")} // the DSN key is gone: a problem
	require.NoError(t, c.Update(ctx, secret))
	r.secrets = newSecretCache(0, nil)
	require.NoError(t, c.Get(ctx, key, relay))
	relay.Spec.Suspend = true
	require.NoError(t, c.Update(ctx, relay))
	refuse = true
	res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err, "the refused scale-down is reported, not returned")
	require.Positive(t, res.RequeueAfter)
	require.LessOrEqual(t, res.RequeueAfter, secretRetryInterval, "tried again soon")
	require.EqualValues(t, 3, *fakeDeployment(t, c, relay).Spec.Replicas)
	require.NoError(t, c.Get(ctx, key, relay))
	ready := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady)
	require.NotNil(t, ready)
	require.Equal(t, outboxv1alpha1.ReasonSecretKeyMissing, ready.Reason)
	require.Contains(t, ready.Message, "scaling Deployment orders-relay down to 0 replicas failed")
	require.Contains(t, ready.Message, "denied by policy")

	refuse = false
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.EqualValues(t, 0, *fakeDeployment(t, c, relay).Spec.Replicas, "scaled down once allowed")
	require.NoError(t, c.Get(ctx, key, relay))
	require.NotContains(t, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Message, "failed")
}
