// Package controllers holds the OutboxRelay reconciler, which turns an
// OutboxRelay into a Deployment of relay pods, a metrics Service and a
// PodDisruptionBudget.
package controllers

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

const (
	// SpecHashAnnotation on a child holds the hash of the spec the operator
	// last wrote; an equal hash means there is nothing to update.
	SpecHashAnnotation = "outbox.dev/spec-hash"
	// ConfigHashAnnotation on the pod template hashes the relay's
	// configuration and the data of every Secret it references, so a rotated
	// DSN or credential rolls the pods.
	ConfigHashAnnotation = "outbox.dev/config-hash"

	// ContainerName is the relay container's name.
	ContainerName = "relay"
	// MetricsPortName names the relay's metrics/health port.
	MetricsPortName = "metrics"
	// MetricsPort is the port the relay serves /metrics, /healthz and /readyz on.
	MetricsPort = 9090
	// TLSMountPath is where the Kafka TLS Secret is mounted.
	TLSMountPath = "/etc/relay/tls"

	// The relay exits within ~10s of SIGTERM; 30s leaves room for a slow broker.
	terminationGracePeriodSeconds = 30
	// nonRootID is the distroless nonroot user and group.
	nonRootID = 65532

	labelName      = "app.kubernetes.io/name"
	labelInstance  = "app.kubernetes.io/instance"
	labelComponent = "app.kubernetes.io/component"
	labelManagedBy = "app.kubernetes.io/managed-by"
)

// ChildName is the name of the Deployment, Service and PodDisruptionBudget of a relay.
func ChildName(relay *outboxv1alpha1.OutboxRelay) string { return relay.Name + "-relay" }

// SelectorLabels select the pods of one relay.
func SelectorLabels(relay *outboxv1alpha1.OutboxRelay) map[string]string {
	return map[string]string{labelName: "outbox-relay", labelInstance: relay.Name}
}

func commonLabels(relay *outboxv1alpha1.OutboxRelay) map[string]string {
	l := SelectorLabels(relay)
	l[labelComponent] = "relay"
	l[labelManagedBy] = "outbox-operator"
	return l
}

// secretInputs is what the relay's pods depend on from the referenced Secrets.
type secretInputs struct {
	// Hash covers the data of every referenced key (and the whole TLS Secret).
	Hash string
	// TLSCA and TLSClientCert say which files the TLS Secret provides.
	TLSCA, TLSClientCert bool
}

// specError is a spec problem the CRD schema cannot express.
type specError struct{ msg string }

func (e *specError) Error() string { return e.msg }

// validateSpec re-checks what the schema cannot express.
func validateSpec(relay *outboxv1alpha1.OutboxRelay) error {
	spec := &relay.Spec
	d, err := time.ParseDuration(spec.PollInterval)
	if spec.PollInterval != "" && (err != nil || d < 10*time.Millisecond || d > time.Hour) {
		return &specError{fmt.Sprintf("spec.pollInterval %q is not a duration between 10ms and 1h", spec.PollInterval)}
	}
	for _, k := range slices.Sorted(maps.Keys(spec.PodLabels)) {
		if _, reserved := commonLabels(relay)[k]; reserved {
			return &specError{fmt.Sprintf("spec.podLabels must not set %s: the operator owns it", k)}
		}
	}
	if _, reserved := spec.PodAnnotations[ConfigHashAnnotation]; reserved {
		return &specError{fmt.Sprintf("spec.podAnnotations must not set %s: the operator owns it", ConfigHashAnnotation)}
	}
	if len(spec.Topics) == 0 {
		return &specError{"spec.topics must map at least one event type"}
	}
	return nil
}

// desiredReplicas is what the Deployment should run: zero when suspended.
func desiredReplicas(relay *outboxv1alpha1.OutboxRelay) int32 {
	if relay.Spec.Suspend {
		return 0
	}
	return ptr.Deref(relay.Spec.Replicas, 1)
}

