package relayconfig_test

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func valid() relayconfig.Command {
	s := relayconfig.Defaults()
	s.DSN = "postgres://x"
	s.Brokers = []string{"k1:9092", "[::1]:9093"}
	s.Topics = map[string]string{"OrderConfirmed": "orders.confirmed", "Order Shipped": "orders_shipped"}
	return s
}

// Args and Parse are inverses for valid settings.
func TestArgsRoundTrip(t *testing.T) {
	t.Parallel()
	cases := map[string]func(s *relayconfig.Command){
		"defaults": func(*relayconfig.Command) {},
		"everything": func(s *relayconfig.Command) {
			s.Table = "app.outbox_2"
			s.DeadLetterTopic = "dlt"
			s.BatchSize = relayconfig.MaxBatchSize
			s.MaxBatchBytes = relayconfig.MinMaxBatchBytes
			s.PollInterval = relayconfig.MinPollInterval
			s.PublishTimeout = relayconfig.MaxPublishTimeout
			s.StallTimeout = 90 * time.Second
			s.Ordering = relayconfig.OrderingPartitionKey
			s.LogFormat = "text"
			s.Notify = true
			s.Format = relayconfig.FormatCloudEvents
			s.CloudEventsSource = "https://orders.example/outbox"
			s.Compression = relayconfig.CompressionZstd
			s.KafkaTLS = true
			s.KafkaTLSCAFile, s.KafkaTLSCertFile, s.KafkaTLSKeyFile = "/tls/ca.crt", "/tls/tls.crt", "/tls/tls.key"
			s.KafkaSASLMechanism = relayconfig.SASLPlain
			s.KafkaSASLUsername, s.KafkaSASLPassword = "u", "s3cret"
			s.DatabaseAuth, s.DatabaseAuthAWSRegion = relayconfig.DatabaseAuthAWSRDSIAM, "eu-west-1"
			s.PartitionColumn = "kafka_partition"
		},
		"OAUTHBEARER from a token endpoint": func(s *relayconfig.Command) {
			s.KafkaTLS = true
			s.KafkaSASLMechanism = relayconfig.SASLOAuthBearer
			s.KafkaSASLOAuthTokenEndpoint, s.KafkaSASLOAuthScope = "https://idp.example/oauth2/token", "kafka openid"
			s.KafkaSASLUsername, s.KafkaSASLPassword = "client", "s3cret"
		},
		"OAUTHBEARER from a file": func(s *relayconfig.Command) {
			s.KafkaTLS = true
			s.KafkaSASLMechanism, s.KafkaSASLOAuthTokenFile = relayconfig.SASLOAuthBearer, "/var/run/secrets/kafka/token"
		},
		"AWS_MSK_IAM": func(s *relayconfig.Command) {
			s.KafkaTLS = true
			s.KafkaSASLMechanism, s.KafkaSASLAWSRegion = relayconfig.SASLAWSMSKIAM, "us-east-2"
		},
	}
	for name, mutate := range cases {
		s := valid()
		mutate(&s)
		require.NoError(t, s.Validate(), name)
		got, err := relayconfig.Parse(s.Args(), env(map[string]string{
			relayconfig.EnvDSN: s.DSN, relayconfig.EnvSASLUsername: s.KafkaSASLUsername, relayconfig.EnvSASLPassword: s.KafkaSASLPassword,
		}), nil)
		require.NoError(t, err, name)
		require.Equal(t, s, got, name)
		for _, a := range s.Args() {
			require.NotContains(t, a, "postgres://", "the DSN is never an argument")
			require.NotContains(t, a, "s3cret", "nor a password")
		}
	}
}

