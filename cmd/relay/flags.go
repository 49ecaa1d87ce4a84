package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/kafkaauth"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// options is the parsed command line and the relay it configures.
type options struct {
	relay       *relay.Relay
	settings    relay.Settings
	registry    *prometheus.Registry // the relay's metrics and the process's
	metricsAddr string
	logger      *slog.Logger
	tracing     *sdktrace.TracerProvider // nil when tracing is off
}

// parseFlags reads and checks the command line and the RELAY_* environment
// with the operator's contract (relayconfig), and builds the relay from the
// settings as they are.
func parseFlags(args []string, lookupEnv func(string) (string, bool), stderr io.Writer) (*options, error) {
	s, err := relayconfig.Parse(args, lookupEnv, stderr)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	logger := newLogger(s.LogFormat, os.Stderr)
	cfg := relay.Config{Settings: s.Settings, Logger: logger, Registerer: reg}
	if s.TLSEnabled() {
		if cfg.TLS, err = tlsConfig(s.KafkaTLSCAFile, s.KafkaTLSCertFile, s.KafkaTLSKeyFile, relayconfig.FlagKafkaTLSCAFile, relayconfig.FlagKafkaTLSCertFile, relayconfig.FlagKafkaTLSKeyFile); err != nil {
			return nil, err
		}
	}
	if cfg.DatabaseTLS, cfg.DatabaseTokens, err = databaseLogin(s.DatabaseLogin); err != nil {
		return nil, err
	}
	if s.KafkaSASLMechanism != "" {
		if cfg.SASL, err = saslMechanism(s); err != nil {
			return nil, err
		}
	}
	tp, err := tracerProvider(lookupEnv)
	if err != nil {
		return nil, err
	}
	if tp != nil {
		cfg.TracerProvider = tp
	}
	r, err := relay.New(cfg)
	if err != nil {
		return nil, errors.Join(err, shutdownTracing(tp))
	}
	return &options{relay: r, settings: s.Settings, registry: reg, metricsAddr: s.MetricsAddr, logger: logger, tracing: tp}, nil
}

// databaseLogin reads the files of the --database-* flags and makes the
// token source of --database-auth: nil, nil for a plain DSN login.
func databaseLogin(d relayconfig.DatabaseLogin) (*tls.Config, *dbauth.Source, error) {
	var t *tls.Config
	if d.DatabaseCAFile != "" {
		var err error
		if t, err = tlsConfig(d.DatabaseCAFile, d.DatabaseCertFile, d.DatabaseKeyFile, relayconfig.FlagDatabaseCAFile, relayconfig.FlagDatabaseCertFile, relayconfig.FlagDatabaseKeyFile); err != nil {
			return nil, nil, err
		}
	}
	provider, err := dbauth.New(context.Background(), d.DatabaseAuth, d.DatabaseAuthAWSRegion)
	if err != nil {
		return nil, nil, fmt.Errorf("--%s: %w", relayconfig.FlagDatabaseAuth, err)
	}
	if provider == nil {
		return t, nil, nil
	}
	return t, dbauth.NewSource(provider), nil
}

// tlsConfig reads the PEM files of a TLS client; the flag names name them in errors.
func tlsConfig(caFile, certFile, keyFile, caFlag, certFlag, keyFlag string) (*tls.Config, error) {
	t := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--%s: %w", caFlag, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--%s: %s holds no PEM certificate", caFlag, caFile)
		}
		t.RootCAs = pool
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("--%s/--%s: %w", certFlag, keyFlag, err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}

// saslMechanism is the Kafka SASL mechanism s names, with its credentials.
func saslMechanism(s relayconfig.Command) (sasl.Mechanism, error) {
	user, pass := s.KafkaSASLUsername, s.KafkaSASLPassword
	switch name := s.KafkaSASLMechanism; name {
	case relayconfig.SASLPlain:
		return plain.Mechanism{Username: user, Password: pass}, nil
	case relayconfig.SASLScramSHA256:
		return scram.Mechanism(scram.SHA256, user, pass)
	case relayconfig.SASLScramSHA512:
		return scram.Mechanism(scram.SHA512, user, pass)
	case relayconfig.SASLOAuthBearer:
		if s.KafkaSASLOAuthTokenFile != "" {
			return kafkaauth.OAuthBearer{Token: kafkaauth.FileToken(s.KafkaSASLOAuthTokenFile)}, nil
		}
		return kafkaauth.OAuthBearer{Token: kafkaauth.ClientCredentials(s.KafkaSASLOAuthTokenEndpoint, user, pass, s.KafkaSASLOAuthScope)}, nil
	case relayconfig.SASLAWSMSKIAM:
		m, err := kafkaauth.MSKIAM(context.Background(), s.KafkaSASLAWSRegion)
		if err != nil {
			return nil, fmt.Errorf("--%s: %w", relayconfig.FlagKafkaSASLMech, err)
		}
		return m, nil
	default:
		return nil, fmt.Errorf("--%s: %q is not supported", relayconfig.FlagKafkaSASLMech, name)
	}
}
