package controllers

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// TestController runs the reconciler in a manager against the real API
// server; each subtest works in its own namespace.
func TestController(t *testing.T) {
	r, mgr := startManager(t)
	c := adminClient(t)

	t.Run("SampleCreatesChildren", func(t *testing.T) { t.Parallel(); testSampleCreatesChildren(t, c) })
	t.Run("SpecChangesFollowAndNoopWritesNothing", func(t *testing.T) { t.Parallel(); testSpecChanges(t, c, r) })
	t.Run("ScaleSubresource", func(t *testing.T) { t.Parallel(); testScaleSubresource(t, c) })
	t.Run("SecretRotationAndDeletion", func(t *testing.T) { t.Parallel(); testSecretRotation(t, c) })
	t.Run("SecretKeyMissing", func(t *testing.T) { t.Parallel(); testSecretKeyMissing(t, c) })
	t.Run("StatusFollowsDeployment", func(t *testing.T) { t.Parallel(); testStatusFollowsDeployment(t, c) })
	t.Run("SuspendAndResume", func(t *testing.T) { t.Parallel(); testSuspend(t, c) })
	t.Run("ReconcilePaused", func(t *testing.T) { t.Parallel(); testReconcilePaused(t, c) })
	t.Run("InvalidSpecSetsConditionAndEvent", func(t *testing.T) { t.Parallel(); testInvalidSpec(t, c) })
	t.Run("KafkaTLSAndSASL", func(t *testing.T) { t.Parallel(); testKafkaTLSAndSASL(t, c) })
	t.Run("ForeignChildIsLeftAlone", func(t *testing.T) { t.Parallel(); testForeignChild(t, c) })
	t.Run("CacheHoldsOnlyChildren", func(t *testing.T) { t.Parallel(); testCacheHoldsOnlyChildren(t, c, mgr) })
	t.Run("OrderingSwitchUsesRecreate", func(t *testing.T) { t.Parallel(); testOrderingSwitch(t, c) })
	t.Run("ImageAllowList", func(t *testing.T) { t.Parallel(); testImageAllowList(t, c) })
	t.Run("SecretsKeptWithoutOtherData", func(t *testing.T) { t.Parallel(); testSecretsKeptWithoutOtherData(t, c, r) })
}

func create(t *testing.T, c client.Client, objs ...client.Object) {
	t.Helper()
	for _, o := range objs {
		require.NoError(t, c.Create(context.Background(), o), "create %T %s", o, o.GetName())
	}
}

// update re-reads obj and applies change until the write does not conflict.
func update[T client.Object](t *testing.T, c client.Client, obj T, change func(T)) {
	t.Helper()
	require.Eventually(t, func() bool {
		if err := c.Get(context.Background(), key(obj), obj); err != nil {
			return false
		}
		change(obj)
		err := c.Update(context.Background(), obj)
		require.False(t, apierrors.IsInvalid(err), "update refused: %v", err)
		return err == nil
	}, eventually, tick)
}

func hasEvent(t *testing.T, c client.Client, relay *outboxv1alpha1.OutboxRelay, reason string) bool {
	var evs eventsv1.EventList
	require.NoError(t, c.List(context.Background(), &evs, client.InNamespace(relay.Namespace)))
	return slices.ContainsFunc(evs.Items, func(e eventsv1.Event) bool {
		return e.Regarding.Name == relay.Name && e.Regarding.Kind == "OutboxRelay" &&
			e.Reason == reason && e.Type == corev1.EventTypeWarning
	})
}