// relayArgs are the relay's command-line arguments, in a fixed order so the
// pod template is stable. The DSN and SASL credentials are never among them.
func relayArgs(relay *outboxv1alpha1.OutboxRelay, in secretInputs) []string {
	spec := &relay.Spec
	brokers := make([]string, len(spec.Kafka.Brokers))
	for i, b := range spec.Kafka.Brokers {
		brokers[i] = string(b)
	}
	ordering := "none"
	if spec.Ordering == outboxv1alpha1.OrderingPartitionKey {
		ordering = "partition-key"
	}
	args := []string{
		"--table=" + cmp.Or(spec.Table, "outbox"),
		"--brokers=" + strings.Join(brokers, ","),
		fmt.Sprintf("--batch-size=%d", cmp.Or(spec.BatchSize, 50)),
		"--poll-interval=" + cmp.Or(spec.PollInterval, "200ms"),
	}
	for _, eventType := range slices.Sorted(maps.Keys(spec.Topics)) {
		args = append(args, fmt.Sprintf("--topic=%s=%s", eventType, spec.Topics[eventType]))
	}
	if spec.DeadLetterTopic != "" {
		args = append(args, "--dead-letter-topic="+string(spec.DeadLetterTopic))
	}
	args = append(args,
		"--ordering="+ordering,
		fmt.Sprintf("--metrics-addr=:%d", MetricsPort),
		"--log-format=json",
	)
	if tls := spec.Kafka.TLS; tls != nil {
		args = append(args, "--kafka-tls")
		if in.TLSCA {
			args = append(args, "--kafka-tls-ca-file="+TLSMountPath+"/ca.crt")
		}
		if in.TLSClientCert {
			args = append(args,
				"--kafka-tls-cert-file="+TLSMountPath+"/tls.crt",
				"--kafka-tls-key-file="+TLSMountPath+"/tls.key")
		}
	}
	if sasl := spec.Kafka.SASL; sasl != nil {
		args = append(args, "--kafka-sasl-mechanism="+string(sasl.Mechanism))
	}
	return args
}

func relayEnv(relay *outboxv1alpha1.OutboxRelay) []corev1.EnvVar {
	spec := &relay.Spec
	env := []corev1.EnvVar{secretEnv("RELAY_DSN", spec.DSNSecretRef.Name, cmp.Or(spec.DSNSecretRef.Key, "dsn"))}
	if sasl := spec.Kafka.SASL; sasl != nil {
		ref := sasl.CredentialsSecretRef
		env = append(env,
			secretEnv("RELAY_KAFKA_SASL_USERNAME", ref.Name, cmp.Or(ref.UsernameKey, "username")),
			secretEnv("RELAY_KAFKA_SASL_PASSWORD", ref.Name, cmp.Or(ref.PasswordKey, "password")))
	}
	return env
}

func secretEnv(name, secret, key string) corev1.EnvVar {
	return corev1.EnvVar{Name: name, ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
		LocalObjectReference: corev1.LocalObjectReference{Name: secret}, Key: key,
	}}}
}

// defaultResources are the relay container's resources when the spec sets none.
func defaultResources() corev1.ResourceRequirements {
	return corev1.ResourceRequirements{Requests: corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("50m"),
		corev1.ResourceMemory: resource.MustParse("64Mi"),
	}}
}

