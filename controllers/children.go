// Package controllers holds the OutboxRelay reconciler, which turns an
// OutboxRelay into a Deployment of relay pods, a metrics Service and a
// PodDisruptionBudget.
package controllers

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
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
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// This file builds the desired children from an OutboxRelay with pure
// functions: no client, no API server.

const (
	// specHashAnnotation on a child holds the hash of the spec the operator
	// last wrote; an equal hash means there is nothing to update.
	specHashAnnotation = "outbox.dev/spec-hash"
	// liveHashLabel on a child holds the hash of the fields the operator
	// owns as the API server stored them after its last write (defaults
	// and admission webhooks' changes included): a live hash that differs
	// means someone else changed them, and the operator puts them back. A
	// label, not an annotation: a write of a Deployment's annotations
	// bumps its generation, which shows as a rollout until the Deployment
	// controller has looked; a write of its labels does not.
	liveHashLabel = "outbox.dev/live-hash"
	// restartedAtAnnotation is what kubectl rollout restart stamps on a
	// Deployment's pod template; the operator keeps it (ensureChildren).
	restartedAtAnnotation = "kubectl.kubernetes.io/restartedAt"
	// configHashAnnotation on the pod template hashes the relay's
	// configuration and the identity and version (UID, resourceVersion) of
	// every Secret it references, never their data, so a rotated DSN or
	// credential rolls the pods.
	configHashAnnotation = "outbox.dev/config-hash"
	// secretVersionsAnnotation on the Deployment records, for each key the
	// pods read from a Secret, the version in the config hash and a keyed
	// digest of its value (secretRecord), so that a restarted operator
	// knows which values the pods were started with.
	secretVersionsAnnotation = "outbox.dev/secret-versions"

	// containerName is the relay container's name.
	containerName = "relay"
	// metricsPortName names the relay's metrics/health port.
	metricsPortName = "metrics"

	// shutdownMargin is what the relay's exit may take after its last
	// batch (relayconfig.BatchDeadline): closing its producer and sessions.
	shutdownMargin = 5 * time.Second
	// nonRootID is the distroless nonroot user and group.
	nonRootID = 65532

	labelName      = "app.kubernetes.io/name"
	labelInstance  = "app.kubernetes.io/instance"
	labelComponent = "app.kubernetes.io/component"
	labelManagedBy = "app.kubernetes.io/managed-by"
	// managedBy is labelManagedBy's value on every object the operator makes.
	managedBy = "outbox-operator"
)

// childKinds are the kinds of a relay's children the manager caches.
func childKinds() []client.Object {
	return []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}}
}

// childSelector selects the objects the operator made (commonLabels): the
// only ones of childKinds its cache holds.
func childSelector() labels.Selector {
	return labels.SelectorFromSet(labels.Set{labelManagedBy: managedBy})
}

// childName is the name of the Deployment, Service and PodDisruptionBudget of a relay.
func childName(relay *outboxv1alpha1.OutboxRelay) string { return relay.Name + "-relay" }

// selectorLabels select the pods of one relay.
func selectorLabels(relay *outboxv1alpha1.OutboxRelay) map[string]string {
	return map[string]string{labelName: "outbox-relay", labelInstance: relay.Name}
}

// OwnLabel reports whether key is a label the operator sets on a relay's
// objects (commonLabels).
func OwnLabel(key string) bool {
	_, own := commonLabels(&outboxv1alpha1.OutboxRelay{})[key]
	return own
}

func commonLabels(relay *outboxv1alpha1.OutboxRelay) map[string]string {
	l := selectorLabels(relay)
	l[labelComponent] = "relay"
	l[labelManagedBy] = managedBy
	return l
}

// desiredReplicas is what the Deployment should run: zero when suspended,
// the autoscaler's count (which Reconcile puts in status.desiredReplicas
// before building anything) when autoscaling, else spec.replicas.
func desiredReplicas(relay *outboxv1alpha1.OutboxRelay) int32 {
	switch {
	case relay.Spec.Suspend:
		return 0
	case relay.Spec.Autoscaling != nil:
		return relay.Status.DesiredReplicas
	}
	return ptr.Deref(relay.Spec.Replicas, outboxv1alpha1.DefaultReplicas)
}