func testSampleCreatesChildren(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	for _, o := range readSamples(t, ns) {
		require.NoError(t, c.Create(ctx, o), "apply sample %s %s", o.GetKind(), o.GetName())
	}
	relay := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders"}, relay))
	secret := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: relay.Spec.DSNSecretRef.Name}, secret))

	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.True(t, metav1.IsControlledBy(d, relay), "the Deployment is owned by the relay")
	require.Equal(t, int32(2), *d.Spec.Replicas)
	require.Equal(t, selectorLabels(relay), d.Spec.Selector.MatchLabels)
	pod := d.Spec.Template.Spec
	require.Len(t, pod.Containers, 1)
	ct := pod.Containers[0]
	require.Equal(t, testImage, ct.Image)
	require.Equal(t, []string{"/relay"}, ct.Command)
	// A flag newer than the first release is not given at its default (--linger).
	require.Equal(t, []string{
		"--table=outbox",
		"--brokers=127.0.0.1:9092",
		"--batch-size=50",
		"--max-batch-bytes=4194304",
		"--poll-interval=200ms",
		"--publish-timeout=10s",
		"--stall-timeout=2m0s",
		"--max-in-flight=2",
		"--on-publish=mark",
		"--keep-published-for=0s",
		"--prune-batch-size=1000",
		"--topic=OrderCancelled=orders.cancelled",
		"--topic=OrderConfirmed=orders.confirmed",
		"--dead-letter-topic=orders.dead-letter",
		"--ordering=none",
		"--metrics-addr=:9090",
		"--log-format=json",
	}, specArgs(ct.Args))

	// The DSN reaches the pod only through a secretKeyRef, and the relay
	// takes no other setting from its environment; RELAY_TABLE is for
	// `relay held` and `relay redrive` run by hand in the pod.
	require.Len(t, ct.Env, 3)
	require.Equal(t, corev1.EnvVar{Name: "RELAY_ARGS_ONLY", Value: "true"}, ct.Env[1])
	require.Equal(t, corev1.EnvVar{Name: "RELAY_TABLE", Value: "outbox"}, ct.Env[2])
	require.Equal(t, "RELAY_DSN", ct.Env[0].Name)
	require.Empty(t, ct.Env[0].Value)
	require.Equal(t, &corev1.SecretKeySelector{
		LocalObjectReference: corev1.LocalObjectReference{Name: "orders-outbox-dsn"}, Key: "dsn",
	}, ct.Env[0].ValueFrom.SecretKeyRef)
	raw, err := json.Marshal(d)
	require.NoError(t, err)
	require.NotContains(t, string(raw), string(secret.Data["dsn"]), "the DSN must not appear in the Deployment")
	require.NotContains(t, string(raw), "postgres://")

	// Restricted security context, no service-account token.
	require.Equal(t, ptr.To(false), pod.AutomountServiceAccountToken)
	require.Equal(t, ptr.To(true), pod.SecurityContext.RunAsNonRoot)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, pod.SecurityContext.SeccompProfile.Type)
	sc := ct.SecurityContext
	require.Equal(t, ptr.To(true), sc.RunAsNonRoot)
	require.Equal(t, ptr.To(true), sc.ReadOnlyRootFilesystem)
	require.Equal(t, ptr.To(false), sc.AllowPrivilegeEscalation)
	require.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop)
	require.Empty(t, sc.Capabilities.Add)
	require.Nil(t, sc.Privileged)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, sc.SeccompProfile.Type)
	require.Equal(t, ptr.To[int64](30), pod.TerminationGracePeriodSeconds)

	// Probes and the metrics port.
	require.Equal(t, []corev1.ContainerPort{{Name: "metrics", ContainerPort: 9090, Protocol: corev1.ProtocolTCP}}, ct.Ports)
	require.Equal(t, "/healthz", ct.LivenessProbe.HTTPGet.Path)
	require.Equal(t, "metrics", ct.LivenessProbe.HTTPGet.Port.String())
	require.Equal(t, "/readyz", ct.ReadinessProbe.HTTPGet.Path)
	require.Equal(t, "metrics", ct.ReadinessProbe.HTTPGet.Port.String())
	require.Equal(t, resource.MustParse("50m"), ct.Resources.Requests[corev1.ResourceCPU])
	require.NotEmpty(t, d.Spec.Template.Annotations[configHashAnnotation])

	svc := &corev1.Service{}
	require.Eventually(t, func() bool { return c.Get(ctx, childKey(relay), svc) == nil }, eventually, tick)
	require.True(t, metav1.IsControlledBy(svc, relay))
	require.Equal(t, selectorLabels(relay), svc.Spec.Selector)
	require.Len(t, svc.Spec.Ports, 1)
	require.Equal(t, int32(9090), svc.Spec.Ports[0].Port)
	require.Equal(t, "metrics", svc.Spec.Ports[0].TargetPort.String())

	pdb := &policyv1.PodDisruptionBudget{}
	require.Eventually(t, func() bool { return c.Get(ctx, childKey(relay), pdb) == nil }, eventually, tick)
	require.True(t, metav1.IsControlledBy(pdb, relay))
	require.Equal(t, 1, pdb.Spec.MaxUnavailable.IntValue())
	require.Equal(t, selectorLabels(relay), pdb.Spec.Selector.MatchLabels)
	require.Equal(t, policyv1.AlwaysAllow, *pdb.Spec.UnhealthyPodEvictionPolicy)

	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonDeploymentUnavailable
	})
	require.Equal(t, relay.Generation, relay.Status.ObservedGeneration)
	require.Equal(t, int32(2), relay.Status.TopicCount)
	require.Equal(t, "0/2", relay.Status.Ready)
	require.Equal(t, "app.kubernetes.io/instance=orders,app.kubernetes.io/name=outbox-relay", relay.Status.Selector)
}

// resourceVersions of the relay and its children, as the API server has them.
func resourceVersions(t *testing.T, c client.Client, relay *outboxv1alpha1.OutboxRelay) []string {
	ctx := context.Background()
	objs := []client.Object{&outboxv1alpha1.OutboxRelay{}, &appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}}
	rvs := make([]string, len(objs))
	for i, o := range objs {
		k := childKey(relay)
		if i == 0 {
			k = key(relay)
		}
		require.NoError(t, c.Get(ctx, k, o))
		rvs[i] = o.GetResourceVersion()
	}
	return rvs
}

