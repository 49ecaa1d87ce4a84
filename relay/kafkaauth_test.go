package relay_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/kafkaauth"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// oauthConfig is f's relay configuration against the broker's
// OAUTHBEARER listener (SASL_SSL, its CA trusted) with mechanism m.
func oauthConfig(t *testing.T, f *outboxtest.Fixture, m kafkaauth.OAuthBearer) relay.Config {
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(testenv.Broker().CA.PEM))
	cfg := f.Config()
	cfg.Brokers = []string{testenv.Broker().OAuthAddr()}
	cfg.TLS = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	cfg.SASL = m
	return cfg
}

// OAUTHBEARER against a real broker (SASL_SSL, Kafka's unsecured JWT
// validator): with a token from a file the relay publishes, and a token
// rewritten in the file is the one new connections use; an expired token
// is refused at start-up with the broker's reason.
func TestKafkaOAuthBearerTokenFile(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(testenv.UnsecuredJWT("relay", -time.Minute)+"\n"), 0o600))
	var reads atomic.Int32
	read := kafkaauth.FileToken(file)
	cfg := oauthConfig(t, f, kafkaauth.OAuthBearer{Token: func(ctx context.Context) (string, error) {
		reads.Add(1)
		return read(ctx)
	}})

	expired, err := relay.New(cfg)
	require.NoError(t, err)
	err = expired.Check(context.Background())
	require.ErrorContains(t, err, "OAUTHBEARER refused by the broker", "an expired token")
	require.ErrorContains(t, err, "invalid_token")
	require.NoError(t, expired.Close())

	require.NoError(t, os.WriteFile(file, []byte(testenv.UnsecuredJWT("relay", time.Hour)), 0o600)) // the platform refreshed it
	f.Insert(30, 5, "E")
	outboxtest.Start(t, cfg)
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 30, 30*time.Second), 30)
	require.Greater(t, reads.Load(), int32(1), "the file is read for each new connection")
}

// OAUTHBEARER with the client credentials grant: the relay asks the token
// endpoint (here local) with its client id and secret and the scope, and
// publishes with the token it got.
func TestKafkaOAuthBearerTokenEndpoint(t *testing.T) {
	t.Parallel()
	var asked atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, secret, ok := r.BasicAuth()
		if err := r.ParseForm(); err != nil || !ok || id != "relay-client" || secret != "s3cret" ||
			r.Form.Get("grant_type") != "client_credentials" || r.Form.Get("scope") != "kafka" {
			http.Error(w, `{"error":"invalid_client"}`, http.StatusUnauthorized)
			return
		}
		asked.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"access_token": testenv.UnsecuredJWT("relay-client", time.Hour), "token_type": "Bearer", "expires_in": 3600})
	}))
	t.Cleanup(srv.Close)
	require.NoError(t, relayconfig.CheckTokenEndpoint(srv.URL), "http to a loopback address is allowed")

	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(20, 4, "E")
	outboxtest.Start(t, oauthConfig(t, f, kafkaauth.OAuthBearer{Token: kafkaauth.ClientCredentials(srv.URL, "relay-client", "s3cret", "kafka")}))
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 20, 30*time.Second), 20)
	require.EqualValues(t, 1, asked.Load(), "one token, reused by every connection while it is valid")
}
