package controllers

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"

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
// at random and lives as long as the process: the digests still tell a
// change of a value from a write of a Secret's metadata in memory, but none
// is recorded, so after a restart the first read of a Secret that was
// written since a relay's pods last rolled rolls them once (as before this
// key existed).
type digestKey struct {
	// secret is the Secret holding the key; zero: none.
	secret types.NamespacedName
	// reader reads it from the API server; writer fills it.
	reader client.Reader
	writer client.Writer

	mu   sync.Mutex
	key  []byte
	kept bool // key is secret's: digests taken with it outlive the process
}

// load reads (or makes) the key, once: later calls return at once. kept
// reports whether the key is the Secret's, so that digests taken with it
// may be recorded. A nil digestKey keys with an empty key and keeps
// nothing (the fake reconcilers of unit tests).
func (d *digestKey) load(ctx context.Context) (kept bool, err error) {
	if d == nil {
		return false, nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.key != nil {
		return d.kept, nil
	}
	if d.secret.Name == "" {
		d.key = randomKey()
		return false, nil
	}
	key, err := d.read(ctx)
	switch {
	case err == nil:
		d.key, d.kept = key, true
	case apierrors.IsNotFound(err) || apierrors.IsForbidden(err):
		// A configuration, not a passing failure: work without it.
		ctrl.LoggerFrom(ctx).Error(err, "cannot keep the digest key: an operator restart will roll, once, the relays whose Secrets were written since their pods last rolled",
			"secret", d.secret.String())
		d.key = randomKey()
	default:
		return false, fmt.Errorf("read the digest key from Secret %s: %w", d.secret, err)
	}
	return d.kept, nil
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
// ConfigMap, kind) with that UID: the object's identity is part of it, so
// two Secrets holding one password have two digests, and a re-created
// Secret's differ from the old one's. 128 bits: enough to tell values
// apart, no more to publish.
func (d *digestKey) sum(kind string, obj types.NamespacedName, uid types.UID, key, value string) string {
	var k []byte
	if d != nil {
		d.mu.Lock()
		k = d.key
		d.mu.Unlock()
	}
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
