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

	// Auth is how the relay and the operator's backlog reads log in: the
	// DSN's password (the default) or a token of the pod's cloud identity.
	// +optional
	Auth *DatabaseAuth `json:"auth,omitempty"`
}

// DatabaseAuthMethod is how the relay logs in to PostgreSQL.
// +kubebuilder:validation:Enum=Password;AWSRDSIAM;GCPCloudSQLIAM;AzureAD
type DatabaseAuthMethod string

const (
	// DatabaseAuthPassword logs in with the DSN's password.
	DatabaseAuthPassword DatabaseAuthMethod = "Password"
	// DatabaseAuthAWSRDSIAM logs in with an RDS IAM token signed with the
	// pod's AWS identity (IRSA or EKS Pod Identity).
	DatabaseAuthAWSRDSIAM DatabaseAuthMethod = "AWSRDSIAM"
	// DatabaseAuthGCPCloudSQLIAM logs in with an access token of the pod's
	// Google identity (Workload Identity), for Cloud SQL IAM users.
	DatabaseAuthGCPCloudSQLIAM DatabaseAuthMethod = "GCPCloudSQLIAM"
	// DatabaseAuthAzureAD logs in with a Microsoft Entra ID token of the
	// pod's Azure identity (Workload Identity).
	DatabaseAuthAzureAD DatabaseAuthMethod = "AzureAD"
)

// DatabaseAuth says how to log in to PostgreSQL. With a token method the
// DSN names the database user and no password; the token is fetched for
// each new connection and refreshed before it expires, and the connection
// must use TLS (spec.database.tls, or sslmode=require or stricter in the
// DSN). The relay pods get the identity of spec.template.pod.serviceAccountName;
// the operator's backlog reads use the operator's own.
// +kubebuilder:validation:XValidation:rule="!has(self.aws) || self.method == 'AWSRDSIAM'",message="spec.database.auth.aws applies only to method AWSRDSIAM",fieldPath=".aws"
type DatabaseAuth struct {
	// Method is Password (the default), AWSRDSIAM, GCPCloudSQLIAM or AzureAD.
	// +kubebuilder:default=Password
	// +optional
	Method DatabaseAuthMethod `json:"method,omitempty"`

	// AWS holds the settings of AWSRDSIAM.
	// +optional
	AWS *AWSDatabaseAuth `json:"aws,omitempty"`
}

// AWSDatabaseAuth is the AWSRDSIAM settings.
type AWSDatabaseAuth struct {
	// Region of the RDS instance, e.g. eu-west-1. Default: the pod's
	// AWS_REGION, which EKS sets with a pod identity.
	// +kubebuilder:validation:MaxLength=32
	// +kubebuilder:validation:Pattern=`^[a-z]{2}(-[a-z]+)+-[0-9]+$`
	// +optional
	Region string `json:"region,omitempty"`
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
