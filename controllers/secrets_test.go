package controllers

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
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

	c.mu.Lock()
	entry := c.entries[k]
	require.WithinRange(t, entry.expires, entry.read.Add(300*time.Millisecond), entry.read.Add(300*time.Millisecond*6/5),
		"used for the refresh interval, stretched by up to a fifth")
	entry.expires = time.Now() // that interval is over
	c.mu.Unlock()
	r.secret.ResourceVersion = "3"
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, 5, r.reads, "read again once the refresh interval (and its jitter) is over")
	require.Equal(t, "3", e.version)
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}, nil), "new versions of the same data: its pods do not roll")
	c.stale(k, 0)
	r.secret.ResourceVersion, r.secret.Data["other"] = "4", []byte("postgres://c")
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}, nil), "new data in a key the pods do not read: they do not roll")
	require.Equal(t, "u1/dsn@1;other@4;tls.crt@-", e.dataVersion([]string{"other", "tls.crt", "dsn", "other"}, nil), "new data")
	c.stale(k, 0)
	r.secret.ResourceVersion, r.secret.Data["dsn"] = "5", []byte("postgres://d")
	e, _ = c.get(ctx, r, k, "dsn")
	require.Equal(t, "u1/dsn@5", e.dataVersion([]string{"dsn"}, nil), "a rotated DSN")

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

	// A bundle in binaryData is read as the kubelet projects it. Before,
	// only data was read, and the relay was refused for a missing key.
	binary := &configMapReader{cm: &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "pg-ca-bin", UID: "b", ResourceVersion: "3"},
		BinaryData: map[string][]byte{"ca.crt": []byte("PEM\x00")}}}
	e, err := c.get(context.Background(), binary, types.NamespacedName{Namespace: "ns", Name: "pg-ca-bin"}, "ca.crt")
	require.NoError(t, err)
	require.True(t, e.keys["ca.crt"])
	require.Equal(t, "PEM\x00", e.values["ca.crt"])
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
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}, nil), "its pods do not roll")

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

// An entry read for the first time (a restarted operator's) takes the
// versions its relay's Deployment recorded for the values whose digests it
// recorded, and the Secret's current version for a value with another
// digest; what it records carries the digests of the values as they are.
func TestRecordedVersionsOutliveTheCache(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k := types.NamespacedName{Namespace: "ns", Name: "creds"}
	r := &countingReader{secret: &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: k.Name, UID: "u1", ResourceVersion: "3"},
		Data: map[string][]byte{"user": []byte("relay"), "password": []byte("hunter2")}}}
	key := &digestKey{key: randomKey(), kept: true}
	first := newSecretCache(time.Minute, nil)
	first.digest = key
	e, err := first.get(ctx, r, k, "")
	require.NoError(t, err)
	keys := []string{"password", "user", "tls.crt"}
	recorded := e.record(keys, nil)
	require.Equal(t, map[string]recordedKey{"password": {Version: "3", Digest: e.digests["password"]}, "user": {Version: "3", Digest: e.digests["user"]}},
		recorded, "present keys only")
	require.NotContains(t, secretRecord{k.Name: recorded}.String(), "hunter2")

	// The operator restarts; meanwhile the Secret got a label, then a new password.
	r.secret.ResourceVersion, r.secret.Labels = "8", map[string]string{"synced": "now"}
	r.secret.ResourceVersion, r.secret.Data["password"] = "9", []byte("hunter3")
	restarted := newSecretCache(time.Minute, nil)
	restarted.digest = key
	e, err = restarted.get(ctx, r, k, "")
	require.NoError(t, err)
	require.Equal(t, "u1/password@9;tls.crt@-;user@3", e.dataVersion(keys, recorded), "the password's version moves, the user's stays")
	require.Equal(t, "u1/password@9;tls.crt@-;user@9", e.dataVersion(keys, nil), "without a record, every value's version is the one first read")
	again := e.record(keys, recorded)
	require.Equal(t, "3", again["user"].Version)
	require.Equal(t, "9", again["password"].Version)
	require.Equal(t, "u1/password@9;tls.crt@-;user@3", e.dataVersion(keys, again), "the new record names the same versions")

	other := newSecretCache(time.Minute, nil)
	other.digest = &digestKey{key: randomKey()}
	e, err = other.get(ctx, r, k, "")
	require.NoError(t, err)
	require.Equal(t, "u1/password@9;tls.crt@-;user@9", e.dataVersion(keys, again), "digests taken with another key match nothing")
}

