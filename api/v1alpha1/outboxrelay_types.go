package v1alpha1

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Condition types of an OutboxRelay.
const (
	// ConditionReady is True when the relay runs with every desired replica ready.
	ConditionReady = "Ready"
	// ConditionProgressing is True while the relay Deployment rolls out or scales.
	ConditionProgressing = "Progressing"
	// ConditionDegraded is True when something needs a human: an invalid spec, a
	// missing Secret or key, a Deployment that cannot make progress, or rows
	// waiting past spec.lagThreshold (reason Lagging).
	ConditionDegraded = "Degraded"
	// ConditionReconciling is True while the relay is not yet where its spec
	// says (rolling out, scaling, replicas not ready). It and ConditionStalled
	// are the abnormal-true conditions kstatus (and so Flux and kubectl-style
	// waits) reads; they speak of the spec being carried out, not of events
	// flowing.
	ConditionReconciling = "Reconciling"
	// ConditionStalled is True when progress needs a human: an invalid spec,
	// a missing Secret, a Deployment past its progress deadline, or rows
	// waiting past spec.lagThreshold with none published (NotPublishing,
	// and NoReadyReplicas once those replicas turned unready, or when none
	// has been ready past the Deployment's progress deadline).
	ConditionStalled = "Stalled"
	// ConditionLagging is True when the oldest row a relay can claim has
	// waited longer than spec.lagThreshold; Unknown before the operator first
	// read the backlog or while it cannot.
	ConditionLagging = "Lagging"
	// ConditionReconciliationPaused is True while the OutboxRelay carries
	// ReconcileAnnotation: ReconcileDisabled. The operator then changes
	// nothing of it or its children; the relay keeps running as it is.
	ConditionReconciliationPaused = "ReconciliationPaused"
)

// ReconcileAnnotation set to ReconcileDisabled pauses the operator's work on
// an OutboxRelay (Strimzi's pause): its Deployment, Service and
// PodDisruptionBudget stay as they are (not scaled to zero, not rolled),
// spec changes wait, and status.conditions says so. Removing the annotation
// resumes reconciliation with the spec as it is then.
const (
	ReconcileAnnotation = "outbox.dev/reconcile"
	ReconcileDisabled   = "disabled"
)

// ReconciliationPaused reports whether r carries ReconcileAnnotation: ReconcileDisabled.
func (r *OutboxRelay) ReconciliationPaused() bool {
	return r.Annotations[ReconcileAnnotation] == ReconcileDisabled
}

// Condition reasons of an OutboxRelay.
const (
	// ReasonAvailable: every desired replica is ready.
	ReasonAvailable = "Available"
	// ReasonSuspended: spec.suspend is true; the relay runs zero replicas.
	ReasonSuspended = "Suspended"
	// ReasonReconcileDisabled: the OutboxRelay carries ReconcileAnnotation: ReconcileDisabled.
	ReasonReconcileDisabled = "ReconcileDisabled"
	// ReasonScaledToZero: spec.replicas is 0.
	ReasonScaledToZero = "ScaledToZero"
	// ReasonInvalidSpec: the spec breaks a rule the schema cannot express (the
	// relay would refuse its settings, spec.image is not under an allowed
	// prefix, a reserved pod label or annotation), or the API server refused a
	// child built from it; no pods are built from it. Fix the spec.
	ReasonInvalidSpec = "InvalidSpec"
	// ReasonSecretNotFound: a Secret the spec references does not exist.
	ReasonSecretNotFound = "SecretNotFound"
	// ReasonSecretKeyMissing: a referenced Secret exists but lacks the key.
	ReasonSecretKeyMissing = "SecretKeyMissing"
	// ReasonDeploymentUnavailable: fewer replicas are ready than desired.
	ReasonDeploymentUnavailable = "DeploymentUnavailable"
	// ReasonRollingOut: the Deployment has not yet brought every replica to the
	// current pod template.
	ReasonRollingOut = "RollingOut"
	// ReasonRolloutComplete: every replica runs the current pod template.
	ReasonRolloutComplete = "RolloutComplete"
	// ReasonProgressDeadlineExceeded: the Deployment reports that its rollout is stuck.
	ReasonProgressDeadlineExceeded = "ProgressDeadlineExceeded"
	// ReasonReplicaFailure: the Deployment cannot create its pods (a service
	// account that does not exist, a ResourceQuota, a Pod Security
	// admission refusal); the message is the Deployment's.
	ReasonReplicaFailure = "ReplicaFailure"
	// ReasonAsExpected: nothing is degraded.
	ReasonAsExpected = "AsExpected"
	// ReasonResourceConflict: an object with a child's name exists and another
	// owner controls it; the operator leaves it alone.
	ReasonResourceConflict = "ResourceConflict"
	// ReasonChildRefused: the API server refused to write a child for a
	// reason other than its content (an admission webhook or policy, a
	// ResourceQuota, the operator's own permissions); the operator tries
	// again at its next pass.
	ReasonChildRefused = "ChildRefused"
	// ReasonLagging: the Ready and Degraded reason while Lagging is True.
	ReasonLagging = "Lagging"
	// ReasonFlowing: no row a relay can claim is older than spec.lagThreshold.
	ReasonFlowing = "Flowing"
	// ReasonFallingBehind: rows are published, but the oldest waiting row is
	// older than spec.lagThreshold.
	ReasonFallingBehind = "FallingBehind"
	// ReasonNotPublishing: rows wait past spec.lagThreshold, replicas are
	// ready, and nothing was published in the last minute.
	ReasonNotPublishing = "NotPublishing"
	// ReasonNoReadyReplicas: rows wait past spec.lagThreshold and no relay
	// replica is ready.
	ReasonNoReadyReplicas = "NoReadyReplicas"
	// ReasonNotStreaming: with spec.capture.writerDeletes the events wait
	// in the replication slot's WAL, not in the table, and no relay pod
	// streams from the slot.
	ReasonNotStreaming = "NotStreaming"
	// ReasonObserving: the operator has not read the backlog yet.
	ReasonObserving = "Observing"
	// ReasonBacklogUnavailable: the operator cannot read the backlog (no
	// connection, the table missing, a permission refused, a timeout).
	ReasonBacklogUnavailable = "BacklogUnavailable"
	// ReasonBacklogNotRead: the operator does not read the backlog by
	// choice: spec.database.auth logs in with a token of the cloud
	// identity, and the operator's own identity logs in only where its
	// --database-token-logins allows.
	ReasonBacklogNotRead = "BacklogNotRead"
	// ReasonCaughtUp: the event reason when Lagging turns False.
	ReasonCaughtUp = "CaughtUp"
	// ReasonScaledUp and ReasonScaledDown: the event reasons of an autoscaling decision.
	ReasonScaledUp   = "ScaledUp"
	ReasonScaledDown = "ScaledDown"
)

