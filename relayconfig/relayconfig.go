// Package relayconfig is the contract between the operator and the relay
// process: the relay's flag and environment names, their defaults and
// ranges, the rules for table names, event types, topics and brokers, and
// the two directions of the command line (Settings.Args builds it, Parse
// reads it back). The operator builds a relay pod's arguments with it,
// cmd/relay parses them with it and the relay library validates its Config
// with the same rules, so a setting changes in one place.
package relayconfig

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	yamlv3 "go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// Flag names of the relay command.
const (
	FlagDSN                         = "dsn"
	FlagTable                       = "table"
	FlagBrokers                     = "brokers"
	FlagTopic                       = "topic"
	FlagTopicsFile                  = "topics-file"
	FlagDeadLetterTopic             = "dead-letter-topic"
	FlagBatchSize                   = "batch-size"
	FlagMaxBatchBytes               = "max-batch-bytes"
	FlagPollInterval                = "poll-interval"
	FlagLinger                      = "linger"
	FlagPublishTimeout              = "publish-timeout"
	FlagOrdering                    = "ordering"
	FlagStallTimeout                = "stall-timeout"
	FlagMaxInFlight                 = "max-in-flight"
	FlagNotify                      = "notify"
	FlagOnPublish                   = "on-publish"
	FlagKeepPublishedFor            = "keep-published-for"
	FlagPruneBatchSize              = "prune-batch-size"
	FlagPrunePause                  = "prune-pause"
	FlagMetricsAddr                 = "metrics-addr"
	FlagLogFormat                   = "log-format"
	FlagKafkaTLS                    = "kafka-tls"
	FlagKafkaTLSCAFile              = "kafka-tls-ca-file"
	FlagKafkaTLSCertFile            = "kafka-tls-cert-file"
	FlagKafkaTLSKeyFile             = "kafka-tls-key-file"
	FlagDatabaseCAFile              = "database-tls-ca-file"
	FlagDatabaseCertFile            = "database-tls-cert-file"
	FlagDatabaseKeyFile             = "database-tls-key-file"
	FlagDatabaseAuth                = "database-auth"
	FlagDatabaseAuthAWSRegion       = "database-auth-aws-region"
	FlagKafkaSASLMech               = "kafka-sasl-mechanism"
	FlagKafkaSASLOAuthTokenFile     = "kafka-sasl-oauth-token-file"
	FlagKafkaSASLOAuthTokenEndpoint = "kafka-sasl-oauth-token-endpoint"
	FlagKafkaSASLOAuthScope         = "kafka-sasl-oauth-scope"
	FlagKafkaSASLAWSRegion          = "kafka-sasl-aws-region"
	FlagFormat                      = "format"
	FlagRecordTimestamp             = "record-timestamp"
	FlagCloudEventsSource           = "cloudevents-source"
	FlagCompression                 = "compression"
	FlagPartitionColumn             = "partition-column"
	FlagCapture                     = "capture"
	FlagMaxRetainedWAL              = "max-retained-wal"
	FlagWriterDeletes               = "writer-deletes"
	flagKafkaSASLUsername           = "kafka-sasl-username" // environment only
	flagKafkaSASLPassword           = "kafka-sasl-password" // environment only
)

// Flag names of `relay schema`, which prints the outbox DDL.
const (
	FlagPartitioned     = "partitioned"
	FlagPartitionPeriod = "partition-period"
	FlagPartitionsAhead = "partitions-ahead"
)

// EnvPrefix starts the environment variable of every flag: RELAY_<FLAG>,
// upper case, "-" as "_". A flag on the command line wins over it.
const EnvPrefix = "RELAY_"

// EnvName is the environment variable that sets a flag.
func EnvName(flagName string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Flag names of `relay held` and `relay redrive`, which list and release
// the rows the relays hold back.
const (
	FlagID     = "id"
	FlagReason = "reason"
	FlagType   = "type"
	FlagAll    = "all"
	FlagLimit  = "limit"
	FlagOutput = "output"
)

// Environment variables that carry secrets; they never appear as arguments.
var (
	EnvDSN          = EnvName(FlagDSN)
	EnvSASLUsername = EnvName(flagKafkaSASLUsername)
	EnvSASLPassword = EnvName(flagKafkaSASLPassword)
)

// EnvArgsOnly set to "true" makes the relay take its settings from its
// arguments alone: of the RELAY_* variables it reads only the secrets
// (EnvDSN, EnvSASLUsername, EnvSASLPassword). The operator sets it on the
// pods it makes, so a variable that reaches a pod another way (envFrom of
// a ConfigMap) does not change what its OutboxRelay says. A relay of a
// release before it ignores it, as it does any variable it does not know.
const EnvArgsOnly = EnvPrefix + "ARGS_ONLY"

// The OpenTelemetry environment the operator sets on a relay pod with
// tracing; the relay reads these and the rest of the standard OTEL_* set.
const (
	// EnvOTELTracesExporter: "otlp" turns tracing on, unset or "none" leaves it off.
	EnvOTELTracesExporter = "OTEL_TRACES_EXPORTER"
	// EnvOTELExporterOTLPEndpoint is the OTLP/HTTP endpoint.
	EnvOTELExporterOTLPEndpoint = "OTEL_EXPORTER_OTLP_ENDPOINT"
	// EnvOTELServiceName is the spans' service.name.
	EnvOTELServiceName = "OTEL_SERVICE_NAME"
)

// Ordering is the per-key ordering mode, as the relay's --ordering takes it.
type Ordering string

const (
	// OrderingNone: rows are published in id order within one replica;
	// across replicas no per-key order is promised.
	OrderingNone Ordering = "none"
	// OrderingPartitionKey: each partition key's rows reach Kafka in id
	// order, with any number of replicas.
	OrderingPartitionKey Ordering = "partition-key"
)

// Orderings are the valid Ordering values.
var Orderings = []Ordering{OrderingNone, OrderingPartitionKey}

// OnPublish is what the relay does to a row Kafka acknowledged.
type OnPublish string

const (
	// OnPublishMark sets published_at (the row stays until pruned).
	OnPublishMark OnPublish = "mark"
	// OnPublishDelete deletes the row in the claim transaction.
	OnPublishDelete OnPublish = "delete"
)

// OnPublishes are the valid OnPublish values.
var OnPublishes = []OnPublish{OnPublishMark, OnPublishDelete}

// Format is how the relay lays out a Kafka record, as --format takes it.
type Format string

const (
	// FormatRaw: the payload as the value, the relay's headers and the row's own.
	FormatRaw Format = "raw"
	// FormatCloudEvents: a CloudEvent in the Kafka protocol binding's binary
	// content mode (ce_* headers, content-type), plus the raw format's headers.
	FormatCloudEvents Format = "cloudevents"
	// FormatCloudEventsStructured: a CloudEvent in the structured content
	// mode (the event as application/cloudevents+json, the payload its
	// data), plus the raw format's headers.
	FormatCloudEventsStructured Format = "cloudevents-structured"
)

// Formats are the valid Format values.
var Formats = []Format{FormatRaw, FormatCloudEvents, FormatCloudEventsStructured}

// RecordTimestamp is what a record's timestamp is, as --record-timestamp takes it.
type RecordTimestamp string

const (
	// RecordTimestampCreatedAt: the row's created_at, when the event
	// happened.
	RecordTimestampCreatedAt RecordTimestamp = "created-at"
	// RecordTimestampPublish: when the relay publishes it.
	RecordTimestampPublish RecordTimestamp = "publish"
)

// RecordTimestamps are the valid RecordTimestamp values.
var RecordTimestamps = []RecordTimestamp{RecordTimestampCreatedAt, RecordTimestampPublish}

// Compression is the codec of the relay's produce requests, as --compression takes it.
type Compression string

// The Compression values.
const (
	CompressionNone   Compression = "none"
	CompressionGzip   Compression = "gzip"
	CompressionSnappy Compression = "snappy"
	CompressionLz4    Compression = "lz4"
	CompressionZstd   Compression = "zstd"
)

// Compressions are the valid Compression values.
var Compressions = []Compression{CompressionNone, CompressionGzip, CompressionSnappy, CompressionLz4, CompressionZstd}

// SASL mechanisms the relay speaks.
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
	// SASLOAuthBearer is OAUTHBEARER with a token from a file or a token endpoint.
	SASLOAuthBearer = "OAUTHBEARER"
	// SASLAWSMSKIAM is Amazon MSK's IAM authentication.
	SASLAWSMSKIAM = "AWS_MSK_IAM"
)

// SASLMechanisms are the valid --kafka-sasl-mechanism values.
var SASLMechanisms = []string{SASLPlain, SASLScramSHA256, SASLScramSHA512, SASLOAuthBearer, SASLAWSMSKIAM}

// Capture is how the relay learns of new rows.
type Capture string

const (
	// CapturePoll claims unpublished rows in id order (the default).
	CapturePoll Capture = "poll"
	// CaptureLogicalReplication streams the table's inserts from a logical
	// replication slot (pgoutput) and publishes them in commit order.
	CaptureLogicalReplication Capture = "logical-replication"
)

// Captures are the valid Capture values.
var Captures = []Capture{CapturePoll, CaptureLogicalReplication}

// DefaultMaxRetainedWAL is how much WAL a relay's slot may hold back
// before the relay gives the slot up and polls.
const DefaultMaxRetainedWAL = 4 << 30

// MinMaxRetainedWAL is the least --max-retained-wal: a slot that may hold
// back less would be given up on an ordinary burst.
const MinMaxRetainedWAL = 64 << 20

// MaxMaxRetainedWAL is the most --max-retained-wal: 1 PiB, past any disk a
// PostgreSQL server keeps its WAL on, so a larger value is a typo (and the
// operator reads a quantity past int64, such as 100Ei, as int64's maximum).
const MaxMaxRetainedWAL = 1 << 50

// DatabaseAuth is how the relay logs in to PostgreSQL.
type DatabaseAuth string

