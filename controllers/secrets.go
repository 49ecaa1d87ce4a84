package controllers

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// This file is everything the operator learns from Secrets. It may only
// get a Secret (no list or watch anywhere: the default install grants no
// access to Secrets it is not told about, and none across the cluster to
// list). It reads each referenced Secret straight from the API server and
// keeps of it, for a refresh interval, its UID, resourceVersion and key
// names, and the value of a key only when the connection that reads a
// relay's backlog needs it (the DSN; spec.database.tls's CA and client
// certificate), and a keyed digest of each value (digestKey). Referenced
// ConfigMaps (a CA bundle) are kept the same way. So a backlog read, which
// wakes the reconciler, costs no Secret read; a Secret is read again when
// its refresh interval is over (rotation rolls the pods within it), when a
// relay asks for a key or value not kept, and when the DSN stops
// authenticating.

// DefaultSecretRefreshInterval is the manager's --secret-refresh-interval
// default: the longest a Secret's change takes to reach the relays' pods.
const DefaultSecretRefreshInterval = 5 * time.Minute

// secretHistoryRetention is how long an entry no relay asks for (its relay
// paused, or gone) keeps at which version each key's value last changed:
// read again within it, a Secret whose metadata was written meanwhile rolls
// no pod. Its values are dropped long before (secretCache.get).
const secretHistoryRetention = 7 * 24 * time.Hour

// secretCache keeps what the reconciler needs of the referenced Secrets.
type secretCache struct {
	// refresh is how long an entry is used before the Secret is read again;
	// each entry's is stretched by up to a fifth, at random, so entries read
	// together (a manager start) are not all read again together.
	refresh time.Duration
	// reads counts the GETs, for the operator's metric (nil: not counted).
	reads func()
	// kind names what the cache keeps (Secret, ConfigMap) in the digests.
	kind string
	// digest keys the digests of the values; SetupWithManager sets it.
	digest *digestKey
	// fetch reads one object: its UID, resourceVersion and data.
	fetch func(ctx context.Context, reader client.Reader, key types.NamespacedName) (types.UID, string, map[string]string, error)

	mu      sync.Mutex
	entries map[types.NamespacedName]*secretEntry
}

// secretEntry is what the operator keeps of one Secret. Its fields are
// fixed once it is in the cache, except used and reread, which only the
// cache touches, under its lock.
type secretEntry struct {
	uid     types.UID
	version string
	// keyVersions are, for each key, the version at which this process
	// last saw its value change (version itself when first read): a write
	// of the metadata alone (a label, an annotation) or of other keys
	// leaves a key's version as it was.
	keyVersions map[string]string
	digests     map[string]string // each key's value's keyed digest (digestKey.sum): to tell a write of a key's value
	digestGen   int               // the generation of the digest key digests were taken with
	keys        map[string]bool   // the names of its keys
	values      map[string]string // the values of the keys the backlog reads connect with (DSN, TLS material)
	read        time.Time
	expires     time.Time
	// used is when a get last returned the entry: an entry is dropped when
	// no relay has asked for it in a while, however long ago it was read.
	used time.Time
	// reread makes the next get read the Secret (stale): the entry stays,
	// so that read still knows at which version each key last changed.
	reread bool
}

// dataVersion names the data of the keys a relay's pods read from the
// entry: its UID and each key with the version at which its value last
// changed ("-" for a key it lacks; keyVersion). It moves only when one of
// those values changes (or the object is re-created), so a write of
// anything else in a Secret shared with the application rolls no relay
// pod. recorded is what the relay's Deployment records of this object
// (nil: nothing).
func (e *secretEntry) dataVersion(keys []string, recorded map[string]recordedKey) string {
	keys = slices.Compact(slices.Sorted(slices.Values(keys)))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "@" + e.keyVersion(k, recorded)
	}
	return string(e.uid) + "/" + strings.Join(parts, ";")
}

// keyVersion is the version at which key's value last changed: the one the
// relay's Deployment recorded with the value's digest while the value keeps
// that digest (what a restarted operator knows), else the one at which this
// process saw it change; "-" when the entry lacks the key.
func (e *secretEntry) keyVersion(key string, recorded map[string]recordedKey) string {
	if !e.keys[key] {
		return "-"
	}
	if r, ok := recorded[key]; ok && r.Digest == e.digests[key] && r.Version != "" {
		return r.Version
	}
	return e.keyVersions[key]
}