// BacklogBound is how many unpublished rows the operator counts exactly; above
// it, status.backlog.pending is an estimate.
const BacklogBound = 100000

// Default keys of the referenced Secrets. The `+kubebuilder:default` markers
// below repeat them as literals (markers cannot name a constant); a test
// compares the generated CRD's defaults with these, and the operator falls
// back to them for objects that never went through the API server.
const (
	// DefaultDSNKey is the default of dsnSecretRef.key.
	DefaultDSNKey = "dsn"
	// DefaultSASLUsernameKey is the default of credentialsSecretRef.usernameKey.
	DefaultSASLUsernameKey = "username"
	// DefaultSASLPasswordKey is the default of credentialsSecretRef.passwordKey.
	DefaultSASLPasswordKey = "password"
)

// Defaults of the fields the operator itself reads. As above, the
// `+kubebuilder:default` markers repeat them as literals, a test compares
// the generated CRD's defaults with these, and the operator falls back to
// them for objects that never went through the API server.
const (
	// DefaultReplicas is the default of spec.replicas.
	DefaultReplicas int32 = 1
	// DefaultMinReplicas is the default of spec.autoscaling.minReplicas.
	DefaultMinReplicas int32 = 1
	// DefaultScaleDownStabilization is the default of
	// spec.autoscaling.scaleDownStabilization.
	DefaultScaleDownStabilization = 5 * time.Minute
	// DefaultBacklogInterval is the default of spec.backlog.interval.
	DefaultBacklogInterval = 15 * time.Second
	// DefaultLagThreshold is the default of spec.lagThreshold.
	DefaultLagThreshold = time.Minute
)

// OrderingMode says which ordering guarantee the relay gives.
// +kubebuilder:validation:Enum=None;PartitionKey
type OrderingMode string

const (
	// OrderingNone publishes rows as replicas claim them (SKIP LOCKED): no loss,
	// no duplicates in steady state, no per-key order across replicas.
	OrderingNone OrderingMode = "None"
	// OrderingPartitionKey keeps the order of rows that share a partition key.
	OrderingPartitionKey OrderingMode = "PartitionKey"
)

// OnPublishMode is what the relay does to a row Kafka acknowledged.
// +kubebuilder:validation:Enum=Mark;Delete
type OnPublishMode string

const (
	// OnPublishMark sets published_at; the row stays until pruned.
	OnPublishMark OnPublishMode = "Mark"
	// OnPublishDelete deletes the row in the claim transaction.
	OnPublishDelete OnPublishMode = "Delete"
)

// RetentionSpec says what becomes of published rows.
type RetentionSpec struct {
	// OnPublish is Mark (set published_at, the default) or Delete (delete
	// the row in the claim transaction: one write less per row, nothing to
	// prune, and no published row to look at later).
	// +kubebuilder:default=Mark
	// +optional
	OnPublish OnPublishMode `json:"onPublish,omitempty"`

	// KeepPublishedFor prunes published rows older than this Go duration,
	// 1m to 87600h; empty keeps them. One relay replica prunes at a time,
	// in bounded transactions that never touch an unpublished row.
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('1m0s') && duration(self) <= duration('87600h0m0s'))",message="spec.retention.keepPublishedFor must be a duration between 1m and 87600h",messageExpression="'spec.retention.keepPublishedFor: ' + self + ' is not a duration between 1m and 87600h'"
	// +optional
	KeepPublishedFor string `json:"keepPublishedFor,omitempty"`

	// PruneBatchSize is the most rows one prune transaction deletes, 10 to
	// 100000. Default: 1000.
	// +kubebuilder:default=1000
	// +kubebuilder:validation:Minimum=10
	// +kubebuilder:validation:Maximum=100000
	// +optional
	PruneBatchSize *int32 `json:"pruneBatchSize,omitempty"`
}

// RecordFormat is the layout of the records the relay publishes.
// +kubebuilder:validation:Enum=Raw;CloudEvents;CloudEventsStructured
type RecordFormat string

const (
	// FormatRaw: the payload as the value, the relay's headers and the row's own.
	FormatRaw RecordFormat = "Raw"
	// FormatCloudEvents: a CloudEvent in the Kafka binding's binary content
	// mode (ce_* headers, content-type), plus the Raw format's headers.
	FormatCloudEvents RecordFormat = "CloudEvents"
	// FormatCloudEventsStructured: a CloudEvent in the structured content
	// mode (application/cloudevents+json), plus the Raw format's headers.
	FormatCloudEventsStructured RecordFormat = "CloudEventsStructured"
)

// RecordTimestamp is what the timestamp of each record is.
// +kubebuilder:validation:Enum=CreatedAt;Publish
type RecordTimestamp string

const (
	// RecordTimestampCreatedAt: the row's created_at, when the event happened.
	RecordTimestampCreatedAt RecordTimestamp = "CreatedAt"
	// RecordTimestampPublish: when the relay publishes the record.
	RecordTimestampPublish RecordTimestamp = "Publish"
)

// Compression is the codec of the relay's produce requests, as Kafka names it.
// +kubebuilder:validation:Enum=none;gzip;snappy;lz4;zstd
type Compression string

// TracingSpec turns on the relay's OpenTelemetry spans, exported over OTLP/HTTP.
type TracingSpec struct {
	// OTLPEndpoint is the OTLP/HTTP endpoint the relay sends spans to, e.g.
	// http://otel-collector.observability:4318 (OTEL_EXPORTER_OTLP_ENDPOINT).
	// +kubebuilder:validation:MaxLength=512
	// +kubebuilder:validation:Pattern=`^https?://[^\s]+$`
	OTLPEndpoint string `json:"otlpEndpoint"`
}

