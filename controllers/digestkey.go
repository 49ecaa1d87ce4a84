package controllers

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// digestKeyField is the data key of the digest key Secret that holds the key.
const digestKeyField = "key"

// digestKeyBytes is the size of the key the operator makes: as long as
// SHA-256's output.
const digestKeyBytes = 32

// digestKey keys the digests the operator takes of the values a relay's
// pods read (HMAC-SHA256), so that it can record them on the relay's
// Deployment (secretRecord): whoever may read Deployments learns nothing of
// a value from its digest, while a plain SHA-256 of a short password could
// be tested against guesses offline. The key is kept in one Secret of the
// operator's own namespace, which the install creates empty and the
// operator fills once with random bytes (it may get and update that Secret
// alone), so that a restarted operator, or the next leader, takes the same
// digests and recognizes the values the running pods were started with.
//
// Without that Secret (none named, missing, or not granted) the key is made
// at random: the digests still tell a change of a value from a write of a
// Secret's metadata in memory, but none is recorded, so after a restart the
// first read of a Secret that was written since a relay's pods last rolled
// rolls them once (as before this key existed). A Secret named but missing
// or not granted is read again every digestKeyRetryInterval, so an install
// that creates it, or grants it, after the operator started is taken up
// without a restart; the key then changes once, and the digests taken with
// the one before are compared with it (keyAt), so the change rolls no pod.
type digestKey struct {
	// secret is the Secret holding the key; zero: none.
	secret types.NamespacedName
	// reader reads it from the API server; writer fills it.
	reader client.Reader
	writer client.Writer

	// reading is held while the Secret is read: once the process has a
	// key, a reconcile that finds a read going on does not wait for it.
	reading sync.Mutex
	mu      sync.Mutex
	key     []byte
	kept    bool // key is secret's: digests taken with it outlive the process
	// gen counts the changes of key (from the process's own to the
	// Secret's); prev is the key before the last one.
	gen  int
	prev []byte
	// nextTry is when the Secret is read again while key is the process's own.
	nextTry time.Time
}

// digestKeyRetryInterval is how often a digest key Secret that was missing
// or not granted is read again.
const digestKeyRetryInterval = time.Minute

// load reads (or makes) the key: once when the Secret holds it, else again
// every digestKeyRetryInterval; between reads it returns at once. kept
// reports whether the key is the Secret's, so that digests taken with it
// may be recorded. A nil digestKey keys with an empty key and keeps
// nothing (the fake reconcilers of unit tests).
func (d *digestKey) load(ctx context.Context) (kept bool, err error) {
	if d == nil {
		return false, nil
	}
	d.mu.Lock()
	if d.key != nil && (d.kept || d.secret.Name == "" || time.Now().Before(d.nextTry)) {
		defer d.mu.Unlock()
		return d.kept, nil
	}
	if d.secret.Name == "" {
		defer d.mu.Unlock()
		d.key = randomKey()
		return false, nil
	}
	first := d.key == nil
	d.mu.Unlock()
	// The read is an API call: the reconciles that need the key meanwhile
	// do not queue behind it, but the first ones, which have no key yet.
	if first {
		d.reading.Lock()
	} else if !d.reading.TryLock() {
		return false, nil
	}
	defer d.reading.Unlock()
	d.mu.Lock()
	if d.key != nil && (d.kept || time.Now().Before(d.nextTry)) {
		defer d.mu.Unlock()
		return d.kept, nil // read meanwhile by the one that held reading
	}
	d.mu.Unlock()
	key, err := d.read(ctx) // secret, reader and writer are fixed: no lock needed
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	switch {
	case err == nil:
		if d.key != nil {
			ctrl.LoggerFrom(ctx).Info("the digest key's Secret can be read now: the digests recorded from now on outlive the process", "secret", d.secret.String())
			d.prev, d.gen = d.key, d.gen+1
		}
		d.key, d.kept = key, true
		return true, nil
	case d.key != nil:
		// Still missing, forbidden or unreachable: keep the process's key.
		ctrl.LoggerFrom(ctx).V(1).Info("the digest key's Secret still cannot be read", "secret", d.secret.String(), "error", err.Error())
	case apierrors.IsNotFound(err) || apierrors.IsForbidden(err):
		// A configuration, not a passing failure: work without it.
		ctrl.LoggerFrom(ctx).Error(err, "cannot keep the digest key: an operator restart will roll, once, the relays whose Secrets were written since their pods last rolled; the Secret is read again",
			"secret", d.secret.String(), "retryEvery", digestKeyRetryInterval)
		d.key = randomKey()
	default:
		return false, fmt.Errorf("read the digest key from Secret %s: %w", d.secret, err)
	}
	d.nextTry = now.Add(digestKeyRetryInterval)
	return false, nil
}

// read returns the key the Secret holds, filling it with a new one when it
// holds none. The update carries the resourceVersion read, so when two
// managers fill it at once, one write wins and the other reads its key.
func (d *digestKey) read(ctx context.Context) ([]byte, error) {
	var err error
	for range 3 {
		s := &corev1.Secret{}
		if err = d.reader.Get(ctx, d.secret, s); err != nil {
			return nil, err
		}
		if k := s.Data[digestKeyField]; len(k) > 0 {
			return k, nil
		}
		k := randomKey()
		if s.Data == nil {
			s.Data = map[string][]byte{}
		}
		s.Data[digestKeyField] = k
		if err = d.writer.Update(ctx, s); err == nil {
			return k, nil
		}
		if !apierrors.IsConflict(err) {
			return nil, err
		}
	}
	return nil, err
}

// sum is the digest of the value of key in an object (a Secret or
// ConfigMap, kind) with that UID, taken with the current key: the object's
// identity is part of it, so two Secrets holding one password have two
// digests, and a re-created Secret's differ from the old one's.
func (d *digestKey) sum(kind string, obj types.NamespacedName, uid types.UID, key, value string) string {
	k, _ := d.current()
	return digestWith(k, kind, obj, uid, key, value)
}

// current is the key and its generation (how many times it changed).
func (d *digestKey) current() ([]byte, int) {
	if d == nil {
		return nil, 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.key, d.gen
}

// sumAt is sum taken with the key of generation gen, which the process
// still knows when it is the current one or the one before; "" (no
// digest's) otherwise.
func (d *digestKey) sumAt(gen int, kind string, obj types.NamespacedName, uid types.UID, key, value string) string {
	if d == nil {
		return digestWith(nil, kind, obj, uid, key, value)
	}
	d.mu.Lock()
	var k []byte
	switch gen {
	case d.gen:
		k = d.key
	case d.gen - 1:
		k = d.prev
	default:
		d.mu.Unlock()
		return ""
	}
	d.mu.Unlock()
	return digestWith(k, kind, obj, uid, key, value)
}

// digestWith is the HMAC-SHA256 of the value of key in obj, with k. 128
// bits: enough to tell values apart, no more to publish.
func digestWith(k []byte, kind string, obj types.NamespacedName, uid types.UID, key, value string) string {
	m := hmac.New(sha256.New, k)
	// Names, UIDs and data keys hold no NUL: the fields cannot run into each other.
	fmt.Fprintf(m, "%s\x00%s\x00%s\x00%s\x00%s\x00", kind, obj.Namespace, obj.Name, uid, key)
	m.Write([]byte(value))
	return hex.EncodeToString(m.Sum(nil)[:16])
}

func randomKey() []byte {
	k := make([]byte, digestKeyBytes)
	_, _ = rand.Read(k) // never fails (crypto/rand)
	return k
}