// relayEnv carries the secrets: the DSN and the SASL credentials, each from a
// secretKeyRef, never as a value or an argument; and, for `relay held` and
// `relay redrive` run by hand in the pod, the table and the database login
// of settings (HeldEnv), which the relay itself takes from its arguments.
func relayEnv(relay *outboxv1alpha1.OutboxRelay, settings relayconfig.Command) []corev1.EnvVar {
	spec := &relay.Spec
	env := []corev1.EnvVar{secretEnv(relayconfig.EnvDSN, spec.DSNSecretRef.Name,
		cmp.Or(spec.DSNSecretRef.Key, outboxv1alpha1.DefaultDSNKey))}
	if sasl := spec.Kafka.SASL; sasl != nil && sasl.CredentialsSecretRef != nil {
		ref := sasl.CredentialsSecretRef
		env = append(env,
			secretEnv(relayconfig.EnvSASLUsername, ref.Name, cmp.Or(ref.UsernameKey, outboxv1alpha1.DefaultSASLUsernameKey)),
			secretEnv(relayconfig.EnvSASLPassword, ref.Name, cmp.Or(ref.PasswordKey, outboxv1alpha1.DefaultSASLPasswordKey)))
	}
	env = append(env, corev1.EnvVar{Name: relayconfig.EnvArgsOnly, Value: "true"}) // settings come from the arguments
	for _, v := range settings.HeldEnv() {
		env = append(env, corev1.EnvVar{Name: v[0], Value: v[1]})
	}
	return append(env, tracingEnv(relay)...)
}

func secretEnv(name, secret, key string) corev1.EnvVar {
	return corev1.EnvVar{Name: name, ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
		LocalObjectReference: corev1.LocalObjectReference{Name: secret}, Key: key,
	}}}
}

// defaultResources are the relay container's resources when the spec sets none.
func defaultResources(s relayconfig.Settings) corev1.ResourceRequirements {
	return corev1.ResourceRequirements{
		Requests: corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("50m"),
			corev1.ResourceMemory: resource.MustParse("64Mi"),
		},
		Limits: corev1.ResourceList{corev1.ResourceMemory: memoryLimit(s)},
	}
}

// memoryLimit is the relay container's default memory limit: a base for the
// process (the benchmark's steady-state relay stays within 64 MiB, its
// target; twice that leaves room for the Go runtime's heap growth) plus,
// for each batch that may be in flight (maxInFlight), two copies of the
// largest batch maxBatchBytes allows: the claimed rows and the records
// built from them.
func memoryLimit(s relayconfig.Settings) resource.Quantity {
	s = s.WithDefaults()
	const base = 128 << 20
	bytes := int64(base) + 2*int64(s.MaxInFlight)*int64(s.MaxBatchBytes)
	const mi = 1 << 20
	return *resource.NewQuantity((bytes+mi-1)/mi*mi, resource.BinarySI)
}

// databaseTLSVolume projects spec.database.tls's CA (as ca.crt) and client
// certificate (tls.crt, tls.key) into one read-only volume.
func databaseTLSVolume(relay *outboxv1alpha1.OutboxRelay) (corev1.Volume, bool) {
	db := relay.Spec.Database
	if db == nil || db.TLS == nil {
		return corev1.Volume{}, false
	}
	var sources []corev1.VolumeProjection
	caItem := func(key string) []corev1.KeyToPath {
		return []corev1.KeyToPath{{Key: cmp.Or(key, outboxv1alpha1.DefaultCAKey), Path: outboxv1alpha1.DefaultCAKey}}
	}
	if ref := db.TLS.CA.SecretRef; ref != nil {
		sources = append(sources, corev1.VolumeProjection{Secret: &corev1.SecretProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: ref.Name}, Items: caItem(ref.Key)}})
	}
	if ref := db.TLS.CA.ConfigMapRef; ref != nil {
		sources = append(sources, corev1.VolumeProjection{ConfigMap: &corev1.ConfigMapProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: ref.Name}, Items: caItem(ref.Key)}})
	}
	if ref := db.TLS.ClientCertSecretRef; ref != nil {
		sources = append(sources, corev1.VolumeProjection{Secret: &corev1.SecretProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: ref.Name},
			Items:                []corev1.KeyToPath{{Key: corev1.TLSCertKey, Path: corev1.TLSCertKey}, {Key: corev1.TLSPrivateKeyKey, Path: corev1.TLSPrivateKeyKey}}}})
	}
	return corev1.Volume{Name: outboxv1alpha1.ReservedDatabaseVolume, VolumeSource: corev1.VolumeSource{
		Projected: &corev1.ProjectedVolumeSource{Sources: sources, DefaultMode: ptr.To[int32](0o440)},
	}}, true
}

// containerSeccomp is the relay container's default seccomp profile:
// RuntimeDefault, unless the template's pod security context sets one,
// which a container's own would override (the pod's is the default of its
// containers) and which must therefore reach the container.
func containerSeccomp(pod *corev1.PodSecurityContext) *corev1.SeccompProfile {
	if pod != nil && pod.SeccompProfile != nil {
		return nil
	}
	return &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}
}

