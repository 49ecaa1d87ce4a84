package controllers

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// This file is everything the operator learns from Secrets. It caches no
// Secret data: it watches Secrets as metadata only (to know when a
// referenced one changes), and reads a referenced Secret directly from the
// API server, uncached, to check that the keys the pods need exist. Of the
// data it keeps only the DSN, in memory, for the one connection that reads
// the relay's backlog.

// secretInputs is what the relay's pods depend on from the referenced Secrets.
type secretInputs struct {
	// Versions names each referenced Secret with its UID and
	// resourceVersion: a new version (or a re-created Secret) rolls the pods,
	// and nothing in the pod template is derived from a Secret's data.
	Versions string
	// TLSCA and TLSClientCert say which files the TLS Secret provides.
	TLSCA, TLSClientCert bool
	// DSN is the DSN itself, which the backlog observer connects with. It
	// stays in memory: it is never hashed, logged or written anywhere.
	DSN string
}

// readSecrets reads every referenced Secret through the uncached API reader
// and checks that the keys the pods need exist. A missing Secret or key is
// a problem to wait on; any other error is transient.
func (r *OutboxRelayReconciler) readSecrets(ctx context.Context, relay *outboxv1alpha1.OutboxRelay) (secretInputs, *problem, error) {
	var in secretInputs
	versions := map[string]string{}
	get := func(field, name string) (*corev1.Secret, *problem, error) {
		s := &corev1.Secret{}
		err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: relay.Namespace, Name: name}, s)
		if apierrors.IsNotFound(err) {
			return nil, &problem{reason: outboxv1alpha1.ReasonSecretNotFound, requeue: true,
				message: fmt.Sprintf("Secret %s (%s) not found", name, field)}, nil
		}
		if err != nil {
			return nil, nil, fmt.Errorf("get Secret %s: %w", name, err)
		}
		versions[s.Name] = fmt.Sprintf("%s/%s/%s", s.Name, s.UID, s.ResourceVersion)
		return s, nil, nil
	}
	needKeys := func(field string, s *corev1.Secret, keys ...string) *problem {
		for _, k := range keys {
			if _, ok := s.Data[k]; !ok {
				return &problem{reason: outboxv1alpha1.ReasonSecretKeyMissing, requeue: true,
					message: fmt.Sprintf("Secret %s has no key %q (%s)", s.Name, k, field)}
			}
		}
		return nil
	}

	ref := relay.Spec.DSNSecretRef
	s, prob, err := get("spec.dsnSecretRef", ref.Name)
	if prob != nil || err != nil {
		return in, prob, err
	}
	if prob := needKeys("spec.dsnSecretRef.key", s, cmp.Or(ref.Key, outboxv1alpha1.DefaultDSNKey)); prob != nil {
		return in, prob, nil
	}
	in.DSN = string(s.Data[cmp.Or(ref.Key, outboxv1alpha1.DefaultDSNKey)])
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
	}
	if sasl := relay.Spec.Kafka.SASL; sasl != nil {
		ref := sasl.CredentialsSecretRef
		s, prob, err := get("spec.kafka.sasl.credentialsSecretRef", ref.Name)
		if prob != nil || err != nil {
			return in, prob, err
		}
		if prob := needKeys("spec.kafka.sasl.credentialsSecretRef", s,
			cmp.Or(ref.UsernameKey, outboxv1alpha1.DefaultSASLUsernameKey),
			cmp.Or(ref.PasswordKey, outboxv1alpha1.DefaultSASLPasswordKey)); prob != nil {
			return in, prob, nil
		}
	}
	names := referencedSecrets(relay)
	parts := make([]string, len(names))
	for i, name := range names {
		parts[i] = versions[name]
	}
	in.Versions = strings.Join(parts, ",")
	return in, nil, nil
}

// referencedSecrets are the names of the Secrets a relay references, sorted.
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

// stripSecret is the cache transform for Secrets. The manager watches them as
// metadata only, but metadata can still carry a Secret's data: `kubectl
// apply` copies the whole object, data included, into the
// last-applied-configuration annotation. Only names, UIDs, labels and
// versions stay; a full Secret, should one ever reach the cache, loses its
// data too.
func stripSecret(obj any) (any, error) {
	if m, err := meta.Accessor(obj); err == nil {
		m.SetAnnotations(nil)
		m.SetManagedFields(nil)
	}
	if s, ok := obj.(*corev1.Secret); ok {
		s.Data, s.StringData = nil, nil
	}
	return obj, nil
}

// ManagerOptions returns opts with the cache and client settings the
// OutboxRelay reconciler relies on to cache no Secret data: the client never
// serves Secrets from the cache (so no code path can start an informer
// holding every Secret's data), and whatever the cache keeps of a Secret
// goes through stripSecret.
func ManagerOptions(opts ctrl.Options) ctrl.Options {
	opts.Cache.ByObject = maps.Clone(opts.Cache.ByObject)
	if opts.Cache.ByObject == nil {
		opts.Cache.ByObject = map[client.Object]cache.ByObject{}
	}
	opts.Cache.ByObject[&corev1.Secret{}] = cache.ByObject{Transform: stripSecret}
	if opts.Client.Cache == nil {
		opts.Client.Cache = &client.CacheOptions{}
	} else {
		c := *opts.Client.Cache
		opts.Client.Cache = &c
	}
	opts.Client.Cache.DisableFor = append(slices.Clone(opts.Client.Cache.DisableFor), &corev1.Secret{})
	return opts
}
