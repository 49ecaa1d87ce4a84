package controllers

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// Secret values the round-trip tests give the relay pods.
const (
	testDSN      = "postgres://relay:pw@db:5432/orders?sslmode=require"
	testUser     = "relay-user"
	testPassword = "p=ss,word with spaces"
)

// testSecretData is what the referenced Secrets hold, by Secret and key.
var testSecretData = map[string]map[string]string{
	"orders-dsn": {"dsn": testDSN, "url": testDSN},
	"creds":      {"username": testUser, "password": testPassword, "u": testUser, "p": testPassword},
}

// podEnv is the environment a relay pod gets from env: each value, and
// each secretKeyRef resolved from data, as the kubelet does.
func podEnv(t testing.TB, env []corev1.EnvVar, data map[string]map[string]string) func(string) (string, bool) {
	vars := map[string]string{}
	for _, e := range env {
		if e.ValueFrom == nil {
			vars[e.Name] = e.Value
			continue
		}
		ref := e.ValueFrom.SecretKeyRef
		v, ok := data[ref.Name][ref.Key]
		require.True(t, ok, "%s: Secret %s has no key %s", e.Name, ref.Name, ref.Key)
		vars[e.Name] = v
	}
	return func(k string) (string, bool) { v, ok := vars[k]; return v, ok }
}

// relayReads is what the relay parses from the pod the operator builds for relay.
func relayReads(t testing.TB, relay *outboxv1alpha1.OutboxRelay, in secretInputs) (relayconfig.Command, error) {
	s, err := relaySettings(relay, in)
	require.NoError(t, err)
	return relayconfig.Parse(s.Args(), podEnv(t, relayEnv(relay, s), testSecretData), io.Discard)
}

