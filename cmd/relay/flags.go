package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"
	"sigs.k8s.io/yaml"

	"github.com/outbox-relay/outbox-operator/relay"
)

var errHelp = errors.New("help requested")

// options is the parsed command line.
type options struct {
	cfg         relay.Config
	metricsAddr string
	logger      interface {
		Info(string, ...any)
		Warn(string, ...any)
		Error(string, ...any)
	}
}

// topicFlag collects repeated --topic EVENT_TYPE=TOPIC values.
type topicFlag map[string]string

func (t topicFlag) String() string {
	var parts []string
	for k, v := range t {
		parts = append(parts, k+"="+v)
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

// Set takes EVENT_TYPE=TOPIC, or several separated by commas (the form the
// RELAY_TOPIC environment variable uses).
func (t topicFlag) Set(v string) error {
	for _, kv := range strings.Split(v, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		et, topic, ok := strings.Cut(kv, "=")
		if !ok || et == "" || topic == "" {
			return fmt.Errorf("%q is not EVENT_TYPE=TOPIC", kv)
		}
		if prev, dup := t[et]; dup && prev != topic {
			return fmt.Errorf("event type %q is mapped twice (%q and %q)", et, prev, topic)
		}
		t[et] = topic
	}
	return nil
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are returned and printed once by run
	var (
		dsn, table, brokers, topicsFile, dlt, metricsAddr, logFormat, ordering string
		batchSize                                                              int
		pollInterval, publishTimeout                                           time.Duration
		useTLS                                                                 bool
		caFile, certFile, keyFile, saslMech                                    string
	)
	topics := topicFlag{}
	fs.StringVar(&dsn, "dsn", "", "PostgreSQL connection string (pass it as RELAY_DSN from a Secret)")
	fs.StringVar(&table, "table", relay.DefaultTable, "outbox table, NAME or SCHEMA.NAME")
	fs.StringVar(&brokers, "brokers", "", "Kafka bootstrap brokers, comma-separated host:port")
	fs.IntVar(&batchSize, "batch-size", relay.DefaultBatchSize, "rows claimed per transaction (1..10000)")
	fs.DurationVar(&pollInterval, "poll-interval", relay.DefaultPollInterval, "sleep after a short batch (10ms..1h)")
	fs.DurationVar(&publishTimeout, "publish-timeout", relay.DefaultPublishTimeout, "deadline of one batch's publish")
	fs.Var(topics, "topic", "EVENT_TYPE=TOPIC mapping (repeatable)")
	fs.StringVar(&topicsFile, "topics-file", "", "YAML or JSON file mapping event types to topics")
	fs.StringVar(&dlt, "dead-letter-topic", "", "topic for rows Kafka refuses permanently (default: hold them)")
	fs.StringVar(&metricsAddr, "metrics-addr", ":9090", "address serving /metrics, /healthz and /readyz")
	fs.StringVar(&logFormat, "log-format", "json", "log format: json or text")
	fs.StringVar(&ordering, "ordering", string(relay.OrderingNone), "per-key ordering: none or partition-key")
	fs.BoolVar(&useTLS, "kafka-tls", false, "connect to Kafka over TLS")
	fs.StringVar(&caFile, "kafka-tls-ca-file", "", "PEM CA bundle to verify the brokers (default: system roots)")
	fs.StringVar(&certFile, "kafka-tls-cert-file", "", "PEM client certificate for mutual TLS")
	fs.StringVar(&keyFile, "kafka-tls-key-file", "", "PEM client key for mutual TLS")
	fs.StringVar(&saslMech, "kafka-sasl-mechanism", "", "SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (credentials from RELAY_KAFKA_SASL_USERNAME and RELAY_KAFKA_SASL_PASSWORD)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: relay [flags]\n       relay schema --table NAME\n\nEvery flag can be set as RELAY_<FLAG> in the environment.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stderr)
			fs.Usage()
			return nil, errHelp
		}
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if err := applyEnv(fs); err != nil {
		return nil, err
	}
	if logFormat != "json" && logFormat != "text" {
		return nil, fmt.Errorf("--log-format: %q is not json or text", logFormat)
	}
	if topicsFile != "" {
		if err := readTopicsFile(topicsFile, topics); err != nil {
			return nil, fmt.Errorf("--topics-file: %w", err)
		}
	}
	cfg := relay.Config{
		DSN: dsn, Table: table, Topics: topics, DeadLetterTopic: dlt,
		BatchSize: batchSize, PollInterval: pollInterval, PublishTimeout: publishTimeout,
		Ordering: relay.Ordering(ordering),
	}
	for _, b := range strings.Split(brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			cfg.Brokers = append(cfg.Brokers, b)
		}
	}
	// Flag values equal to zero must not be mistaken for "use the default".
	if batchSize <= 0 {
		return nil, fmt.Errorf("--batch-size: %d is outside 1..%d", batchSize, relay.MaxBatchSize)
	}
	if pollInterval <= 0 {
		return nil, fmt.Errorf("--poll-interval: %s is outside 10ms..1h", pollInterval)
	}
	if publishTimeout <= 0 {
		return nil, fmt.Errorf("--publish-timeout: %s must be positive", publishTimeout)
	}
	if err := relay.ValidateConfig(cfg); err != nil {
		return nil, prefixFlags(err)
	}
	if useTLS || caFile != "" || certFile != "" {
		t, err := tlsConfig(caFile, certFile, keyFile)
		if err != nil {
			return nil, err
		}
		cfg.TLS = t
	}
	if saslMech != "" {
		m, err := saslMechanism(saslMech, os.Getenv("RELAY_KAFKA_SASL_USERNAME"), os.Getenv("RELAY_KAFKA_SASL_PASSWORD"))
		if err != nil {
			return nil, err
		}
		cfg.SASL = m
	}
	logger := newLogger(logFormat, os.Stderr)
	cfg.Logger = logger
	return &options{cfg: cfg, metricsAddr: metricsAddr, logger: logger}, nil
}

// prefixFlags turns "batch-size: ..." config errors into "--batch-size: ...".
func prefixFlags(err error) error {
	lines := strings.Split(err.Error(), "\n")
	for i, l := range lines {
		lines[i] = "--" + l
	}
	return errors.New(strings.Join(lines, "\n"))
}

// applyEnv sets every flag not given on the command line from RELAY_<FLAG>.
func applyEnv(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] || err != nil {
			return
		}
		env := "RELAY_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(env); ok {
			if e := f.Value.Set(v); e != nil {
				err = fmt.Errorf("%s (--%s): %q: %v", env, f.Name, v, e)
			}
		}
	})
	return err
}

