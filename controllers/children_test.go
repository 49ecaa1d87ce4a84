package controllers

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

func unitRelay() *outboxv1alpha1.OutboxRelay {
	relay, _ := minimalRelay("ns", "orders")
	relay.UID = "uid-1"
	relay.Generation = 4
	return relay
}

var testImages = images{fallback: "img:default", allowed: []string{AnyImage}}

func build(t *testing.T, relay *outboxv1alpha1.OutboxRelay, in secretInputs) *appsv1.Deployment {
	t.Helper()
	d, err := buildDeployment(relay, testImages, in, nil)
	require.NoError(t, err)
	return d
}

func TestRelayDeploymentDefaultsAndArgs(t *testing.T) {
	t.Parallel()
	d := build(t, unitRelay(), secretInputs{Versions: "h"})
	require.Equal(t, "orders-relay", d.Name)
	require.Equal(t, int32(1), *d.Spec.Replicas)
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, d.Spec.Strategy.Type)
	ct := d.Spec.Template.Spec.Containers[0]
	require.Equal(t, "img:default", ct.Image)
	require.Equal(t, []string{
		"--table=outbox", "--brokers=127.0.0.1:9092", "--batch-size=50", "--max-batch-bytes=4194304",
		"--poll-interval=200ms", "--publish-timeout=10s", "--stall-timeout=2m0s",
		"--max-in-flight=2", "--on-publish=mark", "--keep-published-for=0s", "--prune-batch-size=1000",
		"--topic=OrderConfirmed=orders.confirmed", "--ordering=none", "--metrics-addr=:9090", "--log-format=json",
	}, specArgs(ct.Args), "a flag newer than the first release is not given at its default (--linger)")
	require.Equal(t, relayconfig.EnvDSN, ct.Env[0].Name)
	require.Equal(t, "dsn", ct.Env[0].ValueFrom.SecretKeyRef.Key, "the key defaults to dsn")
	require.Equal(t, defaultResources(relayconfig.Settings{}), ct.Resources)
	require.Equal(t, "144Mi", ct.Resources.Limits.Memory().String(), "128Mi and two copies of two 4 MiB batches in flight")
	require.False(t, *d.Spec.Template.Spec.AutomountServiceAccountToken, "no API token by default")
	require.Equal(t, int32(relayconfig.MetricsPort), ct.Ports[0].ContainerPort)
	require.Empty(t, d.Spec.Template.Spec.Volumes)
	require.Empty(t, d.OwnerReferences, "ensure sets the controller reference when it creates the child")
}

func TestRelayDeploymentSpecFields(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	s := &relay.Spec
	s.Table, s.BatchSize, s.MaxBatchBytes, s.PollInterval = "events.outbox", ptr.To[int32](500), ptr.To[int32](1<<20), "1s"
	s.Linger = "20ms"
	s.Topics = map[string]outboxv1alpha1.TopicName{"b": "topic-b", "a": "topic-a", "c": "topic-c"}
	s.DeadLetterTopic = "dlq"
	s.Ordering = outboxv1alpha1.OrderingPartitionKey
	s.Kafka.Brokers = []outboxv1alpha1.BrokerAddress{"k1:9092", "k2:9093"}
	s.Image, s.ImagePullPolicy = "my/relay:1", corev1.PullAlways
	s.ImagePullSecrets = []corev1.LocalObjectReference{{Name: "regcred"}}
	s.NodeSelector = map[string]string{"pool": "relays"}
	s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}}
	s.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{}}
	s.PriorityClassName = "high"
	s.PodAnnotations = map[string]string{"prometheus.io/scrape": "true"}
	s.PodLabels = map[string]string{"team": "orders"}
	s.Resources = &corev1.ResourceRequirements{}

	d := build(t, relay, secretInputs{})
	pod := d.Spec.Template.Spec
	ct := pod.Containers[0]
	require.Equal(t, []string{
		"--table=events.outbox", "--brokers=k1:9092,k2:9093", "--batch-size=500", "--max-batch-bytes=1048576",
		"--poll-interval=1s", "--linger=20ms", "--publish-timeout=10s", "--stall-timeout=2m0s",
		"--max-in-flight=2", "--on-publish=mark", "--keep-published-for=0s", "--prune-batch-size=1000",
		"--topic=a=topic-a", "--topic=b=topic-b", "--topic=c=topic-c", "--dead-letter-topic=dlq",
		"--ordering=partition-key", "--metrics-addr=:9090", "--log-format=json",
	}, specArgs(ct.Args))
	require.Equal(t, "my/relay:1", ct.Image)
	require.Equal(t, corev1.PullAlways, ct.ImagePullPolicy)
	require.Equal(t, corev1.ResourceRequirements{}, ct.Resources)
	require.Equal(t, s.ImagePullSecrets, pod.ImagePullSecrets)
	require.Equal(t, s.NodeSelector, pod.NodeSelector)
	require.Equal(t, s.Tolerations, pod.Tolerations)
	require.Equal(t, s.Affinity, pod.Affinity)
	require.Equal(t, "high", pod.PriorityClassName)
	require.Equal(t, "true", d.Spec.Template.Annotations["prometheus.io/scrape"])
	require.Equal(t, "orders", d.Spec.Template.Labels["team"])
	for k, v := range selectorLabels(relay) {
		require.Equal(t, v, d.Spec.Template.Labels[k])
	}
}

