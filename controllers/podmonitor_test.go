package controllers

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// podMonitorCRD is the Prometheus Operator's PodMonitor CRD (v0.93.0), which
// test/ops also installs.
func podMonitorCRD() string {
	return filepath.Join(testenv.RepoRoot(), "test", "ops", "testdata", "crds", "monitoring.coreos.com_podmonitors.yaml")
}

func TestRelayPodMonitor(t *testing.T) {
	t.Parallel()
	relay := &outboxv1alpha1.OutboxRelay{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "orders"}}
	pm := relayPodMonitor(relay, nil)
	require.Equal(t, podMonitorGVK, pm.GroupVersionKind())
	require.Equal(t, "shop", pm.GetNamespace())
	require.Equal(t, "orders-relay", pm.GetName())
	require.Equal(t, commonLabels(relay), pm.GetLabels())
	extra := map[string]string{"release": "prometheus", labelName: "other"}
	labels := relayPodMonitor(relay, extra).GetLabels()
	require.Equal(t, "prometheus", labels["release"])
	require.Equal(t, commonLabels(relay)[labelName], labels[labelName], "the relay's own labels win")
	require.Equal(t, "other", extra[labelName], "the flag's map is not written")
	require.NotEmpty(t, pm.GetAnnotations()[specHashAnnotation])
	sel, _, _ := unstructured.NestedStringMap(pm.Object, "spec", "selector", "matchLabels")
	require.Equal(t, selectorLabels(relay), sel, "the relay's pods, and only them")
	job, _, _ := unstructured.NestedString(pm.Object, "spec", "jobLabel")
	require.Equal(t, relayJob, selectorLabels(relay)[job], "job takes the pods' app.kubernetes.io/name: outbox-relay")
	eps, _, _ := unstructured.NestedSlice(pm.Object, "spec", "podMetricsEndpoints")
	require.Len(t, eps, 1)
	ep := eps[0].(map[string]any)
	require.Equal(t, "metrics", ep["port"], "the port the relay container names")
	relabel := ep["relabelings"].([]any)[0].(map[string]any)
	require.Equal(t, "outboxrelay", relabel["targetLabel"])
	require.Equal(t, []any{"__meta_kubernetes_pod_label_" + "app_kubernetes_io_instance"}, relabel["sourceLabels"])
	require.Equal(t, relay.Name, selectorLabels(relay)[labelInstance])
}

// monitoringCondition is the relay's Monitoring condition, or nil.
func monitoringCondition(t *testing.T, c client.Client, key client.ObjectKey) *metav1.Condition {
	relay := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(context.Background(), key, relay))
	return meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionMonitoring)
}