// A relay left at its defaults is given only flags the first release
// (0.1.0) knows, so an OutboxRelay whose image is pinned to it keeps
// running after an operator upgrade (a relay refuses a flag it does not
// know), and each of them with its value, so that relay (which knows no
// RELAY_ARGS_ONLY) takes none of them from its environment. A later flag
// is given once its value is not the default. Before, every flag was
// given: --linger and --record-timestamp made a 0.1.0 relay exit.
func TestArgsOfADefaultRelayAreTheFirstReleases(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("testdata/flags-v0.1.0.txt")
	require.NoError(t, err)
	known := map[string]bool{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if !strings.HasPrefix(l, "#") {
			known[l] = true
		}
	}
	s := relayconfig.Defaults()
	s.DSN = "postgres://x"
	s.Brokers = []string{"k:9092"}
	s.Topics = map[string]string{"E": "t"}
	given := map[string]bool{}
	for _, a := range s.Args() {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		require.True(t, known[name], "a relay at its defaults is given --%s, which relay 0.1.0 does not know", name)
		given[name] = true
	}
	for _, a := range s.FullArgs() {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if known[name] {
			require.True(t, given[name], "--%s, which relay 0.1.0 knows, is given with its default", name)
		}
	}
	require.Less(t, len(s.Args()), len(s.FullArgs()), "later flags at their defaults are not given")
	s.Linger = 2 * relayconfig.DefaultLinger
	require.Contains(t, s.Args(), "--linger="+s.Linger.String(), "a later flag off its default is")
}

// With RELAY_ARGS_ONLY (which the operator sets), the environment gives
// the secrets alone: a RELAY_* variable from a ConfigMap the pod reads
// whole (envFrom) changes no setting, neither one the arguments leave at
// its default nor one they never give.
func TestArgsOnlyTakesOnlySecretsFromTheEnvironment(t *testing.T) {
	t.Parallel()
	vars := map[string]string{
		relayconfig.EnvDSN: "postgres://x", relayconfig.EnvSASLUsername: "client", relayconfig.EnvSASLPassword: "s3cret",
		relayconfig.EnvName(relayconfig.FlagBatchSize): "7", relayconfig.EnvName(relayconfig.FlagNotify): "true",
		relayconfig.EnvName(relayconfig.FlagOrdering): string(relayconfig.OrderingPartitionKey), relayconfig.EnvName(relayconfig.FlagDeadLetterTopic): "dlt",
	}
	args := []string{"--brokers=k:9092", "--topic=E=t", "--kafka-tls", "--kafka-sasl-mechanism=" + string(relayconfig.SASLPlain)}
	got, err := relayconfig.Parse(args, env(vars), nil)
	require.NoError(t, err)
	require.Equal(t, 7, got.BatchSize, "without it, the environment sets what the arguments do not")
	require.True(t, got.Notify)
	require.Equal(t, relayconfig.OrderingPartitionKey, got.Ordering)
	require.Equal(t, "dlt", got.DeadLetterTopic)

	vars[relayconfig.EnvArgsOnly] = "true"
	got, err = relayconfig.Parse(args, env(vars), nil)
	require.NoError(t, err)
	want := relayconfig.Defaults()
	want.DSN, want.Brokers, want.Topics = "postgres://x", []string{"k:9092"}, map[string]string{"E": "t"}
	want.KafkaTLS, want.KafkaSASLMechanism = true, relayconfig.SASLPlain
	want.KafkaSASLUsername, want.KafkaSASLPassword = "client", "s3cret"
	require.Equal(t, want, got)

	// `relay held`, run by hand in the pod, reads its table from there.
	vars[relayconfig.EnvName(relayconfig.FlagTable)] = "app.outbox"
	held, err := relayconfig.ParseHeld(nil, false, env(vars), nil)
	require.NoError(t, err)
	require.Equal(t, "app.outbox", held.Table)
	delete(vars, relayconfig.EnvName(relayconfig.FlagTable))

	vars[relayconfig.EnvArgsOnly] = "yes"
	_, err = relayconfig.Parse(args, env(vars), nil)
	require.ErrorContains(t, err, `RELAY_ARGS_ONLY: "yes"`)
}

