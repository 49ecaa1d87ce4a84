package controllers

import (
	"io"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// spec.format, spec.cloudEventsSource and spec.kafka.compression reach the
// relay as the settings they mean; spec.tracing becomes the OTEL_* variables
// the relay reads, and its absence none.
func TestFormatCompressionAndTracingReachTheRelay(t *testing.T) {
	t.Parallel()
	relay := unitRelay()
	s, err := relaySettings(relay, secretInputs{})
	require.NoError(t, err)
	require.Equal(t, relayconfig.FormatRaw, s.Format)
	require.Equal(t, relayconfig.CompressionNone, s.Compression)
	require.Empty(t, tracingEnv(relay))

	relay.Spec.Format = outboxv1alpha1.FormatCloudEvents
	relay.Spec.CloudEventsSource = "urn:orders"
	relay.Spec.Kafka.Compression = "zstd"
	relay.Spec.Tracing = &outboxv1alpha1.TracingSpec{OTLPEndpoint: "http://collector.obs:4318"}
	require.NoError(t, validateSpec(relay, testImages))
	s, err = relaySettings(relay, secretInputs{})
	require.NoError(t, err)
	var secrets []corev1.EnvVar
	plain := map[string]string{}
	for _, e := range relayEnv(relay, s) {
		if e.ValueFrom != nil {
			secrets = append(secrets, e)
		} else {
			plain[e.Name] = e.Value
		}
	}
	fromSecrets := podEnv(t, secrets, testSecretData)
	got, err := relayconfig.Parse(s.Args(), func(k string) (string, bool) {
		if v, ok := plain[k]; ok {
			return v, true
		}
		return fromSecrets(k)
	}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, relayconfig.FormatCloudEvents, got.Format)
	require.Equal(t, "urn:orders", got.CloudEventsSource)
	require.Equal(t, relayconfig.CompressionZstd, got.Compression)
	require.Equal(t, map[string]string{
		relayconfig.EnvOTELTracesExporter:          "otlp",
		relayconfig.EnvOTELExporterOTLPEndpoint:    "http://collector.obs:4318",
		relayconfig.EnvOTELServiceName:             relay.Name + "-relay",
		relayconfig.EnvArgsOnly:                    "true",
		relayconfig.EnvName(relayconfig.FlagTable): "outbox",
	}, plain)

	relay.Spec.CloudEventsSource = "not a uri"
	require.ErrorContains(t, validateSpec(relay, testImages), "spec.cloudEventsSource:")
}