// TestPodMonitorFollowsSpec: without the PodMonitor CRD, spec.monitoring.podMonitor
// is reported in status and the relay runs on; once the CRD is installed the
// operator creates the PodMonitor, leaves it alone on an unchanged pass, and
// deletes it when the spec stops asking.
func TestPodMonitorFollowsSpec(t *testing.T) {
	admin := adminClient(t)
	ctx := context.Background()
	crdOpts := envtest.CRDInstallOptions{Paths: []string{podMonitorCRD()}, ErrorIfPathMissing: true}
	crd := &unstructured.Unstructured{}
	crd.SetAPIVersion("apiextensions.k8s.io/v1")
	crd.SetKind("CustomResourceDefinition")
	if admin.Get(ctx, client.ObjectKey{Name: "podmonitors.monitoring.coreos.com"}, crd) == nil { // -count=N
		require.NoError(t, envtest.UninstallCRDs(testenv.Kube().Config, crdOpts))
		require.Eventually(t, func() bool { return apierrors.IsNotFound(admin.Get(ctx, client.ObjectKeyFromObject(crd), crd)) },
			eventually, tick, "the PodMonitor CRD is gone")
	}
	// The labels a Prometheus selects PodMonitors by (--relay-podmonitor-labels).
	selected := map[string]string{"release": "prometheus"}
	r, _, _ := runManager(t, testManager{digestKey: newDigestKeySecret(t), podMonitorLabels: selected})
	ns := newNamespace(t, admin)
	require.NoError(t, admin.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "dsn"}, StringData: map[string]string{"dsn": "postgres://x"},
	}))
	relay := &outboxv1alpha1.OutboxRelay{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "orders"},
		Spec: outboxv1alpha1.OutboxRelaySpec{
			DSNSecretRef: outboxv1alpha1.SecretKeyReference{Name: "dsn"},
			Topics:       map[string]outboxv1alpha1.TopicName{"OrderConfirmed": "orders.confirmed"},
			Kafka:        outboxv1alpha1.KafkaSpec{Brokers: []outboxv1alpha1.BrokerAddress{"kafka:9092"}},
			Monitoring:   &outboxv1alpha1.MonitoringSpec{PodMonitor: true},
		},
	}
	require.NoError(t, admin.Create(ctx, relay))
	key := client.ObjectKeyFromObject(relay)
	require.Eventually(t, func() bool {
		c := monitoringCondition(t, admin, key)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == outboxv1alpha1.ReasonPodMonitorCRDMissing
	}, eventually, tick, "without the CRD the Monitoring condition says so")
	require.NoError(t, admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "orders-relay"}, &corev1.Service{}),
		"the relay's children are built all the same")

	_, err := envtest.InstallCRDs(testenv.Kube().Config, crdOpts)
	require.NoError(t, err)
	require.NoError(t, admin.Get(ctx, key, relay))
	relay.Spec.Replicas = ptr.To[int32](2) // a new generation: the next pass
	require.NoError(t, admin.Update(ctx, relay))

	pm := newPodMonitor()
	pmKey := client.ObjectKey{Namespace: ns, Name: "orders-relay"}
	require.Eventually(t, func() bool { return admin.Get(ctx, pmKey, pm) == nil }, eventually, tick, "the PodMonitor is created")
	require.True(t, metav1.IsControlledBy(pm, relay), "owned by the relay, so it goes with it")
	require.Equal(t, relayPodMonitor(relay, nil).Object["spec"], pm.Object["spec"])
	require.Equal(t, "prometheus", pm.GetLabels()["release"], "the label the Prometheus selects by")
	require.Eventually(t, func() bool {
		c := monitoringCondition(t, admin, key)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == outboxv1alpha1.ReasonPodMonitorReady &&
			strings.Contains(c.Message, "podMonitorSelector matches its labels") && strings.Contains(c.Message, "release=prometheus")
	}, eventually, tick)
	require.NoError(t, admin.Get(ctx, pmKey, pm)) // as the pass left it: with its live hash

	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	again := newPodMonitor()
	require.NoError(t, admin.Get(ctx, pmKey, again))
	require.Equal(t, pm.GetResourceVersion(), again.GetResourceVersion(), "an unchanged pass writes nothing")

	require.NoError(t, admin.Get(ctx, key, relay))
	relay.Spec.Monitoring = nil
	require.NoError(t, admin.Update(ctx, relay))
	require.Eventually(t, func() bool { return apierrors.IsNotFound(admin.Get(ctx, pmKey, newPodMonitor())) },
		eventually, tick, "the PodMonitor is deleted when the spec stops asking")
	require.Eventually(t, func() bool { return monitoringCondition(t, admin, key) == nil }, eventually, tick)
}

// TestPodMonitorProblemsAreConditions: a missing CRD, a role without the
// permission or the API server's refusal (an admission webhook's, say)
// becomes the Monitoring condition, whether the PodMonitor is wanted or no
// longer wanted; any other error is returned, so the pass is retried
// (TestPodMonitorErrorStillWritesTheStatus).
func TestPodMonitorProblemsAreConditions(t *testing.T) {
	t.Parallel()
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "monitoring.coreos.com", Resource: "podmonitors"},
		"orders-relay", errors.New("no RBAC rule allows it"))
	noCRD := &meta.NoKindMatchError{GroupKind: podMonitorGVK.GroupKind(), SearchedVersions: []string{"v1"}}
	for name, tc := range map[string]struct {
		err         error
		reason      string // "" when the error is returned
		keptWhenOff bool   // the condition stays after the spec stops asking
	}{
		"no CRD":      {err: noCRD, reason: outboxv1alpha1.ReasonPodMonitorCRDMissing},
		"forbidden":   {err: forbidden, reason: outboxv1alpha1.ReasonPodMonitorForbidden, keptWhenOff: true},
		"refused":     {err: apierrors.NewBadRequest("admission webhook \"policy.example.com\" denied the request"), reason: outboxv1alpha1.ReasonPodMonitorRefused, keptWhenOff: true},
		"unavailable": {err: apierrors.NewServiceUnavailable("etcd is slow")},
	} {
		t.Run(name, func(t *testing.T) {
			c := fake.NewClientBuilder().WithScheme(newScheme(t)).WithInterceptorFuncs(interceptor.Funcs{
				Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
					if u, ok := obj.(*unstructured.Unstructured); ok && u.GroupVersionKind() == podMonitorGVK {
						return tc.err
					}
					return c.Get(ctx, key, obj, opts...)
				},
			}).Build()
			r := &OutboxRelayReconciler{Client: c}
			relay := &outboxv1alpha1.OutboxRelay{
				ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "orders", Generation: 3},
				Spec:       outboxv1alpha1.OutboxRelaySpec{Monitoring: &outboxv1alpha1.MonitoringSpec{PodMonitor: true}},
			}
			err := r.ensurePodMonitor(context.Background(), relay)
			if tc.reason == "" {
				require.ErrorIs(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			cond := meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionMonitoring)
			require.NotNil(t, cond)
			require.Equal(t, metav1.ConditionFalse, cond.Status)
			require.Equal(t, tc.reason, cond.Reason)
			require.EqualValues(t, 3, cond.ObservedGeneration)
			if tc.reason != outboxv1alpha1.ReasonPodMonitorCRDMissing {
				require.Contains(t, cond.Message, tc.err.Error(), "the API server's answer, which may be a policy's, not the role's")
			}

			relay.Spec.Monitoring = nil
			require.NoError(t, r.ensurePodMonitor(context.Background(), relay))
			cond = meta.FindStatusCondition(relay.Status.Conditions, outboxv1alpha1.ConditionMonitoring)
			if tc.keptWhenOff {
				require.NotNil(t, cond, "a PodMonitor it may not delete is reported")
				require.Equal(t, tc.reason, cond.Reason)
			} else {
				require.Nil(t, cond, "no CRD: no PodMonitor to delete")
			}
		})
	}
}