func readTopicsFile(path string, into topicFlag) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var m map[string]string
	if err := yaml.UnmarshalStrict(b, &m); err != nil {
		return fmt.Errorf("%s: want a map of event type to topic: %w", path, err)
	}
	for et, topic := range m {
		if err := into.Set(et + "=" + topic); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	return nil
}

func tlsConfig(caFile, certFile, keyFile string) (*tls.Config, error) {
	t := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--kafka-tls-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--kafka-tls-ca-file: %s holds no PEM certificate", caFile)
		}
		t.RootCAs = pool
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("--kafka-tls-cert-file and --kafka-tls-key-file go together")
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("--kafka-tls-cert-file/--kafka-tls-key-file: %w", err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}

func saslMechanism(name, user, pass string) (sasl.Mechanism, error) {
	if user == "" || pass == "" {
		return nil, fmt.Errorf("--kafka-sasl-mechanism %s needs RELAY_KAFKA_SASL_USERNAME and RELAY_KAFKA_SASL_PASSWORD", name)
	}
	switch strings.ToUpper(name) {
	case "PLAIN":
		return plain.Mechanism{Username: user, Password: pass}, nil
	case "SCRAM-SHA-256":
		return scram.Mechanism(scram.SHA256, user, pass)
	case "SCRAM-SHA-512":
		return scram.Mechanism(scram.SHA512, user, pass)
	}
	return nil, fmt.Errorf("--kafka-sasl-mechanism: %q is not PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", name)
}