const (
	// DatabaseAuthPassword: the DSN's own password (the default).
	DatabaseAuthPassword DatabaseAuth = "password"
	// DatabaseAuthAWSRDSIAM: an RDS IAM token signed with the pod's AWS identity.
	DatabaseAuthAWSRDSIAM DatabaseAuth = "aws-rds-iam"
	// DatabaseAuthGCPCloudSQLIAM: a Google access token of the pod's identity (Cloud SQL IAM).
	DatabaseAuthGCPCloudSQLIAM DatabaseAuth = "gcp-cloudsql-iam"
	// DatabaseAuthAzureAD: a Microsoft Entra ID token of the pod's identity.
	DatabaseAuthAzureAD DatabaseAuth = "azure-ad"
)

// DatabaseAuths are the valid DatabaseAuth values.
var DatabaseAuths = []DatabaseAuth{DatabaseAuthPassword, DatabaseAuthAWSRDSIAM, DatabaseAuthGCPCloudSQLIAM, DatabaseAuthAzureAD}

// Log formats.
var LogFormats = []string{"json", "text"}

// Defaults and ranges.
const (
	DefaultTable         = outbox.DefaultTable
	DefaultBatchSize     = 50
	MinBatchSize         = 1
	MaxBatchSize         = 10000
	DefaultMaxBatchBytes = 4 << 20
	MinMaxBatchBytes     = 64 << 10
	MaxMaxBatchBytes     = 64 << 20 // one produce request: brokers refuse one above socket.request.max.bytes (100 MiB by default)
	DefaultPollInterval  = 200 * time.Millisecond
	MinPollInterval      = 10 * time.Millisecond
	MaxPollInterval      = time.Hour
	// DefaultLinger: with rows arriving, a claim every few milliseconds
	// keeps the latency near the batch's own time (docs/benchmarks.md).
	DefaultLinger         = 5 * time.Millisecond
	MinLinger             = time.Millisecond
	MaxLinger             = time.Second
	DefaultPublishTimeout = 10 * time.Second
	MinPublishTimeout     = time.Second
	MaxPublishTimeout     = 5 * time.Minute
	// BatchCommitMargin is what a batch may take beyond its publish
	// (BatchDeadline): its claim, its mark and its commit.
	BatchCommitMargin  = 15 * time.Second
	DefaultMaxInFlight = 2
	MinMaxInFlight     = 1
	MaxMaxInFlight     = 2
	DefaultOnPublish   = OnPublishMark
	// DefaultKeepPublishedFor 0 keeps published rows forever.
	DefaultKeepPublishedFor = time.Duration(0)
	MinKeepPublishedFor     = time.Minute
	MaxKeepPublishedFor     = 10 * 365 * 24 * time.Hour
	DefaultPruneBatchSize   = 1000
	MinPruneBatchSize       = 10
	MaxPruneBatchSize       = 100000
	DefaultPrunePause       = 100 * time.Millisecond
	MinPrunePause           = time.Millisecond // 0 would read as "the default"
	MaxPrunePause           = time.Minute
	DefaultStallTimeout     = 2 * time.Minute
	MinStallTimeout         = 5 * time.Second
	MaxStallTimeout         = 24 * time.Hour
	DefaultOrdering         = OrderingNone
	DefaultLogFormat        = "json"
	DefaultFormat           = FormatRaw
	DefaultRecordTimestamp  = RecordTimestampCreatedAt
	DefaultCompression      = CompressionNone
	// DefaultPartitionPeriod is the span of created_at of one partition
	// that `relay schema --partitioned` lays out.
	DefaultPartitionPeriod = outbox.PartitionDay
	// DefaultPartitionsAhead is how many partitions after the current one
	// `relay schema --partitioned` creates (and its function creates by default).
	DefaultPartitionsAhead = 7
	MinPartitionsAhead     = 1
	MaxPartitionsAhead     = 1000
	// MaxCloudEventsSourceLength bounds --cloudevents-source (it travels in every record).
	MaxCloudEventsSourceLength = 1024
	// MetricsPort is where a relay pod serves /metrics, /healthz and /readyz.
	MetricsPort = 9090
	// MaxTopics is the most event types one relay maps.
	MaxTopics = 512
	// MaxEventTypeLength is the longest event type, in characters.
	MaxEventTypeLength = outbox.MaxEventTypeLength
	// MaxTopicLength is Kafka's longest topic name.
	MaxTopicLength = 249
)

// DefaultMetricsAddr is --metrics-addr's default.
var DefaultMetricsAddr = ":" + strconv.Itoa(MetricsPort)

// Patterns the OutboxRelay schema carries too (a test compares them).
const (
	// TablePattern is a table name, NAME or SCHEMA.NAME.
	TablePattern = outbox.TablePattern
	// TopicPattern is a Kafka topic name's characters; "." and ".." are refused besides.
	TopicPattern = `^[a-zA-Z0-9._-]+$`
	// EventTypePattern: no '=' or ',' (the --topic syntax) and no surrounding space.
	EventTypePattern = outbox.EventTypePattern
	// BrokerPattern is host:port, an IPv6 host in brackets.
	BrokerPattern = `^(\[[0-9a-fA-F:.]+\]|[a-zA-Z0-9]([-a-zA-Z0-9.]*[a-zA-Z0-9])?):[0-9]{1,5}$`
)

var (
	topicRE  = regexp.MustCompile(TopicPattern)
	brokerRE = regexp.MustCompile(BrokerPattern)
)

// Settings are what shape a relay: its database, table, brokers, topics
// and loop. The relay library takes them as they are (relay.Config embeds
// them) and validates them once, in relay.New; the operator builds them
// from an OutboxRelay's spec; Command adds the process's own settings.
// Zero fields take their defaults (WithDefaults).
type Settings struct {
	// DSN is the PostgreSQL connection string; it travels in RELAY_DSN, never as an argument.
	DSN string
	// Table is the outbox table, "name" or "schema.name".
	Table string
	// Brokers are the Kafka bootstrap addresses, host:port.
	Brokers []string
	// Topics maps event_type to Kafka topic. Rows whose event_type is not
	// here are held (never claimed) until it is.
	Topics map[string]string
	// DeadLetterTopic receives rows that Kafka refuses permanently, with
	// the error in headers. Empty: such rows are held and reported.
	DeadLetterTopic string
	// BatchSize is the most rows claimed per transaction.
	BatchSize int
	// MaxBatchBytes is the most payload and headers bytes claimed per
	// transaction; a larger row is claimed alone.
	MaxBatchBytes int
	// PollInterval is the longest sleep between claims: each claim in a
	// row that finds nothing doubles the sleep, from Linger up to this,
	// jittered ±20%.
	PollInterval time.Duration
	// Linger is how long the relay waits after a claim that found rows
	// but did not fill its batch, so the rows still arriving go out
	// together: longer lingers mean fewer, fuller batches (less CPU and
	// fewer database transactions per event) and up to that much more
	// latency. At most PollInterval takes effect. A streaming relay
	// publishes when the stream pauses, and at the latest once the first
	// waiting row has waited Linger.
	Linger time.Duration
	// PublishTimeout bounds one batch's publish to Kafka.
	PublishTimeout time.Duration
	// Ordering is the per-key ordering mode.
	Ordering Ordering
	// MaxInFlight is how many batches may be in flight at once: 2 claims
	// and publishes the next batch while one commits (ordering none only).
	// A crash may then publish up to this many batches again.
	MaxInFlight int
	// Notify: LISTEN on the table's channel for writers that notify
	// (outbox.WithNotify); notifying serializes the writers' commits.
	Notify bool
	// OnPublish: mark or delete an acknowledged row.
	OnPublish OnPublish
	// KeepPublishedFor: published rows older than this are pruned; 0 keeps them.
	KeepPublishedFor time.Duration
	// PruneBatchSize is the most rows one prune transaction deletes.
	PruneBatchSize int
	// PrunePause is the pause between two prune transactions.
	PrunePause time.Duration
	// StallTimeout: readiness fails when no batch completes, or rows wait
	// and none is published, for this long.
	StallTimeout time.Duration
	// Format is the record layout: raw or cloudevents.
	Format Format
	// RecordTimestamp is what each record's timestamp is: the row's
	// created_at or the publish time.
	RecordTimestamp RecordTimestamp
	// CloudEventsSource is ce_source in the cloudevents format; empty means
	// "/outbox/<table>".
	CloudEventsSource string
	// Compression is the produce requests' codec.
	Compression Compression
	// Capture is how the relay learns of new rows: polling, or a logical
	// replication slot.
	Capture Capture
	// MaxRetainedWAL is the most WAL bytes the relay's slot may hold back
	// (logical-replication): beyond, the relay drops the slot and polls
	// until it recreates it.
	MaxRetainedWAL int64
	// WriterDeletes (logical-replication only): the writers delete each
	// row in the transaction that inserts it (outbox.WithDeleteOnStore),
	// so the relay publishes from the stream's decoded rows, puts back in
	// the table only what it could not publish, and never gives up its
	// slot (the WAL is then the only copy of an event until it is out).
	WriterDeletes bool
	// PartitionColumn, when set, is an integer column of the table whose
	// value, when not NULL, is the Kafka partition of the row's record
	// (else the partition key's hash chooses, as without it).
	PartitionColumn string
}