// A pass whose status is settled (small backlog moves wait for
// statusRefresh) still writes a Monitoring condition that changed: the
// PodMonitor CRD was installed since the last pass.
func TestMonitoringConditionWrittenWhenStatusSettled(t *testing.T) {
	t.Parallel()
	var crdInstalled atomic.Bool
	c, r, relay := fakeMonitoredRelay(t, func() error {
		if !crdInstalled.Load() {
			return &meta.NoKindMatchError{GroupKind: podMonitorGVK.GroupKind(), SearchedVersions: []string{"v1"}}
		}
		return nil
	})
	key := client.ObjectKeyFromObject(relay)
	table, err := outbox.ParseTable("outbox")
	require.NoError(t, err)
	// A backlog reading that does not move between the passes: the status settles.
	r.Flow.relays[key] = &relayFlow{target: flowTarget{dsn: fakeDSN, auth: dbAuth{method: relayconfig.DatabaseAuthPassword}, table: table,
		interval: 15 * time.Second}, latest: &backlogSample{at: time.Now()}}
	ctx := context.Background()
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, outboxv1alpha1.ReasonPodMonitorCRDMissing, monitoringCondition(t, c, key).Reason)

	crdInstalled.Store(true)
	v, _ := r.podMonitors.Load(key) // the CRD was installed a while ago
	seen := v.(podMonitorSeen)
	seen.at = seen.at.Add(-podMonitorProblemRecheck)
	r.podMonitors.Store(key, seen)
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, metav1.ConditionTrue, monitoringCondition(t, c, key).Status, "the PodMonitor made in a settled pass is reported")
}

// A PodMonitor that fails for a moment (the API server unavailable) is
// tried again, but the relay's status is written first. Before, the pass
// returned before its status patch, so while the PodMonitor kept failing
// the relay's conditions and backlog stayed as they were.
func TestPodMonitorErrorStillWritesTheStatus(t *testing.T) {
	t.Parallel()
	unavailable := apierrors.NewServiceUnavailable("etcd is slow")
	c, r, relay := fakeMonitoredRelay(t, func() error { return unavailable })
	key := client.ObjectKeyFromObject(relay)
	_, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: key})
	require.ErrorIs(t, err, unavailable, "the pass is retried")
	var got outboxv1alpha1.OutboxRelay
	require.NoError(t, c.Get(context.Background(), key, &got))
	require.Equal(t, got.Generation, got.Status.ObservedGeneration, "the status is written")
	require.NotNil(t, meta.FindStatusCondition(got.Status.Conditions, outboxv1alpha1.ConditionReady))
}

