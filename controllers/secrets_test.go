package controllers

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// countingReader serves one Secret and counts the reads.
type countingReader struct {
	client.Reader
	secret *corev1.Secret // nil: not found
	reads  int
}

func (c *countingReader) Get(_ context.Context, key client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	c.reads++
	if c.secret == nil {
		return apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, key.Name)
	}
	c.secret.DeepCopyInto(obj.(*corev1.Secret))
	return nil
}

// A Secret is read once per refresh interval however often relays ask
// (each backlog reading wakes a reconcile), again at once for a key value it
// does not keep, after a failed login, and while it is missing; for a key it
// lacked, again when the reconcile that reported it comes back.
func TestSecretCacheReadsOncePerChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := &countingReader{secret: &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "dsn", UID: "u1", ResourceVersion: "1"},
		Data: map[string][]byte{"dsn": []byte("postgres://a"), "other": []byte("postgres://b"), "password": []byte("x")}}}
	c := newSecretCache(300*time.Millisecond, nil)
	k := types.NamespacedName{Namespace: "ns", Name: "dsn"}

	for range 100 {
		e, err := c.get(ctx, r, k, "dsn")
		require.NoError(t, err)
		require.Equal(t, "postgres://a", e.values["dsn"])
	}
	require.Equal(t, 1, r.reads, "a hundred reconciles, one read")
	_, err := c.get(ctx, r, k, "")
	require.NoError(t, err)
	_, err = c.get(ctx, r, k, "missing-key")
	require.NoError(t, err)
	require.Equal(t, 1, r.reads, "key names are kept: no read to learn a key is missing")
	c.mu.Lock()
	c.entries[k].read = time.Now().Add(-secretRetryInterval) // the reconcile that reported it missing comes back
	c.mu.Unlock()
	_, err = c.get(ctx, r, k, "missing-key")
	require.NoError(t, err)
	require.Equal(t, 2, r.reads, "a key the Secret lacked is looked for again by the reconcile that comes back for it, not at the refresh")

	e, err := c.get(ctx, r, k, "other")
	require.NoError(t, err)
	require.Equal(t, 3, r.reads, "a value not kept is read")
	require.Equal(t, map[string]string{"dsn": "postgres://a", "other": "postgres://b"}, e.values, "only the values asked for")

	c.stale(k, time.Hour)
	_, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, 3, r.reads, "a failed login right after a read does not read again")
	c.stale(k, 0)
	r.secret.ResourceVersion = "2"
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, 4, r.reads)
	require.Equal(t, "2", e.version)

	time.Sleep(300*time.Millisecond*6/5 + 50*time.Millisecond)
	r.secret.ResourceVersion = "3"
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, 5, r.reads, "read again once the refresh interval (and its jitter) is over")
	require.Equal(t, "3", e.version)
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}), "new versions of the same data: its pods do not roll")
	c.stale(k, 0)
	r.secret.ResourceVersion, r.secret.Data["other"] = "4", []byte("postgres://c")
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}), "new data in a key the pods do not read: they do not roll")
	require.Equal(t, "u1/dsn@1;other@4;tls.crt@-", e.dataVersion([]string{"other", "tls.crt", "dsn", "other"}), "new data")
	c.stale(k, 0)
	r.secret.ResourceVersion, r.secret.Data["dsn"] = "5", []byte("postgres://d")
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, "u1/dsn@5", e.dataVersion([]string{"dsn"}), "a rotated DSN")

	r.secret = nil
	c.stale(k, 0)
	for range 3 {
		_, err = c.get(ctx, r, k, "dsn")
		require.True(t, apierrors.IsNotFound(err))
	}
	require.Equal(t, 10, r.reads, "a missing Secret is not kept")
}