// FuzzArgsRoundTrip: any settings that validate survive Args then Parse.
func FuzzArgsRoundTrip(f *testing.F) {
	f.Add("outbox", "E", "t", 50, int64(200*time.Millisecond), "none", false)
	f.Add("app.x_1", "Order Shipped", "a.b-c_d", 10000, int64(time.Hour), "partition-key", true)
	f.Fuzz(func(t *testing.T, table, eventType, topic string, batch int, poll int64, ordering string, tls bool) {
		s := relayconfig.Defaults()
		s.DSN = "postgres://x"
		s.Table, s.Brokers, s.Topics = table, []string{"k:9092"}, map[string]string{eventType: topic}
		s.BatchSize, s.PollInterval, s.Ordering, s.KafkaTLS = batch, time.Duration(poll), relayconfig.Ordering(ordering), tls
		if s.Validate() != nil {
			return
		}
		got, err := relayconfig.Parse(s.Args(), env(map[string]string{relayconfig.EnvDSN: s.DSN}), nil)
		require.NoError(t, err)
		require.Equal(t, s, got)
	})
}

// Every error names the flag and the value.
func TestParseNamesFlagAndValue(t *testing.T) {
	t.Parallel()
	good := []string{"--brokers=k:9092", "--topic=E=t"}
	dsn := env(map[string]string{relayconfig.EnvDSN: "postgres://x"})
	cases := map[string][]string{
		`--max-batch-bytes: 1024 is outside 65536..67108864`:                                                                           {"--max-batch-bytes=1024"},
		`--stall-timeout: 1s is outside 5s..24h0m0s`:                                                                                   {"--stall-timeout=1s"},
		`--publish-timeout: 0s is outside 1s..5m0s`:                                                                                    {"--publish-timeout=0s"},
		`--kafka-sasl-mechanism: PLAIN sends the password in clear text; it needs --kafka-tls`:                                         {"--kafka-sasl-mechanism=PLAIN"},
		`--topic: event type " E" must be`:                                                                                             {"--topic= E=t2"},
		`--brokers: "k:0" has an invalid port`:                                                                                         {"--brokers=k:0"},
		`--format: "avro" is not one of raw, cloudevents`:                                                                              {"--format=avro"},
		`--compression: "brotli" is not one of none, gzip, snappy, lz4, zstd`:                                                          {"--compression=brotli"},
		`--cloudevents-source: "/a b" is not a URI-reference`:                                                                          {"--cloudevents-source=/a b"},
		`--cloudevents-source: "%zz" is not a URI-reference`:                                                                           {"--cloudevents-source=%zz"},
		`--prune-pause: 0s is outside 1ms..1m0s`:                                                                                       {"--prune-pause=0s"},
		`--database-auth: "kerberos" is not one of password, aws-rds-iam, gcp-cloudsql-iam, azure-ad`:                                  {"--database-auth=kerberos"},
		`--database-auth-aws-region: applies only to --database-auth=aws-rds-iam`:                                                      {"--database-auth=azure-ad", "--database-auth-aws-region=eu-west-1"},
		`--kafka-sasl-mechanism: OAUTHBEARER sends a bearer token in clear text; it needs --kafka-tls`:                                 {"--kafka-sasl-mechanism=OAUTHBEARER", "--kafka-sasl-oauth-token-file=/t"},
		`--kafka-sasl-mechanism: MSK serves AWS_MSK_IAM only over TLS; it needs --kafka-tls`:                                           {"--kafka-sasl-mechanism=AWS_MSK_IAM"},
		`--kafka-sasl-mechanism: OAUTHBEARER needs exactly one of --kafka-sasl-oauth-token-file and --kafka-sasl-oauth-token-endpoint`: {"--kafka-tls", "--kafka-sasl-mechanism=OAUTHBEARER"},
		`--kafka-sasl-oauth-token-endpoint: needs the client id and secret`:                                                            {"--kafka-tls", "--kafka-sasl-mechanism=OAUTHBEARER", "--kafka-sasl-oauth-token-endpoint=https://idp/token"},
		`--kafka-sasl-oauth-token-endpoint: "http://idp/token": http only to a loopback host`:                                          {"--kafka-tls", "--kafka-sasl-mechanism=OAUTHBEARER", "--kafka-sasl-oauth-token-endpoint=http://idp/token"},
		`--kafka-sasl-aws-region: applies only to --kafka-sasl-mechanism=AWS_MSK_IAM`:                                                  {"--kafka-sasl-aws-region=eu-west-1"},
		`--kafka-sasl-oauth-scope: applies only to --kafka-sasl-mechanism=OAUTHBEARER`:                                                 {"--kafka-sasl-oauth-scope=kafka"},
		`--partition-column: "Kafka" is not a plain lower-case identifier`:                                                             {"--partition-column=Kafka"},
		`--partition-column: "event_type" is a column the relay reads for its own purpose`:                                             {"--partition-column=event_type"},
	}
	for want, extra := range cases {
		_, err := relayconfig.Parse(append(good, extra...), dsn, nil)
		require.ErrorContains(t, err, want)
	}
	_, err := relayconfig.Parse([]string{"-h"}, dsn, &bytes.Buffer{})
	require.True(t, errors.Is(err, relayconfig.ErrHelp))
}