// Nor is a PodMonitor the cluster serves no kind for, or the operator may
// not write, tried at every pass: each try of a kind not served costs a
// discovery of the API server's groups besides the request. Before, a
// thousand relays asking for one on a cluster without the Prometheus
// Operator cost tens of discoveries a second.
func TestPodMonitorProblemIsNotRetriedAtEveryPass(t *testing.T) {
	t.Parallel()
	for name, problem := range map[string]error{
		"no CRD": &meta.NoKindMatchError{GroupKind: podMonitorGVK.GroupKind(), SearchedVersions: []string{"v1"}},
		"forbidden": apierrors.NewForbidden(schema.GroupResource{Group: "monitoring.coreos.com", Resource: "podmonitors"},
			"orders-relay", errors.New("no RBAC rule allows it")),
		"refused": apierrors.NewBadRequest("admission webhook denied the request"),
	} {
		t.Run(name, func(t *testing.T) {
			var gets atomic.Int32
			c, r, relay := fakeMonitoredRelay(t, func() error {
				gets.Add(1)
				return problem
			})
			key := client.ObjectKeyFromObject(relay)
			ctx := context.Background()
			for range 5 {
				_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
				require.NoError(t, err)
				require.Equal(t, metav1.ConditionFalse, monitoringCondition(t, c, key).Status)
			}
			require.Equal(t, int32(1), gets.Load(), "tried once in five passes")

			v, _ := r.podMonitors.Load(key)
			seen := v.(podMonitorSeen)
			seen.at = seen.at.Add(-podMonitorProblemRecheck)
			r.podMonitors.Store(key, seen)
			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
			require.NoError(t, err)
			require.Equal(t, int32(2), gets.Load(), "tried again after podMonitorProblemRecheck")
		})
	}
}

// A PodMonitor name another object holds, and a PodMonitor the operator
// may not delete once the relay stops asking for it, are not read again at
// every pass either. Before, each cost an uncached read per relay at every
// backlog reading.
func TestPodMonitorConflictAndForbiddenDeleteAreNotReadAtEveryPass(t *testing.T) {
	t.Parallel()
	var gets, deletes atomic.Int32
	var owner atomic.Pointer[metav1.OwnerReference] // the PodMonitor's controller; nil: another's object
	c, r, relay := fakeRelay(t, interceptor.Funcs{
		Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			if u, ok := obj.(*unstructured.Unstructured); ok && u.GroupVersionKind() == podMonitorGVK {
				gets.Add(1)
				u.SetNamespace(key.Namespace)
				u.SetName(key.Name)
				u.SetUID("podmonitor")
				if ref := owner.Load(); ref != nil {
					u.SetOwnerReferences([]metav1.OwnerReference{*ref})
				} else {
					u.SetLabels(map[string]string{"app": "theirs"})
				}
				return nil
			}
			return c.Get(ctx, key, obj, opts...)
		},
		Delete: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
			if u, ok := obj.(*unstructured.Unstructured); ok && u.GroupVersionKind() == podMonitorGVK {
				deletes.Add(1)
				return apierrors.NewForbidden(schema.GroupResource{Group: "monitoring.coreos.com", Resource: "podmonitors"}, u.GetName(), errors.New("no RBAC rule allows it"))
			}
			return c.Delete(ctx, obj, opts...)
		},
	}, func(relay *outboxv1alpha1.OutboxRelay) {
		relay.Spec.Monitoring = &outboxv1alpha1.MonitoringSpec{PodMonitor: true}
	})
	key := client.ObjectKeyFromObject(relay)
	ctx := context.Background()
	for range 5 {
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
		require.Equal(t, outboxv1alpha1.ReasonResourceConflict, monitoringCondition(t, c, key).Reason)
	}
	require.Equal(t, int32(1), gets.Load(), "a name taken: read once in five passes")

	// The relay stops asking, and its own PodMonitor (made when the
	// operator's role allowed it) may not be deleted.
	require.NoError(t, c.Get(ctx, key, relay))
	owner.Store(metav1.NewControllerRef(relay, outboxv1alpha1.GroupVersion.WithKind("OutboxRelay")))
	relay.Spec.Monitoring = nil
	require.NoError(t, c.Update(ctx, relay))
	gets.Store(0)
	for range 5 {
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
		require.Equal(t, outboxv1alpha1.ReasonPodMonitorForbidden, monitoringCondition(t, c, key).Reason)
	}
	require.Equal(t, int32(1), gets.Load(), "off and not deletable: read once in five passes")
	require.Equal(t, int32(1), deletes.Load())
}

// Every backlog reading wakes its relay, and the client reads PodMonitors
// from the API server: a relay's PodMonitor found as wanted is not read
// again at each pass, only after podMonitorRecheck or when what the relay
// wants of it changes.
func TestPodMonitorIsNotReadAtEveryPass(t *testing.T) {
	t.Parallel()
	var gets atomic.Int32
	c, r, relay := fakeMonitoredRelay(t, func() error {
		gets.Add(1)
		return nil
	})
	key := client.ObjectKeyFromObject(relay)
	ctx := context.Background()
	for range 5 {
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
		require.Equal(t, metav1.ConditionTrue, monitoringCondition(t, c, key).Status)
	}
	require.Equal(t, int32(1), gets.Load(), "read once in five passes")

	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Monitoring.PodMonitor = false })
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	update(t, c, relay, func(o *outboxv1alpha1.OutboxRelay) { o.Spec.Monitoring.PodMonitor = true })
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, int32(3), gets.Load(), "turned off and on: read to delete it, and again to make it")
}

