package v1alpha1

import corev1 "k8s.io/api/core/v1"

// Names the relay pods keep for the operator: refused in spec.template.
const (
	// ReservedEnvPrefix starts the relay's own environment variables
	// (its settings and Secrets); spec.template.container.env may not set them.
	ReservedEnvPrefix = "RELAY_"
	// ReservedVolume is the Kafka TLS Secret's volume.
	ReservedVolume = "kafka-tls"
	// ReservedDatabaseVolume holds the database CA and client certificate.
	ReservedDatabaseVolume = "database-tls"
	// ReservedMountDir holds the relay's own mounts.
	ReservedMountDir = "/etc/relay"
)

// EnvNamePattern is what the API server accepts as the name of a pod's
// environment variable: printable ASCII characters other than '='
// (Kubernetes' relaxed rule: on by default from 1.32, the only one from
// 1.34 on; 1.30 and 1.31 take fewer names). RelayEnvVar's
// marker spells it out; the operator checks it again on OutboxRelays
// stored before the CRD did.
const EnvNamePattern = `^[ -<>-~]+$`

// EnvPrefixPattern is EnvNamePattern for an envFrom prefix, which may also
// be empty (no prefix).
const EnvPrefixPattern = `^[ -<>-~]*$`

// RelayPodTemplate customizes the relay pods and their container beyond
// what the operator sets, as Strimzi's template and the Debezium operator's
// runtime do. What the relay owns (its RELAY_* environment, its volumes,
// probes and arguments) cannot be set here: the API refuses it.
type RelayPodTemplate struct {
	// Metadata adds labels and annotations to the relay pods, beside
	// spec.podLabels and spec.podAnnotations (still read; these win).
	// +optional
	Metadata *PodTemplateMetadata `json:"metadata,omitempty"`
	// Pod customizes the relay pods.
	// +optional
	Pod *RelayPodSpec `json:"pod,omitempty"`
	// Container customizes the relay container.
	// +optional
	Container *RelayContainerSpec `json:"container,omitempty"`
}