// record is what the relay's Deployment is to record of the keys its pods
// read from the entry: each present key's version (keyVersion) and digest.
func (e *secretEntry) record(keys []string, recorded map[string]recordedKey) map[string]recordedKey {
	out := map[string]recordedKey{}
	for _, k := range keys {
		if e.keys[k] {
			out[k] = recordedKey{Version: e.keyVersion(k, recorded), Digest: e.digests[k]}
		}
	}
	return out
}

// secretRecord is what a relay's Deployment records, in its annotation
// secretVersionsAnnotation (not in the pod template, whose every change
// rolls the pods), of the data its pod template was built from: by object
// (a Secret's name, or configmap/<name>) and by key the pods read, the
// version that went into the config hash and the keyed digest of the value
// it stood for. It is how an operator that restarted (an upgrade, a node
// drain, a new leader), whose cache starts empty, knows at which version
// each value last changed: a value whose digest is the recorded one keeps
// the recorded version, so a write of a Secret's labels, annotations or
// other keys made before or during the restart rolls no pod; a value
// changed while the operator was down has another digest, takes the
// Secret's current version, and rolls the pods. The pod template keeps
// only the hash of the versions, as before the record existed, so a
// Deployment written by an earlier operator keeps its template when the
// versions are unchanged.
//
// Why digests and not only versions: a resourceVersion moves with every
// write of the object, so versions alone cannot tell a new value from a
// new label once the operator has forgotten the old value. Why keyed
// (digestKey): anyone who can read Deployments can read the record.
type secretRecord map[string]map[string]recordedKey

// recordedKey is one key of a secretRecord.
type recordedKey struct {
	Version string `json:"version"`
	Digest  string `json:"digest"`
}

// recordOf is the secretRecord d carries; nil when d is nil or carries
// none (or one that does not parse: it is then written anew).
func recordOf(d *appsv1.Deployment) secretRecord {
	if d == nil {
		return nil
	}
	var rec secretRecord
	if json.Unmarshal([]byte(d.Annotations[secretVersionsAnnotation]), &rec) != nil {
		return nil
	}
	return rec
}

// String is the annotation's value (JSON, keys sorted).
func (r secretRecord) String() string {
	b, err := json.Marshal(r)
	if err != nil {
		panic(fmt.Sprintf("marshal a secret record: %v", err)) // maps of strings always marshal
	}
	return string(b)
}

func newSecretCache(refresh time.Duration, reads func()) *secretCache {
	return &secretCache{refresh: cmp.Or(refresh, DefaultSecretRefreshInterval), reads: reads, kind: "Secret",
		entries: map[types.NamespacedName]*secretEntry{},
		fetch: func(ctx context.Context, reader client.Reader, key types.NamespacedName) (types.UID, string, map[string]string, error) {
			s := &corev1.Secret{}
			if err := reader.Get(ctx, key, s); err != nil {
				return "", "", nil, err
			}
			data := make(map[string]string, len(s.Data))
			for k, v := range s.Data {
				data[k] = string(v)
			}
			return s.UID, s.ResourceVersion, data, nil
		}}
}

// newConfigMapCache keeps what the reconciler needs of referenced
// ConfigMaps (a CA bundle) the same way, so a backlog reading costs no
// ConfigMap read either.
func newConfigMapCache(refresh time.Duration) *secretCache {
	return &secretCache{refresh: cmp.Or(refresh, DefaultSecretRefreshInterval), kind: "ConfigMap",
		entries: map[types.NamespacedName]*secretEntry{},
		fetch: func(ctx context.Context, reader client.Reader, key types.NamespacedName) (types.UID, string, map[string]string, error) {
			cm := &corev1.ConfigMap{}
			if err := reader.Get(ctx, key, cm); err != nil {
				return "", "", nil, err
			}
			// A key may be in binaryData as well as in data: the kubelet
			// projects both into the volume, and the API keeps their keys
			// apart.
			data := make(map[string]string, len(cm.Data)+len(cm.BinaryData))
			maps.Copy(data, cm.Data)
			for k, v := range cm.BinaryData {
				data[k] = string(v)
			}
			return cm.UID, cm.ResourceVersion, data, nil
		}}
}