// WithDefaults is s with every zero field set to its default.
func (s Settings) WithDefaults() Settings {
	s.Table = cmp.Or(s.Table, DefaultTable)
	s.BatchSize = cmp.Or(s.BatchSize, DefaultBatchSize)
	s.MaxBatchBytes = cmp.Or(s.MaxBatchBytes, DefaultMaxBatchBytes)
	s.PollInterval = cmp.Or(s.PollInterval, DefaultPollInterval)
	s.Linger = cmp.Or(s.Linger, DefaultLinger)
	s.PublishTimeout = cmp.Or(s.PublishTimeout, DefaultPublishTimeout)
	s.StallTimeout = cmp.Or(s.StallTimeout, DefaultStallTimeout)
	s.Ordering = cmp.Or(s.Ordering, DefaultOrdering)
	s.MaxInFlight = cmp.Or(s.MaxInFlight, DefaultMaxInFlight)
	s.OnPublish = cmp.Or(s.OnPublish, DefaultOnPublish)
	s.KeepPublishedFor = cmp.Or(s.KeepPublishedFor, DefaultKeepPublishedFor)
	s.PruneBatchSize = cmp.Or(s.PruneBatchSize, DefaultPruneBatchSize)
	s.PrunePause = cmp.Or(s.PrunePause, DefaultPrunePause)
	s.Format = cmp.Or(s.Format, DefaultFormat)
	s.RecordTimestamp = cmp.Or(s.RecordTimestamp, DefaultRecordTimestamp)
	s.Compression = cmp.Or(s.Compression, DefaultCompression)
	s.Capture = cmp.Or(s.Capture, CapturePoll)
	s.MaxRetainedWAL = cmp.Or(s.MaxRetainedWAL, DefaultMaxRetainedWAL)
	return s
}

// Command is the relay command's settings: the relay's Settings and the
// process's own (endpoints, logging, Kafka TLS files and SASL).
type Command struct {
	Settings
	MetricsAddr string
	LogFormat   string
	KafkaTLS    bool
	// Kafka TLS files: CA bundle, client certificate and key (PEM).
	KafkaTLSCAFile, KafkaTLSCertFile, KafkaTLSKeyFile string
	DatabaseLogin
	// KafkaSASLMechanism is empty (no SASL) or one of SASLMechanisms.
	KafkaSASLMechanism string
	// SASL credentials (with OAUTHBEARER's token endpoint: the client id
	// and secret); they travel in the environment, never as arguments.
	KafkaSASLUsername, KafkaSASLPassword string
	// OAUTHBEARER's token: a file read for each new connection, or an
	// OAuth 2.0 token endpoint (client credentials grant) and its scope.
	KafkaSASLOAuthTokenFile, KafkaSASLOAuthTokenEndpoint, KafkaSASLOAuthScope string
	// KafkaSASLAWSRegion is AWS_MSK_IAM's region (default AWS_REGION).
	KafkaSASLAWSRegion string
}

// DatabaseLogin is how a process connects to PostgreSQL beyond its DSN:
// the relay's and `relay held`'s and `relay redrive`'s, one set of flags.
type DatabaseLogin struct {
	// PostgreSQL TLS files: with a CA bundle the process connects over TLS
	// and verifies the server's certificate and host name (verify-full),
	// whatever the DSN's sslmode; a client certificate and key (PEM) are
	// presented when given.
	DatabaseCAFile, DatabaseCertFile, DatabaseKeyFile string
	// DatabaseAuth is how the process logs in: the DSN's password or a
	// token of the pod's cloud identity. Default password.
	DatabaseAuth DatabaseAuth
	// DatabaseAuthAWSRegion is the region of aws-rds-iam tokens (default:
	// AWS_REGION, which EKS sets with a pod identity).
	DatabaseAuthAWSRegion string
}

// register adds the --database-* flags to fs, d's default first.
func (d *DatabaseLogin) register(fs *flag.FlagSet) {
	fs.StringVar(&d.DatabaseCAFile, FlagDatabaseCAFile, "", "PEM CA bundle: connect to PostgreSQL over TLS and verify its certificate and host name (verify-full), whatever the DSN's sslmode")
	fs.StringVar(&d.DatabaseCertFile, FlagDatabaseCertFile, "", "PEM client certificate presented to PostgreSQL (with --"+FlagDatabaseCAFile+")")
	fs.StringVar(&d.DatabaseKeyFile, FlagDatabaseKeyFile, "", "PEM client key presented to PostgreSQL")
	d.DatabaseAuth = DatabaseAuthPassword
	fs.Func(FlagDatabaseAuth, "how to log in to PostgreSQL: "+joinValues(DatabaseAuths)+" (a token of the pod's cloud identity as the password; needs TLS) (default password)", func(v string) error { d.DatabaseAuth = DatabaseAuth(v); return nil })
	fs.StringVar(&d.DatabaseAuthAWSRegion, FlagDatabaseAuthAWSRegion, "", "AWS region of aws-rds-iam tokens (default AWS_REGION)")
}

// validate checks the --database-* flags, naming each bad one.
func (d DatabaseLogin) validate() []error {
	var errs []error
	if (d.DatabaseCertFile == "") != (d.DatabaseKeyFile == "") {
		errs = append(errs, fieldErr(FlagDatabaseCertFile, fmt.Errorf("goes together with --%s", FlagDatabaseKeyFile)))
	}
	if d.DatabaseCertFile != "" && d.DatabaseCAFile == "" {
		errs = append(errs, fieldErr(FlagDatabaseCertFile, fmt.Errorf("needs --%s: a client certificate is presented only over a verified connection", FlagDatabaseCAFile)))
	}
	errs = append(errs, fieldErr(FlagDatabaseAuth, oneOf(cmp.Or(d.DatabaseAuth, DatabaseAuthPassword), DatabaseAuths)))
	if d.DatabaseAuthAWSRegion != "" && d.DatabaseAuth != DatabaseAuthAWSRDSIAM {
		errs = append(errs, fieldErr(FlagDatabaseAuthAWSRegion, fmt.Errorf("applies only to --%s=%s", FlagDatabaseAuth, DatabaseAuthAWSRDSIAM)))
	}
	return errs
}

// Defaults are the settings of a relay command given no flags.
func Defaults() Command {
	return Command{Settings: Settings{}.WithDefaults(), MetricsAddr: DefaultMetricsAddr, LogFormat: DefaultLogFormat, DatabaseLogin: DatabaseLogin{DatabaseAuth: DatabaseAuthPassword}}
}

// Args is the command line that gives a relay s, in a fixed order so a pod
// template built from it is stable. Secrets (DSN, SASL credentials) are
// never among the arguments: pass them in the environment (EnvDSN,
// EnvSASLUsername, EnvSASLPassword). A flag added after the first release
// is given only when s's value is not the relay's default (Defaults): a
// relay of an earlier release (an OutboxRelay's image pinned) is never
// given a flag it does not know unless what that flag controls is set,
// and an operator upgrade that adds a flag does not change the pod
// template of every relay. The first release's flags (alwaysGiven) are
// given with their defaults too, so no relay takes one of them from its
// environment, whether or not it knows EnvArgsOnly.
func (s Command) Args() []string {
	defaults := map[string]bool{}
	for _, a := range Defaults().FullArgs() {
		defaults[a] = true
	}
	var args []string
	for _, a := range s.FullArgs() {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !defaults[a] || slices.Contains(alwaysGiven, name) {
			args = append(args, a)
		}
	}
	return args
}

// alwaysGiven are the flags of the first release (0.1.0) that Args gives
// with their defaults: a relay of that release knows each of them.
var alwaysGiven = []string{FlagTable, FlagBrokers, FlagBatchSize, FlagMaxBatchBytes, FlagPollInterval, FlagPublishTimeout,
	FlagStallTimeout, FlagMaxInFlight, FlagOnPublish, FlagKeepPublishedFor, FlagPruneBatchSize, FlagPrunePause, FlagFormat,
	FlagCompression, FlagOrdering, FlagMetricsAddr, FlagLogFormat}

// FullArgs is Args with every flag that has a value, defaults included.
func (s Command) FullArgs() []string {
	arg := func(name, v string) string { return "--" + name + "=" + v }
	args := []string{
		arg(FlagTable, s.Table),
		arg(FlagBrokers, strings.Join(s.Brokers, ",")),
		arg(FlagBatchSize, strconv.Itoa(s.BatchSize)),
		arg(FlagMaxBatchBytes, strconv.Itoa(s.MaxBatchBytes)),
		arg(FlagPollInterval, s.PollInterval.String()),
		arg(FlagLinger, s.Linger.String()),
		arg(FlagPublishTimeout, s.PublishTimeout.String()),
		arg(FlagStallTimeout, s.StallTimeout.String()),
		arg(FlagMaxInFlight, strconv.Itoa(s.MaxInFlight)),
		arg(FlagOnPublish, string(s.OnPublish)),
		arg(FlagKeepPublishedFor, s.KeepPublishedFor.String()),
		arg(FlagPruneBatchSize, strconv.Itoa(s.PruneBatchSize)),
		arg(FlagPrunePause, s.PrunePause.String()),
		arg(FlagFormat, string(s.Format)),
		arg(FlagRecordTimestamp, string(s.RecordTimestamp)),
		arg(FlagCompression, string(s.Compression)),
	}
	for _, et := range slices.Sorted(maps.Keys(s.Topics)) {
		args = append(args, arg(FlagTopic, et+"="+s.Topics[et]))
	}
	if s.DeadLetterTopic != "" {
		args = append(args, arg(FlagDeadLetterTopic, s.DeadLetterTopic))
	}
	if s.CloudEventsSource != "" {
		args = append(args, arg(FlagCloudEventsSource, s.CloudEventsSource))
	}
	if s.PartitionColumn != "" {
		args = append(args, arg(FlagPartitionColumn, s.PartitionColumn))
	}
	if s.Capture != CapturePoll {
		args = append(args, arg(FlagCapture, string(s.Capture)), arg(FlagMaxRetainedWAL, strconv.FormatInt(s.MaxRetainedWAL, 10)))
	}
	if s.WriterDeletes {
		args = append(args, "--"+FlagWriterDeletes)
	}
	args = append(args, arg(FlagOrdering, string(s.Ordering)), arg(FlagMetricsAddr, s.MetricsAddr), arg(FlagLogFormat, s.LogFormat))
	if s.Notify {
		args = append(args, "--"+FlagNotify)
	}
	if s.KafkaTLS {
		args = append(args, "--"+FlagKafkaTLS)
	}
	for _, f := range []struct{ name, v string }{
		{FlagKafkaTLSCAFile, s.KafkaTLSCAFile}, {FlagKafkaTLSCertFile, s.KafkaTLSCertFile},
		{FlagKafkaTLSKeyFile, s.KafkaTLSKeyFile}, {FlagKafkaSASLMech, s.KafkaSASLMechanism},
		{FlagDatabaseCAFile, s.DatabaseCAFile}, {FlagDatabaseCertFile, s.DatabaseCertFile}, {FlagDatabaseKeyFile, s.DatabaseKeyFile},
		{FlagDatabaseAuthAWSRegion, s.DatabaseAuthAWSRegion},
		{FlagKafkaSASLOAuthTokenFile, s.KafkaSASLOAuthTokenFile}, {FlagKafkaSASLOAuthTokenEndpoint, s.KafkaSASLOAuthTokenEndpoint},
		{FlagKafkaSASLOAuthScope, s.KafkaSASLOAuthScope}, {FlagKafkaSASLAWSRegion, s.KafkaSASLAWSRegion},
	} {
		if f.v != "" {
			args = append(args, arg(f.name, f.v))
		}
	}
	if s.DatabaseAuth != "" && s.DatabaseAuth != DatabaseAuthPassword {
		args = append(args, arg(FlagDatabaseAuth, string(s.DatabaseAuth)))
	}
	return args
}

