package relay

import (
	"cmp"
	"crypto/tls"
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go/sasl"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// Ordering says what order the relay promises per partition key.
type Ordering = relayconfig.Ordering

// The ordering modes.
const (
	// OrderingNone: rows are published in id order within one replica;
	// across replicas no per-key order is promised.
	OrderingNone = relayconfig.OrderingNone
	// OrderingPartitionKey: each partition key's rows reach Kafka in id
	// order, with any number of replicas.
	OrderingPartitionKey = relayconfig.OrderingPartitionKey
)

// OnPublish is what the relay does to a row Kafka acknowledged.
type OnPublish = relayconfig.OnPublish

// The OnPublish values.
const (
	OnPublishMark   = relayconfig.OnPublishMark
	OnPublishDelete = relayconfig.OnPublishDelete
)

// Format is the layout of the records the relay publishes.
type Format = relayconfig.Format

// The Format values.
const (
	// FormatRaw: the payload as the record's value, the relay's headers and
	// the row's own headers.
	FormatRaw = relayconfig.FormatRaw
	// FormatCloudEvents: a CloudEvent in the Kafka protocol binding's binary
	// content mode, plus FormatRaw's headers.
	FormatCloudEvents = relayconfig.FormatCloudEvents
)

// Compression is the codec of the relay's produce requests.
type Compression = relayconfig.Compression

// Config configures a Relay. Zero fields take the defaults documented on
// them; New validates the result and names every bad field and value. The
// defaults and ranges are the relay command's (relayconfig).
type Config struct {
	// DSN is the PostgreSQL connection string. Required.
	DSN string
	// Table is the outbox table, "name" or "schema.name". Default "outbox".
	Table string
	// Brokers are the Kafka bootstrap addresses, host:port. Required.
	Brokers []string
	// Topics maps event_type to Kafka topic. At least one entry. Rows
	// whose event_type is not here are held (never claimed) until it is.
	Topics map[string]string
	// DeadLetterTopic receives rows that Kafka refuses permanently (record
	// too large for their topic, invalid record), with the error in
	// headers. Empty: such rows are held and reported instead.
	DeadLetterTopic string
	// BatchSize is the most rows claimed per transaction. Default 50.
	BatchSize int
	// MaxBatchBytes is the most payload and headers bytes claimed per
	// transaction; a row larger than this is claimed alone. Default 4 MiB.
	MaxBatchBytes int
	// PollInterval is the sleep after a short batch, jittered ±20%. Default 200ms.
	PollInterval time.Duration
	// PublishTimeout bounds one batch's publish to Kafka. Default 10s.
	PublishTimeout time.Duration
	// StallTimeout: Ready fails when no batch has completed, or rows wait
	// and none has been published, for this long. Default 2m.
	StallTimeout time.Duration
	// Ordering is the per-key ordering mode. Default OrderingNone.
	Ordering Ordering
	// MaxInFlight is how many batches may be in flight: with 2 (the
	// default) and OrderingNone, the next batch is claimed and published
	// while a full one commits. A crash may then publish up to this many
	// batches again.
	MaxInFlight int
	// Notify makes the relay LISTEN on the table's channel and claim as
	// soon as a writer with outbox.WithNotify commits, besides polling.
	// Default false: notifying serializes the writers' commits.
	Notify bool
	// OnPublish is what happens to an acknowledged row: OnPublishMark (the
	// default) sets published_at, OnPublishDelete deletes it in the same
	// transaction (one write less per row; nothing to prune).
	OnPublish OnPublish
	// KeepPublishedFor prunes published rows older than this; 0 (the
	// default) keeps them. One replica of the table prunes at a time.
	KeepPublishedFor time.Duration
	// PruneBatchSize is the most rows one prune transaction deletes. Default 1000.
	PruneBatchSize int
	// PrunePause is the pause between prune transactions. Default 100ms.
	PrunePause time.Duration
	// FullRescanInterval is how often a claim scans the index from the
	// start instead of from the cursor, to catch rows that committed long
	// after their id was taken. Default 10s.
	FullRescanInterval time.Duration
	// HeldRetryInterval is how often held rows (refused by Kafka with no
	// dead-letter topic, invalid, or of an unavailable topic) are tried
	// again. Default 1m.
	HeldRetryInterval time.Duration
	// MaxBackoff caps the exponential backoff after transient errors. Default 5s.
	MaxBackoff time.Duration
	// Format is the record layout (docs/relay.md lists each format's
	// headers). Default FormatRaw.
	Format Format
	// CloudEventsSource is ce_source in FormatCloudEvents, a URI-reference.
	// Default "/outbox/" followed by the table's name.
	CloudEventsSource string
	// Compression is the produce requests' codec: none, gzip, snappy, lz4
	// or zstd. Default none.
	Compression Compression
	// TracerProvider, when set, makes the relay record a producer span per
	// published event, a child of the span that stored it (the row's
	// traceparent header). Default nil: no spans, and the row's trace
	// context is forwarded as it is.
	TracerProvider trace.TracerProvider
	// TLS, when set, connects to Kafka over TLS.
	TLS *tls.Config
	// SASL, when set, authenticates to Kafka.
	SASL sasl.Mechanism
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// Registerer receives the relay's metrics. Default: none registered.
	Registerer prometheus.Registerer
}

// Defaults of the settings that only the library has (the command's are in relayconfig).
const (
	DefaultFullRescanInterval = 10 * time.Second
	DefaultHeldRetryInterval  = time.Minute
	DefaultMaxBackoff         = 5 * time.Second
)

func (c Config) withDefaults() Config {
	c.Table = cmp.Or(c.Table, relayconfig.DefaultTable)
	c.BatchSize = cmp.Or(c.BatchSize, relayconfig.DefaultBatchSize)
	c.MaxBatchBytes = cmp.Or(c.MaxBatchBytes, relayconfig.DefaultMaxBatchBytes)
	c.PollInterval = cmp.Or(c.PollInterval, relayconfig.DefaultPollInterval)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, relayconfig.DefaultPublishTimeout)
	c.StallTimeout = cmp.Or(c.StallTimeout, relayconfig.DefaultStallTimeout)
	c.Ordering = cmp.Or(c.Ordering, relayconfig.DefaultOrdering)
	c.MaxInFlight = cmp.Or(c.MaxInFlight, relayconfig.DefaultMaxInFlight)
	c.OnPublish = cmp.Or(c.OnPublish, relayconfig.DefaultOnPublish)
	c.PruneBatchSize = cmp.Or(c.PruneBatchSize, relayconfig.DefaultPruneBatchSize)
	c.PrunePause = cmp.Or(c.PrunePause, relayconfig.DefaultPrunePause)
	c.FullRescanInterval = cmp.Or(c.FullRescanInterval, DefaultFullRescanInterval)
	c.HeldRetryInterval = cmp.Or(c.HeldRetryInterval, DefaultHeldRetryInterval)
	c.MaxBackoff = cmp.Or(c.MaxBackoff, DefaultMaxBackoff)
	c.Format = cmp.Or(c.Format, relayconfig.DefaultFormat)
	c.Compression = cmp.Or(c.Compression, relayconfig.DefaultCompression)
	if c.CloudEventsSource == "" {
		if t, err := outbox.ParseTable(c.Table); err == nil {
			c.CloudEventsSource = "/outbox/" + t.String()
		}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// ConfigFrom is the Config the relay command's settings give (without the
// process's own: TLS, SASL, logging, metrics and tracing).
func ConfigFrom(s relayconfig.Settings) Config {
	return Config{
		DSN: s.DSN, Table: s.Table, Brokers: s.Brokers, Topics: s.Topics, DeadLetterTopic: s.DeadLetterTopic,
		BatchSize: s.BatchSize, MaxBatchBytes: s.MaxBatchBytes, PollInterval: s.PollInterval,
		PublishTimeout: s.PublishTimeout, StallTimeout: s.StallTimeout, Ordering: s.Ordering,
		MaxInFlight: s.MaxInFlight, Notify: s.Notify, OnPublish: s.OnPublish, KeepPublishedFor: s.KeepPublishedFor,
		PruneBatchSize: s.PruneBatchSize, PrunePause: s.PrunePause,
		Format: s.Format, CloudEventsSource: s.CloudEventsSource, Compression: s.Compression,
	}
}

// settings is ConfigFrom's inverse: the settings of c, as the relay
// command's flags carry them, so c is checked by the command's rules.
func (c Config) settings() relayconfig.Settings {
	s := relayconfig.Settings{}
	s.DSN, s.Table, s.Brokers, s.Topics, s.DeadLetterTopic = c.DSN, c.Table, c.Brokers, c.Topics, c.DeadLetterTopic
	s.BatchSize, s.MaxBatchBytes, s.PollInterval = c.BatchSize, c.MaxBatchBytes, c.PollInterval
	s.PublishTimeout, s.StallTimeout, s.Ordering = c.PublishTimeout, c.StallTimeout, c.Ordering
	s.MaxInFlight, s.Notify, s.OnPublish, s.KeepPublishedFor = c.MaxInFlight, c.Notify, c.OnPublish, c.KeepPublishedFor
	s.PruneBatchSize, s.PrunePause = c.PruneBatchSize, c.PrunePause
	s.Format, s.CloudEventsSource, s.Compression = c.Format, c.CloudEventsSource, c.Compression
	return s
}

// validate names every bad field and its value, with the relay command's
// rules (its flag names name the fields).
func (c Config) validate() error {
	var errs []error
	if c.DSN == "" {
		errs = append(errs, errors.New("dsn: required"))
	}
	return errors.Join(append(errs, c.settings().ValidateRelay())...)
}

// ValidateConfig applies the defaults to cfg and validates it, naming each
// bad field and value; New runs the same check.
func ValidateConfig(cfg Config) error {
	return cfg.withDefaults().validate()
}