// get returns key's entry, reading the Secret when it has none, the entry
// is due, or value names a key whose value the entry does not keep. A
// missing Secret is not kept: it is read again at the next reconcile.
func (c *secretCache) get(ctx context.Context, reader client.Reader, key types.NamespacedName, value string) (*secretEntry, error) {
	now := time.Now()
	k0, gen := c.digest.current()
	c.mu.Lock()
	e := c.entries[key]
	// An entry whose digests were taken with another key (the digest key
	// changed since) is read again, so that what is recorded is taken
	// with the key that outlives the process.
	if e != nil && !e.reread && now.Before(e.expires) && e.digestGen == gen {
		// A key the Secret lacked is read again by the reconcile that
		// comes back for it, secretRetryInterval later (readings of the
		// backlog in between use the entry): a user who adds it sees the
		// relay start then, not at the entry's refresh.
		missing := value != "" && !e.keys[value]
		if _, kept := e.values[value]; value == "" || kept || (missing && now.Sub(e.read) < secretRetryInterval/2) {
			e.used = now
			c.mu.Unlock()
			return e, nil
		}
	}
	c.mu.Unlock()
	if c.reads != nil {
		c.reads()
	}
	uid, version, data, err := c.fetch(ctx, reader, key)
	if err != nil {
		if apierrors.IsNotFound(err) {
			c.forget(key)
		}
		return nil, err
	}
	n := &secretEntry{uid: uid, version: version, keys: map[string]bool{}, values: map[string]string{},
		keyVersions: make(map[string]string, len(data)), digests: make(map[string]string, len(data)), digestGen: gen, read: now, used: now,
		expires: now.Add(c.refresh + time.Duration(rand.Int64N(int64(c.refresh)/5+1)))}
	for k, v := range data {
		n.keys[k] = true
		n.digests[k] = digestWith(k0, c.kind, key, uid, k, v)
		n.keyVersions[k] = version
		if e == nil || e.uid != uid || !e.keys[k] {
			continue
		}
		same := n.digests[k]
		if e.digestGen != gen {
			same = c.digest.sumAt(e.digestGen, c.kind, key, uid, k, v)
		}
		if e.digests[k] == same && same != "" {
			n.keyVersions[k] = e.keyVersions[k]
		}
	}
	keep := []string{value}
	if e != nil {
		keep = append(keep, slices.Collect(maps.Keys(e.values))...)
	}
	for _, k := range keep {
		if v, ok := data[k]; ok && k != "" {
			n.values[k] = v
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.entries[key] = n
	// Secrets no relay asked for in a while (the relay is paused, or gone):
	// their values (a DSN) are not kept past two refresh intervals, when the
	// entry is due anyway; at which version each key last changed is kept
	// for secretHistoryRetention, so a resumed relay rolls only if a value
	// it reads changed. Entries are replaced, not changed: callers read
	// their values without the lock.
	for k, e := range c.entries {
		switch idle := now.Sub(e.used); {
		case idle > max(secretHistoryRetention, 2*c.refresh):
			delete(c.entries, k)
		case idle > 2*c.refresh && len(e.values) > 0:
			kept := *e
			kept.values = nil
			c.entries[k] = &kept
		}
	}
	return n, nil
}

// stale makes the next get of key read the Secret, if its entry was read
// more than minAge ago (so a DSN that keeps failing is not read at every
// backlog read). The entry is kept until then, with its key versions: were
// it dropped, that read would take every key as changed and roll the pods.
func (c *secretCache) stale(key types.NamespacedName, minAge time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.entries[key]; e != nil && time.Since(e.read) > minAge {
		e.reread = true
	}
}

func (c *secretCache) forget(key types.NamespacedName) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.entries, key)
}

// secretInputs is what the relay's pods depend on from the referenced Secrets.
type secretInputs struct {
	// Versions names each referenced Secret with its UID and, for each
	// key the pods read, the resourceVersion at which its value last
	// changed (secretEntry.dataVersion): a new value of such a key (or a
	// re-created Secret) rolls the pods; a write of its metadata or of
	// other keys does not, and nothing in the pod template is derived
	// from a Secret's data.
	Versions string
	// Record is what the Deployment is to record of Versions (secretRecord);
	// nil when the digest key is not kept, as digests taken with a key that
	// dies with the process tell a restarted operator nothing.
	Record secretRecord
	// TLSCA and TLSClientCert say which files the TLS Secret provides.
	TLSCA, TLSClientCert bool
	// DSN is the DSN itself, which the backlog observer connects with. It
	// stays in memory: it is never hashed, logged or written anywhere.
	DSN string
	// DatabaseTLS is spec.database.tls's CA and client certificate, for
	// the backlog observer; nil without it.
	DatabaseTLS *dbTLS
	// Due is when the first of the entries read expires (zero when none
	// was read): a pass after it reads that Secret again.
	Due time.Time
}