// TestSpecRoundTrip: for valid specs, the arguments and environment the
// operator gives a relay pod, parsed by the relay's own parser, are exactly
// the settings the spec means: every setting a spec field or the operator
// decides is written out by hand below; the relay's own settings that no
// spec field carries keep the relay's defaults.
func TestSpecRoundTrip(t *testing.T) {
	t.Parallel()
	base := relayconfig.Defaults()
	base.DSN = testDSN
	base.Table = "outbox"
	base.Brokers = []string{"127.0.0.1:9092"}
	base.Topics = map[string]string{"OrderConfirmed": "orders.confirmed"}
	base.BatchSize = 50
	base.MaxBatchBytes = 4 << 20
	base.PollInterval = 200 * time.Millisecond
	base.PublishTimeout = 10 * time.Second
	base.Ordering = relayconfig.OrderingNone
	base.StallTimeout = 2 * time.Minute
	base.MetricsAddr = ":9090"
	base.LogFormat = "json"
	for name, tc := range map[string]struct {
		edit func(*outboxv1alpha1.OutboxRelay)
		in   secretInputs
		want func(*relayconfig.Command)
	}{
		"defaults": {},
		"every plain field": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				s := &r.Spec
				s.Table = "events.outbox_2"
				s.BatchSize, s.MaxBatchBytes = ptr.To[int32](10000), ptr.To[int32](relayconfig.MaxMaxBatchBytes)
				s.PollInterval = "1m30s"
				s.Topics = map[string]outboxv1alpha1.TopicName{
					"com.example:Order.Confirmed": "orders.confirmed", "Order Cancelled": "orders_cancelled", "ü": "...",
				}
				s.DeadLetterTopic = "orders.dlq"
				s.Ordering = outboxv1alpha1.OrderingPartitionKey
				s.Kafka.Brokers = []outboxv1alpha1.BrokerAddress{"[::1]:1", "kafka-0.kafka.svc:65535", "10.0.0.7:9092"}
			},
			want: func(s *relayconfig.Command) {
				s.Table = "events.outbox_2"
				s.BatchSize, s.MaxBatchBytes = 10000, relayconfig.MaxMaxBatchBytes
				s.PollInterval = 90 * time.Second
				s.Topics = map[string]string{"com.example:Order.Confirmed": "orders.confirmed", "Order Cancelled": "orders_cancelled", "ü": "..."}
				s.DeadLetterTopic = "orders.dlq"
				s.Ordering = relayconfig.OrderingPartitionKey
				s.Brokers = []string{"[::1]:1", "kafka-0.kafka.svc:65535", "10.0.0.7:9092"}
			},
		},
		"lower bounds": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.BatchSize, r.Spec.MaxBatchBytes, r.Spec.PollInterval = ptr.To[int32](1), ptr.To[int32](relayconfig.MinMaxBatchBytes), "10ms"
			},
			want: func(s *relayconfig.Command) {
				s.BatchSize, s.MaxBatchBytes, s.PollInterval = 1, relayconfig.MinMaxBatchBytes, 10*time.Millisecond
			},
		},
		"flow and retention": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.MaxInFlight, r.Spec.Notify = ptr.To[int32](1), true
				r.Spec.Retention = &outboxv1alpha1.RetentionSpec{OnPublish: outboxv1alpha1.OnPublishMark,
					KeepPublishedFor: "168h", PruneBatchSize: ptr.To[int32](500)}
			},
			want: func(s *relayconfig.Command) {
				s.MaxInFlight, s.Notify = 1, true
				s.OnPublish, s.KeepPublishedFor, s.PruneBatchSize = relayconfig.OnPublishMark, 168*time.Hour, 500
			},
		},
		"delete on publish": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Retention = &outboxv1alpha1.RetentionSpec{OnPublish: outboxv1alpha1.OnPublishDelete}
			},
			want: func(s *relayconfig.Command) { s.OnPublish = relayconfig.OnPublishDelete },
		},
		"fractional poll interval": {
			edit: func(r *outboxv1alpha1.OutboxRelay) { r.Spec.PollInterval = "0.25s" },
			want: func(s *relayconfig.Command) { s.PollInterval = 250 * time.Millisecond },
		},
		"longest names": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Table = strings.Repeat("s", 63) + "." + strings.Repeat("t", 63)
				r.Spec.Topics = map[string]outboxv1alpha1.TopicName{
					strings.Repeat("é", relayconfig.MaxEventTypeLength): outboxv1alpha1.TopicName(strings.Repeat("t", relayconfig.MaxTopicLength)),
				}
			},
			want: func(s *relayconfig.Command) {
				s.Table = strings.Repeat("s", 63) + "." + strings.Repeat("t", 63)
				s.Topics = map[string]string{strings.Repeat("é", relayconfig.MaxEventTypeLength): strings.Repeat("t", relayconfig.MaxTopicLength)}
			},
		},
		"TLS with system roots, SCRAM with custom keys": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{}
				r.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLScramSHA512,
					CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: "creds", UsernameKey: "u", PasswordKey: "p"}}
				r.Spec.DSNSecretRef.Key = "url"
			},
			want: func(s *relayconfig.Command) {
				s.KafkaTLS = true
				s.KafkaSASLMechanism = relayconfig.SASLScramSHA512
				s.KafkaSASLUsername, s.KafkaSASLPassword = testUser, testPassword
			},
		},
		"OAUTHBEARER from a token endpoint": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{}
				r.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLOAuthBearer,
					CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: "creds"},
					OAuth:                &outboxv1alpha1.KafkaOAuth{TokenEndpoint: "https://idp.example/oauth2/token", Scope: "kafka"}}
			},
			want: func(s *relayconfig.Command) {
				s.KafkaTLS = true
				s.KafkaSASLMechanism = relayconfig.SASLOAuthBearer
				s.KafkaSASLOAuthTokenEndpoint, s.KafkaSASLOAuthScope = "https://idp.example/oauth2/token", "kafka"
				s.KafkaSASLUsername, s.KafkaSASLPassword = testUser, testPassword
			},
		},
		"logical replication capture": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				q := resource.MustParse("1Gi")
				r.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication, MaxRetainedWAL: &q}
			},
			want: func(s *relayconfig.Command) {
				s.Capture, s.MaxRetainedWAL = relayconfig.CaptureLogicalReplication, 1<<30
			},
		},
		"logical replication with writer deletes": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication, WriterDeletes: true}
			},
			want: func(s *relayconfig.Command) {
				s.Capture, s.WriterDeletes = relayconfig.CaptureLogicalReplication, true
			},
		},
		"partition column": {
			edit: func(r *outboxv1alpha1.OutboxRelay) { r.Spec.PartitionColumn = "kafka_partition" },
			want: func(s *relayconfig.Command) { s.PartitionColumn = "kafka_partition" },
		},
		"OAUTHBEARER from a token file": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{}
				r.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLOAuthBearer,
					OAuth: &outboxv1alpha1.KafkaOAuth{TokenFile: "/var/run/secrets/kafka/token"}}
			},
			want: func(s *relayconfig.Command) {
				s.KafkaTLS = true
				s.KafkaSASLMechanism, s.KafkaSASLOAuthTokenFile = relayconfig.SASLOAuthBearer, "/var/run/secrets/kafka/token"
			},
		},
		"AWS_MSK_IAM": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{}
				r.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLAWSMSKIAM, AWS: &outboxv1alpha1.KafkaAWS{Region: "eu-west-1"}}
			},
			want: func(s *relayconfig.Command) {
				s.KafkaTLS = true
				s.KafkaSASLMechanism, s.KafkaSASLAWSRegion = relayconfig.SASLAWSMSKIAM, "eu-west-1"
			},
		},
		"database TLS with a client certificate": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Table = "events.outbox"
				r.Spec.Database = &outboxv1alpha1.DatabaseSpec{TLS: &outboxv1alpha1.DatabaseTLS{
					CA:                  outboxv1alpha1.CABundleSource{ConfigMapRef: &outboxv1alpha1.KeyReference{Name: "db-ca", Key: "ca.crt"}},
					ClientCertSecretRef: &outboxv1alpha1.SecretReference{Name: "db-client"},
				}}
			},
			want: func(s *relayconfig.Command) {
				s.Table = "events.outbox"
				s.DatabaseCAFile = "/etc/relay/database-tls/ca.crt"
				s.DatabaseCertFile, s.DatabaseKeyFile = "/etc/relay/database-tls/tls.crt", "/etc/relay/database-tls/tls.key"
			},
		},
		"database login with an RDS IAM token": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Database = &outboxv1alpha1.DatabaseSpec{
					TLS:  &outboxv1alpha1.DatabaseTLS{CA: outboxv1alpha1.CABundleSource{SecretRef: &outboxv1alpha1.KeyReference{Name: "db-ca", Key: "ca.crt"}}},
					Auth: &outboxv1alpha1.DatabaseAuth{Method: outboxv1alpha1.DatabaseAuthAWSRDSIAM, AWS: &outboxv1alpha1.AWSDatabaseAuth{Region: "eu-west-1"}},
				}
			},
			want: func(s *relayconfig.Command) {
				s.DatabaseCAFile = "/etc/relay/database-tls/ca.crt"
				s.DatabaseAuth, s.DatabaseAuthAWSRegion = relayconfig.DatabaseAuthAWSRDSIAM, "eu-west-1"
			},
		},
		"mutual TLS from a Secret, SASL PLAIN": {
			edit: func(r *outboxv1alpha1.OutboxRelay) {
				r.Spec.Kafka.TLS = &outboxv1alpha1.KafkaTLS{SecretRef: &outboxv1alpha1.SecretReference{Name: "tls"}}
				r.Spec.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLPlain,
					CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: "creds"}}
			},
			in: secretInputs{TLSCA: true, TLSClientCert: true},
			want: func(s *relayconfig.Command) {
				s.KafkaTLS = true
				s.KafkaTLSCAFile, s.KafkaTLSCertFile, s.KafkaTLSKeyFile = "/etc/relay/tls/ca.crt", "/etc/relay/tls/tls.crt", "/etc/relay/tls/tls.key"
				s.KafkaSASLMechanism = relayconfig.SASLPlain
				s.KafkaSASLUsername, s.KafkaSASLPassword = testUser, testPassword
			},
		},
	} {
		relay := unitRelay()
		if tc.edit != nil {
			tc.edit(relay)
		}
		require.NoError(t, validateSpec(relay, testImages), name)
		want := base
		want.Topics = map[string]string{"OrderConfirmed": "orders.confirmed"}
		if tc.want != nil {
			tc.want(&want)
		}
		got, err := relayReads(t, relay, tc.in)
		require.NoError(t, err, name)
		require.Equal(t, want, got, name)

		// The Deployment carries exactly these arguments and environment.
		d, err := buildDeployment(relay, testImages, tc.in, nil)
		require.NoError(t, err, name)
		ct := d.Spec.Template.Spec.Containers[0]
		fromPod, err := relayconfig.Parse(ct.Args, podEnv(t, ct.Env, testSecretData), io.Discard)
		require.NoError(t, err, name)
		require.Equal(t, want, fromPod, name)

		// `relay held`, run in the pod with no flags, reaches the table
		// the relay publishes from, and logs in as it does.
		held, err := relayconfig.ParseHeld(nil, false, podEnv(t, ct.Env, testSecretData), io.Discard)
		require.NoError(t, err, name)
		require.Equal(t, want.DSN, held.DSN, name)
		require.Equal(t, want.Table, held.Table, name)
		require.Equal(t, want.DatabaseLogin, held.DatabaseLogin, name)
	}
}