// SchemaSettings are the settings of `relay schema`.
type SchemaSettings struct {
	Table string
	// Partitioned: the DDL of an outbox range-partitioned by created_at.
	Partitioned bool
	// Period is the span of created_at of one partition.
	Period outbox.PartitionPeriod
	// Ahead is how many partitions after the current one to create.
	Ahead int
}

// ParseSchema reads the command line of `relay schema` (the arguments after
// "schema") and validates it; errors name the flag and the value. For -h it
// writes the usage to usage and returns ErrHelp.
func ParseSchema(args []string, usage io.Writer) (SchemaSettings, error) {
	s := SchemaSettings{Table: DefaultTable, Period: DefaultPartitionPeriod, Ahead: DefaultPartitionsAhead}
	fs := flag.NewFlagSet("relay schema", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&s.Table, FlagTable, DefaultTable, "outbox table, NAME or SCHEMA.NAME")
	fs.BoolVar(&s.Partitioned, FlagPartitioned, false, "the DDL of an outbox range-partitioned by created_at")
	fs.Func(FlagPartitionPeriod, fmt.Sprintf("with --%s: the span of created_at of one partition, in UTC: hour, day, week or month (default %s)", FlagPartitioned, DefaultPartitionPeriod),
		func(v string) error { s.Period = outbox.PartitionPeriod(v); return nil })
	fs.IntVar(&s.Ahead, FlagPartitionsAhead, DefaultPartitionsAhead, fmt.Sprintf("with --%s: partitions to create after the current one (%d..%d)", FlagPartitioned, MinPartitionsAhead, MaxPartitionsAhead))
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(usage, "usage: relay schema [flags]\n\nPrints the DDL of the outbox table.\n\n")
			fs.SetOutput(usage)
			fs.PrintDefaults()
			return s, ErrHelp
		}
		return s, err
	}
	if fs.NArg() > 0 {
		return s, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	errs := []error{fieldErr(FlagTable, CheckTable(s.Table))}
	if !slices.Contains(outbox.PartitionPeriods, s.Period) {
		errs = append(errs, fmt.Errorf("--%s: %q is not one of hour, day, week, month", FlagPartitionPeriod, s.Period))
	}
	if s.Ahead < MinPartitionsAhead || s.Ahead > MaxPartitionsAhead {
		errs = append(errs, fmt.Errorf("--%s: %d is outside %d..%d", FlagPartitionsAhead, s.Ahead, MinPartitionsAhead, MaxPartitionsAhead))
	}
	if !s.Partitioned {
		fs.Visit(func(f *flag.Flag) {
			if f.Name == FlagPartitionPeriod || f.Name == FlagPartitionsAhead {
				errs = append(errs, fmt.Errorf("--%s needs --%s", f.Name, FlagPartitioned))
			}
		})
	}
	return s, errors.Join(errs...)
}

// HeldSettings are the settings of `relay held` and `relay redrive`.
type HeldSettings struct {
	DSN   string
	Table string
	// DatabaseLogin: the relay's --database-* flags, so the subcommands
	// reach a database the relay reaches through TLS or a cloud login.
	DatabaseLogin
	// IDs, Reasons and Types select held rows: any that matches.
	IDs     []int64
	Reasons []string
	Types   []string
	// All selects every held row (redrive: required when nothing else selects).
	All bool
	// Limit is the most rows `relay held` lists.
	Limit int
	// Output is text or json (`relay held`).
	Output string
}

// DefaultHeldLimit is how many rows `relay held` lists by default.
const DefaultHeldLimit = 100

// registerConnection registers the flags of `relay held` and `relay
// redrive` that say where and how to connect, the ones they also take from
// the environment.
func (s *HeldSettings) registerConnection(fs *flag.FlagSet) {
	fs.StringVar(&s.DSN, FlagDSN, "", "PostgreSQL connection string (default "+EnvDSN+")")
	fs.StringVar(&s.Table, FlagTable, DefaultTable, "outbox table, NAME or SCHEMA.NAME")
	s.DatabaseLogin.register(fs)
}

// HeldEnv is the environment under which `relay held` and `relay redrive`,
// run by hand in a pod of the relay s (kubectl exec, no flags), reach its
// table as it does: each of their connection flags that s's arguments give,
// as its variable (EnvName), in name order. RELAY_DSN, a Secret, is not
// among them: the pod has it already. A relay given EnvArgsOnly ignores
// these variables, and one of an earlier release reads the values its
// arguments give anyway.
func (s Command) HeldEnv() [][2]string {
	given := map[string]string{}
	for _, a := range s.Args() {
		name, v, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		given[name] = v
	}
	fs := flag.NewFlagSet("", flag.ContinueOnError)
	new(HeldSettings).registerConnection(fs)
	var env [][2]string
	fs.VisitAll(func(f *flag.Flag) {
		if v, ok := given[f.Name]; ok && f.Name != FlagDSN {
			env = append(env, [2]string{EnvName(f.Name), v})
		}
	})
	return env
}

// ParseHeld reads the command line of `relay held` (redrive false) or
// `relay redrive` (the arguments after the command), filling --dsn and
// --table from RELAY_DSN and RELAY_TABLE when not given, as in a relay pod.
// Errors name the flag and the value. For -h it writes the usage to usage
// and returns ErrHelp.
func ParseHeld(args []string, redrive bool, lookupEnv func(string) (string, bool), usage io.Writer) (HeldSettings, error) {
	s := HeldSettings{Table: DefaultTable, Limit: DefaultHeldLimit, Output: "text"}
	name := "relay held"
	if redrive {
		name = "relay redrive"
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	s.registerConnection(fs)
	// Only these flags, where to connect and how, come from the
	// environment (a relay pod's RELAY_DSN, RELAY_TABLE and, when the relay
	// has them, RELAY_DATABASE_*: HeldEnv): which rows to release is said
	// on the command line alone. Before, a RELAY_ALL or RELAY_REASON left
	// in the environment widened a redrive to rows nobody named.
	fromEnv := map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) { fromEnv[EnvName(f.Name)] = true })
	fs.Func(FlagID, "a held row's id (repeatable, or comma-separated)", func(v string) error {
		for _, p := range strings.Split(v, ",") {
			id, err := strconv.ParseInt(strings.TrimSpace(p), 10, 64)
			if err != nil { // any id: a table's sequence may start at 0 or below
				return fmt.Errorf("%q is not a row id", p)
			}
			s.IDs = append(s.IDs, id)
		}
		return nil
	})
	fs.Func(FlagReason, "held for this reason: "+strings.Join(outbox.HeldReasons, ", ")+" (repeatable)", func(v string) error {
		if !slices.Contains(outbox.HeldReasons, v) {
			return fmt.Errorf("%q is not one of %s", v, strings.Join(outbox.HeldReasons, ", "))
		}
		s.Reasons = append(s.Reasons, v)
		return nil
	})
	fs.Func(FlagType, "rows of this event type (repeatable)", func(v string) error {
		if err := CheckEventType(v); err != nil {
			return err
		}
		s.Types = append(s.Types, v)
		return nil
	})
	if redrive {
		fs.BoolVar(&s.All, FlagAll, false, "release every held row")
	} else {
		fs.IntVar(&s.Limit, FlagLimit, DefaultHeldLimit, "most rows to list (1..100000)")
		fs.StringVar(&s.Output, FlagOutput, "text", "text or json")
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			what := "Lists the rows the relays hold back, why, and since when."
			if redrive {
				what = "Releases held rows: the relays try them again within seconds. Select them by id, reason and event type (each kind given narrows the rows; the values of one kind add up), or --all."
			}
			fmt.Fprintf(usage, "usage: %s [flags]\n\n%s\n\n", name, what)
			fs.SetOutput(usage)
			fs.PrintDefaults()
			return s, ErrHelp
		}
		return s, err
	}
	if fs.NArg() > 0 {
		return s, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	// connection is lookupEnv of the connection flags alone, and so without
	// EnvArgsOnly: run by hand in a relay pod, the command reads RELAY_TABLE
	// there.
	connection := func(k string) (string, bool) {
		if !fromEnv[k] {
			return "", false
		}
		return lookupEnv(k)
	}
	fromEnvSet, err := applyEnv(fs, connection)
	if err != nil {
		return s, err
	}
	var errs []error
	if s.DSN == "" {
		errs = append(errs, fmt.Errorf("--%s: required (or set %s)", FlagDSN, EnvDSN))
	}
	errs = append(errs, fieldErr(FlagTable, CheckTable(s.Table)))
	if s.Limit < 1 || s.Limit > 100000 {
		errs = append(errs, fmt.Errorf("--%s: %d is outside 1..100000", FlagLimit, s.Limit))
	}
	if s.Output != "text" && s.Output != "json" {
		errs = append(errs, fmt.Errorf("--%s: %q is not one of text, json", FlagOutput, s.Output))
	}
	errs = append(errs, s.DatabaseLogin.validate()...)
	if redrive && !s.All && len(s.IDs)+len(s.Reasons)+len(s.Types) == 0 {
		errs = append(errs, fmt.Errorf("select the rows to release with --%s, --%s or --%s, or --%s", FlagID, FlagReason, FlagType, FlagAll))
	}
	if redrive && s.All && len(s.IDs)+len(s.Reasons)+len(s.Types) > 0 {
		errs = append(errs, fmt.Errorf("--%s selects every row; drop --%s, --%s and --%s", FlagAll, FlagID, FlagReason, FlagType))
	}
	nameEnv(errs, fromEnvSet)
	return s, errors.Join(errs...)
}