// The digest key is made once, by whichever manager finds its Secret
// empty; another manager (the next leader, a restart) reads the same key.
// Two that fill it at once agree on the one written first. Without the
// Secret (or the right to it) the key is the process's own and kept is
// false, so nothing is recorded with it.
func TestDigestKeyIsKeptInItsSecret(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := types.NamespacedName{Namespace: "outbox-system", Name: "outbox-operator-digest-key"}
	var updates int
	var racer *digestKey
	c := fake.NewClientBuilder().WithScheme(newScheme(t)).
		WithObjects(&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: name.Namespace, Name: name.Name}}).
		WithInterceptorFuncs(interceptor.Funcs{Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			updates++
			if updates == 1 { // another manager fills it between this one's read and write
				_, err := racer.load(ctx)
				require.NoError(t, err)
			}
			return c.Update(ctx, obj, opts...)
		}}).Build()
	racer = &digestKey{secret: name, reader: c, writer: c}
	d := &digestKey{secret: name, reader: c, writer: c}
	kept, err := d.load(ctx)
	require.NoError(t, err)
	require.True(t, kept)
	require.Equal(t, 2, updates, "its write (which conflicted) and the racer's; none after")
	s := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, name, s))
	require.Len(t, s.Data[digestKeyField], digestKeyBytes)
	require.Equal(t, s.Data[digestKeyField], d.key, "the key written first")
	require.Equal(t, racer.key, d.key)

	next := &digestKey{secret: name, reader: c, writer: c}
	kept, err = next.load(ctx)
	require.NoError(t, err)
	require.True(t, kept)
	require.Equal(t, 2, updates, "a filled Secret is only read")
	obj := types.NamespacedName{Namespace: "shop", Name: "dsn"}
	require.Equal(t, d.sum("Secret", obj, "u1", "dsn", "pw"), next.sum("Secret", obj, "u1", "dsn", "pw"))
	require.NotEqual(t, d.sum("Secret", obj, "u1", "dsn", "pw"), d.sum("Secret", obj, "u2", "dsn", "pw"), "a re-created Secret")
	require.NotEqual(t, d.sum("Secret", obj, "u1", "dsn", "pw"), d.sum("Secret", obj, "u1", "password", "pw"), "another key")

	missing := &digestKey{secret: types.NamespacedName{Namespace: "outbox-system", Name: "gone"}, reader: c, writer: c}
	kept, err = missing.load(ctx)
	require.NoError(t, err)
	require.False(t, kept)
	require.Len(t, missing.key, digestKeyBytes)
	require.NotEqual(t, d.sum("Secret", obj, "u1", "dsn", "pw"), missing.sum("Secret", obj, "u1", "dsn", "pw"))
	kept, err = (&digestKey{}).load(ctx)
	require.NoError(t, err)
	require.False(t, kept, "no Secret named")
}