// overlay is base with every field over sets replacing base's, and each
// object field merged the same way, field by field; base when over is nil.
// A field left unset in over keeps base's value, so a template that adds a
// capability keeps the default's drop of all the others; a list replaces
// base's.
func overlay[T any](base, over *T) *T {
	if over == nil {
		return base
	}
	var m, fields map[string]any
	b, err1 := json.Marshal(base)
	o, err2 := json.Marshal(over)
	err3, err4 := json.Unmarshal(b, &m), json.Unmarshal(o, &fields)
	merged, err5 := json.Marshal(mergeFields(m, fields))
	out := new(T)
	if err := errors.Join(err1, err2, err3, err4, err5, json.Unmarshal(merged, out)); err != nil {
		panic(fmt.Sprintf("overlay %T: %v", base, err)) // the API types always marshal
	}
	return out
}

// mergeFields sets over's fields in base, merging where both hold an object.
func mergeFields(base, over map[string]any) map[string]any {
	if base == nil {
		base = map[string]any{}
	}
	for k, v := range over {
		if sub, ok := v.(map[string]any); ok {
			if cur, ok := base[k].(map[string]any); ok {
				base[k] = mergeFields(cur, sub)
				continue
			}
		}
		base[k] = v
	}
	return base
}

// podTemplate and containerTemplate are t's parts, empty when unset (t too).
func podTemplate(t *outboxv1alpha1.RelayPodTemplate) *outboxv1alpha1.RelayPodSpec {
	if t == nil || t.Pod == nil {
		return &outboxv1alpha1.RelayPodSpec{}
	}
	return t.Pod
}

func containerTemplate(t *outboxv1alpha1.RelayPodTemplate) *outboxv1alpha1.RelayContainerSpec {
	if t == nil || t.Container == nil {
		return &outboxv1alpha1.RelayContainerSpec{}
	}
	return t.Container
}

// mode is what no two replicas of one table may differ in: how they claim
// (--ordering) and how they find new rows (--capture). Replicas of two
// orderings would interleave a key's rows; a streaming relay and a polling
// one publish the same rows in two orders.
type mode struct {
	ordering relayconfig.Ordering
	capture  relayconfig.Capture
}

// templateMode is the mode the relay container of d runs with.
func templateMode(d *appsv1.Deployment) mode {
	m := mode{ordering: relayconfig.DefaultOrdering, capture: relayconfig.CapturePoll}
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name != containerName {
			continue
		}
		for _, a := range c.Args { // the last one wins, as in flag parsing
			if v, ok := strings.CutPrefix(a, "--"+relayconfig.FlagOrdering+"="); ok {
				m.ordering = relayconfig.Ordering(v)
			}
			if v, ok := strings.CutPrefix(a, "--"+relayconfig.FlagCapture+"="); ok {
				m.capture = relayconfig.Capture(v)
			}
		}
	}
	return m
}

// rolloutStrategy is Recreate while the relay switches mode (ordering or
// capture), so that no replica of the old mode runs beside one of the new:
// from the rollout that changes it until that rollout has replaced every
// pod. Otherwise it is RollingUpdate (the API server's 25% surge and
// unavailability). current is the Deployment as it runs, nil when none.
func rolloutStrategy(current *appsv1.Deployment, m mode) appsv1.DeploymentStrategy {
	recreate := appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType}
	switch {
	case current == nil:
	case templateMode(current) != m:
		return recreate
	case current.Spec.Strategy.Type == appsv1.RecreateDeploymentStrategyType &&
		!rolledOut(current, ptr.Deref(current.Spec.Replicas, 1)):
		return recreate
	}
	return appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType}
}

// kafkaTLSItems are the keys of the Kafka TLS Secret the relay reads and
// the Secret holds (in says which). Only they are mounted: such a Secret
// may hold more (a Strimzi KafkaUser's holds user.p12 and user.password),
// which no relay pod is to see. None: no volume, as a volume that lists no
// keys mounts all of them.
func kafkaTLSItems(in secretInputs) []corev1.KeyToPath {
	var keys []string
	if in.TLSCA {
		keys = append(keys, outboxv1alpha1.DefaultCAKey)
	}
	if in.TLSClientCert {
		keys = append(keys, corev1.TLSCertKey, corev1.TLSPrivateKeyKey)
	}
	items := make([]corev1.KeyToPath, 0, len(keys))
	for _, k := range keys {
		items = append(items, corev1.KeyToPath{Key: k, Path: k})
	}
	return items
}