// Each codec and format is accepted, from the command line and the environment.
func TestFormatAndCompressionValues(t *testing.T) {
	t.Parallel()
	for _, c := range relayconfig.Compressions {
		s, err := relayconfig.Parse([]string{"--brokers=k:9092", "--topic=E=t", "--compression=" + string(c)},
			env(map[string]string{relayconfig.EnvDSN: "postgres://x"}), nil)
		require.NoError(t, err)
		require.Equal(t, c, s.Compression)
	}
	s, err := relayconfig.Parse([]string{"--brokers=k:9092", "--topic=E=t"}, env(map[string]string{
		relayconfig.EnvDSN: "postgres://x", "RELAY_FORMAT": "cloudevents", "RELAY_CLOUDEVENTS_SOURCE": "urn:orders",
	}), nil)
	require.NoError(t, err)
	require.Equal(t, relayconfig.FormatCloudEvents, s.Format)
	require.Equal(t, "urn:orders", s.CloudEventsSource)
}

// docs/relay.md's flag table lists every flag, with the defaults the relay has.
func TestDocsFlagTableMatches(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/relay.md")
	require.NoError(t, err)
	var usage bytes.Buffer
	_, err = relayconfig.Parse([]string{"-h"}, env(nil), &usage)
	require.ErrorIs(t, err, relayconfig.ErrHelp)
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z-]+)`).FindAllStringSubmatch(usage.String(), -1) {
		require.Contains(t, string(doc), "`--"+m[1], "docs/relay.md lists --%s", m[1])
	}
	rows := regexp.MustCompile("(?m)^\\| `--([a-z-]+)` \\| `([^`]*)` \\|").FindAllStringSubmatch(string(doc), -1)
	require.NotEmpty(t, rows)
	defaults := map[string]string{}
	for _, a := range relayconfig.Defaults().FullArgs() {
		name, value, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		defaults[name] = value
	}
	defaults[relayconfig.FlagKafkaTLS] = "false"
	defaults[relayconfig.FlagNotify] = "false"
	for _, r := range rows {
		want, ok := defaults[r[1]]
		require.True(t, ok, "docs/relay.md gives a default for --%s, which has none", r[1])
		require.Equal(t, want, r[2], "default of --%s", r[1])
	}
}