// SASLMechanism is a Kafka SASL mechanism.
// +kubebuilder:validation:Enum=PLAIN;SCRAM-SHA-256;SCRAM-SHA-512;OAUTHBEARER;AWS_MSK_IAM
type SASLMechanism string

const (
	// SASLPlain is SASL/PLAIN; use it with TLS only.
	SASLPlain SASLMechanism = "PLAIN"
	// SASLScramSHA256 is SASL/SCRAM-SHA-256.
	SASLScramSHA256 SASLMechanism = "SCRAM-SHA-256"
	// SASLScramSHA512 is SASL/SCRAM-SHA-512.
	SASLScramSHA512 SASLMechanism = "SCRAM-SHA-512"
	// SASLOAuthBearer is SASL/OAUTHBEARER with a token from a file or a
	// token endpoint (oauth); use it with TLS only.
	SASLOAuthBearer SASLMechanism = "OAUTHBEARER"
	// SASLAWSMSKIAM is Amazon MSK's IAM authentication, signed with the
	// relay pod's AWS identity; MSK serves it over TLS only.
	SASLAWSMSKIAM SASLMechanism = "AWS_MSK_IAM"
)

// TopicName is a Kafka topic name: 1 to 249 characters from [a-zA-Z0-9._-], not "." or "..".
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=249
// +kubebuilder:validation:Pattern=`^[a-zA-Z0-9._-]+$`
// +kubebuilder:validation:XValidation:rule="self != '.' && self != '..'",message="a Kafka topic name must not be '.' or '..'"
type TopicName string

// BrokerAddress is a Kafka bootstrap broker as host:port (an IPv6 host in brackets).
// +kubebuilder:validation:MaxLength=261
// +kubebuilder:validation:Pattern=`^(\[[0-9a-fA-F:.]+\]|[a-zA-Z0-9]([-a-zA-Z0-9.]*[a-zA-Z0-9])?):[0-9]{1,5}$`
// +kubebuilder:validation:XValidation:rule="!self.matches(':[0-9]{1,5}$') || (int(self.substring(self.lastIndexOf(':') + 1)) >= 1 && int(self.substring(self.lastIndexOf(':') + 1)) <= 65535)",message="a broker port must be between 1 and 65535"
type BrokerAddress string

// SecretKeyReference names a key of a Secret in the OutboxRelay's namespace.
type SecretKeyReference struct {
	// Name of the Secret.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`

	// Key in the Secret's data. Default: dsn.
	// +kubebuilder:default=dsn
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	// +optional
	Key string `json:"key,omitempty"`
}