func TestRelayDeploymentTLSAndSASL(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	relay.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{}
	d := build(t, relay, secretInputs{})
	require.Contains(t, d.Spec.Template.Spec.Containers[0].Args, "--kafka-tls")
	require.Empty(t, d.Spec.Template.Spec.Volumes, "TLS with system roots mounts nothing")

	relay.Spec.Kafka.TLS.SecretRef = &outboxv1alpha1.SecretReference{Name: "ca-only"}
	relay.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{
		Mechanism:            outboxv1alpha1.SASLPlain,
		CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: "creds"},
	}
	d = build(t, relay, secretInputs{TLSCA: true})
	ct := d.Spec.Template.Spec.Containers[0]
	require.Contains(t, ct.Args, "--kafka-tls-ca-file=/etc/relay/tls/ca.crt")
	require.NotContains(t, strings.Join(ct.Args, " "), "--kafka-tls-cert-file", "no client certificate in a CA-only Secret")
	require.Contains(t, ct.Args, "--kafka-sasl-mechanism=PLAIN")
	require.Equal(t, ptr.To[int32](0o440), d.Spec.Template.Spec.Volumes[0].Secret.DefaultMode)
	require.True(t, ct.VolumeMounts[0].ReadOnly)
	names := []string{}
	for _, e := range ct.Env {
		if e.ValueFrom == nil {
			require.Contains(t, []corev1.EnvVar{{Name: "RELAY_ARGS_ONLY", Value: "true"}, {Name: "RELAY_TABLE", Value: "outbox"}}, e)
			continue
		}
		require.Nil(t, e.ValueFrom.FieldRef)
		require.Equal(t, map[string]string{"RELAY_DSN": "orders-dsn", "RELAY_KAFKA_SASL_USERNAME": "creds", "RELAY_KAFKA_SASL_PASSWORD": "creds"}[e.Name],
			e.ValueFrom.SecretKeyRef.Name)
		names = append(names, e.ValueFrom.SecretKeyRef.Key)
	}
	require.Equal(t, []string{"dsn", "username", "password"}, names)
}

func TestConfigHashFollowsConfigAndSecretVersions(t *testing.T) {
	t.Parallel()
	hash := func(edit func(*outboxv1alpha1.OutboxRelay), in secretInputs) string {
		relay := unitRelay()
		if edit != nil {
			edit(relay)
		}
		return build(t, relay, in).Spec.Template.Annotations[configHashAnnotation]
	}
	v1 := secretInputs{Versions: "orders-dsn/uid-a/100"}
	base := hash(nil, v1)
	require.Equal(t, base, hash(nil, v1), "the same inputs give the same hash")
	require.NotEqual(t, base, hash(nil, secretInputs{Versions: "orders-dsn/uid-a/101"}), "a new Secret version")
	require.NotEqual(t, base, hash(nil, secretInputs{Versions: "orders-dsn/uid-b/100"}), "a re-created Secret")
	require.NotEqual(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Topics["X"] = "x" }, v1), "topics")
	require.NotEqual(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.BatchSize = ptr.To[int32](7) }, v1), "batch size")
	require.NotEqual(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.MaxBatchBytes = ptr.To[int32](1 << 20) }, v1), "max batch bytes")
	require.Equal(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Replicas = ptr.To[int32](5) }, v1),
		"scaling does not roll the pods")

	// The spec hash on the Deployment changes with replicas but not with the order maps were built in.
	d1 := build(t, unitRelay(), secretInputs{})
	relay := unitRelay()
	relay.Spec.Replicas = ptr.To[int32](2)
	require.NotEqual(t, d1.Annotations[specHashAnnotation], build(t, relay, secretInputs{}).Annotations[specHashAnnotation])
}