// A status whose backlog numbers moved only a little (an older oldest row,
// a tenth of the pending rows, of the rate or of a count of held rows, or a
// few rows) is not rewritten within statusRefresh; anything else is (held
// rows that appear or are all gone, too).
func TestSettledStatusWaitsForSmallMoves(t *testing.T) {
	t.Parallel()
	now := time.Now()
	rate := func(v int64) *int64 { return &v }
	old := outboxv1alpha1.OutboxRelayStatus{
		Backlog: &outboxv1alpha1.BacklogStatus{Pending: 100, PublishedPerMinute: rate(600),
			OldestAge: metav1.Duration{Duration: 5 * time.Second}, ObservedAt: metav1.NewTime(now.Add(-10 * time.Second))},
		Conditions: []metav1.Condition{{Type: outboxv1alpha1.ConditionLagging, Status: metav1.ConditionFalse,
			Reason: outboxv1alpha1.ReasonFlowing, Message: "oldest waiting row 5s old"}},
	}
	moved := func(change func(*outboxv1alpha1.OutboxRelayStatus)) outboxv1alpha1.OutboxRelayStatus {
		n := *old.DeepCopy()
		n.Backlog.ObservedAt = metav1.NewTime(now)
		n.Backlog.OldestAge = metav1.Duration{Duration: 9 * time.Second}
		n.Conditions[0].Message = "oldest waiting row 9s old"
		change(&n)
		return n
	}
	require.True(t, settled(old, moved(func(*outboxv1alpha1.OutboxRelayStatus) {}), now), "only the age")
	require.True(t, settled(old, moved(func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Pending = 109 }), now))
	// Held rows that keep growing a little: unroutable rows of a busy type.
	held := *old.DeepCopy()
	held.Backlog.Held.Unroutable = 1000
	require.True(t, settled(held, moved(func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Held.Unroutable = 1003 }), now),
		"held rows that grew a little")
	require.False(t, settled(held, moved(func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Held.Unroutable = 0 }), now),
		"held rows all gone")
	// A busy relay that keeps up: a few rows waiting at one reading, none at the next.
	for _, pending := range [][2]int64{{0, 12}, {7, 0}, {3, backlogSmallMove}} {
		busy := *old.DeepCopy()
		busy.Backlog.Pending = pending[0]
		require.True(t, settled(busy, moved(func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Pending = pending[1] }), now),
			"pending %d to %d", pending[0], pending[1])
	}
	for name, change := range map[string]func(*outboxv1alpha1.OutboxRelayStatus){
		"pending by more than a tenth": func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Pending = 100 + backlogSmallMove + 1 },
		"pending to zero":              func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Pending = 0 },
		"the rate to zero":             func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.PublishedPerMinute = rate(0) },
		"a held row":                   func(n *outboxv1alpha1.OutboxRelayStatus) { n.Backlog.Held.TooLarge = 1 },
		"a condition's status": func(n *outboxv1alpha1.OutboxRelayStatus) {
			n.Conditions[0].Status, n.Conditions[0].Reason = metav1.ConditionTrue, outboxv1alpha1.ReasonFallingBehind
		},
		"the ready replicas": func(n *outboxv1alpha1.OutboxRelayStatus) { n.ReadyReplicas = 2 },
	} {
		require.False(t, settled(old, moved(change), now), name)
	}
	require.False(t, settled(old, moved(func(*outboxv1alpha1.OutboxRelayStatus) {}), now.Add(statusRefresh)), "written once statusRefresh is over")
}

type configMapReader struct {
	client.Reader
	cm    *corev1.ConfigMap
	reads int
}

func (c *configMapReader) Get(_ context.Context, _ client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	c.reads++
	c.cm.DeepCopyInto(obj.(*corev1.ConfigMap))
	return nil
}

// A referenced ConfigMap (spec.database.tls's CA) is kept like a Secret:
// read once however many reconciles ask, its value and version kept.
func TestConfigMapCacheReadsOnce(t *testing.T) {
	t.Parallel()
	r := &configMapReader{cm: &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "pg-ca", UID: "u", ResourceVersion: "7"},
		Data: map[string]string{"ca.crt": "PEM"}}}
	c := newConfigMapCache(time.Hour)
	for range 50 {
		e, err := c.get(context.Background(), r, types.NamespacedName{Namespace: "ns", Name: "pg-ca"}, "ca.crt")
		require.NoError(t, err)
		require.Equal(t, "PEM", e.values["ca.crt"])
		require.Equal(t, "7", e.version)
	}
	require.Equal(t, 1, r.reads)
}