// SecretReference names a Secret in the OutboxRelay's namespace.
type SecretReference struct {
	// Name of the Secret.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

// SASLCredentialsReference names the Secret and keys holding SASL credentials.
type SASLCredentialsReference struct {
	// Name of the Secret.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`

	// UsernameKey is the key holding the user name. Default: username.
	// +kubebuilder:default=username
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	// +optional
	UsernameKey string `json:"usernameKey,omitempty"`

	// PasswordKey is the key holding the password. Default: password.
	// +kubebuilder:default=password
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	// +optional
	PasswordKey string `json:"passwordKey,omitempty"`
}

// KafkaSpec says how the relay reaches Kafka.
// +kubebuilder:validation:XValidation:rule="!has(self.sasl) || self.sasl.mechanism != 'PLAIN' || has(self.tls)",message="SASL PLAIN sends the password in clear text: set spec.kafka.tls (tls: {} uses the system roots) or use SCRAM",fieldPath=".sasl.mechanism"
// +kubebuilder:validation:XValidation:rule="!has(self.sasl) || !(self.sasl.mechanism in ['OAUTHBEARER', 'AWS_MSK_IAM']) || has(self.tls)",message="OAUTHBEARER sends a bearer token in clear text, and MSK serves AWS_MSK_IAM only over TLS: set spec.kafka.tls (tls: {} uses the system roots)",fieldPath=".sasl.mechanism"
type KafkaSpec struct {
	// Brokers are the bootstrap brokers, each host:port.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=64
	// +listType=atomic
	Brokers []BrokerAddress `json:"brokers"`

	// TLS, when present, makes the relay talk TLS to the brokers.
	// +optional
	TLS *KafkaTLS `json:"tls,omitempty"`

	// SASL, when present, makes the relay authenticate with SASL.
	// +optional
	SASL *KafkaSASL `json:"sasl,omitempty"`

	// Compression is the codec of the relay's produce requests: none (the
	// default), gzip, snappy, lz4 or zstd.
	// +kubebuilder:default=none
	// +optional
	Compression Compression `json:"compression,omitempty"`
}

// KafkaTLS turns on TLS to the brokers. Without a secretRef the relay trusts the
// system roots and presents no client certificate.
type KafkaTLS struct {
	// SecretRef names a Secret mounted read-only at /etc/relay/tls. Its key
	// ca.crt, when present, is the CA bundle the relay trusts; its keys tls.crt
	// and tls.key, when present (both or neither), are the client certificate
	// for mutual TLS (a kubernetes.io/tls Secret fits).
	// +optional
	SecretRef *SecretReference `json:"secretRef,omitempty"`
}

// KafkaSASL makes the relay authenticate to the brokers.
// +kubebuilder:validation:XValidation:rule="!(self.mechanism in ['PLAIN', 'SCRAM-SHA-256', 'SCRAM-SHA-512']) || has(self.credentialsSecretRef)",message="PLAIN and SCRAM need credentialsSecretRef (the user name and password)",fieldPath=".credentialsSecretRef"
// +kubebuilder:validation:XValidation:rule="(self.mechanism == 'OAUTHBEARER') == has(self.oauth)",message="oauth goes with mechanism OAUTHBEARER, which needs it",fieldPath=".oauth"
// +kubebuilder:validation:XValidation:rule="!has(self.aws) || self.mechanism == 'AWS_MSK_IAM'",message="aws applies only to mechanism AWS_MSK_IAM",fieldPath=".aws"
// +kubebuilder:validation:XValidation:rule="!has(self.oauth) || !has(self.oauth.tokenEndpoint) || has(self.credentialsSecretRef)",message="oauth.tokenEndpoint needs credentialsSecretRef: the client id (usernameKey) and secret (passwordKey)",fieldPath=".credentialsSecretRef"
type KafkaSASL struct {
	// Mechanism is PLAIN (only together with tls), SCRAM-SHA-256,
	// SCRAM-SHA-512, OAUTHBEARER (with tls and oauth) or AWS_MSK_IAM (with tls).
	Mechanism SASLMechanism `json:"mechanism"`

	// CredentialsSecretRef names the Secret holding the user name and
	// password (PLAIN, SCRAM), or the client id and secret of
	// oauth.tokenEndpoint; they reach the relay as environment variables
	// from the Secret, never as arguments.
	// +optional
	CredentialsSecretRef *SASLCredentialsReference `json:"credentialsSecretRef,omitempty"`

	// OAuth is where OAUTHBEARER's token comes from.
	// +optional
	OAuth *KafkaOAuth `json:"oauth,omitempty"`

	// AWS holds AWS_MSK_IAM's settings.
	// +optional
	AWS *KafkaAWS `json:"aws,omitempty"`
}

// KafkaOAuth is where the OAUTHBEARER token comes from: a file the platform
// keeps fresh, or an OAuth 2.0 token endpoint.
// +kubebuilder:validation:XValidation:rule="has(self.tokenFile) != has(self.tokenEndpoint)",message="exactly one of tokenFile and tokenEndpoint"
type KafkaOAuth struct {
	// TokenFile is a file in the relay container holding the token, read
	// for each new connection: a projected service account token or a file
	// a sidecar refreshes, mounted through spec.template.
	// +kubebuilder:validation:MaxLength=4096
	// +kubebuilder:validation:Pattern=`^/`
	// +optional
	TokenFile string `json:"tokenFile,omitempty"`

	// TokenEndpoint is an OAuth 2.0 token endpoint (client credentials
	// grant), https or http to the pod's loopback address; the client id
	// and secret come from credentialsSecretRef. A token is reused until
	// shortly before it expires.
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="self.matches(r'^([A-Za-z0-9._~:/?#\\[\\]@!$&()*+,;=-]|%[0-9A-Fa-f]{2})+$') && self.matches(r'^(https://([A-Za-z0-9._~:-]*@)?[A-Za-z0-9._~-]+|http://(localhost|127[.]0[.]0[.]1|\\[::1\\]))(:[0-9]*)?([/?#]|$)')",message="an https URL with a host name, or http to the pod's loopback address: the client secret never crosses the network in clear text"
	// +optional
	TokenEndpoint string `json:"tokenEndpoint,omitempty"`

	// Scope is asked of the token endpoint (space-separated).
	// +kubebuilder:validation:MaxLength=1024
	// +optional
	Scope string `json:"scope,omitempty"`
}

// KafkaAWS is AWS_MSK_IAM's settings.
type KafkaAWS struct {
	// Region of the MSK cluster, e.g. eu-west-1. Default: the pod's
	// AWS_REGION, which EKS sets with a pod identity.
	// +kubebuilder:validation:MaxLength=32
	// +kubebuilder:validation:Pattern=`^[a-z]{2}(-[a-z]+)+-[0-9]+$`
	// +optional
	Region string `json:"region,omitempty"`
}

// AutoscalingSpec sizes the relay from its backlog: the desired replicas
// are the most any set target asks for, at least one while a row waits or
// is held, within [minReplicas, maxReplicas]. Scaling up takes effect at once; scaling
// down follows the highest count asked for during scaleDownStabilization.
// +kubebuilder:validation:XValidation:rule="self.maxReplicas >= (has(self.minReplicas) ? self.minReplicas : 1)",message="spec.autoscaling.maxReplicas must be at least minReplicas",fieldPath=".maxReplicas"
// +kubebuilder:validation:XValidation:rule="has(self.pendingPerReplica) || has(self.oldestAge)",message="spec.autoscaling needs a target: pendingPerReplica, oldestAge or both"
type AutoscalingSpec struct {
	// MinReplicas is the fewest relay pods, 0 allowed: an idle relay then runs
	// none, and the first waiting row brings one back within one
	// spec.backlog.interval. A relay with held rows (other than unroutable)
	// or with spec.capture.mode LogicalReplication keeps one. Default: 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	// +optional
	MinReplicas *int32 `json:"minReplicas,omitempty"`

	// MaxReplicas is the most relay pods.
	// +kubebuilder:validation:Minimum=1
	MaxReplicas int32 `json:"maxReplicas"`

	// PendingPerReplica asks for one replica per this many waiting rows
	// (status.backlog.pending).
	// +kubebuilder:validation:Minimum=1
	// +optional
	PendingPerReplica *int64 `json:"pendingPerReplica,omitempty"`

	// OldestAge asks for more replicas in proportion while the oldest
	// waiting row is older than this (status.backlog.oldestAge), a Go
	// duration between 1s and 24h: 48s against 10s with one replica asks for five.
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('1s') && duration(self) <= duration('24h'))",message="spec.autoscaling.oldestAge must be a duration between 1s and 24h",messageExpression="'spec.autoscaling.oldestAge: ' + self + ' is not a duration between 1s and 24h'"
	// +optional
	OldestAge string `json:"oldestAge,omitempty"`

	// ScaleDownStabilization is how long a lower replica count must be all
	// that is asked for before the relay scales down to it, a Go duration
	// between 0s and 1h. Default: 5m.
	// +kubebuilder:default="5m"
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || duration(self) <= duration('1h')",message="spec.autoscaling.scaleDownStabilization must be a duration between 0s and 1h",messageExpression="'spec.autoscaling.scaleDownStabilization: ' + self + ' is not a duration between 0s and 1h'"
	// +optional
	ScaleDownStabilization string `json:"scaleDownStabilization,omitempty"`
}

// BacklogSpec says how the operator observes the outbox table.
type BacklogSpec struct {
	// Interval between two reads of the backlog, a Go duration between 5s
	// and 1h. Each read is one bounded query over one connection. Default: 15s.
	// +kubebuilder:default="15s"
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('5s') && duration(self) <= duration('1h'))",message="spec.backlog.interval must be a duration between 5s and 1h",messageExpression="'spec.backlog.interval: ' + self + ' is not a duration between 5s and 1h'"
	// +optional
	Interval string `json:"interval,omitempty"`
}