// nameEnv names the variable in each error of errs about a flag whose
// value came from the environment (fromEnv, as applyEnv returns it): the
// command line a user reads does not hold it.
func nameEnv(errs []error, fromEnv map[string]bool) {
	for _, err := range errs {
		var fe *FieldError
		if errors.As(err, &fe) && fromEnv[fe.Flag] {
			fe.Env = EnvName(fe.Flag)
		}
	}
}

// ErrHelp is returned by Parse for -h or --help, after the usage is written.
var ErrHelp = flag.ErrHelp

// Parse reads the relay's command line, filling each flag not given from
// its RELAY_<FLAG> variable (looked up through lookupEnv), and validates the
// result (Command.Validate): an explicit zero is refused here, where the
// relay library would take it for "the default". Errors name the flag (or
// variable) and the bad value. For -h it writes the usage to usage and
// returns ErrHelp.
func Parse(args []string, lookupEnv func(string) (string, bool), usage io.Writer) (Command, error) {
	s := Defaults()
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are returned, and printed once by the caller
	var brokers, topicsFile string
	topics := topicsValue{}
	fs.StringVar(&s.DSN, FlagDSN, "", "PostgreSQL connection string (pass it as "+EnvDSN+" from a Secret)")
	fs.StringVar(&s.Table, FlagTable, DefaultTable, "outbox table, NAME or SCHEMA.NAME")
	fs.StringVar(&brokers, FlagBrokers, "", "Kafka bootstrap brokers, comma-separated host:port")
	fs.IntVar(&s.BatchSize, FlagBatchSize, DefaultBatchSize, fmt.Sprintf("most rows claimed per transaction (%d..%d)", MinBatchSize, MaxBatchSize))
	fs.IntVar(&s.MaxBatchBytes, FlagMaxBatchBytes, DefaultMaxBatchBytes, fmt.Sprintf("most payload and headers bytes claimed per transaction; a larger row is claimed alone (%d..%d)", MinMaxBatchBytes, MaxMaxBatchBytes))
	fs.DurationVar(&s.PollInterval, FlagPollInterval, DefaultPollInterval, fmt.Sprintf("longest sleep between claims, reached by claims that find nothing (%s..%s)", MinPollInterval, MaxPollInterval))
	fs.DurationVar(&s.Linger, FlagLinger, DefaultLinger, fmt.Sprintf("wait after a claim that found rows but did not fill its batch (streaming: the longest the first waiting row waits for more): longer means fuller batches, less CPU and fewer transactions per event, more latency; at most --%s (%s..%s)", FlagPollInterval, MinLinger, MaxLinger))
	fs.DurationVar(&s.PublishTimeout, FlagPublishTimeout, DefaultPublishTimeout, fmt.Sprintf("deadline of one batch's publish (%s..%s)", MinPublishTimeout, MaxPublishTimeout))
	fs.DurationVar(&s.StallTimeout, FlagStallTimeout, DefaultStallTimeout, fmt.Sprintf("/readyz fails when no batch completes, or rows wait and none is published, for this long (%s..%s)", MinStallTimeout, MaxStallTimeout))
	fs.IntVar(&s.MaxInFlight, FlagMaxInFlight, DefaultMaxInFlight, fmt.Sprintf("batches in flight at once: 2 claims and publishes the next batch while one commits, with ordering none (%d..%d)", MinMaxInFlight, MaxMaxInFlight))
	fs.Func(FlagOnPublish, "what to do with a row Kafka acknowledged: mark (set published_at) or delete (default mark)", func(v string) error { s.OnPublish = OnPublish(v); return nil })
	fs.DurationVar(&s.KeepPublishedFor, FlagKeepPublishedFor, DefaultKeepPublishedFor, fmt.Sprintf("prune published rows older than this; 0 keeps them (0 or %s..%s)", MinKeepPublishedFor, MaxKeepPublishedFor))
	fs.IntVar(&s.PruneBatchSize, FlagPruneBatchSize, DefaultPruneBatchSize, fmt.Sprintf("most rows one prune transaction deletes (%d..%d)", MinPruneBatchSize, MaxPruneBatchSize))
	fs.DurationVar(&s.PrunePause, FlagPrunePause, DefaultPrunePause, fmt.Sprintf("pause between prune transactions (%s..%s)", MinPrunePause, MaxPrunePause))
	fs.Func(FlagFormat, "record layout: raw, cloudevents (CloudEvents binary content mode) or cloudevents-structured (default raw)", func(v string) error { s.Format = Format(v); return nil })
	fs.Func(FlagRecordTimestamp, "each record's timestamp: created-at (the row's created_at) or publish (default created-at)", func(v string) error { s.RecordTimestamp = RecordTimestamp(v); return nil })
	fs.StringVar(&s.CloudEventsSource, FlagCloudEventsSource, "", "ce_source of the cloudevents format, a URI-reference (default /outbox/<table>)")
	fs.Func(FlagCapture, "how new rows are found: "+joinValues(Captures)+" (default poll)", func(v string) error { s.Capture = Capture(v); return nil })
	fs.Func(FlagMaxRetainedWAL, fmt.Sprintf("logical-replication: the most WAL the slot may hold back before the relay drops it and polls, in bytes or a whole number with %s (%s..%s) (default %s)",
		binarySuffixList(), formatBinarySize(MinMaxRetainedWAL), formatBinarySize(MaxMaxRetainedWAL), formatBinarySize(DefaultMaxRetainedWAL)), func(v string) error {
		n, err := parseBinarySize(v)
		s.MaxRetainedWAL = n
		return err
	})
	fs.BoolVar(&s.WriterDeletes, FlagWriterDeletes, false, "logical-replication: the writers delete each row in the transaction that inserts it (outbox.WithDeleteOnStore); publish from the stream's rows, put back only what cannot be published, never give up the slot")
	fs.StringVar(&s.PartitionColumn, FlagPartitionColumn, "", "integer column whose value, when not NULL, is the record's Kafka partition (default: the partition key's hash chooses)")
	fs.Func(FlagCompression, "produce request codec: none, gzip, snappy, lz4 or zstd (default none)", func(v string) error { s.Compression = Compression(v); return nil })
	fs.BoolVar(&s.Notify, FlagNotify, false, "also claim as soon as a writer that notifies (outbox.WithNotify) commits; polling still runs")
	fs.Var(topics, FlagTopic, "EVENT_TYPE=TOPIC mapping (repeatable, or comma-separated)")
	fs.StringVar(&topicsFile, FlagTopicsFile, "", "YAML or JSON file mapping event types to topics")
	fs.StringVar(&s.DeadLetterTopic, FlagDeadLetterTopic, "", "topic for rows Kafka refuses permanently (default: hold them)")
	fs.StringVar(&s.MetricsAddr, FlagMetricsAddr, DefaultMetricsAddr, "address serving /metrics, /healthz and /readyz")
	fs.StringVar(&s.LogFormat, FlagLogFormat, DefaultLogFormat, "log format: "+strings.Join(LogFormats, " or "))
	fs.Func(FlagOrdering, "per-key ordering: none or partition-key (default none)", func(v string) error { s.Ordering = Ordering(v); return nil })
	fs.BoolVar(&s.KafkaTLS, FlagKafkaTLS, false, "connect to Kafka over TLS")
	fs.StringVar(&s.KafkaTLSCAFile, FlagKafkaTLSCAFile, "", "PEM CA bundle to verify the brokers (default: system roots)")
	fs.StringVar(&s.KafkaTLSCertFile, FlagKafkaTLSCertFile, "", "PEM client certificate for mutual TLS")
	fs.StringVar(&s.KafkaTLSKeyFile, FlagKafkaTLSKeyFile, "", "PEM client key for mutual TLS")
	s.DatabaseLogin.register(fs)
	fs.StringVar(&s.KafkaSASLMechanism, FlagKafkaSASLMech, "", "SASL mechanism: "+strings.Join(SASLMechanisms, ", ")+" (PLAIN and SCRAM: credentials from "+EnvSASLUsername+" and "+EnvSASLPassword+")")
	fs.StringVar(&s.KafkaSASLOAuthTokenFile, FlagKafkaSASLOAuthTokenFile, "", "OAUTHBEARER: file holding the token, read for each new connection")
	fs.StringVar(&s.KafkaSASLOAuthTokenEndpoint, FlagKafkaSASLOAuthTokenEndpoint, "", "OAUTHBEARER: OAuth 2.0 token endpoint (client credentials grant; client id and secret from "+EnvSASLUsername+" and "+EnvSASLPassword+")")
	fs.StringVar(&s.KafkaSASLOAuthScope, FlagKafkaSASLOAuthScope, "", "OAUTHBEARER: scope asked of the token endpoint")
	fs.StringVar(&s.KafkaSASLAWSRegion, FlagKafkaSASLAWSRegion, "", "AWS_MSK_IAM: the cluster's region (default AWS_REGION)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(usage, "usage: relay [flags]\n       relay schema [--table NAME] [--partitioned]\n       relay held [--reason R] [--type T] [--id N]\n       relay redrive (--id N | --reason R | --type T | --all)\n\nEvery flag can be set as %s<FLAG> in the environment.\n\n", EnvPrefix)
			fs.SetOutput(usage)
			fs.PrintDefaults()
			return s, ErrHelp
		}
		return s, err
	}
	if fs.NArg() > 0 {
		return s, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	fromEnv, err := applyEnv(fs, topicsFromOnePlace(fs, lookupEnv))
	if err != nil {
		return s, err
	}
	s.KafkaSASLUsername, _ = lookupEnv(EnvSASLUsername)
	s.KafkaSASLPassword, _ = lookupEnv(EnvSASLPassword)
	if topicsFile != "" {
		if err := readTopicsFile(topicsFile, topics); err != nil {
			fe := &FieldError{Flag: FlagTopicsFile, Err: err}
			nameEnv([]error{fe}, fromEnv)
			return s, fe
		}
	}
	if len(topics) > 0 {
		s.Topics = map[string]string(topics)
	}
	for _, b := range strings.Split(brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			s.Brokers = append(s.Brokers, b)
		}
	}
	errs := Errors(s.Validate())
	// --max-retained-wal bounds a replication slot, which a polling relay
	// has none of: given to one, it is a mistake to say, as --writer-deletes
	// is (the operator gives it only with logical replication).
	given := maps.Clone(fromEnv)
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if given[FlagMaxRetainedWAL] && s.Capture != CaptureLogicalReplication {
		errs = append(errs, fieldErr(FlagMaxRetainedWAL, fmt.Errorf("applies only to --%s=%s", FlagCapture, CaptureLogicalReplication)))
	}
	nameEnv(errs, fromEnv)
	return s, errors.Join(errs...)
}