// A failed login marks the DSN Secret's entry to be read again; reads of
// other Secrets in between (other relays) keep it, so the read that
// follows still knows at which version each key's value last changed: a
// write of the Secret's annotations does not roll the relay. Before, the
// mark dropped the entry at the next read of any Secret, and the relay
// rolled.
func TestStaleSecretKeepsItsKeyVersions(t *testing.T) {
	t.Parallel()
	c, r, relay := fakeRelay(t, interceptor.Funcs{}, nil)
	ctx := context.Background()
	key := client.ObjectKeyFromObject(relay)
	dsn := types.NamespacedName{Namespace: relay.Namespace, Name: relay.Spec.DSNSecretRef.Name}
	other := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: relay.Namespace, Name: "other"}, Data: map[string][]byte{"dsn": []byte("x")}}
	require.NoError(t, c.Create(ctx, other))
	configHash := func() string { return fakeDeployment(t, c, relay).Spec.Template.Annotations[configHashAnnotation] }
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	before := configHash()
	require.NotEmpty(t, before)

	s := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, dsn, s))
	s.Annotations = map[string]string{"team": "orders"} // a metadata-only write
	require.NoError(t, c.Update(ctx, s))
	// The operator's login fails, then another relay's Secret is read.
	r.secrets.stale(dsn, 0)
	_, err = r.secrets.get(ctx, c, client.ObjectKeyFromObject(other), "")
	require.NoError(t, err)
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.Equal(t, before, configHash(), "a write of the DSN Secret's annotations rolls no pod")
}

// An entry no relay asks for (its relay paused, or gone) no longer keeps
// its values past the refresh, but keeps at which version each key's value
// last changed: a relay resumed after a while, whose Secret's annotations
// were written meanwhile, does not roll.
func TestIdleSecretEntryKeepsItsKeyVersions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := &countingReader{secret: &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "dsn", UID: "u1", ResourceVersion: "1"},
		Data: map[string][]byte{"dsn": []byte("postgres://a")}}}
	other := &countingReader{secret: &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "other", UID: "u2", ResourceVersion: "1"}}}
	c := newSecretCache(time.Minute, nil)
	k := types.NamespacedName{Namespace: "ns", Name: "dsn"}
	_, err := c.get(ctx, r, k, "dsn")
	require.NoError(t, err)
	c.mu.Lock()
	idle := *c.entries[k] // paused for an hour
	idle.read, idle.used, idle.expires = idle.read.Add(-time.Hour), idle.used.Add(-time.Hour), idle.expires.Add(-time.Hour)
	c.entries[k] = &idle
	c.mu.Unlock()
	_, err = c.get(ctx, other, types.NamespacedName{Namespace: "ns", Name: "other"}, "")
	require.NoError(t, err)
	c.mu.Lock()
	require.NotNil(t, c.entries[k], "its versions are kept")
	require.Empty(t, c.entries[k].values, "its values are not")
	c.mu.Unlock()

	r.secret.ResourceVersion, r.secret.Annotations = "2", map[string]string{"team": "orders"}
	e, err := c.get(ctx, r, k, "dsn")
	require.NoError(t, err)
	require.Equal(t, 2, r.reads, "read again")
	require.Equal(t, "postgres://a", e.values["dsn"])
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}), "its pods do not roll")

	c.mu.Lock()
	gone := *c.entries[k]
	gone.used = gone.used.Add(-secretHistoryRetention - time.Minute)
	c.entries[k] = &gone
	c.mu.Unlock()
	_, err = c.get(ctx, other, types.NamespacedName{Namespace: "ns", Name: "third"}, "")
	require.NoError(t, err)
	c.mu.Lock()
	require.Nil(t, c.entries[k], "forgotten once no relay asked for it in secretHistoryRetention")
	c.mu.Unlock()
}