// terminationGracePeriodSeconds outlasts the relay's shutdown, which waits
// for the batch in flight (relayconfig.BatchDeadline): 30 s at the default
// publish timeout. A shorter one killed a batch published to Kafka before
// its mark, to be published again.
func terminationGracePeriodSeconds(publishTimeout time.Duration) int64 {
	return int64((relayconfig.BatchDeadline(publishTimeout) + shutdownMargin + time.Second - 1) / time.Second)
}

// relayDeployment builds the desired relay Deployment from settings, the
// relay's settings that checkSpec built and checked. in is what the
// referenced Secrets provide; current is the Deployment as it runs (nil
// when none), which decides the rollout strategy.
func relayDeployment(relay *outboxv1alpha1.OutboxRelay, img images, settings relayconfig.Command, in secretInputs, current *appsv1.Deployment) *appsv1.Deployment {
	spec := &relay.Spec
	image := cmp.Or(spec.Image, img.fallback)
	args := settings.Args()
	env := relayEnv(relay, settings)

	tmpl := spec.Template
	if tmpl == nil {
		tmpl = &outboxv1alpha1.RelayPodTemplate{}
	}
	podLabels := maps.Clone(spec.PodLabels)
	if podLabels == nil {
		podLabels = map[string]string{}
	}
	podAnnotations := maps.Clone(spec.PodAnnotations)
	if podAnnotations == nil {
		podAnnotations = map[string]string{}
	}
	if m := tmpl.Metadata; m != nil {
		maps.Copy(podLabels, m.Labels)
		maps.Copy(podAnnotations, m.Annotations)
	}
	maps.Copy(podLabels, commonLabels(relay))
	podAnnotations[configHashAnnotation] = hashOf(struct {
		Image          string
		Args           []string
		Env            []corev1.EnvVar
		SecretVersions string
	}{image, args, env, in.Versions})

	resources := defaultResources(settings.Settings)
	if spec.Resources != nil {
		resources = *spec.Resources.DeepCopy()
	}
	container := corev1.Container{
		Name:            containerName,
		Image:           image,
		ImagePullPolicy: spec.ImagePullPolicy,
		Command:         []string{relayBinary},
		Args:            args,
		Env:             env,
		Ports: []corev1.ContainerPort{{
			Name: metricsPortName, ContainerPort: relayconfig.MetricsPort, Protocol: corev1.ProtocolTCP,
		}},
		LivenessProbe:  httpProbe("/healthz", 10, 3),
		ReadinessProbe: httpProbe("/readyz", readinessPeriodSeconds, 1),
		Resources:      resources,
		SecurityContext: overlay(&corev1.SecurityContext{
			RunAsNonRoot:             ptr.To(true),
			ReadOnlyRootFilesystem:   ptr.To(true),
			AllowPrivilegeEscalation: ptr.To(false),
			Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			SeccompProfile:           containerSeccomp(podTemplate(tmpl).SecurityContext),
		}, containerTemplate(tmpl).SecurityContext),
	}
	podSpec := corev1.PodSpec{
		Containers:                    []corev1.Container{container},
		ServiceAccountName:            podTemplate(tmpl).ServiceAccountName,
		AutomountServiceAccountToken:  cmp.Or(podTemplate(tmpl).AutomountServiceAccountToken, ptr.To(false)),
		TopologySpreadConstraints:     slices.Clone(podTemplate(tmpl).TopologySpreadConstraints),
		EnableServiceLinks:            ptr.To(false),
		TerminationGracePeriodSeconds: ptr.To(terminationGracePeriodSeconds(settings.PublishTimeout)),
		ImagePullSecrets:              slices.Clone(spec.ImagePullSecrets),
		NodeSelector:                  maps.Clone(spec.NodeSelector),
		Tolerations:                   slices.Clone(spec.Tolerations),
		Affinity:                      spec.Affinity.DeepCopy(),
		PriorityClassName:             spec.PriorityClassName,
		SecurityContext: overlay(&corev1.PodSecurityContext{
			RunAsNonRoot:   ptr.To(true),
			RunAsUser:      ptr.To[int64](nonRootID),
			RunAsGroup:     ptr.To[int64](nonRootID),
			FSGroup:        ptr.To[int64](nonRootID),
			SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		}, podTemplate(tmpl).SecurityContext),
	}
	if items := kafkaTLSItems(in); spec.Kafka.TLS != nil && spec.Kafka.TLS.SecretRef != nil && len(items) > 0 {
		podSpec.Volumes = []corev1.Volume{{
			Name: outboxv1alpha1.ReservedVolume,
			VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
				SecretName: spec.Kafka.TLS.SecretRef.Name, Items: items, DefaultMode: ptr.To[int32](0o440),
			}},
		}}
		podSpec.Containers[0].VolumeMounts = []corev1.VolumeMount{{
			Name: outboxv1alpha1.ReservedVolume, MountPath: tlsMountPath, ReadOnly: true,
		}}
	}

	if v, ok := databaseTLSVolume(relay); ok {
		podSpec.Volumes = append(podSpec.Volumes, v)
		podSpec.Containers[0].VolumeMounts = append(podSpec.Containers[0].VolumeMounts, corev1.VolumeMount{
			Name: outboxv1alpha1.ReservedDatabaseVolume, MountPath: dbTLSMountPath, ReadOnly: true,
		})
	}
	// The template's additions come after the relay's own, which they
	// cannot replace (the API refuses their names).
	for _, v := range podTemplate(tmpl).Volumes {
		podSpec.Volumes = append(podSpec.Volumes, v.Volume())
	}
	c := &podSpec.Containers[0]
	for _, e := range containerTemplate(tmpl).Env {
		c.Env = append(c.Env, e.EnvVar())
	}
	for _, e := range containerTemplate(tmpl).EnvFrom {
		c.EnvFrom = append(c.EnvFrom, e.EnvFromSource())
	}
	c.VolumeMounts = append(c.VolumeMounts, containerTemplate(tmpl).VolumeMounts...)

	d := &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: childMeta(relay),
		Spec: appsv1.DeploymentSpec{
			Replicas:             ptr.To(desiredReplicas(relay)),
			Selector:             &metav1.LabelSelector{MatchLabels: selectorLabels(relay)},
			Strategy:             rolloutStrategy(current, mode{ordering: settings.Ordering, capture: settings.Capture}),
			RevisionHistoryLimit: ptr.To[int32](3),
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels, Annotations: podAnnotations},
				Spec:       podSpec,
			},
		},
	}
	d.Annotations[specHashAnnotation] = hashOf(d.Spec)
	if in.Record != nil {
		d.Annotations[secretVersionsAnnotation] = in.Record.String()
	}
	return d
}