func testSpecChanges(t *testing.T, c client.Client, r *OutboxRelayReconciler) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "changes")
	create(t, c, secret, relay)
	before := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.Equal(t, int32(1), *before.Spec.Replicas)
	require.True(t, apierrors.IsNotFound(c.Get(ctx, childKey(relay), &policyv1.PodDisruptionBudget{})), "no PDB for one replica")

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.BatchSize = ptr.To[int32](500)
		o.Spec.Topics["OrderShipped"] = "orders.shipped"
		o.Spec.Replicas = ptr.To[int32](3)
	})
	after := waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 3 })
	args := after.Spec.Template.Spec.Containers[0].Args
	require.Contains(t, args, "--batch-size=500")
	require.Contains(t, args, "--topic=OrderShipped=orders.shipped")
	require.Contains(t, args, "--topic=OrderConfirmed=orders.confirmed")
	require.NotEqual(t, before.Spec.Template.Annotations[configHashAnnotation], after.Spec.Template.Annotations[configHashAnnotation],
		"a topic change must roll the pods")
	require.Eventually(t, func() bool { return c.Get(ctx, childKey(relay), &policyv1.PodDisruptionBudget{}) == nil }, eventually, tick)
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.ObservedGeneration == o.Generation && o.Status.Ready == "0/3" && o.Status.TopicCount == 2
	})

	// The backlog observer cannot reach the test DSN's host; once it has said
	// so, later failed reads change nothing.
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		cond := meta.FindStatusCondition(o.Status.Conditions, outboxv1alpha1.ConditionLagging)
		return cond != nil && cond.Reason == outboxv1alpha1.ReasonBacklogUnavailable
	})

	// A pass over an unchanged relay writes nothing. Eventually only waits for
	// the manager's cache to catch up: a perpetual diff would never settle.
	req := ctrl.Request{NamespacedName: key(relay)}
	require.Eventually(t, func() bool {
		rvs := resourceVersions(t, c, relay)
		_, err := r.Reconcile(ctx, req)
		return err == nil && slices.Equal(rvs, resourceVersions(t, c, relay))
	}, eventually, tick)
	// The API server drops no-op writes without a new resourceVersion, so also
	// check that the reconciler sends no write at all.
	counted := &writeCounter{Client: r.Client}
	quiet := &OutboxRelayReconciler{Client: counted, APIReader: r.APIReader, Recorder: r.Recorder,
		RelayImage: r.RelayImage, AllowedImages: r.AllowedImages, Flow: r.Flow, Metrics: r.Metrics, secrets: r.secrets}
	rvs := resourceVersions(t, c, relay)
	for range 3 {
		res, err := quiet.Reconcile(ctx, req)
		require.NoError(t, err)
		// Its Secret's entry expires within the refresh interval and its
		// fifth from the last read, which may have been passes ago.
		require.Positive(t, res.RequeueAfter, "looked at again when its Secrets are due")
		require.LessOrEqual(t, res.RequeueAfter, testSecretRefresh*6/5+secretDueMargin, "looked at again when its Secrets are due")
	}
	require.Equal(t, rvs, resourceVersions(t, c, relay), "a no-op reconcile changed a resourceVersion (relay, Deployment, Service, PDB)")
	require.Empty(t, counted.writes, "a no-op reconcile sent writes")

	// Someone scaling the Deployment directly is put back.
	d := &appsv1.Deployment{}
	require.NoError(t, c.Get(ctx, childKey(relay), d))
	update(t, c, d, func(d *appsv1.Deployment) { d.Spec.Replicas = ptr.To[int32](7) })
	want := waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 3 })
	// kubectl rollout pause is undone: a paused Deployment rolls out no
	// later change (a Secret's rotation, a topic), never Stalled.
	update(t, c, d, func(d *appsv1.Deployment) { d.Spec.Paused = true })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return !d.Spec.Paused })

	// Hand edits of what the operator owns are put back, whatever field
	// they touch: the pod template, the Service's selector.
	update(t, c, d, func(d *appsv1.Deployment) {
		ctr := &d.Spec.Template.Spec.Containers[0]
		ctr.Image = "registry.example/someone-else:1"
		ctr.Env = append(ctr.Env, corev1.EnvVar{Name: "RELAY_BATCH_SIZE", Value: "1"})
		d.Spec.Template.Spec.HostNetwork = true
	})
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool {
		return equality.Semantic.DeepEqual(d.Spec.Template, want.Spec.Template)
	})
	svc := &corev1.Service{}
	require.NoError(t, c.Get(ctx, childKey(relay), svc))
	wantSelector := maps.Clone(svc.Spec.Selector)
	update(t, c, svc, func(s *corev1.Service) { s.Spec.Selector = map[string]string{"app": "someone-else"} })
	require.Eventually(t, func() bool {
		return c.Get(ctx, childKey(relay), svc) == nil && maps.Equal(svc.Spec.Selector, wantSelector)
	}, eventually, tick, "the Service's selector is put back")

	// kubectl rollout restart's stamp stays, and the operator settles: no
	// write once it has seen the stamp.
	update(t, c, d, func(d *appsv1.Deployment) {
		d.Spec.Template.Annotations[restartedAtAnnotation] = "2026-12-04T10:00:00Z"
	})
	require.Eventually(t, func() bool {
		rvs := resourceVersions(t, c, relay)
		_, err := r.Reconcile(ctx, req)
		return err == nil && slices.Equal(rvs, resourceVersions(t, c, relay))
	}, eventually, tick)
	require.NoError(t, c.Get(ctx, childKey(relay), d))
	require.Equal(t, "2026-12-04T10:00:00Z", d.Spec.Template.Annotations[restartedAtAnnotation])
	counted.writes = nil
	for range 3 {
		_, err := quiet.Reconcile(ctx, req)
		require.NoError(t, err)
	}
	require.Empty(t, counted.writes, "a no-op reconcile after a restart sent writes")

	// A child written by a release before the live hash gets one, with no
	// change of its pod template: the pods do not roll.
	require.NoError(t, c.Get(ctx, childKey(relay), d))
	template, generation := d.Spec.Template.DeepCopy(), d.Generation
	update(t, c, d, func(d *appsv1.Deployment) { delete(d.Labels, liveHashLabel) })
	d = waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return d.Labels[liveHashLabel] != "" })
	require.True(t, equality.Semantic.DeepEqual(*template, d.Spec.Template), "recording the live hash changed the pod template")
	// A label: a write of a Deployment's annotations would bump its
	// generation, which shows as a rollout until the Deployment controller
	// has looked.
	require.Equal(t, generation, d.Generation, "recording the live hash moved the Deployment's generation")
}

