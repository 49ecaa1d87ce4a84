package v1alpha1

// DatabaseSpec says how the relay and the operator's backlog reads reach
// PostgreSQL beyond the DSN.
type DatabaseSpec struct {
	// TLS makes the relay and the operator's backlog reads connect over TLS
	// and verify the server's certificate and host name against a CA
	// (verify-full), whatever the DSN's sslmode; they never fall back to
	// plain text.
	// +optional
	TLS *DatabaseTLS `json:"tls,omitempty"`
}

// DatabaseTLS is the CA that signed PostgreSQL's certificate, and
// optionally a client certificate.
type DatabaseTLS struct {
	// CA is the PEM CA bundle, from a Secret or a ConfigMap.
	CA CABundleSource `json:"ca"`
	// ClientCertSecretRef names a kubernetes.io/tls Secret (tls.crt,
	// tls.key) presented to PostgreSQL for certificate authentication.
	// +optional
	ClientCertSecretRef *SecretReference `json:"clientCertSecretRef,omitempty"`
}

// DefaultCAKey is the key of a CA bundle in its Secret or ConfigMap.
const DefaultCAKey = "ca.crt"

// CABundleSource is a PEM CA bundle in a Secret or a ConfigMap.
// +kubebuilder:validation:XValidation:rule="has(self.secretRef) != has(self.configMapRef)",message="exactly one of secretRef and configMapRef"
type CABundleSource struct {
	// SecretRef is a Secret holding the bundle.
	// +optional
	SecretRef *KeyReference `json:"secretRef,omitempty"`
	// ConfigMapRef is a ConfigMap holding the bundle.
	// +optional
	ConfigMapRef *KeyReference `json:"configMapRef,omitempty"`
}

// KeyReference names one key of a Secret or ConfigMap in the OutboxRelay's namespace.
type KeyReference struct {
	// Name of the Secret or ConfigMap.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
	// Key holding the PEM bundle. Default: ca.crt.
	// +kubebuilder:default=ca.crt
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	// +optional
	Key string `json:"key,omitempty"`
}
