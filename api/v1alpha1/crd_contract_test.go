package v1alpha1_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// schema is the part of an OpenAPI v3 schema the CRD's rules live in.
type schema struct {
	Pattern              string             `json:"pattern"`
	Minimum              *float64           `json:"minimum"`
	Maximum              *float64           `json:"maximum"`
	MinLength            *int               `json:"minLength"`
	MaxLength            *int               `json:"maxLength"`
	MinProperties        *int               `json:"minProperties"`
	MaxProperties        *int               `json:"maxProperties"`
	Default              json.RawMessage    `json:"default"`
	Enum                 []string           `json:"enum"`
	Properties           map[string]*schema `json:"properties"`
	Items                *schema            `json:"items"`
	AdditionalProperties *schema            `json:"additionalProperties"`
	Validations          []struct {
		Rule, Message, FieldPath string
	} `json:"x-kubernetes-validations"`
}

// at walks a dotted path; "[]" steps into array items, "{}" into map values.
func (s *schema) at(t *testing.T, path string) *schema {
	t.Helper()
	cur := s
	for _, step := range strings.Split(path, ".") {
		switch step {
		case "[]":
			cur = cur.Items
		case "{}":
			cur = cur.AdditionalProperties
		default:
			cur = cur.Properties[step]
		}
		require.NotNil(t, cur, "the CRD has no %s (at %q)", path, step)
	}
	return cur
}

func (s *schema) rules() []string {
	var rules []string
	for _, v := range s.Validations {
		rules = append(rules, v.Rule)
	}
	return rules
}

// committedSchema is the OutboxRelay schema as config/crd/bases holds it.
func committedSchema(t *testing.T) *schema {
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "crd", "bases", "outbox.dev_outboxrelays.yaml"))
	require.NoError(t, err)
	var crd struct {
		Spec struct {
			Versions []struct {
				Name   string
				Schema struct {
					OpenAPIV3Schema *schema `json:"openAPIV3Schema"`
				}
			}
		}
	}
	require.NoError(t, yaml.Unmarshal(b, &crd))
	require.Len(t, crd.Spec.Versions, 1)
	require.Equal(t, outboxv1alpha1.GroupVersion.Version, crd.Spec.Versions[0].Name)
	return crd.Spec.Versions[0].Schema.OpenAPIV3Schema
}

func number(t *testing.T, want int, got *float64, what string) {
	t.Helper()
	require.NotNil(t, got, what)
	require.Equal(t, float64(want), *got, what)
}

func defaultOf(t *testing.T, s *schema, want any) {
	t.Helper()
	wantJSON, err := json.Marshal(want)
	require.NoError(t, err)
	require.JSONEq(t, string(wantJSON), string(s.Default))
}