func testScaleSubresource(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "scaled")
	create(t, c, secret, relay)
	waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })

	// As `kubectl scale outboxrelay scaled --replicas=4` does.
	// The controller writes status meanwhile: retry on conflict, as kubectl does.
	first := true
	require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		scale := &autoscalingv1.Scale{}
		if err := c.SubResource("scale").Get(ctx, relay, scale); err != nil {
			return err
		}
		if first {
			require.Equal(t, int32(1), scale.Spec.Replicas)
			first = false
		}
		scale.Spec.Replicas = 4
		return c.SubResource("scale").Update(ctx, relay, client.WithSubResourceBody(scale))
	}))

	require.NoError(t, c.Get(ctx, key(relay), relay))
	require.Equal(t, ptr.To[int32](4), relay.Spec.Replicas)
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 4 })
	setDeploymentStatus(t, c, childKey(relay), 4)

	want := "app.kubernetes.io/instance=scaled,app.kubernetes.io/name=outbox-relay"
	require.Eventually(t, func() bool {
		s := &autoscalingv1.Scale{}
		return c.SubResource("scale").Get(ctx, relay, s) == nil &&
			s.Status.Replicas == 4 && s.Status.Selector == want && s.Spec.Replicas == 4
	}, eventually, tick, "the scale subresource reports replicas and the selector")
}

func configHash(d *appsv1.Deployment) string {
	return d.Spec.Template.Annotations[configHashAnnotation]
}

func testSecretRotation(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "rotated")
	create(t, c, secret, relay)
	first := configHash(waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true }))

	// A write of the Secret's metadata (a label) or of a key the pods do
	// not read (the application's own, in a Secret it shares with the
	// relay) rolls nothing: the pods read only the DSN's key. Before, any
	// new version rolled them, and then any new data.
	update(t, c, secret, func(s *corev1.Secret) { s.Labels = map[string]string{"team": "orders"} })
	update(t, c, secret, func(s *corev1.Secret) { s.Data["app-password"] = []byte("hunter2") })
	<-time.After(testSecretRefresh*6/5 + 2*time.Second)
	require.Equal(t, first, configHash(waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })),
		"a label on the Secret, or a key the relay does not read, rolled the relay's pods")

	// A rotation reaches the pods within the refresh interval (and its
	// jitter of a fifth), measured from the write.
	rotatedAt := time.Now()
	update(t, c, secret, func(s *corev1.Secret) { s.Data["dsn"] = []byte("postgres://relay@db-2/rotated") })
	second := configHash(waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return configHash(d) != first }))
	took := time.Since(rotatedAt)
	t.Logf("the rotation rolled the pods after %s (refresh interval %s)", took, testSecretRefresh)
	require.Less(t, took, testSecretRefresh*6/5+2*time.Second, "within the refresh interval, plus a reconcile")
	// Back to the first DSN: a hash of the data would return to the first
	// value; the hash of the Secret's version moves on.
	update(t, c, secret, func(s *corev1.Secret) { s.Data["dsn"] = []byte("postgres://relay@db/rotated") })
	rotated := configHash(waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return configHash(d) != second }))
	require.NotEqual(t, first, rotated, "the config hash is not derived from the Secret's data")

	require.NoError(t, c.Delete(ctx, secret))
	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonSecretNotFound
	})
	ready := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady)
	require.Equal(t, metav1.ConditionFalse, ready.Status)
	require.Contains(t, ready.Message, "rotated-dsn")
	require.True(t, meta.IsStatusConditionTrue(relay.Status.Conditions, outboxv1alpha1.ConditionDegraded))
	require.Eventually(t, func() bool { return hasEvent(t, c, relay, outboxv1alpha1.ReasonSecretNotFound) }, eventually, tick)
	// The running Deployment is left as it was.
	require.Equal(t, rotated, configHash(waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })))

	create(t, c, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: secret.Name},
		StringData: map[string]string{"dsn": "postgres://relay@db-3/rotated"},
	})
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonDeploymentUnavailable &&
			!meta.IsStatusConditionTrue(o.Status.Conditions, outboxv1alpha1.ConditionDegraded)
	})
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool {
		return configHash(d) != rotated && configHash(d) != first
	})
}