// PodTemplateMetadata are labels and annotations of the relay pods.
type PodTemplateMetadata struct {
	// Labels of the relay pods; the app.kubernetes.io labels the operator
	// selects the pods by are refused.
	// +kubebuilder:validation:XValidation:rule="!['app.kubernetes.io/name', 'app.kubernetes.io/instance', 'app.kubernetes.io/component', 'app.kubernetes.io/managed-by'].exists(k, k in self)",messageExpression="'must not set ' + ['app.kubernetes.io/name', 'app.kubernetes.io/instance', 'app.kubernetes.io/component', 'app.kubernetes.io/managed-by'].filter(k, k in self)[0] + ': the operator selects the relay pods by it'"
	// +optional
	Labels map[string]string `json:"labels,omitempty"`
	// Annotations of the relay pods; outbox.dev/config-hash is the
	// operator's.
	// +kubebuilder:validation:XValidation:rule="!('outbox.dev/config-hash' in self)",message="must not set outbox.dev/config-hash: the operator owns it"
	// +kubebuilder:validation:XValidation:rule="!('seccomp.security.alpha.kubernetes.io/pod' in self) || self['seccomp.security.alpha.kubernetes.io/pod'] in ['runtime/default', 'docker/default']",message="must not set seccomp.security.alpha.kubernetes.io/pod to other than runtime/default: the seccomp annotations are deprecated, and the API server refuses a pod whose annotation differs from its seccompProfile, which the operator sets (RuntimeDefault); set spec.template.pod.securityContext.seccompProfile"
	// +kubebuilder:validation:XValidation:rule="!('container.seccomp.security.alpha.kubernetes.io/relay' in self) || self['container.seccomp.security.alpha.kubernetes.io/relay'] in ['runtime/default', 'docker/default']",message="must not set container.seccomp.security.alpha.kubernetes.io/relay to other than runtime/default: the seccomp annotations are deprecated, and the API server refuses a pod whose annotation differs from its container's seccompProfile, which the operator sets (RuntimeDefault); set spec.template.container.securityContext.seccompProfile"
	// +kubebuilder:validation:XValidation:rule="!self.exists(k, k.startsWith('container.apparmor.security.beta.kubernetes.io/') && self[k] == 'unconfined')",messageExpression="'must not set ' + self.filter(k, k.startsWith('container.apparmor.security.beta.kubernetes.io/') && self[k] == 'unconfined')[0] + ': unconfined breaks Pod Security restricted; use runtime/default or localhost/<profile>'"
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`
}

// RelayPodSpec customizes the relay pods.
type RelayPodSpec struct {
	// ServiceAccountName runs the relay pods as this service account (for a
	// cloud identity: IRSA, GKE or Azure workload identity). Default: the
	// namespace's default account.
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +optional
	ServiceAccountName string `json:"serviceAccountName,omitempty"`
	// AutomountServiceAccountToken mounts the service account's token into
	// the relay pods. Default false: the relay does not talk to the API server.
	// +optional
	AutomountServiceAccountToken *bool `json:"automountServiceAccountToken,omitempty"`
	// SecurityContext is merged over the operator's (Pod Security
	// "restricted": non-root user and group 65532, fsGroup 65532, the
	// RuntimeDefault seccomp profile): each field set here wins, the others
	// keep the operator's value. On OpenShift's restricted-v2, set
	// runAsUser, runAsGroup and fsGroup from the namespace's ranges. What
	// "restricted" forbids is refused: the relay needs none of it, and
	// whoever may write an OutboxRelay would otherwise choose how its pods
	// run.
	// +kubebuilder:validation:XValidation:rule="!has(self.runAsNonRoot) || self.runAsNonRoot",message="runAsNonRoot: false breaks Pod Security restricted; the relay runs as a non-root user"
	// +kubebuilder:validation:XValidation:rule="!has(self.runAsUser) || self.runAsUser != 0",message="runAsUser: 0 (root) breaks Pod Security restricted; the relay runs as a non-root user"
	// +kubebuilder:validation:XValidation:rule="!has(self.seccompProfile) || self.seccompProfile.type != 'Unconfined'",message="seccompProfile Unconfined breaks Pod Security restricted; use RuntimeDefault or Localhost"
	// +kubebuilder:validation:XValidation:rule="!has(self.appArmorProfile) || self.appArmorProfile.type != 'Unconfined'",message="appArmorProfile Unconfined breaks Pod Security restricted; use RuntimeDefault or Localhost"
	// +kubebuilder:validation:XValidation:rule="!has(self.seLinuxOptions) || ((!has(self.seLinuxOptions.user) || self.seLinuxOptions.user == '') && (!has(self.seLinuxOptions.role) || self.seLinuxOptions.role == '') && (!has(self.seLinuxOptions.type) || self.seLinuxOptions.type in ['', 'container_t', 'container_init_t', 'container_kvm_t', 'container_engine_t']))",message="seLinuxOptions: Pod Security restricted allows no user or role, and only the types container_t, container_init_t, container_kvm_t and container_engine_t"
	// +kubebuilder:validation:XValidation:rule="!has(self.windowsOptions) || !has(self.windowsOptions.hostProcess) || !self.windowsOptions.hostProcess",message="windowsOptions.hostProcess: true breaks Pod Security restricted; the relay needs no host process"
	// +optional
	SecurityContext *corev1.PodSecurityContext `json:"securityContext,omitempty"`
	// Volumes added to the relay pods; "kafka-tls" and "database-tls" are the relay's.
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:XValidation:rule="self.all(v, v.name != 'kafka-tls' && v.name != 'database-tls')",message="the volume names kafka-tls and database-tls are the relay's own"
	// +listType=map
	// +listMapKey=name
	// +optional
	Volumes []RelayVolume `json:"volumes,omitempty"`
	// TopologySpreadConstraints of the relay pods, for example over zones.
	// +kubebuilder:validation:MaxItems=8
	// +listType=atomic
	// +optional
	TopologySpreadConstraints []corev1.TopologySpreadConstraint `json:"topologySpreadConstraints,omitempty"`
}

// RelayContainerSpec customizes the relay container.
type RelayContainerSpec struct {
	// Env adds environment variables; RELAY_* are the relay's own settings
	// and Secrets (set them through this OutboxRelay's fields).
	// +kubebuilder:validation:MaxItems=64
	// +listType=map
	// +listMapKey=name
	// +optional
	Env []RelayEnvVar `json:"env,omitempty"`
	// EnvFrom adds the variables of ConfigMaps and Secrets. The relay's own
	// variables (env) win over them, and its settings are arguments: it
	// reads no setting from a RELAY_* variable.
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +optional
	EnvFrom []RelayEnvFromSource `json:"envFrom,omitempty"`
	// VolumeMounts of the volumes in spec.template.pod.volumes, at absolute
	// paths (the kubelet puts a relative one under /, so "relay" would be
	// /relay); /etc/relay holds the relay's own mounts, and /relay is the
	// relay's binary (a mount over it would run another program with the
	// relay's Secrets, past the operator's image allow-list).
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:XValidation:rule="self.mountPath.startsWith('/')",message="mountPath must be absolute (start with /): the kubelet would mount a relative path under /",messageExpression="'mountPath ' + self.mountPath + ' must be absolute (start with /): the kubelet would mount a relative path under /'"
	// +kubebuilder:validation:items:XValidation:rule="self.name != 'kafka-tls' && self.name != 'database-tls' && self.mountPath != '/etc/relay' && !self.mountPath.startsWith('/etc/relay/') && self.mountPath != '/' && self.mountPath != '/relay' && !self.mountPath.startsWith('/relay/')",message="the volumes kafka-tls and database-tls, the directory /etc/relay and the relay's binary /relay are the relay's own",messageExpression="'volume ' + self.name + ' at ' + self.mountPath + ': the volumes kafka-tls and database-tls, the directory /etc/relay and the relay\\'s binary /relay are the relay\\'s own'"
	// +listType=map
	// +listMapKey=mountPath
	// +optional
	VolumeMounts []corev1.VolumeMount `json:"volumeMounts,omitempty"`
	// SecurityContext is merged over the operator's (no privilege
	// escalation, a read-only root filesystem, every capability dropped):
	// each field set here wins, the others keep the operator's value. What
	// Pod Security "restricted" forbids is refused: the relay needs none of
	// it, and whoever may write an OutboxRelay would otherwise choose how
	// its pods run.
	// +kubebuilder:validation:XValidation:rule="!has(self.privileged) || !self.privileged",message="privileged: true breaks Pod Security restricted; the relay needs no privilege"
	// +kubebuilder:validation:XValidation:rule="!has(self.allowPrivilegeEscalation) || !self.allowPrivilegeEscalation",message="allowPrivilegeEscalation: true breaks Pod Security restricted; the relay needs no privilege"
	// +kubebuilder:validation:XValidation:rule="!has(self.capabilities) || !has(self.capabilities.add) || size(self.capabilities.add) == 0 || (size(self.capabilities.add) == 1 && self.capabilities.add[0] == 'NET_BIND_SERVICE')",message="capabilities.add: Pod Security restricted allows none but NET_BIND_SERVICE, and the relay needs none"
	// +kubebuilder:validation:XValidation:rule="!has(self.runAsNonRoot) || self.runAsNonRoot",message="runAsNonRoot: false breaks Pod Security restricted; the relay runs as a non-root user"
	// +kubebuilder:validation:XValidation:rule="!has(self.runAsUser) || self.runAsUser != 0",message="runAsUser: 0 (root) breaks Pod Security restricted; the relay runs as a non-root user"
	// +kubebuilder:validation:XValidation:rule="!has(self.seccompProfile) || self.seccompProfile.type != 'Unconfined'",message="seccompProfile Unconfined breaks Pod Security restricted; use RuntimeDefault or Localhost"
	// +kubebuilder:validation:XValidation:rule="!has(self.procMount) || self.procMount == 'Default'",message="procMount: the relay needs the default; Pod Security restricted allows no other"
	// +kubebuilder:validation:XValidation:rule="!has(self.capabilities) || !has(self.capabilities.drop) || self.capabilities.drop.exists(c, c == 'ALL')",message="capabilities.drop must include ALL (Pod Security restricted): the list replaces the operator's [ALL]"
	// +kubebuilder:validation:XValidation:rule="!has(self.appArmorProfile) || self.appArmorProfile.type != 'Unconfined'",message="appArmorProfile Unconfined breaks Pod Security restricted; use RuntimeDefault or Localhost"
	// +kubebuilder:validation:XValidation:rule="!has(self.seLinuxOptions) || ((!has(self.seLinuxOptions.user) || self.seLinuxOptions.user == '') && (!has(self.seLinuxOptions.role) || self.seLinuxOptions.role == '') && (!has(self.seLinuxOptions.type) || self.seLinuxOptions.type in ['', 'container_t', 'container_init_t', 'container_kvm_t', 'container_engine_t']))",message="seLinuxOptions: Pod Security restricted allows no user or role, and only the types container_t, container_init_t, container_kvm_t and container_engine_t"
	// +kubebuilder:validation:XValidation:rule="!has(self.windowsOptions) || !has(self.windowsOptions.hostProcess) || !self.windowsOptions.hostProcess",message="windowsOptions.hostProcess: true breaks Pod Security restricted; the relay needs no host process"
	// +optional
	SecurityContext *corev1.SecurityContext `json:"securityContext,omitempty"`
}

// The relay's own types for env and envFrom carry a pattern on the name and
// the prefix: a CEL rule over corev1's types could not afford to match a
// string of unbounded length in each of 64 items (the API server refuses
// such a CRD), and corev1's fields take no marker.

// RelayEnvVar is an environment variable of the relay container, as a pod's,
// with a name the API server accepts in a pod.
// +kubebuilder:validation:XValidation:rule="!has(self.valueFrom) || !has(self.value) || size(self.value) == 0",message="value and valueFrom are exclusive: set one",messageExpression="self.name + ': value and valueFrom are exclusive: set one'"
type RelayEnvVar struct {
	// Name of the variable: printable ASCII characters other than '=', not
	// starting with RELAY_ (ReservedEnvPrefix).
	// +kubebuilder:validation:Pattern=`^[ -<>-~]+$`
	// +kubebuilder:validation:XValidation:rule="!self.startsWith('RELAY_')",message="RELAY_* variables are the relay's own settings and Secrets: set them through the OutboxRelay's fields",messageExpression="self + ': RELAY_* variables are the relay\\'s own settings and Secrets: set them through the OutboxRelay\\'s fields'"
	Name string `json:"name"`
	// Value of the variable; $(VAR) expands as in a pod's env. Default "".
	// +optional
	Value string `json:"value,omitempty"`
	// ValueFrom takes the value from a field of the pod, a resource of the
	// container, or a key of a ConfigMap or Secret; not with value.
	// +optional
	ValueFrom *corev1.EnvVarSource `json:"valueFrom,omitempty"`
}

// EnvVar is e as a container's environment variable.
func (e RelayEnvVar) EnvVar() corev1.EnvVar {
	return corev1.EnvVar{Name: e.Name, Value: e.Value, ValueFrom: e.ValueFrom}
}

// RelayEnvFromSource adds the keys of a ConfigMap or Secret to the relay
// container's environment, as a pod's envFrom, with a prefix the API server
// accepts in a pod.
// +kubebuilder:validation:XValidation:rule="has(self.configMapRef) != has(self.secretRef)",message="exactly one of configMapRef and secretRef"
type RelayEnvFromSource struct {
	// Prefix put before each key to make the variable's name: printable
	// ASCII characters other than '='.
	// +kubebuilder:validation:Pattern=`^[ -<>-~]*$`
	// +optional
	Prefix string `json:"prefix,omitempty"`
	// ConfigMapRef names the ConfigMap to take the variables from.
	// +optional
	ConfigMapRef *corev1.ConfigMapEnvSource `json:"configMapRef,omitempty"`
	// SecretRef names the Secret to take the variables from.
	// +optional
	SecretRef *corev1.SecretEnvSource `json:"secretRef,omitempty"`
}

// EnvFromSource is e as a container's envFrom source.
func (e RelayEnvFromSource) EnvFromSource() corev1.EnvFromSource {
	return corev1.EnvFromSource{Prefix: e.Prefix, ConfigMapRef: e.ConfigMapRef, SecretRef: e.SecretRef}
}

// RelayVolume is a volume of the relay pods: the kinds a relay needs (a CA
// bundle or client certificate from a Secret or ConfigMap, a projected
// service account token for a cloud identity, scratch space, a CSI secret
// store), not every kind a pod may have, so the CRD stays small enough for
// a client-side kubectl apply.
// +kubebuilder:validation:XValidation:rule="[has(self.secret), has(self.configMap), has(self.projected), has(self.emptyDir), has(self.csi)].filter(x, x).size() == 1",message="exactly one of secret, configMap, projected, emptyDir and csi"
type RelayVolume struct {
	// Name of the volume, as volumeMounts name it.
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Name string `json:"name"`
	// +optional
	Secret *corev1.SecretVolumeSource `json:"secret,omitempty"`
	// +optional
	ConfigMap *corev1.ConfigMapVolumeSource `json:"configMap,omitempty"`
	// +optional
	Projected *corev1.ProjectedVolumeSource `json:"projected,omitempty"`
	// +optional
	EmptyDir *corev1.EmptyDirVolumeSource `json:"emptyDir,omitempty"`
	// +optional
	CSI *corev1.CSIVolumeSource `json:"csi,omitempty"`
}

// Volume is v as a pod's volume.
func (v RelayVolume) Volume() corev1.Volume {
	return corev1.Volume{Name: v.Name, VolumeSource: corev1.VolumeSource{
		Secret: v.Secret, ConfigMap: v.ConfigMap, Projected: v.Projected, EmptyDir: v.EmptyDir, CSI: v.CSI,
	}}
}