// `relay schema` takes --table and, with --partitioned, the period and the
// partitions ahead; errors name the flag and the value.
func TestParseSchema(t *testing.T) {
	t.Parallel()
	s, err := relayconfig.ParseSchema(nil, nil)
	require.NoError(t, err)
	require.Equal(t, relayconfig.SchemaSettings{Table: "outbox", Period: "day", Ahead: relayconfig.DefaultPartitionsAhead}, s)
	s, err = relayconfig.ParseSchema([]string{"--table", "app.outbox", "--partitioned", "--partition-period", "hour", "--partitions-ahead", "48"}, nil)
	require.NoError(t, err)
	require.Equal(t, relayconfig.SchemaSettings{Table: "app.outbox", Partitioned: true, Period: "hour", Ahead: 48}, s)
	for want, args := range map[string][]string{
		`--partition-period: "year" is not one of hour, day, week, month`: {"--partitioned", "--partition-period=year"},
		`--partitions-ahead: 0 is outside 1..1000`:                        {"--partitioned", "--partitions-ahead=0"},
		`--partitions-ahead needs --partitioned`:                          {"--partitions-ahead=3"},
		`--table: table "A"`:                                              {"--table=A"},
		`unexpected argument "x"`:                                         {"x"},
	} {
		_, err := relayconfig.ParseSchema(args, nil)
		require.ErrorContains(t, err, want)
	}
}

// docs/relay.md describes every flag of `relay schema`.
func TestDocsDescribeSchemaFlags(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/relay.md")
	require.NoError(t, err)
	var usage bytes.Buffer
	_, err = relayconfig.ParseSchema([]string{"-h"}, &usage)
	require.ErrorIs(t, err, relayconfig.ErrHelp)
	flags := regexp.MustCompile(`(?m)^  -([a-z-]+)`).FindAllStringSubmatch(usage.String(), -1)
	require.Len(t, flags, 4)
	for _, m := range flags {
		require.Contains(t, string(doc), "`--"+m[1], "docs/relay.md describes relay schema --%s", m[1])
	}
	for flag, def := range map[string]string{
		relayconfig.FlagTable:           relayconfig.DefaultTable,
		relayconfig.FlagPartitionPeriod: string(relayconfig.DefaultPartitionPeriod),
		relayconfig.FlagPartitionsAhead: strconv.Itoa(relayconfig.DefaultPartitionsAhead),
	} {
		require.Contains(t, string(doc), "`--"+flag+"` (default `"+def+"`)", "docs/relay.md gives the default of relay schema --%s", flag)
	}
}
func TestCheckTokenEndpoint(t *testing.T) {
	for endpoint, ok := range map[string]bool{
		"https://idp.example/oauth2/token": true,
		"http://127.0.0.1:8080/token":      true,
		"http://localhost/token":           true,
		"http://[::1]:9/token":             true,
		"http://idp.example/token":         false,
		"ftp://idp.example/token":          false,
		"/token":                           false,
		"idp.example/token":                false,
	} {
		if err := relayconfig.CheckTokenEndpoint(endpoint); ok {
			require.NoError(t, err, endpoint)
		} else {
			require.Error(t, err, endpoint)
		}
	}
}