func testSecretKeyMissing(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "nokey")
	relay.Spec.DSNSecretRef.Key = "url"
	create(t, c, secret, relay)
	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonSecretKeyMissing
	})
	require.Contains(t, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Message, `"url"`)
	require.True(t, apierrors.IsNotFound(c.Get(ctx, childKey(relay), &appsv1.Deployment{})),
		"no Deployment is created while the DSN key is missing")

	// An empty value is refused as missing, naming the key, rather than
	// given to pods that exit at start.
	update(t, c, secret, func(s *corev1.Secret) { s.Data["url"] = []byte(" \n") })
	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return strings.Contains(meta.FindStatusCondition(o.Status.Conditions, outboxv1alpha1.ConditionReady).Message, `"url" (spec.dsnSecretRef.key) is empty or blank`)
	})
	require.Equal(t, outboxv1alpha1.ReasonSecretKeyMissing, readyReason(relay))
	require.True(t, apierrors.IsNotFound(c.Get(ctx, childKey(relay), &appsv1.Deployment{})))

	update(t, c, secret, func(s *corev1.Secret) { s.Data["url"] = []byte("postgres://relay@db/nokey") })
	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.Equal(t, "url", d.Spec.Template.Spec.Containers[0].Env[0].ValueFrom.SecretKeyRef.Key)
}

func testStatusFollowsDeployment(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "status")
	relay.Spec.Replicas = ptr.To[int32](2)
	create(t, c, secret, relay)
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonDeploymentUnavailable && o.Status.Ready == "0/2"
	})

	setDeploymentStatus(t, c, childKey(relay), 1)
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.ReadyReplicas == 1 && o.Status.Replicas == 2 && o.Status.Ready == "1/2" &&
			readyReason(o) == outboxv1alpha1.ReasonDeploymentUnavailable
	})

	setDeploymentStatus(t, c, childKey(relay), 2)
	got := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return meta.IsStatusConditionTrue(o.Status.Conditions, outboxv1alpha1.ConditionReady)
	})
	require.Equal(t, got.Generation, got.Status.ObservedGeneration)
	require.Equal(t, int32(2), got.Status.ReadyReplicas)
	require.Equal(t, "2/2", got.Status.Ready)
	for typ, want := range map[string]struct {
		status metav1.ConditionStatus
		reason string
	}{
		outboxv1alpha1.ConditionReady:       {metav1.ConditionTrue, outboxv1alpha1.ReasonAvailable},
		outboxv1alpha1.ConditionProgressing: {metav1.ConditionFalse, outboxv1alpha1.ReasonRolloutComplete},
		outboxv1alpha1.ConditionDegraded:    {metav1.ConditionFalse, outboxv1alpha1.ReasonAsExpected},
	} {
		cond := meta.FindStatusCondition(got.Status.Conditions, typ)
		require.NotNil(t, cond, typ)
		require.Equal(t, want.status, cond.Status, typ)
		require.Equal(t, want.reason, cond.Reason, typ)
		require.Equal(t, got.Generation, cond.ObservedGeneration, typ)
	}

	// A new generation: observedGeneration follows and the rollout shows.
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.BatchSize = ptr.To[int32](10) })
	got = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.ObservedGeneration == o.Generation && o.Generation > got.Generation
	})
	require.True(t, meta.IsStatusConditionTrue(got.Status.Conditions, outboxv1alpha1.ConditionProgressing),
		"the Deployment has not yet observed the new template")
	requireHealth(t, got, "Progressing")

	// A rollout the Deployment controller gave up on is Degraded.
	require.Eventually(t, func() bool {
		d := &appsv1.Deployment{}
		if err := c.Get(context.Background(), childKey(relay), d); err != nil {
			return false
		}
		d.Status.Conditions = []appsv1.DeploymentCondition{{
			Type: appsv1.DeploymentProgressing, Status: corev1.ConditionFalse,
			Reason: "ProgressDeadlineExceeded", Message: "ReplicaSet has timed out progressing",
		}}
		return c.Status().Update(context.Background(), d) == nil
	}, eventually, tick)
	got = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		cond := meta.FindStatusCondition(o.Status.Conditions, outboxv1alpha1.ConditionDegraded)
		return cond != nil && cond.Status == metav1.ConditionTrue && cond.Reason == outboxv1alpha1.ReasonProgressDeadlineExceeded
	})
	require.Contains(t, requireHealth(t, got, "Degraded"), "ReplicaSet has timed out progressing")
}