// readSecrets reads every referenced Secret through the cache and checks
// that the keys the pods need exist. recorded is what the relay's
// Deployment records (nil: none). A missing Secret or key is a problem to
// wait on; any other error is transient.
func (r *OutboxRelayReconciler) readSecrets(ctx context.Context, relay *outboxv1alpha1.OutboxRelay, recorded secretRecord) (secretInputs, *problem, error) {
	var in secretInputs
	kept, err := r.digest.load(ctx) // before any read: the cache's digests need the key
	if err != nil {
		return in, nil, err
	}
	versions, record := map[string]string{}, secretRecord{}
	// read are the keys the pods read from each Secret: only a change of
	// their values rolls the pods.
	entries, read := map[string]*secretEntry{}, map[string][]string{}
	get := func(field, name, value string, podReads ...string) (*secretEntry, *problem, error) {
		e, err := r.secrets.get(ctx, r.APIReader, types.NamespacedName{Namespace: relay.Namespace, Name: name}, value)
		if apierrors.IsNotFound(err) {
			return nil, &problem{reason: outboxv1alpha1.ReasonSecretNotFound, requeue: true,
				message: fmt.Sprintf("Secret %s (%s) not found", name, field)}, nil
		}
		if err != nil {
			return nil, nil, fmt.Errorf("get Secret %s: %w", name, err)
		}
		entries[name], read[name] = e, append(read[name], podReads...)
		in.Due = earliest(in.Due, e.expires)
		return e, nil, nil
	}
	needKeys := func(field, name string, e *secretEntry, keys ...string) *problem {
		for _, k := range keys {
			if !e.keys[k] {
				return &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
					message: fmt.Sprintf("Secret %s has no key %q (%s)", name, k, field)}
			}
		}
		return nil
	}

	ref := relay.Spec.DSNSecretRef
	dsnKey := cmp.Or(ref.Key, outboxv1alpha1.DefaultDSNKey)
	e, prob, err := get("spec.dsnSecretRef", ref.Name, dsnKey, dsnKey)
	if prob != nil || err != nil {
		return in, prob, err
	}
	if prob := needKeys("spec.dsnSecretRef.key", ref.Name, e, dsnKey); prob != nil {
		return in, prob, nil
	}
	in.DSN = e.values[dsnKey]
	if strings.TrimSpace(in.DSN) == "" {
		// The relay exits at start on an empty DSN ("required"): its pods
		// would crash-loop while the backlog reads said only that PostgreSQL
		// cannot be reached.
		return in, &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
			message: fmt.Sprintf("Secret %s's key %q (spec.dsnSecretRef.key) is empty or blank: it must hold the PostgreSQL connection string", ref.Name, dsnKey)}, nil
	}
	if tls := relay.Spec.Kafka.TLS; tls != nil && tls.SecretRef != nil {
		name := tls.SecretRef.Name
		e, prob, err := get("spec.kafka.tls.secretRef", name, "", kafkaTLSKeys...)
		if prob != nil || err != nil {
			return in, prob, err
		}
		in.TLSCA = e.keys[outboxv1alpha1.DefaultCAKey]
		hasCert, hasKey := e.keys[corev1.TLSCertKey], e.keys[corev1.TLSPrivateKeyKey]
		if hasCert != hasKey {
			return in, &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
				message: fmt.Sprintf("Secret %s (spec.kafka.tls.secretRef) must hold both tls.crt and tls.key, or neither", name)}, nil
		}
		in.TLSClientCert = hasCert
	}
	if db := relay.Spec.Database; db != nil && db.TLS != nil {
		t := &dbTLS{}
		if ref := db.TLS.CA.SecretRef; ref != nil {
			key := cmp.Or(ref.Key, outboxv1alpha1.DefaultCAKey)
			e, prob, err := get("spec.database.tls.ca.secretRef", ref.Name, key, key)
			if prob != nil || err != nil {
				return in, prob, err
			}
			if prob := needKeys("spec.database.tls.ca.secretRef.key", ref.Name, e, key); prob != nil {
				return in, prob, nil
			}
			t.ca = []byte(e.values[key])
		}
		if ref := db.TLS.CA.ConfigMapRef; ref != nil {
			key := cmp.Or(ref.Key, outboxv1alpha1.DefaultCAKey)
			cm, err := r.configMaps.get(ctx, r.APIReader, types.NamespacedName{Namespace: relay.Namespace, Name: ref.Name}, key)
			if apierrors.IsNotFound(err) {
				return in, &problem{reason: outboxv1alpha1.ReasonSecretNotFound, requeue: true,
					message: fmt.Sprintf("ConfigMap %s (spec.database.tls.ca.configMapRef) not found", ref.Name)}, nil
			}
			if err != nil {
				return in, nil, fmt.Errorf("get ConfigMap %s: %w", ref.Name, err)
			}
			if !cm.keys[key] {
				return in, &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
					message: fmt.Sprintf("ConfigMap %s has no key %q (spec.database.tls.ca.configMapRef.key)", ref.Name, key)}, nil
			}
			name := "configmap/" + ref.Name // as referencedSecrets names it
			versions[name] = name + "/" + cm.dataVersion([]string{key}, recorded[name])
			record[name] = cm.record([]string{key}, recorded[name])
			in.Due = earliest(in.Due, cm.expires)
			t.ca = []byte(cm.values[key])
		}
		if ref := db.TLS.ClientCertSecretRef; ref != nil {
			for _, key := range []string{corev1.TLSCertKey, corev1.TLSPrivateKeyKey} {
				e, prob, err := get("spec.database.tls.clientCertSecretRef", ref.Name, key, key)
				if prob != nil || err != nil {
					return in, prob, err
				}
				if prob := needKeys("spec.database.tls.clientCertSecretRef", ref.Name, e, key); prob != nil {
					return in, prob, nil
				}
				if key == corev1.TLSCertKey {
					t.cert = []byte(e.values[key])
				} else {
					t.key = []byte(e.values[key])
				}
			}
		}
		in.DatabaseTLS = t
	}
	if sasl := relay.Spec.Kafka.SASL; sasl != nil && sasl.CredentialsSecretRef != nil {
		ref := sasl.CredentialsSecretRef
		user, password := cmp.Or(ref.UsernameKey, outboxv1alpha1.DefaultSASLUsernameKey), cmp.Or(ref.PasswordKey, outboxv1alpha1.DefaultSASLPasswordKey)
		e, prob, err := get("spec.kafka.sasl.credentialsSecretRef", ref.Name, "", user, password)
		if prob != nil || err != nil {
			return in, prob, err
		}
		if prob := needKeys("spec.kafka.sasl.credentialsSecretRef", ref.Name, e, user, password); prob != nil {
			return in, prob, nil
		}
	}
	for name, e := range entries {
		versions[name] = name + "/" + e.dataVersion(read[name], recorded[name])
		record[name] = e.record(read[name], recorded[name])
	}
	names := referencedSecrets(relay)
	parts := make([]string, len(names))
	for i, name := range names {
		parts[i] = versions[name]
	}
	in.Versions = strings.Join(parts, ",")
	if kept {
		in.Record = record
	}
	return in, nil, nil
}