// fakeMonitoredRelay is fakeRelay with spec.monitoring.podMonitor, on a
// client whose PodMonitor reads call read (its error is the read's; nil
// reads none) and whose PodMonitor creates (and the patch that records
// their live hash) succeed without storing.
func fakeMonitoredRelay(t *testing.T, read func() error) (client.Client, *OutboxRelayReconciler, *outboxv1alpha1.OutboxRelay) {
	t.Helper()
	return fakeRelay(t, interceptor.Funcs{
		Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			if u, ok := obj.(*unstructured.Unstructured); ok && u.GroupVersionKind() == podMonitorGVK {
				if err := read(); err != nil {
					return err
				}
				return apierrors.NewNotFound(schema.GroupResource{Group: podMonitorGVK.Group, Resource: "podmonitors"}, key.Name)
			}
			return c.Get(ctx, key, obj, opts...)
		},
		Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			if u, ok := obj.(*unstructured.Unstructured); ok && u.GroupVersionKind() == podMonitorGVK {
				return nil
			}
			return c.Create(ctx, obj, opts...)
		},
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			if u, ok := obj.(*unstructured.Unstructured); ok && u.GroupVersionKind() == podMonitorGVK {
				return nil
			}
			return c.Patch(ctx, obj, patch, opts...)
		},
	}, func(relay *outboxv1alpha1.OutboxRelay) {
		relay.Spec.Monitoring = &outboxv1alpha1.MonitoringSpec{PodMonitor: true}
	})
}

// A PodMonitor whose spec was changed by hand is put right once
// podMonitorRecheck has passed, and one left as written is not written
// again.
func TestPodMonitorEditedByHandIsRepaired(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, func(o *outboxv1alpha1.OutboxRelay) {
		o.Spec.Monitoring = &outboxv1alpha1.MonitoringSpec{PodMonitor: true}
	})
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	pmKey := client.ObjectKey{Namespace: relay.Namespace, Name: childName(relay)}
	recheck := func() {
		v, ok := r.podMonitors.Load(key)
		require.True(t, ok)
		seen := v.(podMonitorSeen)
		seen.at = seen.at.Add(-podMonitorRecheck)
		r.podMonitors.Store(key, seen)
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
	}
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	pm := newPodMonitor()
	require.NoError(t, c.Get(ctx, pmKey, pm))
	want := pm.Object["spec"]
	require.Equal(t, relayPodMonitor(relay, nil).Object["spec"], want)

	recheck()
	again := newPodMonitor()
	require.NoError(t, c.Get(ctx, pmKey, again))
	require.Equal(t, pm.GetResourceVersion(), again.GetResourceVersion(), "a PodMonitor left as written is not written again")

	eps, _, _ := unstructured.NestedSlice(again.Object, "spec", "podMetricsEndpoints")
	eps[0].(map[string]any)["path"] = "/other"
	require.NoError(t, unstructured.SetNestedSlice(again.Object, eps, "spec", "podMetricsEndpoints"))
	require.NoError(t, unstructured.SetNestedField(again.Object, "team", "spec", "jobLabel"))
	require.NoError(t, c.Update(ctx, again))
	edited := again.GetResourceVersion()

	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, pmKey, again))
	require.Equal(t, edited, again.GetResourceVersion(), "within podMonitorRecheck the PodMonitor is not read")

	recheck()
	require.NoError(t, c.Get(ctx, pmKey, again))
	require.Equal(t, want, again.Object["spec"], "the hand edit is undone")
	require.Equal(t, metav1.ConditionTrue, monitoringCondition(t, c, key).Status)

	// Deleted by hand, it comes back at the next change of the relay's
	// spec, one that leaves the PodMonitor as it was, as the docs say.
	// Before, only a change of the PodMonitor itself brought it back
	// before podMonitorRecheck.
	require.NoError(t, c.Delete(ctx, again))
	require.NoError(t, c.Get(ctx, key, relay))
	relay.Spec.BatchSize = ptr.To[int32](77)
	relay.Generation++ // as the API server does; the fake client does not
	require.NoError(t, c.Update(ctx, relay))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, pmKey, newPodMonitor()), "made again at the spec change")
}
