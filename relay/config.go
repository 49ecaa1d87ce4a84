package relay

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"regexp"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go/sasl"
)

// Ordering says what order the relay promises per partition key.
type Ordering string

const (
	// OrderingNone: rows are published in id order within one replica;
	// across replicas no per-key order is promised.
	OrderingNone Ordering = "none"
	// OrderingPartitionKey: each partition key's rows reach Kafka in id
	// order, with any number of replicas.
	OrderingPartitionKey Ordering = "partition-key"
)

// Config configures a Relay. Zero fields take the defaults documented on
// them; New validates the result and names any bad field and value.
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
	// too large, invalid topic), with the error in headers. Empty: such rows
	// are held and reported instead.
	DeadLetterTopic string
	// BatchSize is the number of rows claimed per transaction. Default 50.
	BatchSize int
	// PollInterval is the sleep after a short batch, jittered ±20%. Default 200ms.
	PollInterval time.Duration
	// PublishTimeout bounds one batch's publish to Kafka. Default 10s.
	PublishTimeout time.Duration
	// Ordering is the per-key ordering mode. Default OrderingNone.
	Ordering Ordering
	// FullRescanInterval is how often a claim scans the index from the
	// start instead of from the cursor, to catch rows that committed long
	// after their id was taken. Default 10s.
	FullRescanInterval time.Duration
	// HeldRetryInterval is how often rows that failed permanently (and had
	// no dead-letter topic) are tried again. Default 1m.
	HeldRetryInterval time.Duration
	// MaxBackoff caps the exponential backoff after transient errors. Default 5s.
	MaxBackoff time.Duration
	// TLS, when set, connects to Kafka over TLS.
	TLS *tls.Config
	// SASL, when set, authenticates to Kafka.
	SASL sasl.Mechanism
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// Registerer receives the relay's metrics. Default: none registered.
	Registerer prometheus.Registerer
}

// Defaults.
const (
	DefaultTable              = "outbox"
	DefaultBatchSize          = 50
	DefaultPollInterval       = 200 * time.Millisecond
	DefaultPublishTimeout     = 10 * time.Second
	DefaultFullRescanInterval = 10 * time.Second
	DefaultHeldRetryInterval  = time.Minute
	DefaultMaxBackoff         = 5 * time.Second
	MaxBatchSize              = 10000
)

// topicPattern is a legal Kafka topic name.
var topicPattern = regexp.MustCompile(`^[a-zA-Z0-9._-]{1,249}$`)

// ValidTopic reports whether s is a legal Kafka topic name.
func ValidTopic(s string) bool {
	return topicPattern.MatchString(s) && s != "." && s != ".."
}

func (c Config) withDefaults() Config {
	c.Table = cmp.Or(c.Table, DefaultTable)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, DefaultPublishTimeout)
	c.Ordering = cmp.Or(c.Ordering, OrderingNone)
	c.FullRescanInterval = cmp.Or(c.FullRescanInterval, DefaultFullRescanInterval)
	c.HeldRetryInterval = cmp.Or(c.HeldRetryInterval, DefaultHeldRetryInterval)
	c.MaxBackoff = cmp.Or(c.MaxBackoff, DefaultMaxBackoff)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// validate names the first bad field and its value.
func (c Config) validate() error {
	var errs []error
	if c.DSN == "" {
		errs = append(errs, errors.New("dsn: required"))
	}
	if _, err := ParseTable(c.Table); err != nil {
		errs = append(errs, err)
	}
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("brokers: at least one host:port is required"))
	}
	for _, b := range c.Brokers {
		if err := validateBroker(b); err != nil {
			errs = append(errs, err)
		}
	}
	if len(c.Topics) == 0 {
		errs = append(errs, errors.New("topics: at least one EVENT_TYPE=TOPIC mapping is required"))
	}
	for et, topic := range c.Topics {
		if et == "" {
			errs = append(errs, fmt.Errorf("topics: empty event type (mapped to %q)", topic))
		}
		if !ValidTopic(topic) {
			errs = append(errs, fmt.Errorf("topics: %q for event type %q is not a valid Kafka topic name ([a-zA-Z0-9._-], 1-249 characters, not . or ..)", topic, et))
		}
		if c.DeadLetterTopic != "" && topic == c.DeadLetterTopic {
			errs = append(errs, fmt.Errorf("dead-letter-topic: %q is also the topic of event type %q", topic, et))
		}
	}
	if c.DeadLetterTopic != "" && !ValidTopic(c.DeadLetterTopic) {
		errs = append(errs, fmt.Errorf("dead-letter-topic: %q is not a valid Kafka topic name", c.DeadLetterTopic))
	}
	if c.BatchSize < 1 || c.BatchSize > MaxBatchSize {
		errs = append(errs, fmt.Errorf("batch-size: %d is outside 1..%d", c.BatchSize, MaxBatchSize))
	}
	if c.PollInterval < 10*time.Millisecond || c.PollInterval > time.Hour {
		errs = append(errs, fmt.Errorf("poll-interval: %s is outside 10ms..1h", c.PollInterval))
	}
	if c.PublishTimeout <= 0 {
		errs = append(errs, fmt.Errorf("publish-timeout: %s must be positive", c.PublishTimeout))
	}
	if c.Ordering != OrderingNone && c.Ordering != OrderingPartitionKey {
		errs = append(errs, fmt.Errorf("ordering: %q is not one of none, partition-key", c.Ordering))
	}
	return errors.Join(errs...)
}

func validateBroker(b string) error {
	host, port, err := net.SplitHostPort(b)
	if err != nil || host == "" {
		return fmt.Errorf("brokers: %q is not host:port", b)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("brokers: %q has an invalid port %q", b, port)
	}
	return nil
}

// ValidateConfig applies the defaults to cfg and validates it, naming each
// bad field and value; New runs the same check.
func ValidateConfig(cfg Config) error {
	return cfg.withDefaults().validate()
}