func testSuspend(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "suspended")
	relay.Spec.Replicas = ptr.To[int32](3)
	create(t, c, secret, relay)
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 3 })
	require.Eventually(t, func() bool { return c.Get(ctx, childKey(relay), &policyv1.PodDisruptionBudget{}) == nil }, eventually, tick)

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Suspend = true })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 0 })
	require.Eventually(t, func() bool {
		return apierrors.IsNotFound(c.Get(ctx, childKey(relay), &policyv1.PodDisruptionBudget{}))
	}, eventually, tick, "no PDB while suspended")
	got := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonSuspended
	})
	require.Equal(t, ptr.To[int32](3), got.Spec.Replicas, "suspend keeps spec.replicas")
	requireHealth(t, got, "Suspended")
	require.NoError(t, c.Get(ctx, childKey(relay), &corev1.Service{}), "suspend keeps the Service")

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Suspend = false })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 3 })
	require.Eventually(t, func() bool { return c.Get(ctx, childKey(relay), &policyv1.PodDisruptionBudget{}) == nil }, eventually, tick)
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonDeploymentUnavailable && o.Status.Ready == "0/3"
	})

	// While its children cannot be written (here the DSN key is gone),
	// fewer replicas still reach the Deployment, suspend too; more wait
	// until they can be. Before, the pods ran on whatever was asked.
	update(t, c, secret, func(s *corev1.Secret) { s.Data = map[string][]byte{"other": []byte("x")} })
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonSecretKeyMissing
	})
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Replicas = ptr.To[int32](2) })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 2 })
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Suspend = true })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 0 })
	require.Eventually(t, func() bool {
		return apierrors.IsNotFound(c.Get(ctx, childKey(relay), &policyv1.PodDisruptionBudget{}))
	}, eventually, tick, "no PDB while suspended")
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Suspend = false })
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return o.Status.ObservedGeneration == o.Generation && o.Status.DesiredReplicas == 2
	})
	d := &appsv1.Deployment{}
	require.NoError(t, c.Get(ctx, childKey(relay), d))
	require.Equal(t, int32(0), *d.Spec.Replicas, "no pods of a template the operator cannot write")
	update(t, c, secret, func(s *corev1.Secret) { s.Data = map[string][]byte{"dsn": []byte("postgres://relay@db/suspended")} })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 2 })
}

func testInvalidSpec(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)

	// A rule the schema does not express: a mount over the relay's binary
	// spelt in a way the API's rule does not catch.
	relay, secret := minimalRelay(ns, "badmount")
	relay.Spec.Template = &outboxv1alpha1.RelayPodTemplate{
		Pod:       &outboxv1alpha1.RelayPodSpec{Volumes: []outboxv1alpha1.RelayVolume{{Name: "bin", EmptyDir: &corev1.EmptyDirVolumeSource{}}}},
		Container: &outboxv1alpha1.RelayContainerSpec{VolumeMounts: []corev1.VolumeMount{{Name: "bin", MountPath: "//relay"}}},
	}
	create(t, c, secret, relay)
	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonInvalidSpec
	})
	require.Contains(t, meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Message, "spec.template.container.volumeMounts")
	require.Contains(t, requireHealth(t, relay, "Degraded"), "spec.template.container.volumeMounts")
	require.Eventually(t, func() bool { return hasEvent(t, c, relay, outboxv1alpha1.ReasonInvalidSpec) }, eventually, tick)
	require.True(t, apierrors.IsNotFound(c.Get(ctx, childKey(relay), &appsv1.Deployment{})))

	// Fixing the spec recovers.
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.Template.Container.VolumeMounts[0].MountPath = "/var/cache/relay"
		o.Spec.PodLabels = map[string]string{"team": "orders"}
	})
	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.Equal(t, "orders", d.Spec.Template.Labels["team"])

	// The API server refusing the Deployment built from the spec (an
	// absolute subPath, which neither the CRD nor the operator checks) is
	// an invalid spec too, not a retry loop.
	relay2, secret2 := minimalRelay(ns, "badsubpath")
	relay2.Spec.Template = &outboxv1alpha1.RelayPodTemplate{
		Pod:       &outboxv1alpha1.RelayPodSpec{Volumes: []outboxv1alpha1.RelayVolume{{Name: "cache", EmptyDir: &corev1.EmptyDirVolumeSource{}}}},
		Container: &outboxv1alpha1.RelayContainerSpec{VolumeMounts: []corev1.VolumeMount{{Name: "cache", MountPath: "/var/cache/relay", SubPath: "/abs"}}},
	}
	create(t, c, secret2, relay2)
	relay2 = waitRelay(t, c, key(relay2), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonInvalidSpec
	})
	msg := meta.FindStatusCondition(relay2.Status.Conditions, outboxv1alpha1.ConditionReady).Message
	require.Contains(t, msg, "spec.template.container.volumeMounts", "the OutboxRelay's field, not the Deployment's")
	require.NotContains(t, msg, "spec.template.spec.containers")
	require.Contains(t, msg, "subPath")
	require.Contains(t, msg, "/abs")
}