// TestCRDMatchesRelayContract compares every rule the OutboxRelay schema
// shares with the relay (patterns, bounds, defaults, CEL ranges) with
// relayconfig's constants. The kubebuilder markers must be
// literals, so this is what keeps them from drifting apart: a marker
// changed without the constant (or the reverse) fails here.
func TestCRDMatchesRelayContract(t *testing.T) {
	t.Parallel()
	root := committedSchema(t)
	spec := root.at(t, "spec")

	table := spec.at(t, "table")
	require.Equal(t, relayconfig.TablePattern, table.Pattern, "spec.table pattern")
	require.Contains(t, table.rules(), "!self.matches('"+outbox.SelfDerivedPattern+"')", "spec.table refuses what outbox.ParseTable does")
	require.Equal(t, relayconfig.PartitionColumnPattern, spec.at(t, "partitionColumn").Pattern, "spec.partitionColumn pattern")
	var own []string // relayconfig.CheckPartitionColumn refuses these
	for _, c := range append(slices.Clone(outbox.Columns), outbox.OptionalColumns...) {
		own = append(own, "'"+c.Name+"'")
		require.Error(t, relayconfig.CheckPartitionColumn(c.Name))
	}
	require.Contains(t, spec.at(t, "partitionColumn").rules(), "!(self in ["+strings.Join(own, ", ")+"])",
		"spec.partitionColumn refuses the columns the relay reads for its own purpose")
	defaultOf(t, table, relayconfig.DefaultTable)
	require.NotNil(t, table.MaxLength)
	require.Equal(t, 63+1+63, *table.MaxLength, "spec.table maxLength: the longest SCHEMA.NAME the pattern admits")

	batch := spec.at(t, "batchSize")
	number(t, relayconfig.MinBatchSize, batch.Minimum, "spec.batchSize minimum")
	number(t, relayconfig.MaxBatchSize, batch.Maximum, "spec.batchSize maximum")
	defaultOf(t, batch, relayconfig.DefaultBatchSize)

	inFlight := spec.at(t, "maxInFlight")
	number(t, relayconfig.MinMaxInFlight, inFlight.Minimum, "spec.maxInFlight minimum")
	number(t, relayconfig.MaxMaxInFlight, inFlight.Maximum, "spec.maxInFlight maximum")
	defaultOf(t, inFlight, relayconfig.DefaultMaxInFlight)
	prune := spec.at(t, "retention.pruneBatchSize")
	number(t, relayconfig.MinPruneBatchSize, prune.Minimum, "spec.retention.pruneBatchSize minimum")
	number(t, relayconfig.MaxPruneBatchSize, prune.Maximum, "spec.retention.pruneBatchSize maximum")
	defaultOf(t, prune, relayconfig.DefaultPruneBatchSize)
	bytes := spec.at(t, "maxBatchBytes")
	number(t, relayconfig.MinMaxBatchBytes, bytes.Minimum, "spec.maxBatchBytes minimum")
	number(t, relayconfig.MaxMaxBatchBytes, bytes.Maximum, "spec.maxBatchBytes maximum")
	defaultOf(t, bytes, relayconfig.DefaultMaxBatchBytes)

	poll := spec.at(t, "pollInterval")
	defaultOf(t, poll, relayconfig.DefaultPollInterval.String())
	require.Contains(t, poll.rules(), fmt.Sprintf(
		"!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('%s') && duration(self) <= duration('%s'))",
		relayconfig.MinPollInterval, relayconfig.MaxPollInterval), "spec.pollInterval CEL range")

	linger := spec.at(t, "linger")
	defaultOf(t, linger, relayconfig.DefaultLinger.String())
	require.Contains(t, linger.rules(), fmt.Sprintf(
		"!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('%s') && duration(self) <= duration('%s'))",
		relayconfig.MinLinger, relayconfig.MaxLinger), "spec.linger CEL range")

	stall := spec.at(t, "stallTimeout")
	defaultOf(t, stall, relayconfig.DefaultStallTimeout.String())
	require.Contains(t, stall.rules(), fmt.Sprintf(
		"!self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || (duration(self) >= duration('%s') && duration(self) <= duration('%s'))",
		relayconfig.MinStallTimeout, relayconfig.MaxStallTimeout), "spec.stallTimeout CEL range")

	topics := spec.at(t, "topics")
	require.NotNil(t, topics.MaxProperties)
	require.Equal(t, relayconfig.MaxTopics, *topics.MaxProperties, "spec.topics maxProperties")
	require.Contains(t, topics.rules(), fmt.Sprintf("self.all(k, size(k) <= %d && k.matches(r'%s'))",
		relayconfig.MaxEventTypeLength, relayconfig.EventTypePattern), "spec.topics event-type rule")

	// Every topic name: the map's values and the dead-letter topic.
	for _, path := range []string{"topics.{}", "deadLetterTopic"} {
		topic := spec.at(t, path)
		require.Equal(t, relayconfig.TopicPattern, topic.Pattern, "spec.%s pattern", path)
		require.NotNil(t, topic.MaxLength)
		require.Equal(t, relayconfig.MaxTopicLength, *topic.MaxLength, "spec.%s maxLength", path)
		require.Contains(t, topic.rules(), "self != '.' && self != '..'", "spec.%s refuses . and ..", path)
	}

	require.Equal(t, relayconfig.BrokerPattern, spec.at(t, "kafka.brokers.[]").Pattern, "spec.kafka.brokers pattern")

	require.ElementsMatch(t, relayconfig.SASLMechanisms, spec.at(t, "kafka.sasl.mechanism").Enum, "SASL mechanisms")
	require.Contains(t, spec.at(t, "kafka").rules(),
		fmt.Sprintf("!has(self.sasl) || self.sasl.mechanism != '%s' || has(self.tls)", relayconfig.SASLPlain),
		"SASL PLAIN needs TLS, as the relay requires")

	// The operator maps each API ordering to one relay ordering (a controllers
	// test covers the mapping); here: one enum value per relay ordering.
	ordering := spec.at(t, "ordering")
	require.Equal(t, []string{string(outboxv1alpha1.OrderingNone), string(outboxv1alpha1.OrderingPartitionKey)}, ordering.Enum)
	require.Len(t, ordering.Enum, len(relayconfig.Orderings), "one API ordering per relay ordering")
	defaultOf(t, ordering, outboxv1alpha1.OrderingNone)

	source := spec.at(t, "cloudEventsSource")
	require.Equal(t, relayconfig.CloudEventsSourcePattern, source.Pattern, "spec.cloudEventsSource pattern")
	number(t, relayconfig.MaxCloudEventsSourceLength, ptr.To(float64(*source.MaxLength)), "spec.cloudEventsSource maxLength")
	require.Contains(t, source.rules(), fmt.Sprintf("self.matches(r'%s') || !self.matches(r'%s')",
		relayconfig.URISchemePattern, relayconfig.URIColonFirstPattern), "spec.cloudEventsSource first-segment rule")
	require.Contains(t, source.rules(), fmt.Sprintf("!self.matches(r'%s') || self.matches(r'%s')",
		relayconfig.URIAuthorityStartPattern, relayconfig.URIAuthorityPattern), "spec.cloudEventsSource authority rule")

	wal := spec.at(t, "capture.maxRetainedWAL")
	for _, bound := range []struct {
		op    string
		bytes int64
	}{{">=", relayconfig.MinMaxRetainedWAL}, {"<=", relayconfig.MaxMaxRetainedWAL}} {
		q := resource.NewQuantity(bound.bytes, resource.BinarySI)
		require.Contains(t, wal.rules(), fmt.Sprintf("quantity(string(self)).compareTo(quantity('%s')) %s 0", q, bound.op),
			"spec.capture.maxRetainedWAL bound %s %d", bound.op, bound.bytes)
	}

	defaultOf(t, spec.at(t, "dsnSecretRef.key"), outboxv1alpha1.DefaultDSNKey)
	defaultOf(t, spec.at(t, "kafka.sasl.credentialsSecretRef.usernameKey"), outboxv1alpha1.DefaultSASLUsernameKey)
	defaultOf(t, spec.at(t, "kafka.sasl.credentialsSecretRef.passwordKey"), outboxv1alpha1.DefaultSASLPasswordKey)

	// Environment variable names and envFrom prefixes: the patterns the
	// operator checks (TestEnvNamePatternIsTheAPIServers ties them to the pod rule).
	require.Equal(t, outboxv1alpha1.EnvNamePattern, spec.at(t, "template.container.env.[].name").Pattern, "spec.template.container.env[].name pattern")
	require.Equal(t, outboxv1alpha1.EnvPrefixPattern, spec.at(t, "template.container.envFrom.[].prefix").Pattern, "spec.template.container.envFrom[].prefix pattern")

	// The defaults the operator reads itself.
	defaultOf(t, spec.at(t, "replicas"), outboxv1alpha1.DefaultReplicas)
	defaultOf(t, spec.at(t, "autoscaling.minReplicas"), outboxv1alpha1.DefaultMinReplicas)
	durationDefaultOf(t, spec.at(t, "autoscaling.scaleDownStabilization"), outboxv1alpha1.DefaultScaleDownStabilization)
	durationDefaultOf(t, spec.at(t, "backlog.interval"), outboxv1alpha1.DefaultBacklogInterval)
	durationDefaultOf(t, spec.at(t, "lagThreshold"), outboxv1alpha1.DefaultLagThreshold)
}