// TestRolloutStrategyOnOrderingSwitch: a change of --ordering or --capture
// rolls out with Recreate, kept until that rollout has replaced every pod;
// anything else rolls out with RollingUpdate.
func TestRolloutStrategyOnOrderingSwitch(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	running := build(t, relay, secretInputs{})
	running.Generation = 3
	running.Status = appsv1.DeploymentStatus{ObservedGeneration: 3, Replicas: 1, UpdatedReplicas: 1, AvailableReplicas: 1}
	strategy := func(edit func(*outboxv1alpha1.OutboxRelay), current *appsv1.Deployment) appsv1.DeploymentStrategyType {
		r := unitRelay()
		if edit != nil {
			edit(r)
		}
		d, err := buildDeployment(r, testImages, secretInputs{}, current)
		require.NoError(t, err)
		return d.Spec.Strategy.Type
	}
	toPartitionKey := func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Ordering = outboxv1alpha1.OrderingPartitionKey }
	toNone := func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Ordering = outboxv1alpha1.OrderingNone }

	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, strategy(nil, nil), "a new relay")
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, strategy(func(r *outboxv1alpha1.OutboxRelay) {
		r.Spec.BatchSize = ptr.To[int32](9)
	}, running), "a change that keeps the ordering")
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, strategy(toNone, running), "None written out is still none")
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(toPartitionKey, running), "None -> PartitionKey")

	// The switch has been written: the template runs partition-key with Recreate.
	switching, err := buildDeployment(func() *outboxv1alpha1.OutboxRelay { r := unitRelay(); toPartitionKey(r); return r }(),
		testImages, secretInputs{}, running)
	require.NoError(t, err)
	switching.Generation = 4
	switching.Status = running.Status // the Deployment controller has not caught up
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(toPartitionKey, switching), "kept while old pods may run")
	switching.Status = appsv1.DeploymentStatus{ObservedGeneration: 4, Replicas: 1, UpdatedReplicas: 0}
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(toPartitionKey, switching), "kept until every pod is replaced")
	switching.Status = appsv1.DeploymentStatus{ObservedGeneration: 4, Replicas: 1, UpdatedReplicas: 1, AvailableReplicas: 1}
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, strategy(toPartitionKey, switching), "back to RollingUpdate once done")
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(toNone, switching), "PartitionKey -> None")

	// A template without --ordering or --capture runs the relay's defaults.
	bare := running.DeepCopy()
	bare.Spec.Template.Spec.Containers[0].Args = nil
	require.Equal(t, mode{ordering: relayconfig.OrderingNone, capture: relayconfig.CapturePoll}, templateMode(bare))
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(toPartitionKey, bare))
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, strategy(nil, bare))

	// A switch of capture mode, either way, rolls out with Recreate too: a
	// streaming replica beside a polling one publishes rows in two orders.
	toStreaming := func(r *outboxv1alpha1.OutboxRelay) {
		r.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication}
	}
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(toStreaming, running), "Poll -> LogicalReplication")
	streaming, err := buildDeployment(func() *outboxv1alpha1.OutboxRelay { r := unitRelay(); toStreaming(r); return r }(),
		testImages, secretInputs{}, running)
	require.NoError(t, err)
	require.Equal(t, relayconfig.CaptureLogicalReplication, templateMode(streaming).capture)
	streaming.Generation = 5
	streaming.Status = appsv1.DeploymentStatus{ObservedGeneration: 5, Replicas: 1, UpdatedReplicas: 1, AvailableReplicas: 1}
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, strategy(toStreaming, streaming), "streaming, rolled out")
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, strategy(nil, streaming), "LogicalReplication -> Poll")
}

func TestOrderingsCoverTheAPI(t *testing.T) {
	t.Parallel()
	got := []relayconfig.Ordering{}
	for _, mode := range []outboxv1alpha1.OrderingMode{outboxv1alpha1.OrderingNone, outboxv1alpha1.OrderingPartitionKey} {
		o, ok := orderings[mode]
		require.True(t, ok, "API ordering %s has no relay ordering", mode)
		got = append(got, o)
	}
	require.ElementsMatch(t, relayconfig.Orderings, got, "every relay ordering is reachable from the API")
	require.Len(t, orderings, len(relayconfig.Orderings))
}