// A digest key Secret that is missing or not granted when the operator
// starts is read again every digestKeyRetryInterval: once the install
// creates it (or grants it), the operator keeps its key from then on,
// without a restart. The key's change rolls no pod: the digests taken
// with the process's own key are compared with that key, and a Secret
// whose metadata was written meanwhile keeps the version at which its
// value last changed. Before, the Secret was read once, at the first
// reconcile, and the key stayed the process's own until a restart.
func TestDigestKeyIsTakenUpOnceItCanBeRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := types.NamespacedName{Namespace: "outbox-system", Name: "outbox-operator-digest-key"}
	forbidden := true
	c := fake.NewClientBuilder().WithScheme(newScheme(t)).
		WithInterceptorFuncs(interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			if key == name && forbidden {
				return apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, key.Name, errors.New("no Role yet"))
			}
			return c.Get(ctx, key, obj, opts...)
		}}).Build()
	d := &digestKey{secret: name, reader: c, writer: c}
	cache := newSecretCache(time.Hour, nil)
	cache.digest = d
	k := types.NamespacedName{Namespace: "shop", Name: "dsn"}
	r := &countingReader{secret: &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: k.Name, UID: "u1", ResourceVersion: "1"},
		Data: map[string][]byte{"dsn": []byte("postgres://a")}}}

	kept, err := d.load(ctx)
	require.NoError(t, err)
	require.False(t, kept, "forbidden: the process's own key")
	_, err = cache.get(ctx, r, k, "dsn")
	require.NoError(t, err)

	forbidden = false // the Role arrives, then the Secret
	require.NoError(t, c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: name.Namespace, Name: name.Name}}))
	r.secret.ResourceVersion, r.secret.Labels = "2", map[string]string{"synced": "now"} // a metadata-only write
	kept, err = d.load(ctx)
	require.NoError(t, err)
	require.False(t, kept, "not read again before the retry interval")

	d.mu.Lock()
	d.nextTry = time.Now() // the retry interval is over
	d.mu.Unlock()
	kept, err = d.load(ctx)
	require.NoError(t, err)
	require.True(t, kept, "read again, filled and kept")
	s := &corev1.Secret{}
	require.NoError(t, c.Get(ctx, name, s))
	require.Equal(t, s.Data[digestKeyField], d.key)

	e, err := cache.get(ctx, r, k, "dsn")
	require.NoError(t, err)
	require.Equal(t, 2, r.reads, "an entry whose digests were taken with the old key is read again")
	require.Equal(t, "u1/dsn@1", e.dataVersion([]string{"dsn"}, nil), "its pods do not roll")
	require.Equal(t, digestWith(s.Data[digestKeyField], "Secret", k, "u1", "dsn", "postgres://a"), e.record([]string{"dsn"}, nil)["dsn"].Digest,
		"what is recorded is taken with the kept key")

	r.secret.ResourceVersion, r.secret.Data["dsn"] = "3", []byte("postgres://b")
	cache.stale(k, 0)
	e, err = cache.get(ctx, r, k, "dsn")
	require.NoError(t, err)
	require.Equal(t, "u1/dsn@3", e.dataVersion([]string{"dsn"}, nil), "a new value still rolls them")
}