// `relay held` and `relay redrive` take where to connect from the
// environment, never which rows: a RELAY_ALL or RELAY_REASON left in a
// pod's environment does not widen a redrive. Before, a bare `relay
// redrive` with RELAY_ALL=true released every held row.
func TestHeldTakesOnlyTheConnectionFromTheEnvironment(t *testing.T) {
	t.Parallel()
	vars := map[string]string{
		relayconfig.EnvDSN: "postgres://x", relayconfig.EnvName(relayconfig.FlagTable): "app.outbox",
		relayconfig.EnvName(relayconfig.FlagDatabaseAuth): string(relayconfig.DatabaseAuthAzureAD),
		relayconfig.EnvName(relayconfig.FlagAll):          "true", relayconfig.EnvName(relayconfig.FlagReason): "refused",
		relayconfig.EnvName(relayconfig.FlagType): "E", relayconfig.EnvName(relayconfig.FlagLimit): "5",
		relayconfig.EnvName(relayconfig.FlagOutput): "json",
	}
	_, err := relayconfig.ParseHeld(nil, true, env(vars), nil)
	require.ErrorContains(t, err, "select the rows to release")

	got, err := relayconfig.ParseHeld([]string{"--id", "42"}, true, env(vars), nil)
	require.NoError(t, err)
	require.Equal(t, []int64{42}, got.IDs)
	require.False(t, got.All)
	require.Empty(t, got.Reasons)
	require.Empty(t, got.Types)
	require.Equal(t, "postgres://x", got.DSN)
	require.Equal(t, "app.outbox", got.Table)
	require.Equal(t, relayconfig.DatabaseAuthAzureAD, got.DatabaseAuth)
	got, err = relayconfig.ParseHeld([]string{"--id=-5,0"}, true, env(vars), nil)
	require.NoError(t, err, "a row's id may be 0 or below")
	require.Equal(t, []int64{-5, 0}, got.IDs)

	list, err := relayconfig.ParseHeld(nil, false, env(vars), nil)
	require.NoError(t, err)
	require.Equal(t, relayconfig.DefaultHeldLimit, list.Limit)
	require.Equal(t, "text", list.Output)

	// A bad value from the environment is named by its variable, which
	// the command line does not show; the same value given as a flag is
	// named by the flag alone.
	vars[relayconfig.EnvName(relayconfig.FlagTable)] = "App.Outbox"
	vars[relayconfig.EnvName(relayconfig.FlagDatabaseAuthAWSRegion)] = "eu-west-1"
	_, err = relayconfig.ParseHeld(nil, false, env(vars), nil)
	require.ErrorContains(t, err, `RELAY_TABLE (--table): table "App.Outbox"`)
	require.ErrorContains(t, err, "RELAY_DATABASE_AUTH_AWS_REGION (--database-auth-aws-region): applies only to")
	_, err = relayconfig.ParseHeld([]string{"--table", "App.Outbox"}, false, env(vars), nil)
	require.ErrorContains(t, err, `--table: table "App.Outbox"`)
	require.NotContains(t, err.Error(), "RELAY_TABLE")
}

// The topic map comes from the command line or from the environment,
// never from both: --topic or --topics-file on the command line leaves
// RELAY_TOPIC and RELAY_TOPICS_FILE unread.
func TestTopicMapComesFromOnePlace(t *testing.T) {
	t.Parallel()
	file := t.TempDir() + "/topics.yaml"
	require.NoError(t, os.WriteFile(file, []byte("Foo: b\n"), 0o600))
	vars := env(map[string]string{relayconfig.EnvDSN: "postgres://x", relayconfig.EnvName(relayconfig.FlagTopic): "Foo=a,Bar=c"})
	got, err := relayconfig.Parse([]string{"--brokers=k:9092", "--topics-file", file}, vars, nil)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"Foo": "b"}, got.Topics)
	got, err = relayconfig.Parse([]string{"--brokers=k:9092", "--topic", "Baz=d"}, vars, nil)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"Baz": "d"}, got.Topics)
	got, err = relayconfig.Parse([]string{"--brokers=k:9092"}, vars, nil)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"Foo": "a", "Bar": "c"}, got.Topics, "without either flag, the environment gives the map")
}