func TestReplicasSuspendAndPDB(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		replicas *int32
		suspend  bool
		want     int32
		pdb      bool
	}{
		{nil, false, 1, false},
		{ptr.To[int32](0), false, 0, false},
		{ptr.To[int32](1), false, 1, false},
		{ptr.To[int32](2), false, 2, true},
		{ptr.To[int32](5), true, 0, false},
	} {
		relay := unitRelay()
		relay.Spec.Replicas, relay.Spec.Suspend = tc.replicas, tc.suspend
		require.Equal(t, tc.want, *build(t, relay, secretInputs{}).Spec.Replicas)
		pdb := relayPDB(relay)
		require.Equal(t, tc.pdb, pdb != nil, "replicas %v suspend %v", tc.replicas, tc.suspend)
		if pdb != nil {
			require.Equal(t, 1, pdb.Spec.MaxUnavailable.IntValue())
			require.Equal(t, selectorLabels(relay), pdb.Spec.Selector.MatchLabels)
			require.Equal(t, policyv1.AlwaysAllow, *pdb.Spec.UnhealthyPodEvictionPolicy, "unready pods do not block a drain")
		}
	}
}

func TestValidateSpecCatchesWhatTheSchemaCannot(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		edit func(*outboxv1alpha1.OutboxRelay)
		want []string
	}{
		"pod label takes the selector": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.PodLabels = map[string]string{"app.kubernetes.io/name": "x"}
		}, []string{"spec.podLabels"}},
		"pod annotation takes the config hash": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.PodAnnotations = map[string]string{configHashAnnotation: "x"}
		}, []string{"spec.podAnnotations"}},
		"template mount over the relay's binary, spelt otherwise": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Template = &outboxv1alpha1.RelayPodTemplate{Container: &outboxv1alpha1.RelayContainerSpec{
				VolumeMounts: []corev1.VolumeMount{{Name: "bin", MountPath: "//relay/", SubPath: "relay"}}}}
		}, []string{`spec.template.container.volumeMounts: "//relay/" is /relay, the relay's own`}},
		"template mount over the relay's binary, relative": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Template = &outboxv1alpha1.RelayPodTemplate{Container: &outboxv1alpha1.RelayContainerSpec{
				VolumeMounts: []corev1.VolumeMount{{Name: "bin", MountPath: "relay", SubPath: "relay"}}}}
		}, []string{`spec.template.container.volumeMounts: "relay" is /relay, the relay's own`}},
		"template mount under /etc/relay, relative": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Template = &outboxv1alpha1.RelayPodTemplate{Container: &outboxv1alpha1.RelayContainerSpec{
				VolumeMounts: []corev1.VolumeMount{{Name: "ca", MountPath: "./etc/relay/tls"}}}}
		}, []string{`"./etc/relay/tls" is /etc/relay/tls`}},
		"template mount under /etc/relay, spelt otherwise": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Template = &outboxv1alpha1.RelayPodTemplate{Container: &outboxv1alpha1.RelayContainerSpec{
				VolumeMounts: []corev1.VolumeMount{{Name: "ca", MountPath: "/etc//relay/./tls"}}}}
		}, []string{`"/etc//relay/./tls" is /etc/relay/tls`}},
		"template pod with an unsafe sysctl": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Template = &outboxv1alpha1.RelayPodTemplate{Pod: &outboxv1alpha1.RelayPodSpec{
				SecurityContext: &corev1.PodSecurityContext{Sysctls: []corev1.Sysctl{{Name: "kernel.msgmax", Value: "65536"}}}}}
		}, []string{`spec.template: the relay pod would break Pod Security restricted: forbidden sysctls (kernel.msgmax)`}},
		"template container dropping less than all, stored before the rule": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Template = &outboxv1alpha1.RelayPodTemplate{Container: &outboxv1alpha1.RelayContainerSpec{
				SecurityContext: &corev1.SecurityContext{Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"NET_RAW"}}}}}
		}, []string{`Pod Security restricted: unrestricted capabilities`, `capabilities.drop=["ALL"]`}},
		"poll interval out of range":   {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.PollInterval = "2h" }, []string{"spec.pollInterval: 2h0m0s is outside"}},
		"poll interval not a duration": {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.PollInterval = "soon" }, []string{"spec.pollInterval"}},
		"no topics":                    {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Topics = nil }, []string{"spec.topics"}},
		"upper-case table":             {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Table = "Orders" }, []string{"spec.table"}},
		"batch size zero":              {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.BatchSize = ptr.To[int32](0) }, []string{"spec.batchSize"}},
		"max batch bytes too small": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.MaxBatchBytes = ptr.To[int32](relayconfig.MinMaxBatchBytes - 1)
		}, []string{"spec.maxBatchBytes"}},
		"ordering unknown": {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Ordering = "Strict" }, []string{"spec.ordering"}},
		"SASL PLAIN without TLS": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLPlain,
				CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: "creds"}}
		}, []string{"spec.kafka.sasl.mechanism", "--kafka-tls"}},
		"several at once": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.Table = "a.b.c"
			r.Spec.Kafka.Brokers = []outboxv1alpha1.BrokerAddress{"k:0"}
		}, []string{"spec.table", "spec.kafka.brokers"}},
	} {
		relay := unitRelay()
		tc.edit(relay)
		err := validateSpec(relay, testImages)
		require.Error(t, err, name)
		for _, want := range tc.want {
			require.ErrorContains(t, err, want, name)
		}
		_, err = buildDeployment(relay, testImages, secretInputs{}, nil)
		require.Error(t, err, "%s: the builder refuses what validateSpec refuses", name)
	}
	require.NoError(t, validateSpec(unitRelay(), testImages))
	require.ErrorContains(t, validateSpec(unitRelay(), images{}), "spec.image", "no image anywhere")
}

