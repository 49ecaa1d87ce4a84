// Package v1alpha1 holds the OutboxRelay API (group outbox.dev, version v1alpha1).
//
// +kubebuilder:object:generate=true
// +groupName=outbox.dev
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the API group and version of the OutboxRelay API.
	GroupVersion = schema.GroupVersion{Group: "outbox.dev", Version: "v1alpha1"}

	// SchemeBuilder registers the API types with a runtime.Scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds the API types to a runtime.Scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
