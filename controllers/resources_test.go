package controllers

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

func unitRelay() *outboxv1alpha1.OutboxRelay {
	relay, _ := minimalRelay("ns", "orders")
	relay.UID = "uid-1"
	relay.Generation = 4
	return relay
}

func build(t *testing.T, relay *outboxv1alpha1.OutboxRelay, in secretInputs) *appsv1.Deployment {
	t.Helper()
	d, err := relayDeployment(relay, "img:default", in)
	require.NoError(t, err)
	return d
}

func TestRelayDeploymentDefaultsAndArgs(t *testing.T) {
	t.Parallel()
	d := build(t, unitRelay(), secretInputs{Hash: "h"})
	require.Equal(t, "orders-relay", d.Name)
	require.Equal(t, int32(1), *d.Spec.Replicas)
	ct := d.Spec.Template.Spec.Containers[0]
	require.Equal(t, "img:default", ct.Image)
	require.Equal(t, []string{
		"--table=outbox", "--brokers=127.0.0.1:9092", "--batch-size=50", "--poll-interval=200ms",
		"--topic=OrderConfirmed=orders.confirmed", "--ordering=none", "--metrics-addr=:9090", "--log-format=json",
	}, ct.Args)
	require.Equal(t, "dsn", ct.Env[0].ValueFrom.SecretKeyRef.Key, "the key defaults to dsn")
	require.Equal(t, defaultResources(), ct.Resources)
	require.Empty(t, d.Spec.Template.Spec.Volumes)
	owner := metav1.GetControllerOf(d)
	require.NotNil(t, owner)
	require.Equal(t, "OutboxRelay", owner.Kind)
	require.Equal(t, "uid-1", string(owner.UID))
}

func TestRelayDeploymentSpecFields(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	s := &relay.Spec
	s.Table, s.BatchSize, s.PollInterval = "events.outbox", 500, "1s"
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
		"--table=events.outbox", "--brokers=k1:9092,k2:9093", "--batch-size=500", "--poll-interval=1s",
		"--topic=a=topic-a", "--topic=b=topic-b", "--topic=c=topic-c", "--dead-letter-topic=dlq",
		"--ordering=partition-key", "--metrics-addr=:9090", "--log-format=json",
	}, ct.Args)
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
	for k, v := range SelectorLabels(relay) {
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
		CredentialsSecretRef: outboxv1alpha1.SASLCredentialsReference{Name: "creds"},
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
		require.Nil(t, e.ValueFrom.FieldRef)
		require.Equal(t, map[string]string{"RELAY_DSN": "orders-dsn", "RELAY_KAFKA_SASL_USERNAME": "creds", "RELAY_KAFKA_SASL_PASSWORD": "creds"}[e.Name],
			e.ValueFrom.SecretKeyRef.Name)
		names = append(names, e.ValueFrom.SecretKeyRef.Key)
	}
	require.Equal(t, []string{"dsn", "username", "password"}, names)
}

func TestConfigHashFollowsConfigAndSecrets(t *testing.T) {
	t.Parallel()
	hash := func(edit func(*outboxv1alpha1.OutboxRelay), in secretInputs) string {
		relay := unitRelay()
		if edit != nil {
			edit(relay)
		}
		return build(t, relay, in).Spec.Template.Annotations[ConfigHashAnnotation]
	}
	base := hash(nil, secretInputs{Hash: "a"})
	require.Equal(t, base, hash(nil, secretInputs{Hash: "a"}), "the same inputs give the same hash")
	require.NotEqual(t, base, hash(nil, secretInputs{Hash: "b"}), "Secret data")
	require.NotEqual(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Topics["X"] = "x" }, secretInputs{Hash: "a"}), "topics")
	require.NotEqual(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.BatchSize = 7 }, secretInputs{Hash: "a"}), "batch size")
	require.Equal(t, base, hash(func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Replicas = ptr.To[int32](5) }, secretInputs{Hash: "a"}),
		"scaling does not roll the pods")

	// The spec hash on the Deployment changes with replicas but not with the order maps were built in.
	d1 := build(t, unitRelay(), secretInputs{})
	relay := unitRelay()
	relay.Spec.Replicas = ptr.To[int32](2)
	require.NotEqual(t, d1.Annotations[SpecHashAnnotation], build(t, relay, secretInputs{}).Annotations[SpecHashAnnotation])
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
			require.Equal(t, SelectorLabels(relay), pdb.Spec.Selector.MatchLabels)
		}
	}
}

func TestValidateSpecCatchesWhatTheSchemaCannot(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		edit func(*outboxv1alpha1.OutboxRelay)
		want string
	}{
		"pod label takes the selector": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.PodLabels = map[string]string{"app.kubernetes.io/name": "x"}
		}, "spec.podLabels"},
		"pod annotation takes the config hash": {func(r *outboxv1alpha1.OutboxRelay) {
			r.Spec.PodAnnotations = map[string]string{ConfigHashAnnotation: "x"}
		}, "spec.podAnnotations"},
		"poll interval out of range": {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.PollInterval = "2h" }, "spec.pollInterval"},
		"no topics":                  {func(r *outboxv1alpha1.OutboxRelay) { r.Spec.Topics = nil }, "spec.topics"},
	} {
		relay := unitRelay()
		tc.edit(relay)
		_, err := relayDeployment(relay, "img", secretInputs{})
		require.ErrorContains(t, err, tc.want, name)
	}
	relay := unitRelay()
	_, err := relayDeployment(relay, "", secretInputs{})
	require.ErrorContains(t, err, "spec.image", "no image anywhere")
}

func TestRelayService(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	s := relayService(relay)
	require.Equal(t, "orders-relay", s.Name)
	require.Equal(t, SelectorLabels(relay), s.Spec.Selector)
	require.Equal(t, int32(9090), s.Spec.Ports[0].Port)
	require.NotEmpty(t, s.Annotations[SpecHashAnnotation])
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
		st := computeStatus(relay, tc.deploy, tc.prob)
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
	relay.Status = computeStatus(relay, deploy(1, 1, 1), nil)
	before := meta.FindStatusCondition(relay.Status.Conditions, "Ready").LastTransitionTime
	relay.Status.Conditions[0].LastTransitionTime = metav1.NewTime(before.Add(-3600e9))
	again := computeStatus(relay, deploy(1, 1, 1), nil)
	require.Equal(t, relay.Status, again, "a second computation over the same inputs changes nothing")
}