// TestOperatorRestart stops the operator and starts another (a new
// reconciler and cache over the same API server and digest key, as after
// an upgrade, a node drain or a change of leader) and checks what the
// second does to a relay the first rolled out.
func TestOperatorRestart(t *testing.T) {
	c := adminClient(t)
	ctx := context.Background()
	// restart runs a relay under one manager until its Deployment is
	// written, stops it, calls meanwhile, and starts another manager,
	// which has reconciled the relay once when restart returns.
	restart := func(t *testing.T, firstKey, keySecret types.NamespacedName, meanwhile func(*corev1.Secret)) (before *appsv1.Deployment, r *OutboxRelayReconciler, relay *outboxv1alpha1.OutboxRelay, secret *corev1.Secret) {
		ns := newNamespace(t, c)
		_, _, stop := runManager(t, testManager{namespaces: []string{ns}, digestKey: firstKey})
		relay, secret = minimalRelay(ns, "restarted")
		create(t, c, secret, relay)
		waitDeployment(t, c, relay, func(d *appsv1.Deployment) bool { return d.Labels[liveHashLabel] != "" })
		stop()
		before = &appsv1.Deployment{} // as the first manager left it
		require.NoError(t, c.Get(ctx, childKey(relay), before))
		update(t, c, secret, meanwhile)
		r, _, _ = runManager(t, testManager{namespaces: []string{ns}, digestKey: keySecret})
		// The manager's own worker reconciles the relay at start too: a
		// pass of ours that loses the race to write is refused (an
		// optimistic lock) and done again.
		require.Eventually(t, func() bool {
			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key(relay)})
			return err == nil
		}, eventually, tick)
		return before, r, relay, secret
	}
	deployment := func(t *testing.T, relay *outboxv1alpha1.OutboxRelay) *appsv1.Deployment {
		d := &appsv1.Deployment{}
		require.NoError(t, c.Get(ctx, childKey(relay), d))
		return d
	}
	// settled waits until a pass of r over relay writes nothing (the
	// worker's passes for the writes so far have settled too) and returns
	// the Deployment then: a relay rolled again and again never settles.
	settled := func(t *testing.T, r *OutboxRelayReconciler, relay *outboxv1alpha1.OutboxRelay) *appsv1.Deployment {
		var d *appsv1.Deployment
		require.Eventually(t, func() bool {
			d = deployment(t, relay)
			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key(relay)})
			return err == nil && deployment(t, relay).ResourceVersion == d.ResourceVersion
		}, eventually, tick)
		return d
	}

	t.Run("MetadataWriteRollsNothing", func(t *testing.T) {
		keySecret := newDigestKeySecret(t)
		// What External Secrets, Sealed Secrets or a Vault injector write at
		// every sync, and a key the relay does not read.
		before, _, relay, _ := restart(t, keySecret, keySecret, func(s *corev1.Secret) {
			s.Labels = map[string]string{"reconcile.external-secrets.io/managed": "true"}
			s.Annotations = map[string]string{"reconcile.external-secrets.io/data-hash": "9f86d081"}
			s.Data["app-password"] = []byte("hunter2")
		})
		require.Contains(t, before.Annotations, secretVersionsAnnotation, "the first operator recorded what the pods read")
		after := deployment(t, relay)
		require.Equal(t, configHash(before), configHash(after))
		require.Equal(t, before.Spec.Template, after.Spec.Template, "the restarted operator keeps the pods")
		require.Equal(t, before.ResourceVersion, after.ResourceVersion, "and writes nothing")

		s := &corev1.Secret{}
		require.NoError(t, c.Get(ctx, keySecret, s))
		require.Len(t, s.Data[digestKeyField], digestKeyBytes, "the first operator filled the digest key's Secret")
	})

	t.Run("ValueChangedWhileDownRolls", func(t *testing.T) {
		keySecret := newDigestKeySecret(t)
		before, r, relay, secret := restart(t, keySecret, keySecret, func(s *corev1.Secret) {
			s.Labels = map[string]string{"team": "orders"}
			s.Data["dsn"] = []byte("postgres://relay@db-2/restarted")
		})
		after := deployment(t, relay)
		require.NotEqual(t, configHash(before), configHash(after), "the DSN changed while no operator ran: the pods roll")
		require.Equal(t, secret.ResourceVersion, recordOf(after)[secret.Name]["dsn"].Version, "at the version that changed it")
		require.Equal(t, configHash(after), configHash(settled(t, r, relay)), "once")
	})

	// A Deployment an operator without the record wrote (the previous
	// release; here one whose digest key is not kept) keeps its template
	// when its Secret was not written since, and gains the record; after a
	// write of the Secret's metadata it rolls once (docs/operator.md).
	t.Run("UpgradeKeepsTheTemplate", func(t *testing.T) {
		keySecret := newDigestKeySecret(t)
		before, _, relay, _ := restart(t, types.NamespacedName{}, keySecret, func(*corev1.Secret) {})
		require.NotContains(t, before.Annotations, secretVersionsAnnotation, "nothing recorded without a kept key")
		after := deployment(t, relay)
		require.Equal(t, before.Spec.Template, after.Spec.Template, "an upgrade over an unwritten Secret rolls nothing")
		require.Contains(t, after.Annotations, secretVersionsAnnotation, "and records what the pods read")

		before, r, relay, _ := restart(t, types.NamespacedName{}, keySecret, func(s *corev1.Secret) { s.Labels = map[string]string{"team": "orders"} })
		after = deployment(t, relay)
		require.NotEqual(t, configHash(before), configHash(after), "nothing tells a label from a value the pods never saw: one roll")
		require.Equal(t, configHash(after), configHash(settled(t, r, relay)), "only one")
	})
}