// A topics file maps each event type as written to one topic, or is
// refused with the line, the event type and the value.
func TestTopicsFileTakesEachEntryAsWritten(t *testing.T) {
	t.Parallel()
	parse := func(body string) (map[string]string, error) {
		file := t.TempDir() + "/topics.yaml"
		require.NoError(t, os.WriteFile(file, []byte(body), 0o600))
		got, err := relayconfig.Parse([]string{"--brokers=k:9092", "--topics-file", file}, env(map[string]string{relayconfig.EnvDSN: "postgres://x"}), nil)
		return got.Topics, err
	}
	got, err := parse("yes: a\n1.0: b\n0x10: c\n\"Order Shipped\": \"123\"\n")
	require.NoError(t, err)
	require.Equal(t, map[string]string{"yes": "a", "1.0": "b", "0x10": "c", "Order Shipped": "123"}, got)
	_, err = parse("Foo: ~\n")
	require.NotContains(t, err.Error(), "quote it", "~ names no topic quoted either")
	got, err = parse("Foo: \"null\"\n")
	require.NoError(t, err, "a quoted null names a topic")
	require.Equal(t, map[string]string{"Foo": "null"}, got)
	got, err = parse(`{"E": "t"}`)
	require.NoError(t, err, "JSON is YAML")
	require.Equal(t, map[string]string{"E": "t"}, got)
	for body, want := range map[string]string{
		"Foo: \"orders,Bar=payments\"\n": `line 1: event type "Foo": "orders,Bar=payments"`,
		"Foo: \"orders,\"\n":             `event type "Foo": "orders,"`,
		"Foo:\n":                         `event type "Foo": ""`,
		"Foo: null\n":                    `line 1: event type "Foo": null is no topic (quote it to name a topic "null")`,
		`{"Foo": null}`:                  `event type "Foo": null is no topic`,
		"Foo: ~\n":                       `event type "Foo": ~ is no topic`,
		"Foo: a\nFoo: b\n":               `line 2: event type "Foo" is mapped twice in the file`,
		"Foo: [a, b]\n":                  "line 1: want EVENT_TYPE: TOPIC, one name each",
		"- Foo\n":                        "want a map of event type to topic, not a !!seq",
		"Foo: &x a\nBar: *x\n":           "line 2: want EVENT_TYPE: TOPIC, one name each",
	} {
		_, err := parse(body)
		require.ErrorContains(t, err, want, "%q", body)
		require.ErrorContains(t, err, "--topics-file: ", "%q", body)
	}
}

// --max-retained-wal takes the OutboxRelay's form (4Gi) beside bytes, and
// a bad value is named with its flag, or with its variable when it came
// from the environment.
func TestMaxRetainedWALAndEnvironmentErrors(t *testing.T) {
	t.Parallel()
	good := []string{"--brokers=k:9092", "--topic=E=t", "--capture=" + string(relayconfig.CaptureLogicalReplication)}
	dsn := map[string]string{relayconfig.EnvDSN: "postgres://x"}
	for v, want := range map[string]int64{"4Gi": 4 << 30, "64Mi": 64 << 20, "1Pi": 1 << 50, "68719476736": 64 << 30} {
		got, err := relayconfig.Parse(append(good, "--max-retained-wal="+v), env(dsn), nil)
		require.NoError(t, err, v)
		require.Equal(t, want, got.MaxRetainedWAL, v)
	}
	for v, want := range map[string]string{
		"4GB":   `flag -max-retained-wal: "4GB" is not a size`,
		"-1Gi":  `"-1Gi" is not a size`,
		"32Mi":  "--max-retained-wal: 33554432 is less than 67108864 (64Mi)",
		"2Pi":   "2251799813685248 is more than 1125899906842624 (1Pi)",
		"9Ei":   `"9Ei" is not a size: bytes, or a whole number with Ki, Mi, Gi, Ti or Pi (4Gi)`,
		"4G":    `"4G" is not a size`, // a quantity's decimal suffix
		"1.5Gi": `"1.5Gi" is not a size`,
	} {
		_, err := relayconfig.Parse(append(good, "--max-retained-wal="+v), env(dsn), nil)
		require.ErrorContains(t, err, want, v)
	}
	// The help states the range and default the checks use, in the form
	// the flag reads.
	var help strings.Builder
	_, err := relayconfig.Parse([]string{"--help"}, env(nil), &help)
	require.ErrorIs(t, err, relayconfig.ErrHelp)
	require.Contains(t, help.String(), "whole number with Ki, Mi, Gi, Ti or Pi (64Mi..1Pi) (default 4Gi)")

	vars := map[string]string{relayconfig.EnvDSN: "postgres://x", relayconfig.EnvName(relayconfig.FlagBatchSize): "0"}
	_, err = relayconfig.Parse(good, env(vars), nil)
	require.ErrorContains(t, err, "RELAY_BATCH_SIZE (--batch-size): 0 is outside")
	_, err = relayconfig.Parse(append(good, "--batch-size=0"), env(vars), nil)
	require.ErrorContains(t, err, "--batch-size: 0 is outside", "given on the command line, it is the flag's")
	require.NotContains(t, err.Error(), "RELAY_BATCH_SIZE")
	// A variable the relay does not read (RELAY_ARGS_ONLY) names nothing:
	// the bad value came from elsewhere.
	vars = map[string]string{relayconfig.EnvDSN: "postgres://x", relayconfig.EnvArgsOnly: "true", relayconfig.EnvName(relayconfig.FlagKafkaTLSCertFile): "/c.pem"}
	_, err = relayconfig.Parse(append(good, "--"+relayconfig.FlagKafkaTLSKeyFile+"=/k.pem"), env(vars), nil)
	require.ErrorContains(t, err, "--kafka-tls-cert-file: goes together with --kafka-tls-key-file")
	require.NotContains(t, err.Error(), "RELAY_KAFKA_TLS_CERT_FILE", "with RELAY_ARGS_ONLY the variable was not read")
}