// OutboxRelaySpec is the desired state of an OutboxRelay.
// +kubebuilder:validation:XValidation:rule="!has(self.deadLetterTopic) || !self.topics.exists(k, self.topics[k] == self.deadLetterTopic)",message="spec.deadLetterTopic must not be one of the topics in spec.topics",fieldPath=".deadLetterTopic"
// +kubebuilder:validation:XValidation:rule="!has(self.capture) || !has(self.capture.mode) || self.capture.mode != 'LogicalReplication' || !has(self.ordering) || self.ordering != 'PartitionKey'",message="spec.capture.mode LogicalReplication publishes in commit order from one streaming pod and does not combine with spec.ordering PartitionKey",fieldPath=".capture.mode"
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.capture) || !has(oldSelf.capture.writerDeletes) || !oldSelf.capture.writerDeletes || (has(self.capture) && has(self.capture.mode) && self.capture.mode == 'LogicalReplication' && (has(self.table) ? self.table : 'outbox') == (has(oldSelf.table) ? oldSelf.table : 'outbox'))",message="spec.capture.writerDeletes: the events its writers deleted are only in the table's replication slot until the relay publishes them, which polling or another table's relay never does; set writerDeletes: false first, and switch to Poll or change spec.table once status.backlog.slot.confirmedLag is near zero",fieldPath=".capture"
// +kubebuilder:validation:XValidation:rule="!has(self.capture) || !has(self.capture.writerDeletes) || !self.capture.writerDeletes || !has(self.autoscaling)",message="spec.autoscaling does not combine with spec.capture.writerDeletes: the writers leave no backlog in the table to scale by, and with no pod streaming the events would wait in the WAL",fieldPath=".autoscaling"
type OutboxRelaySpec struct {
	// DSNSecretRef names the Secret key holding the PostgreSQL DSN. The DSN
	// reaches the relay only as the RELAY_DSN environment variable from this Secret.
	DSNSecretRef SecretKeyReference `json:"dsnSecretRef"`

	// Database says how to reach PostgreSQL beyond the DSN: TLS that
	// verifies the server.
	// +optional
	Database *DatabaseSpec `json:"database,omitempty"`

	// Table is the outbox table, optionally schema-qualified (schema.table);
	// each part a plain lower-case PostgreSQL identifier ([a-z_][a-z0-9_]*)
	// of at most 63 characters, so it never needs quoting. Default: outbox.
	// +kubebuilder:default=outbox
	// +kubebuilder:validation:MaxLength=127
	// +kubebuilder:validation:Pattern=`^[a-z_][a-z0-9_]{0,62}(\.[a-z_][a-z0-9_]{0,62})?$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('(^|[.])([a-z_][a-z0-9_]{57}_held|[a-z_][a-z0-9_]{52}_event_ids)$')",message="spec.table: a name of 63 characters ending in _held or _event_ids is the name of its own held or event id table; shorten it"
	// +optional
	Table string `json:"table,omitempty"`

	// BatchSize is the most rows one claim takes, 1 to 10000. Default: 50.
	// +kubebuilder:default=50
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10000
	// +optional
	BatchSize *int32 `json:"batchSize,omitempty"`

	// MaxBatchBytes is the most payload and header bytes one claim takes, 65536 (64 KiB)
	// to 67108864 (64 MiB); a larger row is claimed alone. Default: 4194304 (4 MiB).
	// +kubebuilder:default=4194304
	// +kubebuilder:validation:Minimum=65536
	// +kubebuilder:validation:Maximum=67108864
	// +optional
	MaxBatchBytes *int32 `json:"maxBatchBytes,omitempty"`

	// MaxInFlight is how many batches a relay has in flight, 1 or 2. With 2
	// (the default) and ordering None the relay claims and publishes the
	// next batch while a full one commits; PartitionKey runs one at a time
	// either way. After a crash up to this many batches are published again.
	// +kubebuilder:default=2
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=2
	// +optional
	MaxInFlight *int32 `json:"maxInFlight,omitempty"`

	// Notify makes the relays also claim as soon as a writer that notifies
	// (the outbox package's WithNotify) commits, besides polling. Off by
	// default: PostgreSQL delivers notifications under a lock that
	// serializes the notifying writers' commits.
	// +optional
	Notify bool `json:"notify,omitempty"`

	// Capture is how the relays learn of new rows: polling (the default)
	// or a logical replication slot.
	// +optional
	Capture *CaptureSpec `json:"capture,omitempty"`

	// Retention says what becomes of published rows. Default: they are
	// marked (published_at) and kept.
	// +optional
	Retention *RetentionSpec `json:"retention,omitempty"`

	// StallTimeout is how long a relay may go without completing a batch,
	// or with rows waiting and nothing published, before its /readyz fails
	// (the pod turns not ready, outbox_relay_stalled is set), a Go duration
	// between 5s and 24h. Default: 2m.
	// +kubebuilder:default="2m0s"
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('5s') && duration(self) <= duration('24h0m0s'))",message="spec.stallTimeout must be a duration between 5s and 24h",messageExpression="'spec.stallTimeout: ' + self + ' is not a duration between 5s and 24h'"
	// +optional
	StallTimeout string `json:"stallTimeout,omitempty"`

	// PollInterval is the longest sleep between claims that find nothing
	// (each such claim in a row doubles the sleep, from linger up to this),
	// a Go duration between 10ms and 1h. Default: 200ms.
	// +kubebuilder:default="200ms"
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('10ms') && duration(self) <= duration('1h0m0s'))",message="spec.pollInterval must be a duration between 10ms and 1h",messageExpression="'spec.pollInterval: ' + self + ' is not a duration between 10ms and 1h'"
	// +optional
	PollInterval string `json:"pollInterval,omitempty"`

	// Linger is how long a polling relay waits after a claim that found
	// rows but did not fill its batch, so the rows still arriving go out
	// together: longer means fewer, fuller batches (less CPU and fewer
	// database transactions per event) and up to that much more latency.
	// With logical replication it is the longest the first streamed row
	// waits for more while rows keep arriving.
	// A Go duration between 1ms and 1s; at most pollInterval takes effect.
	// Default: 5ms.
	// +kubebuilder:default="5ms"
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('1ms') && duration(self) <= duration('1s'))",message="spec.linger must be a duration between 1ms and 1s",messageExpression="'spec.linger: ' + self + ' is not a duration between 1ms and 1s'"
	// +optional
	Linger string `json:"linger,omitempty"`

	// Topics maps each event type to the Kafka topic its rows go to; at most
	// 512 entries. Event types are 1 to 255 characters without '=' or ','
	// (the relay's --topic syntax) and without surrounding whitespace.
	// +kubebuilder:validation:MinProperties=1
	// +kubebuilder:validation:MaxProperties=512
	// +kubebuilder:validation:XValidation:rule=`self.all(k, size(k) <= 255 && k.matches(r'^[^=,\s]([^=,]*[^=,\s])?$'))`,message="spec.topics: event types must be 1 to 255 characters without '=' or ',' and without surrounding whitespace",messageExpression=`'spec.topics: event type "' + self.filter(k, !(size(k) <= 255 && k.matches(r'^[^=,\s]([^=,]*[^=,\s])?$'))).map(k, size(k) > 64 ? k.substring(0, 64) + '...' : k)[0] + '" must be 1 to 255 characters without = or , and without surrounding whitespace'`
	Topics map[string]TopicName `json:"topics"`

	// DeadLetterTopic receives the rows Kafka refuses permanently (a record
	// larger than its topic takes, an invalid record), with their payload;
	// without it such rows are held and retried. A missing topic, an
	// authorization or a policy refusal is never dead-lettered: those rows
	// are held and retried until it is fixed. Rows of an unmapped event type are held
	// either way. It must not be one of the mapped topics.
	// +optional
	DeadLetterTopic TopicName `json:"deadLetterTopic,omitempty"`

	// Ordering is None (the default: replicas share rows with SKIP LOCKED, no
	// per-key order across replicas) or PartitionKey (rows with the same
	// partition key are published in id order). A change rolls out with the
	// Recreate strategy, so relays of the two modes never run side by side.
	// +kubebuilder:default=None
	// +optional
	Ordering OrderingMode `json:"ordering,omitempty"`

	// Kafka says how to reach the brokers.
	Kafka KafkaSpec `json:"kafka"`

	// Format is the record layout: Raw (the default: the payload as the value,
	// event_id, event_type, aggregate_type, aggregate_id and the row's own
	// headers), CloudEvents (the CloudEvents Kafka binding's binary content
	// mode, keeping the Raw headers) or CloudEventsStructured (its structured
	// content mode, application/cloudevents+json, keeping the Raw headers).
	// docs/relay.md lists each format's headers.
	// +kubebuilder:default=Raw
	// +optional
	Format RecordFormat `json:"format,omitempty"`

	// RecordTimestamp is each record's timestamp: CreatedAt (the default:
	// the row's created_at, when the event happened) or Publish (when the
	// relay publishes it). Kafka's
	// time-based retention and consumers' time lookups go by it.
	// +kubebuilder:default=CreatedAt
	// +optional
	RecordTimestamp RecordTimestamp `json:"recordTimestamp,omitempty"`

	// PartitionColumn names an integer column (smallint, integer or bigint)
	// of the outbox table whose value, when not NULL, is the Kafka
	// partition of the row's record; a row that leaves it NULL goes where
	// its partition key's hash says. A value that is not a partition of
	// the topic holds the row (invalid_row) with the reason. Default: none.
	// +kubebuilder:validation:Pattern=`^[a-z_][a-z0-9_]{0,62}$`
	// +kubebuilder:validation:XValidation:rule="!(self in ['id', 'event_id', 'aggregate_type', 'aggregate_id', 'event_type', 'payload', 'partition_key', 'created_at', 'published_at', 'headers'])",messageExpression="'spec.partitionColumn: ' + self + ' is a column the relay reads for its own purpose'"
	// +optional
	PartitionColumn string `json:"partitionColumn,omitempty"`

	// CloudEventsSource is ce_source in the CloudEvents format, a URI-reference.
	// Default: /outbox/<table>.
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:Pattern=`^([A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})+$`
	// +kubebuilder:validation:XValidation:rule="self.matches(r'^[A-Za-z][A-Za-z0-9+.-]*:') || !self.matches(r'^[^/?#]*:')",message="not a URI-reference: a ':' before the first '/' needs a scheme before it (letters, digits, +-.) or it reads as one"
	// +kubebuilder:validation:XValidation:rule="!self.matches(r'^([A-Za-z][A-Za-z0-9+.-]*:)?//') || self.matches(r'^([A-Za-z][A-Za-z0-9+.-]*:)?//([A-Za-z0-9._~:-]*@)?[A-Za-z0-9._~-]*(:[0-9]*)?([/?#]|$)')",message="not a URI-reference: after // comes [user@]host[:port], with a host of letters, digits and -._~"
	// +optional
	CloudEventsSource string `json:"cloudEventsSource,omitempty"`

	// Tracing, when present, makes the relay record a producer span per event,
	// a child of the span of the service that stored it, and export it over
	// OTLP/HTTP. Without it the relay forwards the rows' trace context only.
	// +optional
	Tracing *TracingSpec `json:"tracing,omitempty"`

	// Replicas is the number of relay pods when spec.autoscaling is absent. Default: 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// Suspend scales the relay to zero and keeps everything else.
	// +optional
	Suspend bool `json:"suspend,omitempty"`

	// Autoscaling, when present, lets the operator choose the number of relay
	// pods from the backlog, between minReplicas and maxReplicas; spec.replicas
	// is then ignored (and kept for when autoscaling is removed). The operator
	// writes the Deployment's replicas and status.desiredReplicas, never this spec.
	// +optional
	Autoscaling *AutoscalingSpec `json:"autoscaling,omitempty"`

	// Backlog says how often the operator reads the outbox table's backlog.
	// +optional
	Backlog *BacklogSpec `json:"backlog,omitempty"`

	// LagThreshold is how long the oldest row a relay can claim may wait
	// before the relay counts as Lagging, a Go duration between 1s and 24h.
	// Default: 1m.
	// +kubebuilder:default="1m"
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('1s') && duration(self) <= duration('24h'))",message="spec.lagThreshold must be a duration between 1s and 24h",messageExpression="'spec.lagThreshold: ' + self + ' is not a duration between 1s and 24h'"
	// +optional
	LagThreshold string `json:"lagThreshold,omitempty"`

	// Image is the relay image. Default: the operator's configured relay image.
	// By default only the operator's relay image, or another tag or digest
	// of it, is admitted; the operator's --allowed-relay-images replaces
	// that with the prefixes it lists (the relay image itself stays
	// admitted).
	// Whoever sets it runs that image with the Secrets this relay references.
	// +kubebuilder:validation:MaxLength=512
	// +optional
	Image string `json:"image,omitempty"`

	// ImagePullPolicy of the relay container.
	// +kubebuilder:validation:Enum=Always;IfNotPresent;Never
	// +optional
	ImagePullPolicy corev1.PullPolicy `json:"imagePullPolicy,omitempty"`

	// ImagePullSecrets for the relay pods.
	// +listType=atomic
	// +optional
	ImagePullSecrets []corev1.LocalObjectReference `json:"imagePullSecrets,omitempty"`

	// Resources of the relay container. Default: requests of 50m CPU and
	// 64Mi memory, and a memory limit sized from maxBatchBytes and
	// maxInFlight (docs/operator.md gives the rule). A request of cpu,
	// memory or ephemeral-storage may not exceed its limit.
	// +kubebuilder:validation:XValidation:rule="(!has(self.requests) || !has(self.limits) || !('cpu' in self.requests) || !('cpu' in self.limits) || quantity(string(self.requests['cpu'])).compareTo(quantity(string(self.limits['cpu']))) <= 0) && (!has(self.requests) || !has(self.limits) || !('memory' in self.requests) || !('memory' in self.limits) || quantity(string(self.requests['memory'])).compareTo(quantity(string(self.limits['memory']))) <= 0) && (!has(self.requests) || !has(self.limits) || !('ephemeral-storage' in self.requests) || !('ephemeral-storage' in self.limits) || quantity(string(self.requests['ephemeral-storage'])).compareTo(quantity(string(self.limits['ephemeral-storage']))) <= 0)",message="a request exceeds its limit: requests of cpu, memory and ephemeral-storage must be at most their limits"
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// NodeSelector of the relay pods.
	// +optional
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`

	// Tolerations of the relay pods.
	// +listType=atomic
	// +optional
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`

	// Affinity of the relay pods.
	// +optional
	Affinity *corev1.Affinity `json:"affinity,omitempty"`

	// PriorityClassName of the relay pods.
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +optional
	PriorityClassName string `json:"priorityClassName,omitempty"`

	// PodAnnotations are added to the relay pods; outbox.dev/config-hash
	// is the operator's.
	// +kubebuilder:validation:XValidation:rule="!('outbox.dev/config-hash' in self)",message="must not set outbox.dev/config-hash: the operator owns it"
	// +kubebuilder:validation:XValidation:rule="!('seccomp.security.alpha.kubernetes.io/pod' in self) || self['seccomp.security.alpha.kubernetes.io/pod'] in ['runtime/default', 'docker/default']",message="must not set seccomp.security.alpha.kubernetes.io/pod to other than runtime/default: the seccomp annotations are deprecated, and the API server refuses a pod whose annotation differs from its seccompProfile, which the operator sets (RuntimeDefault); set spec.template.pod.securityContext.seccompProfile"
	// +kubebuilder:validation:XValidation:rule="!('container.seccomp.security.alpha.kubernetes.io/relay' in self) || self['container.seccomp.security.alpha.kubernetes.io/relay'] in ['runtime/default', 'docker/default']",message="must not set container.seccomp.security.alpha.kubernetes.io/relay to other than runtime/default: the seccomp annotations are deprecated, and the API server refuses a pod whose annotation differs from its container's seccompProfile, which the operator sets (RuntimeDefault); set spec.template.container.securityContext.seccompProfile"
	// +kubebuilder:validation:XValidation:rule="!self.exists(k, k.startsWith('container.apparmor.security.beta.kubernetes.io/') && self[k] == 'unconfined')",messageExpression="'must not set ' + self.filter(k, k.startsWith('container.apparmor.security.beta.kubernetes.io/') && self[k] == 'unconfined')[0] + ': unconfined breaks Pod Security restricted; use runtime/default or localhost/<profile>'"
	// +optional
	PodAnnotations map[string]string `json:"podAnnotations,omitempty"`

	// PodLabels are added to the relay pods; they cannot override the
	// app.kubernetes.io labels the operator selects the pods by.
	// +kubebuilder:validation:XValidation:rule="!['app.kubernetes.io/name', 'app.kubernetes.io/instance', 'app.kubernetes.io/component', 'app.kubernetes.io/managed-by'].exists(k, k in self)",messageExpression="'must not set ' + ['app.kubernetes.io/name', 'app.kubernetes.io/instance', 'app.kubernetes.io/component', 'app.kubernetes.io/managed-by'].filter(k, k in self)[0] + ': the operator selects the relay pods by it'"
	// +optional
	PodLabels map[string]string `json:"podLabels,omitempty"`

	// Monitoring asks for monitoring objects for the relay pods.
	// +optional
	Monitoring *MonitoringSpec `json:"monitoring,omitempty"`

	// Template customizes the relay pods and their container: a service
	// account (cloud identity), environment, volumes, security contexts
	// merged over the operator's, topology spread, labels and annotations.
	// +optional
	Template *RelayPodTemplate `json:"template,omitempty"`
}