// relayDeployment builds the desired relay Deployment. defaultImage is used
// when the spec names no image.
func relayDeployment(relay *outboxv1alpha1.OutboxRelay, defaultImage string, in secretInputs) (*appsv1.Deployment, error) {
	if err := validateSpec(relay); err != nil {
		return nil, err
	}
	spec := &relay.Spec
	image := cmp.Or(spec.Image, defaultImage)
	if image == "" {
		return nil, &specError{"spec.image is empty and the operator has no default relay image"}
	}
	args := relayArgs(relay, in)
	env := relayEnv(relay)

	podLabels := maps.Clone(spec.PodLabels)
	if podLabels == nil {
		podLabels = map[string]string{}
	}
	maps.Copy(podLabels, commonLabels(relay))
	podAnnotations := maps.Clone(spec.PodAnnotations)
	if podAnnotations == nil {
		podAnnotations = map[string]string{}
	}
	podAnnotations[ConfigHashAnnotation] = hashOf(struct {
		Image   string
		Args    []string
		Env     []corev1.EnvVar
		Secrets string
	}{image, args, env, in.Hash})

	resources := defaultResources()
	if spec.Resources != nil {
		resources = *spec.Resources.DeepCopy()
	}
	container := corev1.Container{
		Name:            ContainerName,
		Image:           image,
		ImagePullPolicy: spec.ImagePullPolicy,
		Command:         []string{"/relay"},
		Args:            args,
		Env:             env,
		Ports: []corev1.ContainerPort{{
			Name: MetricsPortName, ContainerPort: MetricsPort, Protocol: corev1.ProtocolTCP,
		}},
		LivenessProbe:  httpProbe("/healthz", 3),
		ReadinessProbe: httpProbe("/readyz", 1),
		Resources:      resources,
		SecurityContext: &corev1.SecurityContext{
			RunAsNonRoot:             ptr.To(true),
			ReadOnlyRootFilesystem:   ptr.To(true),
			AllowPrivilegeEscalation: ptr.To(false),
			Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		},
	}
	podSpec := corev1.PodSpec{
		Containers:                    []corev1.Container{container},
		AutomountServiceAccountToken:  ptr.To(false),
		EnableServiceLinks:            ptr.To(false),
		TerminationGracePeriodSeconds: ptr.To[int64](terminationGracePeriodSeconds),
		ImagePullSecrets:              slices.Clone(spec.ImagePullSecrets),
		NodeSelector:                  maps.Clone(spec.NodeSelector),
		Tolerations:                   slices.Clone(spec.Tolerations),
		Affinity:                      spec.Affinity.DeepCopy(),
		PriorityClassName:             spec.PriorityClassName,
		SecurityContext: &corev1.PodSecurityContext{
			RunAsNonRoot:   ptr.To(true),
			RunAsUser:      ptr.To[int64](nonRootID),
			RunAsGroup:     ptr.To[int64](nonRootID),
			FSGroup:        ptr.To[int64](nonRootID),
			SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		},
	}
	if tls := spec.Kafka.TLS; tls != nil && tls.SecretRef != nil {
		podSpec.Volumes = []corev1.Volume{{
			Name: "kafka-tls",
			VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
				SecretName: tls.SecretRef.Name, DefaultMode: ptr.To[int32](0o440),
			}},
		}}
		podSpec.Containers[0].VolumeMounts = []corev1.VolumeMount{{
			Name: "kafka-tls", MountPath: TLSMountPath, ReadOnly: true,
		}}
	}

	d := &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: childMeta(relay),
		Spec: appsv1.DeploymentSpec{
			Replicas:             ptr.To(desiredReplicas(relay)),
			Selector:             &metav1.LabelSelector{MatchLabels: SelectorLabels(relay)},
			RevisionHistoryLimit: ptr.To[int32](3),
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels, Annotations: podAnnotations},
				Spec:       podSpec,
			},
		},
	}
	d.Annotations[SpecHashAnnotation] = hashOf(d.Spec)
	return d, nil
}

func httpProbe(path string, failureThreshold int32) *corev1.Probe {
	return &corev1.Probe{
		ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{
			Path: path, Port: intstr.FromString(MetricsPortName), Scheme: corev1.URISchemeHTTP,
		}},
		PeriodSeconds:    10,
		TimeoutSeconds:   2,
		FailureThreshold: failureThreshold,
		SuccessThreshold: 1,
	}
}

// relayService builds the desired metrics Service.
func relayService(relay *outboxv1alpha1.OutboxRelay) *corev1.Service {
	s := &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: childMeta(relay),
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeClusterIP,
			Selector: SelectorLabels(relay),
			Ports: []corev1.ServicePort{{
				Name: MetricsPortName, Port: MetricsPort, Protocol: corev1.ProtocolTCP,
				TargetPort: intstr.FromString(MetricsPortName),
			}},
		},
	}
	s.Annotations[SpecHashAnnotation] = hashOf(s.Spec)
	return s
}

// relayPDB builds the desired PodDisruptionBudget, or nil when the relay
// runs fewer than two replicas (a PDB over one pod only blocks node drains).
func relayPDB(relay *outboxv1alpha1.OutboxRelay) *policyv1.PodDisruptionBudget {
	if desiredReplicas(relay) < 2 {
		return nil
	}
	p := &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: childMeta(relay),
		Spec: policyv1.PodDisruptionBudgetSpec{
			MaxUnavailable: ptr.To(intstr.FromInt32(1)),
			Selector:       &metav1.LabelSelector{MatchLabels: SelectorLabels(relay)},
		},
	}
	p.Annotations[SpecHashAnnotation] = hashOf(p.Spec)
	return p
}

func childMeta(relay *outboxv1alpha1.OutboxRelay) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:        ChildName(relay),
		Namespace:   relay.Namespace,
		Labels:      commonLabels(relay),
		Annotations: map[string]string{},
		OwnerReferences: []metav1.OwnerReference{{
			APIVersion:         outboxv1alpha1.GroupVersion.String(),
			Kind:               "OutboxRelay",
			Name:               relay.Name,
			UID:                relay.UID,
			Controller:         ptr.To(true),
			BlockOwnerDeletion: ptr.To(true),
		}},
	}
}

// hashOf is a short, stable hash of v's JSON form (map keys are sorted).
func hashOf(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("hash %T: %v", v, err)) // only plain API structs reach here
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])[:16]
}
