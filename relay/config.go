package relay

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go/sasl"

	"github.com/outbox-relay/outbox-operator/dbauth"
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
	// FormatCloudEventsStructured: a CloudEvent in the structured content
	// mode (application/cloudevents+json), plus FormatRaw's headers.
	FormatCloudEventsStructured = relayconfig.FormatCloudEventsStructured
)

// RecordTimestamp is what each record's timestamp is.
type RecordTimestamp = relayconfig.RecordTimestamp

// The RecordTimestamp values.
const (
	RecordTimestampCreatedAt = relayconfig.RecordTimestampCreatedAt
	RecordTimestampPublish   = relayconfig.RecordTimestampPublish
)

// Compression is the codec of the relay's produce requests.
type Compression = relayconfig.Compression

// Settings are the relay's settings (relayconfig.Settings: the same type
// the relay command parses and the operator builds).
type Settings = relayconfig.Settings

// Config configures a Relay: its Settings, the tuning only the library
// has, and the live objects of the process. Zero fields take their
// defaults; New validates the result once and names every bad field and
// value (a setting's as a *relayconfig.FieldError, naming its flag; the
// library's durations by their Config field).
type Config struct {
	Settings
	// FullRescanInterval is how often a claim scans the index from the
	// start instead of from the cursor, to catch rows that committed long
	// after their id was taken, and how often a streaming relay sweeps
	// for what its stream does not carry. Default 10s.
	FullRescanInterval time.Duration
	// HeldRetryInterval is how often held rows (refused by Kafka and not
	// dead-lettered, invalid, or of an unavailable topic) are tried again;
	// a row whose dead-letter copy failed in a way a retry may fix is held
	// for MaxBackoff instead. Default 1m.
	HeldRetryInterval time.Duration
	// MaxBackoff caps the exponential backoff after transient errors. Default 5s.
	MaxBackoff time.Duration
	// StreamRetryLimit bounds how long a streaming relay publishes again,
	// in place, rows that failed transiently, before it goes on to any
	// later row. Past it, they wait in the table for the sweep and the
	// stream goes on, so a partition that stays down does not hold the
	// others' rows back for longer; their keys' later rows then go out
	// before them. Default 1m.
	StreamRetryLimit time.Duration
	// TracerProvider, when set, makes the relay record a producer span per
	// published event, a child of the span that stored it (the row's
	// traceparent header). Default nil: no spans, and the row's trace
	// context is forwarded as it is.
	TracerProvider trace.TracerProvider
	// TLS, when set, connects to Kafka over TLS.
	TLS *tls.Config
	// DatabaseTLS, when set, connects to PostgreSQL over TLS with it,
	// whatever the DSN's sslmode, and never falls back to plain text. Its
	// ServerName defaults to the DSN's host, so with RootCAs set the
	// server's certificate and host name are verified (verify-full).
	DatabaseTLS *tls.Config
	// DatabaseTokens, when set, gives every new PostgreSQL connection a
	// token as its password (dbauth: AWS RDS IAM, Cloud SQL IAM, Azure
	// AD), fetched then and refreshed before it expires. The connection
	// must then use TLS without a plain-text fallback (DatabaseTLS, or
	// sslmode=require or stricter in the DSN), or New refuses it.
	DatabaseTokens *dbauth.Source
	// SASL, when set, authenticates to Kafka.
	SASL sasl.Mechanism
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// Registerer receives the relay's metrics. Default: none registered.
	Registerer prometheus.Registerer
}

// Defaults of the settings that only the library has (the relay's are in relayconfig).
const (
	DefaultFullRescanInterval = 10 * time.Second
	DefaultHeldRetryInterval  = time.Minute
	DefaultMaxBackoff         = 5 * time.Second
	DefaultStreamRetryLimit   = time.Minute
)

// validateTuning refuses a negative duration among the library's own
// fields (zero takes the default): a negative MaxBackoff made every retry
// at once, against the database and Kafka, and a negative
// HeldRetryInterval tried held rows again at every claim.
func (c Config) validateTuning() error {
	var errs []error
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"FullRescanInterval", c.FullRescanInterval}, {"HeldRetryInterval", c.HeldRetryInterval}, {"MaxBackoff", c.MaxBackoff}, {"StreamRetryLimit", c.StreamRetryLimit}} {
		if f.d < 0 {
			errs = append(errs, fmt.Errorf("relay.Config.%s: %s is negative (0 takes the default)", f.name, f.d))
		}
	}
	return errors.Join(errs...)
}

func (c Config) withDefaults() Config {
	c.Settings = c.Settings.WithDefaults()
	c.FullRescanInterval = cmp.Or(c.FullRescanInterval, DefaultFullRescanInterval)
	c.HeldRetryInterval = cmp.Or(c.HeldRetryInterval, DefaultHeldRetryInterval)
	c.MaxBackoff = cmp.Or(c.MaxBackoff, DefaultMaxBackoff)
	c.StreamRetryLimit = cmp.Or(c.StreamRetryLimit, DefaultStreamRetryLimit)
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