// FuzzSpecRoundTrip: whatever spec the operator accepts, the relay parses
// the pod it gets back into exactly the settings the operator meant; and a
// spec whose pod the relay would refuse is one the operator refuses too.
func FuzzSpecRoundTrip(f *testing.F) {
	f.Add("outbox", int32(50), int32(4<<20), "200ms", "OrderConfirmed", "orders.confirmed", "", false, "127.0.0.1:9092", false, uint8(0))
	f.Add("events.outbox_2", int32(1), int32(65536), "10ms", "com.example:Order Confirmed", "...", "dlq", true, "[::1]:9092", true, uint8(1))
	f.Add("a.b.c", int32(10001), int32(65535), "61m", "a=b", "a/b", "orders.confirmed", false, "k:0", false, uint8(1))
	f.Add("Orders", int32(0), int32(0), "5ms", " lead", ".", "..", true, "k:65536", true, uint8(2))
	f.Add("_", int32(10000), int32(256<<20), "1h", "x,y", strings.Repeat("t", 250), "", false, "a:1,b:2", false, uint8(3))
	f.Add(strings.Repeat("a", 64), int32(-1), int32(1<<30), "1.5s", strings.Repeat("e", 256), "t", "t", true, " k:1", true, uint8(3))
	f.Add("outbox", int32(50), int32(4<<20), "soon", "", "t", "", false, "kafka-0.kafka:9092", false, uint8(0))
	f.Fuzz(func(t *testing.T, table string, batch, maxBytes int32, poll, eventType, topic, deadLetter string,
		partitionKey bool, broker string, tls bool, sasl uint8) {
		relay := unitRelay()
		s := &relay.Spec
		s.Table, s.BatchSize, s.MaxBatchBytes, s.PollInterval = table, &batch, &maxBytes, poll
		s.Topics = map[string]outboxv1alpha1.TopicName{eventType: outboxv1alpha1.TopicName(topic)}
		s.DeadLetterTopic = outboxv1alpha1.TopicName(deadLetter)
		if partitionKey {
			s.Ordering = outboxv1alpha1.OrderingPartitionKey
		}
		s.Kafka.Brokers = []outboxv1alpha1.BrokerAddress{outboxv1alpha1.BrokerAddress(broker)}
		if tls {
			s.Kafka.TLS = &outboxv1alpha1.KafkaTLS{}
		}
		if m := int(sasl) % 4; m > 0 {
			s.Kafka.SASL = &outboxv1alpha1.KafkaSASL{Mechanism: outboxv1alpha1.SASLMechanism(relayconfig.SASLMechanisms[m-1]),
				CredentialsSecretRef: &outboxv1alpha1.SASLCredentialsReference{Name: "creds"}}
		}

		verdict := validateSpec(relay, testImages)
		meant, err := relaySettings(relay, secretInputs{})
		if err != nil {
			require.Error(t, verdict, "a spec without settings must be refused")
			return
		}
		got, err := relayconfig.Parse(meant.Args(), podEnv(t, relayEnv(relay, meant), testSecretData), io.Discard)
		if verdict != nil {
			return // no pod is built
		}
		require.NoError(t, err, "the operator accepted a spec whose pod the relay refuses: args %q", meant.Args())
		meant.DSN = testDSN
		if s.Kafka.SASL != nil {
			meant.KafkaSASLUsername, meant.KafkaSASLPassword = testUser, testPassword
		}
		require.Equal(t, meant, got, "args %q", meant.Args())
	})
}

