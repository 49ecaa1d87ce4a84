// Package v1alpha1 will hold the OutboxRelay API (group outbox.dev, version v1alpha1).
package v1alpha1