// readinessPeriodSeconds is how often the kubelet asks a relay's /readyz.
// Short, so that a new pod counts as ready soon after it is: a rolling
// update waits for it before stopping an old pod, the PodDisruptionBudget
// counts it, and status.ready shows it. The probe is an HTTP GET the relay
// answers from memory.
const readinessPeriodSeconds = 2

func httpProbe(path string, periodSeconds, failureThreshold int32) *corev1.Probe {
	return &corev1.Probe{
		ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{
			Path: path, Port: intstr.FromString(metricsPortName), Scheme: corev1.URISchemeHTTP,
		}},
		PeriodSeconds:    periodSeconds,
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
			Selector: selectorLabels(relay),
			Ports: []corev1.ServicePort{{
				Name: metricsPortName, Port: relayconfig.MetricsPort, Protocol: corev1.ProtocolTCP,
				TargetPort: intstr.FromString(metricsPortName),
			}},
		},
	}
	s.Annotations[specHashAnnotation] = hashOf(s.Spec)
	return s
}

// relayPDB builds the desired PodDisruptionBudget, or nil when the relay
// runs fewer than two replicas (a PDB over one pod only blocks node drains).
// A pod that is not ready may always be evicted: it publishes nothing, and
// under the default policy (IfHealthyBudget) relay pods all unready at once
// (the broker down, a wrong password) would block every node drain.
func relayPDB(relay *outboxv1alpha1.OutboxRelay) *policyv1.PodDisruptionBudget {
	if desiredReplicas(relay) < 2 {
		return nil
	}
	p := &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: childMeta(relay),
		Spec: policyv1.PodDisruptionBudgetSpec{
			MaxUnavailable:             ptr.To(intstr.FromInt32(1)),
			Selector:                   &metav1.LabelSelector{MatchLabels: selectorLabels(relay)},
			UnhealthyPodEvictionPolicy: ptr.To(policyv1.AlwaysAllow),
		},
	}
	p.Annotations[specHashAnnotation] = hashOf(p.Spec)
	return p
}

// childMeta is a child's name, namespace and labels; ensure adds the
// controller reference when it creates the child.
func childMeta(relay *outboxv1alpha1.OutboxRelay) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:        childName(relay),
		Namespace:   relay.Namespace,
		Labels:      commonLabels(relay),
		Annotations: map[string]string{},
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