func TestImageAllowList(t *testing.T) {
	t.Parallel()
	img := images{fallback: "ghcr.io/outbox-relay/outbox-operator:v1", allowed: []string{"registry.example/relays/", "ghcr.io/acme/relay@"}}
	for image, ok := range map[string]bool{
		"": true, // the operator's own image
		"ghcr.io/outbox-relay/outbox-operator:v1": true, // named explicitly
		"registry.example/relays/relay:2":         true,
		"ghcr.io/acme/relay@sha256:0123":          true,
		"registry.example/relays-evil/relay:1":    false,
		"docker.io/someone/relay:latest":          false,
		"ghcr.io/acme/relay:latest":               false,
	} {
		relay := unitRelay()
		relay.Spec.Image = image
		err := validateSpec(relay, img)
		if ok {
			require.NoError(t, err, image)
			continue
		}
		require.ErrorContains(t, err, "spec.image", image)
		require.ErrorContains(t, err, image)
		require.ErrorContains(t, err, "registry.example/relays/, ghcr.io/acme/relay@", "the message names the allowed prefixes")
	}
	// No allow-list admits the operator's own repository only, any tag or digest.
	own := images{fallback: "ghcr.io/outbox-relay/outbox-operator:v1"}
	for image, ok := range map[string]bool{
		"ghcr.io/outbox-relay/outbox-operator:v2":          true,
		"ghcr.io/outbox-relay/outbox-operator@sha256:0123": true,
		"ghcr.io/outbox-relay/outbox-operator":             true,
		"ghcr.io/outbox-relay/outbox-operator-evil:v1":     false,
		"ghcr.io/outbox-relay/outbox-operator/evil:v1":     false,
		"docker.io/someone/relay:latest":                   false,
		"localhost:5000/outbox-relay/outbox-operator:v1":   false,
	} {
		relay := unitRelay()
		relay.Spec.Image = image
		err := validateSpec(relay, own)
		if ok {
			require.NoError(t, err, image)
			continue
		}
		require.ErrorContains(t, err, fmt.Sprintf("spec.image %q does not start with an allowed prefix (ghcr.io/outbox-relay/outbox-operator:, ghcr.io/outbox-relay/outbox-operator@;", image))
		require.ErrorContains(t, err, `"*" admits any image`)
	}
	// A prefix that does not end a part matches whole parts only.
	bare := images{fallback: "x", allowed: []string{"registry.example/acme"}}
	for image, ok := range map[string]bool{
		"registry.example/acme:1":            true,
		"registry.example/acme@sha256:0123":  true,
		"registry.example/acme/relay:1":      true,
		"registry.example/acme-evil/relay:1": false,
		"registry.example/acmerelay:1":       false,
		"registry.example/acme.evil.io/x:1":  false,
	} {
		relay := unitRelay()
		relay.Spec.Image = image
		if ok {
			require.NoError(t, validateSpec(relay, bare), image)
		} else {
			require.ErrorContains(t, validateSpec(relay, bare), "spec.image", image)
		}
	}
	require.Equal(t, "localhost:5000/r/x", imageRepository("localhost:5000/r/x:v1@sha256:00"))
	require.Equal(t, "localhost:5000/r/x", imageRepository("localhost:5000/r/x"))
	relay := unitRelay()
	relay.Spec.Image = "docker.io/someone/relay:latest"
	require.NoError(t, validateSpec(relay, images{fallback: "x", allowed: []string{AnyImage}}), `"*" admits any image`)
}

func TestRelayService(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	s := relayService(relay)
	require.Equal(t, "orders-relay", s.Name)
	require.Equal(t, selectorLabels(relay), s.Spec.Selector)
	require.Equal(t, int32(relayconfig.MetricsPort), s.Spec.Ports[0].Port)
	require.NotEmpty(t, s.Annotations[specHashAnnotation])
}