// durationDefaultOf requires s's default to be a duration string of want.
func durationDefaultOf(t *testing.T, s *schema, want time.Duration) {
	t.Helper()
	var text string
	require.NoError(t, json.Unmarshal(s.Default, &text), "default %s", s.Default)
	got, err := time.ParseDuration(text)
	require.NoError(t, err)
	require.Equal(t, want, got, "default %q", text)
}

// TestEnvNamePatternIsTheAPIServers: EnvNamePattern admits exactly the
// names the API server admits in a pod's environment (its relaxed rule, the
// only one from Kubernetes 1.34 on), and EnvPrefixPattern exactly its
// envFrom prefixes (the same, or none): every ASCII character alone, in a
// name and at its ends, and some that are not ASCII.
func TestEnvNamePatternIsTheAPIServers(t *testing.T) {
	t.Parallel()
	name, prefix := regexp.MustCompile(outboxv1alpha1.EnvNamePattern), regexp.MustCompile(outboxv1alpha1.EnvPrefixPattern)
	values := []string{"", "A_B", "a.b-c", "1st", " ", "my var:~", "A=", "=A", "é", "A\u00a0B", "\U0001F600"}
	for r := rune(0); r <= 0x80; r++ {
		values = append(values, string(r), "A"+string(r)+"B", string(r)+"A", "A"+string(r))
	}
	for _, v := range values {
		k8s := validation.IsRelaxedEnvVarName(v)
		require.Equal(t, len(k8s) == 0, name.MatchString(v), "name %q: the API server says %v", v, k8s)
		require.Equal(t, len(k8s) == 0 || v == "", prefix.MatchString(v), "prefix %q: the API server says %v", v, k8s)
	}
}

// TestCRDKeepsTheRelaysOwnNames: the names the template may not use are
// the constants the operator builds the pods with (the markers must be
// literals).
func TestCRDKeepsTheRelaysOwnNames(t *testing.T) {
	t.Parallel()
	spec := committedSchema(t).at(t, "spec")
	require.Equal(t, relayconfig.EnvPrefix, outboxv1alpha1.ReservedEnvPrefix, "the relay's environment")
	require.Contains(t, spec.at(t, "template.container.env.[].name").rules(), "!self.startsWith('"+outboxv1alpha1.ReservedEnvPrefix+"')")
	vols := strings.Join(spec.at(t, "template.pod.volumes").rules(), " ")
	mounts := strings.Join(spec.at(t, "template.container.volumeMounts.[]").rules(), " ")
	for _, name := range []string{outboxv1alpha1.ReservedVolume, outboxv1alpha1.ReservedDatabaseVolume} {
		require.Contains(t, vols, "v.name != '"+name+"'")
		require.Contains(t, mounts, "self.name != '"+name+"'")
	}
	require.Contains(t, mounts, "self.mountPath != '"+outboxv1alpha1.ReservedMountDir+"' && !self.mountPath.startsWith('"+outboxv1alpha1.ReservedMountDir+"/')")
}