// earliest is the earlier of two times, a zero one not counting.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || b.Before(a) {
		return b
	}
	return a
}

// referencedSecrets are the names of the Secrets a relay references, sorted.
func referencedSecrets(relay *outboxv1alpha1.OutboxRelay) []string {
	names := []string{relay.Spec.DSNSecretRef.Name}
	if tls := relay.Spec.Kafka.TLS; tls != nil && tls.SecretRef != nil {
		names = append(names, tls.SecretRef.Name)
	}
	if sasl := relay.Spec.Kafka.SASL; sasl != nil && sasl.CredentialsSecretRef != nil {
		names = append(names, sasl.CredentialsSecretRef.Name)
	}
	if db := relay.Spec.Database; db != nil && db.TLS != nil {
		if ref := db.TLS.CA.SecretRef; ref != nil {
			names = append(names, ref.Name)
		}
		if ref := db.TLS.CA.ConfigMapRef; ref != nil {
			names = append(names, "configmap/"+ref.Name) // its version is recorded under this name
		}
		if ref := db.TLS.ClientCertSecretRef; ref != nil {
			names = append(names, ref.Name)
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// ManagerOptions returns opts with the cache and client settings the
// OutboxRelay reconciler relies on. The client never serves Secrets from a
// cache, so no code path can start a Secret informer (which would need to
// list and watch every Secret, and hold their data). The cache holds only
// the Deployments, Services and PodDisruptionBudgets the operator made
// (childSelector), not every one in the cluster; ensure finds a child that
// lost its label on the API server.
func ManagerOptions(opts ctrl.Options) ctrl.Options {
	if opts.Client.Cache == nil {
		opts.Client.Cache = &client.CacheOptions{}
	} else {
		c := *opts.Client.Cache
		opts.Client.Cache = &c
	}
	opts.Client.Cache.DisableFor = append(slices.Clone(opts.Client.Cache.DisableFor), &corev1.Secret{})
	byObject := maps.Clone(opts.Cache.ByObject)
	if byObject == nil {
		byObject = map[client.Object]cache.ByObject{}
	}
	for _, o := range childKinds() {
		byObject[o] = cache.ByObject{Label: childSelector()}
	}
	opts.Cache.ByObject = byObject
	return opts
}