func TestComputeStatus(t *testing.T) {
	t.Parallel()
	deploy := func(replicas, updated, ready int32) *appsv1.Deployment {
		return &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Generation: 2},
			Status: appsv1.DeploymentStatus{
				ObservedGeneration: 2, Replicas: replicas, UpdatedReplicas: updated,
				ReadyReplicas: ready, AvailableReplicas: ready,
			},
		}
	}
	type conds struct{ ready, progressing, degraded string }
	for name, tc := range map[string]struct {
		replicas int32
		suspend  bool
		deploy   *appsv1.Deployment
		prob     *problem
		want     conds
		readyTxt string
	}{
		"available":      {2, false, deploy(2, 2, 2), nil, conds{"True/Available", "False/RolloutComplete", "False/AsExpected"}, "2/2"},
		"partly ready":   {2, false, deploy(2, 2, 1), nil, conds{"False/DeploymentUnavailable", "True/RollingOut", "False/AsExpected"}, "1/2"},
		"no deployment":  {1, false, nil, nil, conds{"False/DeploymentUnavailable", "True/RollingOut", "False/AsExpected"}, "0/1"},
		"rolling out":    {2, false, deploy(3, 1, 2), nil, conds{"True/Available", "True/RollingOut", "False/AsExpected"}, "2/2"},
		"suspended":      {2, true, deploy(0, 0, 0), nil, conds{"True/Suspended", "False/RolloutComplete", "False/AsExpected"}, "0/0"},
		"scaled to zero": {0, false, deploy(0, 0, 0), nil, conds{"True/ScaledToZero", "False/RolloutComplete", "False/AsExpected"}, "0/0"},
		"secret missing": {1, false, deploy(1, 1, 1), &problem{reason: outboxv1alpha1.ReasonSecretNotFound, message: "gone"}, conds{"False/SecretNotFound", "False/SecretNotFound", "True/SecretNotFound"}, "1/1"},
		"invalid spec":   {1, false, nil, &problem{reason: outboxv1alpha1.ReasonInvalidSpec, message: "bad"}, conds{"False/InvalidSpec", "False/InvalidSpec", "True/InvalidSpec"}, "0/1"},
	} {
		relay := unitRelay()
		relay.Spec.Replicas, relay.Spec.Suspend = ptr.To(tc.replicas), tc.suspend
		st := computeStatus(relay, tc.deploy, tc.prob, observation{})
		got := func(typ string) string {
			c := meta.FindStatusCondition(st.Conditions, typ)
			require.NotNil(t, c, "%s: %s", name, typ)
			require.Equal(t, relay.Generation, c.ObservedGeneration, name)
			return string(c.Status) + "/" + c.Reason
		}
		require.Equal(t, tc.want, conds{got("Ready"), got("Progressing"), got("Degraded")}, name)
		require.Equal(t, tc.readyTxt, st.Ready, name)
		require.Equal(t, relay.Generation, st.ObservedGeneration, name)
		require.Equal(t, "app.kubernetes.io/instance=orders,app.kubernetes.io/name=outbox-relay", st.Selector, name)
	}

	// An unchanged condition keeps its transition time.
	relay := unitRelay()
	relay.Status = computeStatus(relay, deploy(1, 1, 1), nil, observation{})
	before := meta.FindStatusCondition(relay.Status.Conditions, "Ready").LastTransitionTime
	relay.Status.Conditions[0].LastTransitionTime = metav1.NewTime(before.Add(-3600e9))
	again := computeStatus(relay, deploy(1, 1, 1), nil, observation{})
	require.Equal(t, relay.Status, again, "a second computation over the same inputs changes nothing")
}

// buildDeployment is what a reconcile does to build the Deployment: the
// settings checked once (checkSpec), the TLS Secret's files added, the
// Deployment built from them.
func buildDeployment(relay *outboxv1alpha1.OutboxRelay, img images, in secretInputs, current *appsv1.Deployment) (*appsv1.Deployment, error) {
	s, err := checkSpec(relay, img)
	if err != nil {
		return nil, err
	}
	kafkaFiles(&s, in)
	return relayDeployment(relay, img, s, in, current), nil
}

// validateSpec is checkSpec's verdict alone.
func validateSpec(relay *outboxv1alpha1.OutboxRelay, img images) error {
	_, err := checkSpec(relay, img)
	return err
}