// operatorFlags are the relay flags the operator sets from the spec or
// decides itself; the relay's other flags keep their defaults.
var operatorFlags = map[string]bool{
	relayconfig.FlagTable: true, relayconfig.FlagBrokers: true, relayconfig.FlagBatchSize: true,
	relayconfig.FlagMaxBatchBytes: true, relayconfig.FlagPollInterval: true, relayconfig.FlagLinger: true, relayconfig.FlagPublishTimeout: true,
	relayconfig.FlagStallTimeout: true, relayconfig.FlagTopic: true, relayconfig.FlagDeadLetterTopic: true,
	relayconfig.FlagOrdering: true, relayconfig.FlagMetricsAddr: true, relayconfig.FlagLogFormat: true,
	relayconfig.FlagKafkaTLS: true, relayconfig.FlagKafkaTLSCAFile: true, relayconfig.FlagKafkaTLSCertFile: true,
	relayconfig.FlagKafkaTLSKeyFile: true, relayconfig.FlagKafkaSASLMech: true,
	relayconfig.FlagMaxInFlight: true, relayconfig.FlagNotify: true, relayconfig.FlagOnPublish: true,
	relayconfig.FlagKeepPublishedFor: true, relayconfig.FlagPruneBatchSize: true,
}

// specArgs are the arguments of the operator's flags, in their order.
func specArgs(args []string) []string {
	var out []string
	for _, a := range args {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if operatorFlags[name] {
			out = append(out, a)
		}
	}
	return out
}