// Validate checks every setting of the command, the relay's and the
// process's, and names each bad flag and its value: the operator's verdict
// on the command line it gives a relay pod. Every error is a *FieldError.
func (s Command) Validate() error {
	return errors.Join(append(Errors(s.Settings.Validate()), Errors(s.validateProcess())...)...)
}

// validPort reports whether p is a port number, 0 to 65535.
func validPort(p string) bool {
	_, err := strconv.ParseUint(p, 10, 16)
	return err == nil
}

// validateProcess checks the process's own settings.
func (s Command) validateProcess() error {
	var errs []error
	if !slices.Contains(LogFormats, s.LogFormat) {
		errs = append(errs, fieldErr(FlagLogFormat, fmt.Errorf("%q is not one of %s", s.LogFormat, strings.Join(LogFormats, ", "))))
	}
	// Checked here, so a bad address is refused with the other settings
	// (exit 2), not when the relay listens on it.
	if _, port, err := net.SplitHostPort(s.MetricsAddr); err != nil || !validPort(port) {
		errs = append(errs, fieldErr(FlagMetricsAddr, fmt.Errorf("%q is not [HOST]:PORT with a port of 0 to 65535", s.MetricsAddr)))
	}
	if (s.KafkaTLSCertFile == "") != (s.KafkaTLSKeyFile == "") {
		errs = append(errs, fieldErr(FlagKafkaTLSCertFile, fmt.Errorf("goes together with --%s", FlagKafkaTLSKeyFile)))
	}
	errs = append(errs, s.DatabaseLogin.validate()...)
	if m := s.KafkaSASLMechanism; m != "" {
		switch {
		case !slices.Contains(SASLMechanisms, m):
			errs = append(errs, fieldErr(FlagKafkaSASLMech, fmt.Errorf("%q is not one of %s", m, strings.Join(SASLMechanisms, ", "))))
		case m == SASLPlain && !s.TLSEnabled():
			errs = append(errs, fieldErr(FlagKafkaSASLMech, fmt.Errorf("%s sends the password in clear text; it needs --%s", m, FlagKafkaTLS)))
		case m == SASLOAuthBearer && !s.TLSEnabled():
			errs = append(errs, fieldErr(FlagKafkaSASLMech, fmt.Errorf("%s sends a bearer token in clear text; it needs --%s", m, FlagKafkaTLS)))
		case m == SASLAWSMSKIAM && !s.TLSEnabled():
			errs = append(errs, fieldErr(FlagKafkaSASLMech, fmt.Errorf("MSK serves %s only over TLS; it needs --%s", m, FlagKafkaTLS)))
		case m == SASLOAuthBearer && (s.KafkaSASLOAuthTokenFile == "") == (s.KafkaSASLOAuthTokenEndpoint == ""):
			errs = append(errs, fieldErr(FlagKafkaSASLMech, fmt.Errorf("%s needs exactly one of --%s and --%s", m, FlagKafkaSASLOAuthTokenFile, FlagKafkaSASLOAuthTokenEndpoint)))
		case m == SASLOAuthBearer && s.KafkaSASLOAuthTokenEndpoint != "" && (s.KafkaSASLUsername == "" || s.KafkaSASLPassword == ""):
			errs = append(errs, fieldErr(FlagKafkaSASLOAuthTokenEndpoint, fmt.Errorf("needs the client id and secret in %s and %s", EnvSASLUsername, EnvSASLPassword)))
		case (m == SASLPlain || m == SASLScramSHA256 || m == SASLScramSHA512) && (s.KafkaSASLUsername == "" || s.KafkaSASLPassword == ""):
			errs = append(errs, fieldErr(FlagKafkaSASLMech, fmt.Errorf("%s needs %s and %s", m, EnvSASLUsername, EnvSASLPassword)))
		}
	}
	if e := s.KafkaSASLOAuthTokenEndpoint; e != "" {
		errs = append(errs, fieldErr(FlagKafkaSASLOAuthTokenEndpoint, CheckTokenEndpoint(e)))
	}
	for _, f := range []struct{ flag, v, mech string }{
		{FlagKafkaSASLOAuthTokenFile, s.KafkaSASLOAuthTokenFile, SASLOAuthBearer},
		{FlagKafkaSASLOAuthTokenEndpoint, s.KafkaSASLOAuthTokenEndpoint, SASLOAuthBearer},
		{FlagKafkaSASLOAuthScope, s.KafkaSASLOAuthScope, SASLOAuthBearer},
		{FlagKafkaSASLAWSRegion, s.KafkaSASLAWSRegion, SASLAWSMSKIAM},
	} {
		if f.v != "" && s.KafkaSASLMechanism != f.mech {
			errs = append(errs, fieldErr(f.flag, fmt.Errorf("applies only to --%s=%s", FlagKafkaSASLMech, f.mech)))
		}
	}
	return errors.Join(errs...)
}

// Validate checks the relay's settings, with their defaults applied, and
// names each bad flag and its value. Every error is a *FieldError.
func (s Settings) Validate() error {
	var errs []error
	if s.DSN == "" {
		errs = append(errs, fieldErr(FlagDSN, fmt.Errorf("required (set %s)", EnvDSN)))
	}
	errs = append(errs,
		fieldErr(FlagTable, CheckTable(s.Table)),
		fieldErr(FlagBrokers, CheckBrokers(s.Brokers)),
		fieldErr(FlagTopic, CheckTopics(s.Topics)),
		fieldErr(FlagBatchSize, CheckBatchSize(s.BatchSize)),
		fieldErr(FlagMaxBatchBytes, CheckMaxBatchBytes(s.MaxBatchBytes)),
		fieldErr(FlagPollInterval, CheckPollInterval(s.PollInterval)),
		fieldErr(FlagLinger, CheckLinger(s.Linger)),
		fieldErr(FlagPublishTimeout, CheckPublishTimeout(s.PublishTimeout)),
		fieldErr(FlagStallTimeout, CheckStallTimeout(s.StallTimeout)),
		fieldErr(FlagMaxInFlight, CheckMaxInFlight(s.MaxInFlight)),
		fieldErr(FlagOnPublish, CheckOnPublish(s.OnPublish)),
		fieldErr(FlagKeepPublishedFor, CheckKeepPublishedFor(s.KeepPublishedFor)),
		fieldErr(FlagPruneBatchSize, CheckPruneBatchSize(s.PruneBatchSize)),
		fieldErr(FlagPrunePause, CheckPrunePause(s.PrunePause)),
		fieldErr(FlagOrdering, CheckOrdering(s.Ordering)),
		fieldErr(FlagFormat, CheckFormat(s.Format)),
		fieldErr(FlagRecordTimestamp, CheckRecordTimestamp(s.RecordTimestamp)),
		fieldErr(FlagCloudEventsSource, CheckCloudEventsSource(s.CloudEventsSource)),
		fieldErr(FlagCompression, CheckCompression(s.Compression)),
		fieldErr(FlagPartitionColumn, CheckPartitionColumn(s.PartitionColumn)),
		fieldErr(FlagCapture, oneOf(s.Capture, Captures)),
		fieldErr(FlagCapture, checkCaptureOrdering(s.Capture, s.Ordering)),
		fieldErr(FlagWriterDeletes, checkWriterDeletes(s.WriterDeletes, s.Capture)),
		fieldErr(FlagMaxRetainedWAL, CheckMaxRetainedWAL(s.MaxRetainedWAL)),
	)
	if s.DeadLetterTopic != "" {
		errs = append(errs, fieldErr(FlagDeadLetterTopic, CheckDeadLetterTopic(s.DeadLetterTopic, s.Topics)))
	}
	return errors.Join(errs...)
}

// FieldError is one bad setting: the flag that carries it (the operator
// maps it to its spec field) and what is wrong with the value.
type FieldError struct {
	Flag string
	Err  error
	// Env is the variable the value came from, when it did not come from
	// the command line (Parse): the error then names both.
	Env string
}

func (e *FieldError) Error() string {
	if e.Env != "" {
		return e.Env + " (--" + e.Flag + "): " + e.Err.Error()
	}
	return "--" + e.Flag + ": " + e.Err.Error()
}