// spec.template: its service account, environment, volumes, spread, labels
// and annotations reach the pods after the relay's own, and its security
// contexts are merged over the operator's.
func TestRelayDeploymentTemplate(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	relay.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{SecretRef: &outboxv1alpha1.SecretReference{Name: "kafka-ca"}}
	relay.Spec.PodLabels = map[string]string{"team": "old", "tier": "backend"}
	relay.Spec.Template = &outboxv1alpha1.RelayPodTemplate{
		Metadata: &outboxv1alpha1.PodTemplateMetadata{Labels: map[string]string{"team": "payments"}, Annotations: map[string]string{"example.com/a": "b"}},
		Pod: &outboxv1alpha1.RelayPodSpec{
			ServiceAccountName: "relay-irsa", AutomountServiceAccountToken: ptr.To(true),
			SecurityContext: &corev1.PodSecurityContext{RunAsUser: ptr.To[int64](1000700000), FSGroup: ptr.To[int64](1000700000)},
			Volumes: []outboxv1alpha1.RelayVolume{{Name: "pg-ca", ConfigMap: &corev1.ConfigMapVolumeSource{
				LocalObjectReference: corev1.LocalObjectReference{Name: "pg-ca"}}}},
			TopologySpreadConstraints: []corev1.TopologySpreadConstraint{{MaxSkew: 1, TopologyKey: "topology.kubernetes.io/zone", WhenUnsatisfiable: corev1.ScheduleAnyway}},
		},
		Container: &outboxv1alpha1.RelayContainerSpec{
			Env:          []outboxv1alpha1.RelayEnvVar{{Name: "AWS_REGION", Value: "eu-west-1"}},
			EnvFrom:      []outboxv1alpha1.RelayEnvFromSource{{ConfigMapRef: &corev1.ConfigMapEnvSource{LocalObjectReference: corev1.LocalObjectReference{Name: "proxy"}}}},
			VolumeMounts: []corev1.VolumeMount{{Name: "pg-ca", MountPath: "/etc/pg-ca", ReadOnly: true}},
			SecurityContext: &corev1.SecurityContext{ReadOnlyRootFilesystem: ptr.To(false),
				// A capability added keeps the default's drop of all the others.
				Capabilities:   &corev1.Capabilities{Add: []corev1.Capability{"NET_BIND_SERVICE"}},
				SELinuxOptions: &corev1.SELinuxOptions{Level: "s0:c1,c2"}},
		},
	}
	d := build(t, relay, secretInputs{TLSCA: true})
	pod := d.Spec.Template
	require.Equal(t, "payments", pod.Labels["team"], "the template wins over spec.podLabels")
	require.Equal(t, "backend", pod.Labels["tier"], "spec.podLabels is still read")
	require.Equal(t, "b", pod.Annotations["example.com/a"])
	require.Contains(t, pod.Annotations, configHashAnnotation)
	require.Equal(t, "relay-irsa", pod.Spec.ServiceAccountName)
	require.True(t, *pod.Spec.AutomountServiceAccountToken)
	require.Len(t, pod.Spec.TopologySpreadConstraints, 1)
	sc := pod.Spec.SecurityContext
	require.Equal(t, int64(1000700000), *sc.RunAsUser, "set in the template")
	require.Equal(t, int64(1000700000), *sc.FSGroup)
	require.Equal(t, int64(nonRootID), *sc.RunAsGroup, "unset in the template: the operator's")
	require.True(t, *sc.RunAsNonRoot)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, sc.SeccompProfile.Type)
	require.Equal(t, []string{"kafka-tls", "pg-ca"}, []string{pod.Spec.Volumes[0].Name, pod.Spec.Volumes[1].Name}, "the relay's volume first")
	require.NotNil(t, pod.Spec.Volumes[1].ConfigMap)
	c := pod.Spec.Containers[0]
	require.Equal(t, relayconfig.EnvDSN, c.Env[0].Name, "the relay's variables first")
	require.Equal(t, corev1.EnvVar{Name: "AWS_REGION", Value: "eu-west-1"}, c.Env[len(c.Env)-1])
	require.Equal(t, "proxy", c.EnvFrom[0].ConfigMapRef.Name)
	require.Equal(t, []string{tlsMountPath, "/etc/pg-ca"}, []string{c.VolumeMounts[0].MountPath, c.VolumeMounts[1].MountPath})
	require.False(t, *c.SecurityContext.ReadOnlyRootFilesystem, "set in the template")
	require.False(t, *c.SecurityContext.AllowPrivilegeEscalation, "unset in the template: the operator's")
	require.Equal(t, []corev1.Capability{"ALL"}, c.SecurityContext.Capabilities.Drop)
	require.Equal(t, []corev1.Capability{"NET_BIND_SERVICE"}, c.SecurityContext.Capabilities.Add, "set in the template")
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, c.SecurityContext.SeccompProfile.Type, "unset in the template: the operator's")
	require.Equal(t, "s0:c1,c2", c.SecurityContext.SELinuxOptions.Level, "set in the template")

	// A pod's profile is its containers' default: the container takes no
	// profile of its own then, or the pod's would have no effect.
	localhost := &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeLocalhost, LocalhostProfile: ptr.To("relay.json")}
	relay.Spec.Template.Pod.SecurityContext.SeccompProfile = localhost
	d = build(t, relay, secretInputs{TLSCA: true})
	require.Equal(t, localhost, d.Spec.Template.Spec.SecurityContext.SeccompProfile, "set in the template")
	require.Nil(t, d.Spec.Template.Spec.Containers[0].SecurityContext.SeccompProfile, "the pod's applies")
	relay.Spec.Template.Container.SecurityContext.SeccompProfile = &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}
	d = build(t, relay, secretInputs{TLSCA: true})
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, d.Spec.Template.Spec.Containers[0].SecurityContext.SeccompProfile.Type, "the container's own wins")
	relay.Spec.Template.Pod.SecurityContext.SeccompProfile = nil
	relay.Spec.Template.Container.SecurityContext.SeccompProfile = nil

	relay.Spec.Template.Metadata.Labels["app.kubernetes.io/instance"] = "x"
	require.ErrorContains(t, validateSpec(relay, testImages), "spec.template.metadata.labels must not set app.kubernetes.io/instance")
}

