package controllers

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// TestAPIServerAndRelayAgree applies, for every rule the OutboxRelay schema
// shares with the relay, values on both sides of its edge to the real API
// server, and parses the arguments and environment the operator builds from
// the same manifest with the relay's own parser. Both must accept or both
// refuse, and the operator's own check must agree: an OutboxRelay the API
// server takes must never become pods that refuse to start, and one it
// refuses must be one the relay would refuse.
func TestAPIServerAndRelayAgree(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	set := func(field string, v any) func(map[string]any) {
		return func(s map[string]any) { s[field] = v }
	}
	topics := func(kv ...string) func(map[string]any) {
		return func(s map[string]any) {
			m := map[string]any{}
			for i := 0; i < len(kv); i += 2 {
				m[kv[i]] = kv[i+1]
			}
			s["topics"] = m
		}
	}
	eventType := func(et string) func(map[string]any) { return topics(et, "orders") }
	topic := func(tp string) func(map[string]any) { return topics("OrderConfirmed", tp) }
	brokers := func(b ...any) func(map[string]any) { return func(s map[string]any) { kafka(s)["brokers"] = b } }
	manyTopics := func(n int) func(map[string]any) {
		return func(s map[string]any) {
			m := map[string]any{}
			for i := range n {
				m["E"+strconv.Itoa(i)] = "t"
			}
			s["topics"] = m
		}
	}
	sasl := func(mechanism string, tls map[string]any) func(map[string]any) {
		return func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": mechanism, "credentialsSecretRef": map[string]any{"name": "creds"}}
			if tls != nil {
				kafka(s)["tls"] = tls
			}
		}
	}
	ident63, ident64 := strings.Repeat("a", 63), strings.Repeat("a", 64)

	cases := []struct {
		name   string
		edit   func(spec map[string]any)
		accept bool
	}{
		{"table outbox", set("table", "outbox"), true},
		{"table app.outbox", set("table", "app.outbox"), true},
		{"table _", set("table", "_"), true},
		{"table Orders", set("table", "Orders"), false},
		{"table events.Outbox_2", set("table", "events.Outbox_2"), false},
		{"table a.b.c", set("table", "a.b.c"), false},
		{"table of 63 characters", set("table", ident63), true},
		{"table of 63.63 characters", set("table", ident63+"."+ident63), true},
		{"table of 64 characters", set("table", ident64), false},
		{"table schema of 64 characters", set("table", ident64+".outbox"), false},
		{"table 1outbox", set("table", "1outbox"), false},
		{"table with a quote", set("table", `"outbox"`), false},

		{"event type with =", eventType("a=b"), false},
		{"event type with ,", eventType("a,b"), false},
		{"event type with a leading space", eventType(" OrderConfirmed"), false},
		{"event type with a trailing space", eventType("OrderConfirmed "), false},
		{"event type with a leading tab", eventType("\tOrderConfirmed"), false},
		{"event type with an inner space", eventType("Order Confirmed"), true},
		{"event type with dots and colons", eventType("com.example:Order.Confirmed"), true},
		{"event type of 255 characters", eventType(strings.Repeat("e", 255)), true},
		{"event type of 255 two-byte characters", eventType(strings.Repeat("é", 255)), true},
		{"event type of 256 characters", eventType(strings.Repeat("e", 256)), false},
		{"event type empty", eventType(""), false},
		{"512 event types", manyTopics(relayconfig.MaxTopics), true},
		{"513 event types", manyTopics(relayconfig.MaxTopics + 1), false},

		{"topic .", topic("."), false},
		{"topic ..", topic(".."), false},
		{"topic ...", topic("..."), true},
		{"topic a/b", topic("a/b"), false},
		{"topic with a space", topic("a b"), false},
		{"topic of 249 characters", topic(strings.Repeat("t", 249)), true},
		{"topic of 250 characters", topic(strings.Repeat("t", 250)), false},
		{"topic empty", topic(""), false},
		{"dead-letter topic distinct", set("deadLetterTopic", "orders.dlq"), true},
		{"dead-letter topic is a mapped topic", set("deadLetterTopic", "orders.confirmed"), false},
		{"dead-letter topic ..", set("deadLetterTopic", ".."), false},

		{"pollInterval 5ms", set("pollInterval", "5ms"), false},
		{"pollInterval 9999us", set("pollInterval", "9999us"), false},
		{"pollInterval 10ms", set("pollInterval", "10ms"), true},
		{"pollInterval 0.5s", set("pollInterval", "0.5s"), true},
		{"pollInterval 1h", set("pollInterval", "1h"), true},
		{"pollInterval 3600001ms", set("pollInterval", "3600001ms"), false},
		{"pollInterval 61m", set("pollInterval", "61m"), false},
		{"pollInterval soon", set("pollInterval", "soon"), false},

		{"batchSize -1", set("batchSize", int64(-1)), false},
		{"batchSize 0", set("batchSize", int64(0)), false},
		{"batchSize 1", set("batchSize", int64(1)), true},
		{"batchSize 10000", set("batchSize", int64(10000)), true},
		{"batchSize 10001", set("batchSize", int64(10001)), false},

		{"maxBatchBytes 0", set("maxBatchBytes", int64(0)), false},
		{"maxBatchBytes below 64 KiB", set("maxBatchBytes", int64(relayconfig.MinMaxBatchBytes-1)), false},
		{"maxBatchBytes 64 KiB", set("maxBatchBytes", int64(relayconfig.MinMaxBatchBytes)), true},
		{"maxBatchBytes 64 MiB", set("maxBatchBytes", int64(relayconfig.MaxMaxBatchBytes)), true},
		{"maxBatchBytes above 64 MiB", set("maxBatchBytes", int64(relayconfig.MaxMaxBatchBytes+1)), false},

		{"broker k:0", brokers("k:0"), false},
		{"broker k:1", brokers("k:1"), true},
		{"broker k:65535", brokers("k:65535"), true},
		{"broker k:65536", brokers("k:65536"), false},
		{"broker [::1]:9092", brokers("[::1]:9092"), true},
		{"broker without a port", brokers("kafka-0"), false},
		{"broker as a URL", brokers("tcp://kafka-0:9092"), false},
		{"broker starting with -", brokers("-k:9092"), false},
		{"no brokers", brokers(), false},

		{"SASL PLAIN without TLS", sasl("PLAIN", nil), false},
		{"SASL PLAIN with TLS from the system roots", sasl("PLAIN", map[string]any{}), true},
		{"SASL PLAIN with TLS from a Secret", sasl("PLAIN", map[string]any{"secretRef": map[string]any{"name": "tls"}}), true},
		{"SASL SCRAM-SHA-256 without TLS", sasl("SCRAM-SHA-256", nil), true},
		{"SASL SCRAM-SHA-512 with TLS", sasl("SCRAM-SHA-512", map[string]any{}), true},

		{"ordering PartitionKey", set("ordering", "PartitionKey"), true},
		{"ordering None", set("ordering", "None"), true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			u := manifest(ns, fmt.Sprintf("verdict-%d", i), tc.edit)
			relay := &outboxv1alpha1.OutboxRelay{}
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, relay))

			// The API server's verdict; a dry run validates and defaults without storing.
			apiErr := c.Create(context.Background(), u, client.DryRunAll)
			// The relay's verdict on the pod the operator builds from the manifest.
			relayErr := relayVerdict(t, relay)
			// The operator's own check, which decides whether it builds that pod.
			operatorErr := validateSpec(relay, testImages)

			require.Equal(t, tc.accept, apiErr == nil, "API server: %v", apiErr)
			require.Equal(t, tc.accept, relayErr == nil, "relay: %v", relayErr)
			require.Equal(t, tc.accept, operatorErr == nil, "operator: %v", operatorErr)
			if !tc.accept {
				return
			}
			// The object as the API server defaulted it means the same relay
			// settings as the manifest: the CRD's defaults are the relay's.
			defaulted := &outboxv1alpha1.OutboxRelay{}
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, defaulted))
			want, err := relaySettings(relay, secretInputs{})
			require.NoError(t, err)
			got, err := relaySettings(defaulted, secretInputs{})
			require.NoError(t, err)
			require.Equal(t, want, got)
		})
	}
}

// relayVerdict is relayconfig.Parse's verdict on the arguments and
// environment the operator gives relay's pods.
func relayVerdict(t *testing.T, relay *outboxv1alpha1.OutboxRelay) error {
	s, err := relaySettings(relay, secretInputs{})
	if err != nil {
		return err // the value has no command-line form at all
	}
	_, err = relayconfig.Parse(s.Args(), podEnv(t, relayEnv(relay, s), testSecretData), io.Discard)
	return err
}