func (e *FieldError) Unwrap() error { return e.Err }

// Errors is the flat list of the errors in err (those errors.Join joined), nil for nil.
func Errors(err error) []error {
	if err == nil {
		return nil
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var errs []error
	for _, e := range joined.Unwrap() {
		errs = append(errs, Errors(e)...)
	}
	return errs
}

// TLSEnabled reports whether the relay talks TLS to Kafka.
func (s Command) TLSEnabled() bool {
	return s.KafkaTLS || s.KafkaTLSCAFile != "" || s.KafkaTLSCertFile != ""
}

func fieldErr(flag string, err error) error {
	if err == nil {
		return nil
	}
	return &FieldError{Flag: flag, Err: err}
}

// CheckTable applies the table-name rule.
func CheckTable(s string) error {
	_, err := outbox.ParseTable(s)
	return err
}

// CheckBatchSize applies --batch-size's range.
func CheckBatchSize(n int) error {
	if n < MinBatchSize || n > MaxBatchSize {
		return fmt.Errorf("%d is outside %d..%d", n, MinBatchSize, MaxBatchSize)
	}
	return nil
}

// CheckMaxBatchBytes applies --max-batch-bytes' range.
func CheckMaxBatchBytes(n int) error {
	if n < MinMaxBatchBytes || n > MaxMaxBatchBytes {
		return fmt.Errorf("%d is outside %d..%d", n, MinMaxBatchBytes, MaxMaxBatchBytes)
	}
	return nil
}

func checkDuration(d, lo, hi time.Duration) error {
	if d < lo || d > hi {
		return fmt.Errorf("%s is outside %s..%s", d, lo, hi)
	}
	return nil
}

// CheckPollInterval applies --poll-interval's range.
func CheckPollInterval(d time.Duration) error {
	return checkDuration(d, MinPollInterval, MaxPollInterval)
}

// CheckLinger applies --linger's range.
func CheckLinger(d time.Duration) error {
	return checkDuration(d, MinLinger, MaxLinger)
}

// CheckPublishTimeout applies --publish-timeout's range.
func CheckPublishTimeout(d time.Duration) error {
	return checkDuration(d, MinPublishTimeout, MaxPublishTimeout)
}

// CheckStallTimeout applies --stall-timeout's range.
func CheckStallTimeout(d time.Duration) error {
	return checkDuration(d, MinStallTimeout, MaxStallTimeout)
}

// CheckMaxInFlight applies --max-in-flight's range.
func CheckMaxInFlight(n int) error {
	if n < MinMaxInFlight || n > MaxMaxInFlight {
		return fmt.Errorf("%d is outside %d..%d", n, MinMaxInFlight, MaxMaxInFlight)
	}
	return nil
}

// CheckOnPublish accepts the OnPublishes.
func CheckOnPublish(o OnPublish) error { return oneOf(o, OnPublishes) }

// oneOf accepts v when it is one of values, and names them when it is not:
// the list is the one home of a setting's values and of its message.
func oneOf[T ~string](v T, values []T) error {
	if slices.Contains(values, v) {
		return nil
	}
	return fmt.Errorf("%q is not one of %s", v, joinValues(values))
}

// joinValues lists values for a message.
func joinValues[T ~string](values []T) string {
	names := make([]string, len(values))
	for i, x := range values {
		names[i] = string(x)
	}
	return strings.Join(names, ", ")
}

// CheckKeepPublishedFor accepts 0 (keep forever) or a duration in range.
func CheckKeepPublishedFor(d time.Duration) error {
	if d == 0 {
		return nil
	}
	return checkDuration(d, MinKeepPublishedFor, MaxKeepPublishedFor)
}

// CheckPruneBatchSize applies --prune-batch-size's range.
func CheckPruneBatchSize(n int) error {
	if n < MinPruneBatchSize || n > MaxPruneBatchSize {
		return fmt.Errorf("%d is outside %d..%d", n, MinPruneBatchSize, MaxPruneBatchSize)
	}
	return nil
}

// CheckPrunePause applies --prune-pause's range.
func CheckPrunePause(d time.Duration) error { return checkDuration(d, MinPrunePause, MaxPrunePause) }

// CheckOrdering accepts the Orderings.
func CheckOrdering(o Ordering) error { return oneOf(o, Orderings) }

// CheckFormat accepts the Formats.
func CheckFormat(f Format) error { return oneOf(f, Formats) }

// CheckRecordTimestamp applies --record-timestamp's values.
func CheckRecordTimestamp(t RecordTimestamp) error { return oneOf(t, RecordTimestamps) }

// CheckCloudEventsSource accepts "" (the default, derived from the table)
// or a URI-reference, which CloudEvents requires of source.
func CheckCloudEventsSource(src string) error {
	if src == "" {
		return nil
	}
	if len(src) > MaxCloudEventsSourceLength {
		return fmt.Errorf("%d characters, at most %d", len(src), MaxCloudEventsSourceLength)
	}
	if !cloudEventsSourceRE.MatchString(src) {
		return fmt.Errorf("%q is not a URI-reference: only letters, digits, %s and %%XX escapes", src, "-._~:/?#[]@!$&'()*+,;=")
	}
	if !uriSchemeRE.MatchString(src) && uriColonFirstRE.MatchString(src) {
		return fmt.Errorf("%q is not a URI-reference: a ':' before the first '/' needs a scheme before it (letters, digits, +-.) or it reads as one", src)
	}
	if uriAuthorityStartRE.MatchString(src) && !uriAuthorityRE.MatchString(src) {
		return fmt.Errorf("%q is not a URI-reference: after // comes [user@]host[:port], with a host of letters, digits and -._~", src)
	}
	if _, err := url.Parse(src); err != nil {
		return fmt.Errorf("%q is not a URI-reference: %v", src, err)
	}
	return nil
}

// CheckCompression accepts the Compressions.
func CheckCompression(c Compression) error { return oneOf(c, Compressions) }

// CheckTopic applies Kafka's topic-name rule.
func CheckTopic(t string) error {
	if !topicRE.MatchString(t) || len(t) > MaxTopicLength || t == "." || t == ".." {
		return fmt.Errorf("%q is not a valid Kafka topic name ([a-zA-Z0-9._-], 1-%d characters, not . or ..)", t, MaxTopicLength)
	}
	return nil
}

// CheckEventType applies the event-type rule.
func CheckEventType(et string) error { return outbox.CheckEventType(et) }

// CheckTopics checks a topic map.
func CheckTopics(topics map[string]string) error {
	if len(topics) == 0 {
		return errors.New("at least one EVENT_TYPE=TOPIC mapping is required")
	}
	if len(topics) > MaxTopics {
		return fmt.Errorf("%d event types mapped, at most %d", len(topics), MaxTopics)
	}
	var errs []error
	for _, et := range slices.Sorted(maps.Keys(topics)) {
		topic := topics[et]
		if err := CheckEventType(et); err != nil {
			errs = append(errs, err)
		}
		if err := CheckTopic(topic); err != nil {
			errs = append(errs, fmt.Errorf("event type %q: %w", et, err))
		}
	}
	return errors.Join(errs...)
}

// CheckDeadLetterTopic checks the dead-letter topic's name and that it is
// none of the mapped topics.
func CheckDeadLetterTopic(deadLetter string, topics map[string]string) error {
	if err := CheckTopic(deadLetter); err != nil {
		return err
	}
	for _, et := range slices.Sorted(maps.Keys(topics)) {
		if topics[et] == deadLetter {
			return fmt.Errorf("%q is also the topic of event type %q", deadLetter, et)
		}
	}
	return nil
}

// CheckBrokers needs at least one host:port.
func CheckBrokers(brokers []string) error {
	if len(brokers) == 0 {
		return errors.New("at least one host:port is required")
	}
	var errs []error
	for _, b := range brokers {
		if err := CheckBroker(b); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// CheckBroker applies the host:port rule.
func CheckBroker(b string) error {
	if !brokerRE.MatchString(b) {
		return fmt.Errorf("%q is not host:port", b)
	}
	_, port, _ := net.SplitHostPort(b)
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("%q has an invalid port %q (1..65535)", b, port)
	}
	return nil
}

// topicsValue collects repeated --topic EVENT_TYPE=TOPIC values.
type topicsValue map[string]string

func (t topicsValue) String() string {
	parts := make([]string, 0, len(t))
	for _, k := range slices.Sorted(maps.Keys(t)) {
		parts = append(parts, k+"="+t[k])
	}
	return strings.Join(parts, ",")
}

// Set takes EVENT_TYPE=TOPIC, or several separated by commas (the form the
// RELAY_TOPIC environment variable uses). Event types cannot hold '=' or
// ',' (CheckEventType), so the split is unambiguous.
func (t topicsValue) Set(v string) error {
	for _, kv := range strings.Split(v, ",") {
		if strings.TrimSpace(kv) == "" {
			continue
		}
		et, topic, ok := strings.Cut(kv, "=")
		if !ok || et == "" || topic == "" {
			return fmt.Errorf("%q is not EVENT_TYPE=TOPIC", kv)
		}
		if err := t.add(et, topic); err != nil {
			return err
		}
	}
	return nil
}

// add maps event type et to topic, unless another topic has it.
func (t topicsValue) add(et, topic string) error {
	if prev, dup := t[et]; dup && prev != topic {
		return fmt.Errorf("event type %q is mapped twice (%q and %q)", et, prev, topic)
	}
	t[et] = topic
	return nil
}

// topicsFromOnePlace is lookupEnv without the topic map's variables when
// the command line gives the map (--topic or --topics-file): both flags
// set one map, which comes from the command line or from the environment,
// never from both. Before, RELAY_TOPIC added its event types to a
// --topics-file map, and a conflict between them blamed the file.
func topicsFromOnePlace(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) func(string) (string, bool) {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == FlagTopic || f.Name == FlagTopicsFile })
	return func(k string) (string, bool) {
		if given && (k == EnvName(FlagTopic) || k == EnvName(FlagTopicsFile)) {
			return "", false
		}
		return lookupEnv(k)
	}
}