// The default memory limit grows with what a relay may hold in memory.
func TestDefaultMemoryLimit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		batchBytes, inFlight int
		want                 string
	}{{0, 0, "144Mi"}, {64 << 20, 1, "256Mi"}, {16 << 20, 2, "192Mi"}} {
		got := memoryLimit(relayconfig.Settings{MaxBatchBytes: c.batchBytes, MaxInFlight: c.inFlight})
		require.Equal(t, c.want, got.String(), "%+v", c)
	}
}

// spec.database.tls: one projected volume with the CA (from a Secret or a
// ConfigMap, as ca.crt) and the client certificate, and the relay's flags
// pointing at it.
func TestRelayDeploymentDatabaseTLS(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	relay.Spec.Database = &outboxv1alpha1.DatabaseSpec{TLS: &outboxv1alpha1.DatabaseTLS{
		CA:                  outboxv1alpha1.CABundleSource{ConfigMapRef: &outboxv1alpha1.KeyReference{Name: "pg-ca", Key: "bundle.pem"}},
		ClientCertSecretRef: &outboxv1alpha1.SecretReference{Name: "pg-client"},
	}}
	d := build(t, relay, secretInputs{})
	pod := d.Spec.Template.Spec
	require.Len(t, pod.Volumes, 1)
	v := pod.Volumes[0]
	require.Equal(t, outboxv1alpha1.ReservedDatabaseVolume, v.Name)
	require.Equal(t, "pg-ca", v.Projected.Sources[0].ConfigMap.Name)
	require.Equal(t, []corev1.KeyToPath{{Key: "bundle.pem", Path: "ca.crt"}}, v.Projected.Sources[0].ConfigMap.Items)
	require.Equal(t, "pg-client", v.Projected.Sources[1].Secret.Name)
	c := pod.Containers[0]
	require.Equal(t, dbTLSMountPath, c.VolumeMounts[0].MountPath)
	require.Subset(t, c.Args, []string{"--database-tls-ca-file=/etc/relay/database-tls/ca.crt",
		"--database-tls-cert-file=/etc/relay/database-tls/tls.crt", "--database-tls-key-file=/etc/relay/database-tls/tls.key"})
}

// The relay pods' grace period outlasts the relay's shutdown, which waits
// for the batch in flight, at every publish timeout the relay takes; at
// the default it stays 30 s, so an operator upgrade rolls no pod for it.
func TestGracePeriodOutlastsTheBatchInFlight(t *testing.T) {
	t.Parallel()
	for _, p := range []time.Duration{relayconfig.MinPublishTimeout, relayconfig.DefaultPublishTimeout, 17*time.Second + time.Millisecond, relayconfig.MaxPublishTimeout} {
		grace := time.Duration(terminationGracePeriodSeconds(p)) * time.Second
		require.GreaterOrEqual(t, grace, relayconfig.BatchDeadline(p)+shutdownMargin, p)
	}
	require.Equal(t, int64(30), terminationGracePeriodSeconds(relayconfig.DefaultPublishTimeout))
}
