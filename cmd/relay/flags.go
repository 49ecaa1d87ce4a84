package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// options is the parsed command line.
type options struct {
	cfg         relay.Config
	metricsAddr string
	logger      *slog.Logger
	tracing     *sdktrace.TracerProvider // nil when tracing is off
}

// parseFlags reads the command line and the RELAY_* environment with the
// operator's contract (relayconfig) and builds the relay's Config from it.
func parseFlags(args []string, lookupEnv func(string) (string, bool), stderr io.Writer) (*options, error) {
	s, err := relayconfig.Parse(args, lookupEnv, stderr)
	if err != nil {
		return nil, err
	}
	cfg, err := configFrom(s)
	if err != nil {
		return nil, err
	}
	tp, err := tracerProvider(lookupEnv)
	if err != nil {
		return nil, err
	}
	if tp != nil {
		cfg.TracerProvider = tp
	}
	logger := newLogger(s.LogFormat, os.Stderr)
	cfg.Logger = logger
	return &options{cfg: cfg, metricsAddr: s.MetricsAddr, logger: logger, tracing: tp}, nil
}

// configFrom turns the command's settings into the relay's Config (reading
// the TLS files and building the SASL mechanism).
func configFrom(s relayconfig.Settings) (relay.Config, error) {
	cfg := relay.ConfigFrom(s)
	if err := relay.ValidateConfig(cfg); err != nil {
		return cfg, err
	}
	if s.TLSEnabled() {
		t, err := tlsConfig(s.KafkaTLSCAFile, s.KafkaTLSCertFile, s.KafkaTLSKeyFile)
		if err != nil {
			return cfg, err
		}
		cfg.TLS = t
	}
	if s.KafkaSASLMechanism != "" {
		m, err := saslMechanism(s.KafkaSASLMechanism, s.KafkaSASLUsername, s.KafkaSASLPassword)
		if err != nil {
			return cfg, err
		}
		cfg.SASL = m
	}
	return cfg, nil
}

func tlsConfig(caFile, certFile, keyFile string) (*tls.Config, error) {
	t := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--%s: %w", relayconfig.FlagKafkaTLSCAFile, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--%s: %s holds no PEM certificate", relayconfig.FlagKafkaTLSCAFile, caFile)
		}
		t.RootCAs = pool
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("--%s/--%s: %w", relayconfig.FlagKafkaTLSCertFile, relayconfig.FlagKafkaTLSKeyFile, err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}

func saslMechanism(name, user, pass string) (sasl.Mechanism, error) {
	switch name {
	case relayconfig.SASLPlain:
		return plain.Mechanism{Username: user, Password: pass}, nil
	case relayconfig.SASLScramSHA256:
		return scram.Mechanism(scram.SHA256, user, pass)
	case relayconfig.SASLScramSHA512:
		return scram.Mechanism(scram.SHA512, user, pass)
	}
	return nil, fmt.Errorf("--%s: %q is not supported", relayconfig.FlagKafkaSASLMech, name)
}