func testKafkaTLSAndSASL(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "secure")
	tlsSecret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "kafka-tls"},
		StringData: map[string]string{"ca.crt": "CA", "tls.crt": "CERT", "tls.key": "KEY"},
	}
	sasl := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "kafka-user"},
		StringData: map[string]string{"user": "relay", "password": "s3cret-pw"},
	}
	relay.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{SecretRef: &outboxv1alpha1.SecretReference{Name: tlsSecret.Name}}
	relay.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{
		Mechanism:            outboxv1alpha1.SASLScramSHA512,
		CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: sasl.Name, UsernameKey: "user"},
	}
	create(t, c, secret, tlsSecret, sasl, relay)

	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	ct := d.Spec.Template.Spec.Containers[0]
	require.Subset(t, ct.Args, []string{
		"--kafka-tls",
		"--kafka-tls-ca-file=/etc/relay/tls/ca.crt",
		"--kafka-tls-cert-file=/etc/relay/tls/tls.crt",
		"--kafka-tls-key-file=/etc/relay/tls/tls.key",
		"--kafka-sasl-mechanism=SCRAM-SHA-512",
	})
	require.Equal(t, []corev1.VolumeMount{{Name: "kafka-tls", MountPath: "/etc/relay/tls", ReadOnly: true}}, ct.VolumeMounts)
	require.Equal(t, "kafka-tls", d.Spec.Template.Spec.Volumes[0].Secret.SecretName)
	env := map[string]corev1.EnvVar{}
	for _, e := range ct.Env {
		if e.Name != "RELAY_ARGS_ONLY" && e.Name != "RELAY_TABLE" {
			require.Empty(t, e.Value, "%s comes from a Secret", e.Name)
		}
		env[e.Name] = e
	}
	require.Equal(t, "user", env["RELAY_KAFKA_SASL_USERNAME"].ValueFrom.SecretKeyRef.Key)
	require.Equal(t, "password", env["RELAY_KAFKA_SASL_PASSWORD"].ValueFrom.SecretKeyRef.Key)
	require.Equal(t, "kafka-user", env["RELAY_KAFKA_SASL_PASSWORD"].ValueFrom.SecretKeyRef.Name)
	raw, err := json.Marshal(d)
	require.NoError(t, err)
	require.NotContains(t, string(raw), "s3cret-pw")

	// Rotating the SASL password or the certificate rolls the pods.
	first := configHash(d)
	update(t, c, sasl, func(s *corev1.Secret) { s.Data["password"] = []byte("n3w-pw") })
	second := configHash(waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return configHash(d) != first }))
	update(t, c, tlsSecret, func(s *corev1.Secret) { s.Data["tls.crt"] = []byte("CERT-2") })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return configHash(d) != second })
}

func testForeignChild(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "taken")
	foreign := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: childName(relay)},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 80}}},
	}
	create(t, c, foreign, secret, relay)
	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonResourceConflict
	})
	got := &corev1.Service{}
	require.NoError(t, c.Get(ctx, key(foreign), got))
	require.Equal(t, foreign.ResourceVersion, got.ResourceVersion, "a Service the relay does not own is left alone")
}

// testCacheHoldsOnlyChildren: the manager caches the Deployments it made,
// not the cluster's others; a child whose label someone removed leaves the
// cache, and the operator finds it on the API server and labels it again.
func testCacheHoldsOnlyChildren(t *testing.T, c client.Client, mgr ctrl.Manager) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "cached")
	labels := map[string]string{"app": "someone-elses"}
	other := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "someone-elses", Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
			},
		},
	}
	create(t, c, other, secret, relay)
	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.Eventually(t, func() bool { return mgr.GetCache().Get(ctx, childKey(relay), &appsv1.Deployment{}) == nil },
		10*time.Second, tick, "the relay's Deployment is cached")
	err := mgr.GetCache().Get(ctx, key(other), &appsv1.Deployment{})
	require.True(t, apierrors.IsNotFound(err), "another Deployment is not cached: %v", err)

	update(t, c, d, func(o *appsv1.Deployment) { delete(o.Labels, labelManagedBy) })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return d.Labels[labelManagedBy] == managedBy })
}

// testOrderingSwitch: the rollout that changes the ordering mode uses
// Recreate until it has replaced every pod, then the Deployment goes back to
// RollingUpdate.
func testOrderingSwitch(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "switch")
	relay.Spec.Replicas = ptr.To[int32](2)
	create(t, c, secret, relay)
	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, d.Spec.Strategy.Type)
	setDeploymentStatus(t, c, childKey(relay), 2)

	hasArg := func(d *appsv1.Deployment, arg string) bool {
		return slices.Contains(d.Spec.Template.Spec.Containers[0].Args, arg)
	}
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Ordering = outboxv1alpha1.OrderingPartitionKey })
	d = waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return hasArg(d, "--ordering=partition-key") })
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, d.Spec.Strategy.Type, "the mode switch rolls out with Recreate")
	require.Nil(t, d.Spec.Strategy.RollingUpdate)

	// Another change while old pods may still run keeps Recreate.
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.BatchSize = ptr.To[int32](77) })
	d = waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return hasArg(d, "--batch-size=77") })
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, d.Spec.Strategy.Type)

	// The rollout completes: back to RollingUpdate, with the API server's defaults.
	setDeploymentStatus(t, c, childKey(relay), 2)
	d = waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool {
		return d.Spec.Strategy.Type == appsv1.RollingUpdateDeploymentStrategyType
	})
	require.NotNil(t, d.Spec.Strategy.RollingUpdate)
	require.True(t, hasArg(d, "--ordering=partition-key"))

	// And the way back.
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Ordering = outboxv1alpha1.OrderingNone })
	d = waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return hasArg(d, "--ordering=none") })
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, d.Spec.Strategy.Type, "PartitionKey -> None uses Recreate too")
}

func testImageAllowList(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "image")
	relay.Spec.Image = "evil.test/relay:1"
	create(t, c, secret, relay)
	relay = waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return readyReason(o) == outboxv1alpha1.ReasonInvalidSpec
	})
	msg := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionReady).Message
	for _, want := range []string{"spec.image", "evil.test/relay:1", allowedPrefix} {
		require.Contains(t, msg, want)
	}
	require.Eventually(t, func() bool { return hasEvent(t, c, relay, outboxv1alpha1.ReasonInvalidSpec) }, eventually, tick)
	require.True(t, apierrors.IsNotFound(c.Get(ctx, childKey(relay), &appsv1.Deployment{})), "no pods from a refused image")

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Image = allowedPrefix + "relay:2" })
	d := waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	require.Equal(t, allowedPrefix+"relay:2", d.Spec.Template.Spec.Containers[0].Image)
}

