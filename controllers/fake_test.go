package controllers

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
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