// BacklogStatus is what the operator read from the outbox table. It reads the
// BacklogBound (100000) oldest unpublished rows by id, in one query.
type BacklogStatus struct {
	// Pending is the number of unpublished rows a relay can claim: of a
	// mapped event type, with no NULL in a column the relay reads. Exact
	// while Estimated is false.
	Pending int64 `json:"pending"`

	// Estimated is true when more than 100000 rows are unpublished. Pending
	// is then the count among the 100000 oldest plus every id issued after
	// the last of them (max(id) minus its id): that also counts rows
	// published since and ids of rolled-back inserts, so it errs high.
	// +optional
	Estimated bool `json:"estimated,omitempty"`

	// OldestAge is the age of the oldest row a relay can claim (by
	// created_at, on the database's clock), to the second; 0s when none waits.
	OldestAge metav1.Duration `json:"oldestAge"`

	// Held counts the unpublished rows among the 100000 oldest that no relay
	// publishes as things stand: by the topic map and the rows' columns, and
	// as the relays recorded them in the held table (<table>_held; `relay
	// held` lists them, `relay redrive` releases them). They count in
	// neither Pending nor OldestAge, so they never scale the relays up. Rows
	// of an unavailable topic are not recorded per row: the relays count
	// them in outbox_relay_rows_held{reason="topic_unavailable"}, and the
	// operator counts them as pending.
	// +optional
	Held HeldRows `json:"held,omitempty"`

	// PublishedPerMinute is the number of rows published over the last
	// minute (scaled to a minute while the operator has read for less than
	// one), from the difference of PostgreSQL's count of the table's updated
	// rows between reads (of its deleted rows with retention.onPublish
	// Delete): the relays update a row only to mark it published and delete
	// one only once it is published, so no table scan is needed; rows pruned
	// are not counted for a relay that marks. Absent until two reads exist,
	// or when the server does not count (track_counts off).
	// +optional
	PublishedPerMinute *int64 `json:"publishedPerMinute,omitempty"`

	// Slot is the replication slot of spec.capture LogicalReplication, as
	// PostgreSQL reports it. In Poll mode it is present only while a slot
	// left by logical replication exists and nothing streams from it: it
	// holds back the database's WAL, and no relay gives it up.
	// +optional
	Slot *SlotStatus `json:"slot,omitempty"`

	// ObservedAt is when the operator read these numbers. While they stay
	// the same it is renewed every 5 minutes only, so that an idle relay's
	// status is not rewritten at every read.
	ObservedAt metav1.Time `json:"observedAt"`
}