// testSecretsKeptWithoutOtherData: of a referenced Secret the operator keeps
// its version and key names, and the value of the DSN key only.
func testSecretsKeptWithoutOtherData(t *testing.T, c client.Client, r *OutboxRelayReconciler) {
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "kept")
	secret.StringData["password"] = "hunter2"
	create(t, c, secret, relay)
	waitDeployment(t, c, relay, func(*appsv1.Deployment) bool { return true })
	r.secrets.mu.Lock()
	e := r.secrets.entries[key(secret)]
	r.secrets.mu.Unlock()
	require.NotNil(t, e)
	require.Equal(t, map[string]bool{"dsn": true, "password": true}, e.keys)
	require.Equal(t, map[string]string{"dsn": "postgres://relay@db/kept"}, e.values, "no other value is kept")
	require.NotEmpty(t, e.version)
}

// writeCounter records every write a client sends.
type writeCounter struct {
	client.Client
	mu     sync.Mutex
	writes []string
}

func (w *writeCounter) record(verb string, obj client.Object) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.writes = append(w.writes, fmt.Sprintf("%s %T %s", verb, obj, obj.GetName()))
}

func (w *writeCounter) Create(ctx context.Context, obj client.Object, opts ...client.CreateOption) error {
	w.record("create", obj)
	return w.Client.Create(ctx, obj, opts...)
}

func (w *writeCounter) Update(ctx context.Context, obj client.Object, opts ...client.UpdateOption) error {
	w.record("update", obj)
	return w.Client.Update(ctx, obj, opts...)
}

func (w *writeCounter) Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
	w.record("patch", obj)
	return w.Client.Patch(ctx, obj, patch, opts...)
}

func (w *writeCounter) Delete(ctx context.Context, obj client.Object, opts ...client.DeleteOption) error {
	w.record("delete", obj)
	return w.Client.Delete(ctx, obj, opts...)
}

func (w *writeCounter) Status() client.SubResourceWriter {
	return &statusCounter{SubResourceWriter: w.Client.Status(), w: w}
}

type statusCounter struct {
	client.SubResourceWriter
	w *writeCounter
}

func (s *statusCounter) Update(ctx context.Context, obj client.Object, opts ...client.SubResourceUpdateOption) error {
	s.w.record("update status", obj)
	return s.SubResourceWriter.Update(ctx, obj, opts...)
}

func (s *statusCounter) Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.SubResourcePatchOption) error {
	s.w.record("patch status", obj)
	return s.SubResourceWriter.Patch(ctx, obj, patch, opts...)
}

// outbox.dev/reconcile: disabled pauses the operator: spec changes and
// scaling wait, the running Deployment is left as it is (not scaled to
// zero), the status says so and Argo CD shows Suspended; removing the
// annotation applies the spec as it is then.
func testReconcilePaused(t *testing.T, c client.Client) {
	ns := newNamespace(t, c)
	relay, secret := minimalRelay(ns, "paused")
	relay.Spec.Replicas = ptr.To[int32](2)
	create(t, c, secret, relay)
	before := waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return *d.Spec.Replicas == 2 })

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) {
		o.Annotations = map[string]string{outboxv1alpha1.ReconcileAnnotation: outboxv1alpha1.ReconcileDisabled}
	})
	got := waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return meta.IsStatusConditionTrue(o.Status.Conditions, outboxv1alpha1.ConditionReconciliationPaused)
	})
	cond := meta.FindStatusCondition(got.Status.Conditions, outboxv1alpha1.ConditionReconciliationPaused)
	require.Equal(t, outboxv1alpha1.ReasonReconcileDisabled, cond.Reason)
	require.Contains(t, cond.Message, "outbox.dev/reconcile: disabled")
	requireHealth(t, got, "Suspended")
	generation := got.Status.ObservedGeneration

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.Replicas = ptr.To[int32](3)
		o.Spec.BatchSize = ptr.To[int32](77)
	})
	require.Never(t, func() bool {
		d := &appsv1.Deployment{}
		return c.Get(context.Background(), childKey(relay), d) != nil || *d.Spec.Replicas != 2 ||
			!slices.Equal(d.Spec.Template.Spec.Containers[0].Args, before.Spec.Template.Spec.Containers[0].Args)
	}, 3*time.Second, tick, "a paused relay's Deployment is left as it is")
	o := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(context.Background(), key(relay), o))
	require.Equal(t, generation, o.Status.ObservedGeneration, "the paused generation is not observed")

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { delete(o.Annotations, outboxv1alpha1.ReconcileAnnotation) })
	waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool {
		return *d.Spec.Replicas == 3 && slices.Contains(d.Spec.Template.Spec.Containers[0].Args, "--batch-size=77")
	})
	waitRelay(t, c, key(relay), func(o *outboxv1alpha1.OutboxRelay) bool {
		return meta.FindStatusCondition(o.Status.Conditions, outboxv1alpha1.ConditionReconciliationPaused) == nil &&
			o.Status.ObservedGeneration == o.Generation
	})
}