// applyEnv sets every flag not given on the command line from RELAY_<FLAG>
// (only the secrets' with EnvArgsOnly), and says which it set.
func applyEnv(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) (set map[string]bool, err error) {
	set = map[string]bool{}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	argsOnly := false
	if v, ok := lookupEnv(EnvArgsOnly); ok {
		b, perr := strconv.ParseBool(v)
		if perr != nil {
			return nil, fmt.Errorf("%s: %q is not true or false", EnvArgsOnly, v)
		}
		argsOnly = b
	}
	fs.VisitAll(func(f *flag.Flag) {
		env := EnvName(f.Name)
		if given[f.Name] || err != nil || (argsOnly && env != EnvDSN && env != EnvSASLUsername && env != EnvSASLPassword) {
			return
		}
		if v, ok := lookupEnv(env); ok {
			if e := f.Value.Set(v); e != nil {
				err = fmt.Errorf("%s (--%s): %q: %v", env, f.Name, v, e)
			}
			set[f.Name] = true
		}
	})
	return set, err
}

// readTopicsFile adds the event type to topic map of a YAML (or JSON)
// file to into. Each key and value is taken as written: YAML would read
// `yes:` as true and `1.0:` as 1, and so route event types nobody writes.
// A value is one topic, checked as a name (null, ~ and JSON's null are
// none): before, it went through
// --topic's comma split, so `Foo: "orders,Bar=payments"` mapped two event
// types without a word.
func readTopicsFile(path string, into topicsValue) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var doc yamlv3.Node
	if err := yamlv3.Unmarshal(b, &doc); err != nil {
		return fmt.Errorf("%s: want a map of event type to topic: %w", path, err)
	}
	if len(doc.Content) == 0 {
		return nil
	}
	m := doc.Content[0]
	if m.Kind != yamlv3.MappingNode {
		return fmt.Errorf("%s: want a map of event type to topic, not a %s", path, m.ShortTag())
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		if k.Kind != yamlv3.ScalarNode || v.Kind != yamlv3.ScalarNode || k.Tag == "!!merge" {
			return fmt.Errorf("%s: line %d: want EVENT_TYPE: TOPIC, one name each", path, k.Line)
		}
		et, topic := k.Value, v.Value
		if err := CheckEventType(et); err != nil {
			return fmt.Errorf("%s: line %d: %w", path, k.Line, err)
		}
		if v.Tag == "!!null" && v.Style == 0 && topic != "" { // JSON's {"Foo": null} is no topic, not one named null
			hint := ""
			if CheckTopic(topic) == nil {
				hint = fmt.Sprintf(" (quote it to name a topic %q)", topic)
			}
			return fmt.Errorf("%s: line %d: event type %q: %s is no topic%s", path, v.Line, et, topic, hint)
		}
		if err := CheckTopic(topic); err != nil {
			return fmt.Errorf("%s: line %d: event type %q: %w", path, v.Line, et, err)
		}
		if seen[et] {
			return fmt.Errorf("%s: line %d: event type %q is mapped twice in the file", path, k.Line, et)
		}
		seen[et] = true
		if err := into.add(et, topic); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	return nil
}

// CheckTokenEndpoint accepts an https URL, or http to a loopback host (a
// sidecar in the pod): a client secret never crosses the network in clear text.
func CheckTokenEndpoint(endpoint string) error {
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return fmt.Errorf("%q is not an absolute URL", endpoint)
	}
	switch u.Scheme {
	case "https":
		return nil
	case "http":
		if ip := net.ParseIP(u.Hostname()); u.Hostname() == "localhost" || (ip != nil && ip.IsLoopback()) {
			return nil
		}
		return fmt.Errorf("%q: http only to a loopback host; use https", endpoint)
	}
	return fmt.Errorf("%q is not an https URL", endpoint)
}

// The rules of --cloudevents-source, a URI-reference (RFC 3986). The CRD
// states each of them, and CheckCloudEventsSource applies them and then
// Go's URL parser, so whatever the API server admits, the relay does too.
const (
	// CloudEventsSourcePattern admits a URI's characters: unreserved,
	// reserved, and %XX escapes.
	CloudEventsSourcePattern = `^([A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})+$`
	// URISchemePattern matches a reference that starts with a scheme.
	URISchemePattern = `^[A-Za-z][A-Za-z0-9+.-]*:`
	// URIColonFirstPattern matches a ':' in the first segment; without a
	// scheme before it, that would read as one.
	URIColonFirstPattern = `^[^/?#]*:`
	// URIAuthorityStartPattern matches a reference with an authority (//).
	URIAuthorityStartPattern = `^([A-Za-z][A-Za-z0-9+.-]*:)?//`
	// URIAuthorityPattern is the authority the relay admits: [user@]host[:port].
	URIAuthorityPattern = `^([A-Za-z][A-Za-z0-9+.-]*:)?//([A-Za-z0-9._~:-]*@)?[A-Za-z0-9._~-]*(:[0-9]*)?([/?#]|$)`
)

var (
	cloudEventsSourceRE = regexp.MustCompile(CloudEventsSourcePattern)
	uriSchemeRE         = regexp.MustCompile(URISchemePattern)
	uriColonFirstRE     = regexp.MustCompile(URIColonFirstPattern)
	uriAuthorityStartRE = regexp.MustCompile(URIAuthorityStartPattern)
	uriAuthorityRE      = regexp.MustCompile(URIAuthorityPattern)
)

// PartitionColumnPattern is the rule for a partition column's name: a plain
// lower-case PostgreSQL identifier, which never needs quoting.
const PartitionColumnPattern = `^[a-z_][a-z0-9_]{0,62}$`

var partitionColumnRE = regexp.MustCompile(PartitionColumnPattern)

// CheckPartitionColumn accepts "" (none) or a plain identifier that is not
// one of the columns the relay reads for another purpose.
func CheckPartitionColumn(c string) error {
	if c == "" {
		return nil
	}
	if !partitionColumnRE.MatchString(c) {
		return fmt.Errorf("%q is not a plain lower-case identifier (%s)", c, PartitionColumnPattern)
	}
	for _, col := range append(slices.Clone(outbox.Columns), outbox.OptionalColumns...) {
		if col.Name == c {
			return fmt.Errorf("%q is a column the relay reads for its own purpose", c)
		}
	}
	return nil
}

// binarySuffixes are the size suffixes parseBinarySize takes, as
// Kubernetes quantities write them.
var binarySuffixes = []struct {
	suffix string
	shift  uint
}{{"Ki", 10}, {"Mi", 20}, {"Gi", 30}, {"Ti", 40}, {"Pi", 50}}

// binarySuffixList is the suffixes parseBinarySize takes, for messages.
func binarySuffixList() string {
	names := make([]string, len(binarySuffixes))
	for i, b := range binarySuffixes {
		names[i] = b.suffix
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// parseBinarySize reads a whole number of bytes, or one with a binary
// suffix (4Gi), the form of the OutboxRelay's quantities: before, the flag
// took bytes only and answered 4Gi with a bare "parse error". Decimal
// suffixes (4G) and fractions (1.5Gi), which a quantity takes too, are
// refused.
func parseBinarySize(v string) (int64, error) {
	digits, shift := v, uint(0)
	for _, b := range binarySuffixes {
		if d, ok := strings.CutSuffix(v, b.suffix); ok {
			digits, shift = d, b.shift
			break
		}
	}
	n, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64>>shift {
		return 0, fmt.Errorf("%q is not a size: bytes, or a whole number with %s (%s)", v, binarySuffixList(), formatBinarySize(DefaultMaxRetainedWAL))
	}
	return n << shift, nil
}

// formatBinarySize writes n as parseBinarySize reads it, with the largest
// suffix that keeps it whole.
func formatBinarySize(n int64) string {
	for _, b := range slices.Backward(binarySuffixes) {
		if n != 0 && n%(1<<b.shift) == 0 {
			return strconv.FormatInt(n>>b.shift, 10) + b.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// CheckMaxRetainedWAL accepts MinMaxRetainedWAL..MaxMaxRetainedWAL bytes.
func CheckMaxRetainedWAL(n int64) error {
	if n < MinMaxRetainedWAL {
		return fmt.Errorf("%d is less than %d (%s)", n, MinMaxRetainedWAL, formatBinarySize(MinMaxRetainedWAL))
	}
	if n > MaxMaxRetainedWAL {
		return fmt.Errorf("%d is more than %d (%s)", n, MaxMaxRetainedWAL, formatBinarySize(MaxMaxRetainedWAL))
	}
	return nil
}

// checkCaptureOrdering refuses logical replication with partition-key
// ordering: one replica streams in commit order, which keeps each key's
// order by itself; the key lanes and buckets are polling's.
func checkCaptureOrdering(c Capture, o Ordering) error {
	if c == CaptureLogicalReplication && o == OrderingPartitionKey {
		return fmt.Errorf("%s publishes in commit order from one streaming replica and does not combine with --%s %s", c, FlagOrdering, o)
	}
	return nil
}

// checkWriterDeletes: only a streaming relay sees rows its writers
// delete in the inserting transaction.
func checkWriterDeletes(on bool, c Capture) error {
	if on && c != CaptureLogicalReplication {
		return fmt.Errorf("needs --%s %s: a polling relay never sees rows deleted in the transaction that inserts them", FlagCapture, CaptureLogicalReplication)
	}
	return nil
}

// BatchDeadline bounds one batch of a relay whose publish timeout is
// publishTimeout, from its begin to its commit, also after SIGTERM: the
// relay's shutdown waits for it, and the pods' termination grace period
// must outlast it, or a batch published to Kafka is killed before its mark
// and published again.
func BatchDeadline(publishTimeout time.Duration) time.Duration {
	return publishTimeout + BatchCommitMargin
}