// HeldRows counts unpublished rows held back, by reason.
type HeldRows struct {
	// Unroutable rows have an event type not in spec.topics (or a NULL one).
	// +optional
	Unroutable int64 `json:"unroutable,omitempty"`
	// Invalid rows have a NULL in a column the relay reads, a created_at out
	// of range, or malformed headers; the relay holds them (reason
	// invalid_row) until the row is fixed.
	// +optional
	Invalid int64 `json:"invalid,omitempty"`
	// TooLarge rows are larger than their topic and the dead-letter topic
	// take (reason too_large).
	// +optional
	TooLarge int64 `json:"tooLarge,omitempty"`
	// Refused rows were refused by Kafka for good, with no dead-letter topic,
	// or one that refused their copy or is unavailable (reason refused).
	// +optional
	Refused int64 `json:"refused,omitempty"`
	// Blocked rows wait behind a held or invalid row of their partition key
	// on the same topic (PartitionKey ordering), to keep the key's order.
	// +optional
	Blocked int64 `json:"blocked,omitempty"`
}

// OutboxRelayStatus is the observed state of an OutboxRelay.
type OutboxRelayStatus struct {
	// ObservedGeneration is the spec generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// Replicas is the number of relay pods the Deployment runs.
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// ReadyReplicas is the number of ready relay pods.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas,omitempty"`

	// DesiredReplicas is the number of pods the operator asks the Deployment
	// for: spec.replicas, 0 when suspended, or the autoscaler's choice.
	// Always written, so that 0 (scaled to zero) shows as 0.
	// +optional
	DesiredReplicas int32 `json:"desiredReplicas"`

	// Backlog is the outbox table's backlog as the operator last read it.
	// +optional
	Backlog *BacklogStatus `json:"backlog,omitempty"`

	// Ready is ready/desired replicas, for display (kubectl get).
	// +optional
	Ready string `json:"ready,omitempty"`

	// Selector is the label selector of the relay pods, for the scale subresource and HPAs.
	// +optional
	Selector string `json:"selector,omitempty"`

	// TopicCount is the number of mapped event types, for display.
	// +optional
	TopicCount int32 `json:"topicCount,omitempty"`

	// Conditions are Ready, Progressing, Degraded, Reconciling, Stalled and
	// Lagging; Monitoring when spec.monitoring.podMonitor asks for a
	// PodMonitor; ReconciliationPaused while the reconcile annotation pauses
	// the operator.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// OutboxRelay runs a Deployment of transactional-outbox relays that publish
// the rows of a PostgreSQL outbox table to Kafka.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=obr,categories=outbox
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.ready`,description="Ready replicas / desired replicas"
// +kubebuilder:printcolumn:name="Backlog",type=integer,JSONPath=`.status.backlog.pending`,description="Rows waiting for a relay (an estimate above 100000)"
// +kubebuilder:printcolumn:name="Lag",type=string,JSONPath=`.status.backlog.oldestAge`,description="Age of the oldest waiting row"
// +kubebuilder:printcolumn:name="Lagging",type=string,JSONPath=`.status.conditions[?(@.type=="Lagging")].status`,priority=1,description="The Lagging condition"
// +kubebuilder:printcolumn:name="Desired",type=integer,JSONPath=`.status.desiredReplicas`,priority=1,description="Replicas the operator asks for"
// +kubebuilder:printcolumn:name="Table",type=string,JSONPath=`.spec.table`,priority=1
// +kubebuilder:printcolumn:name="Topics",type=integer,JSONPath=`.status.topicCount`,priority=1,description="Number of mapped event types"
// +kubebuilder:printcolumn:name="Status",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`,description="The Ready condition"
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 57 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must be a DNS label of at most 57 characters starting with a letter (children are named <name>-relay)"
type OutboxRelay struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// Spec is the desired state.
	Spec OutboxRelaySpec `json:"spec"`

	// Status is the observed state.
	// +optional
	Status OutboxRelayStatus `json:"status,omitempty"`
}

// OutboxRelayList is a list of OutboxRelays.
//
// +kubebuilder:object:root=true
type OutboxRelayList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// Items are the OutboxRelays.
	Items []OutboxRelay `json:"items"`
}

func init() {
	SchemeBuilder.Register(&OutboxRelay{}, &OutboxRelayList{})
}