// A topics file that cannot be read is named by the variable that gave it
// when it came from the environment; a metrics address that is no
// [HOST]:PORT is refused with the other settings (the process exits 2),
// not when the relay listens on it.
func TestTopicsFileAndMetricsAddrErrorsNameTheirSource(t *testing.T) {
	t.Parallel()
	base := map[string]string{relayconfig.EnvDSN: "postgres://x"}
	vars := maps.Clone(base)
	vars[relayconfig.EnvName(relayconfig.FlagTopicsFile)] = "/nonexistent/topics.yaml"
	_, err := relayconfig.Parse([]string{"--brokers=k:9092"}, env(vars), nil)
	require.ErrorContains(t, err, "RELAY_TOPICS_FILE (--topics-file): open /nonexistent/topics.yaml")
	_, err = relayconfig.Parse([]string{"--brokers=k:9092", "--topics-file=/nonexistent/topics.yaml"}, env(base), nil)
	require.ErrorContains(t, err, "--topics-file: open /nonexistent/topics.yaml")
	require.NotContains(t, err.Error(), "RELAY_TOPICS_FILE")

	for _, addr := range []string{"9090", "localhost:99999", "[::1]", ":http"} {
		_, err := relayconfig.Parse([]string{"--brokers=k:9092", "--topic=E=t", "--metrics-addr=" + addr}, env(base), nil)
		require.ErrorContains(t, err, fmt.Sprintf("--metrics-addr: %q is not [HOST]:PORT", addr))
	}
	// --max-retained-wal bounds a slot, which a polling relay has none of.
	_, err = relayconfig.Parse([]string{"--brokers=k:9092", "--topic=E=t", "--max-retained-wal=1073741824"}, env(base), nil)
	require.ErrorContains(t, err, "--max-retained-wal: applies only to --capture=logical-replication")
	_, err = relayconfig.Parse([]string{"--brokers=k:9092", "--topic=E=t", "--capture=logical-replication", "--max-retained-wal=1073741824"}, env(base), nil)
	require.NoError(t, err)
	for _, addr := range []string{":9090", "0.0.0.0:0", "[::1]:8080", "localhost:65535"} {
		_, err := relayconfig.Parse([]string{"--brokers=k:9092", "--topic=E=t", "--metrics-addr=" + addr}, env(base), nil)
		require.NoError(t, err, addr)
	}
}
