package relay_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// With Config.DatabaseTLS the relay talks TLS to PostgreSQL whatever the
// DSN says (here sslmode=disable), verifies the server's certificate
// against the CA and its host name, and publishes; with another CA it
// refuses the server, naming the certificate.
func TestDatabaseTLSVerifiesTheServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, ca, err := testenv.StartPostgresTLS(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Close() })
	_, err = pg.CreateDatabase(ctx, "tls")
	require.NoError(t, err)
	require.NoError(t, pg.Exec(ctx, "tls", outbox.SchemaDDL(outbox.Table{Name: "outbox"})))
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/tls?sslmode=disable", pg.Port)
	db, err := pgxpool.New(ctx, dsn)
	require.NoError(t, err)
	t.Cleanup(db.Close)
	for i := range 20 {
		_, err := db.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
			VALUES ($1, 'Order', $2, 'E', '{}', $2)`, outbox.NewEventID(), fmt.Sprint(i))
		require.NoError(t, err)
	}
	topic := testenv.Broker().TopicName(t, "dbtls")
	testenv.Broker().CreateTopic(t, topic, 1)
	roots := func(pem []byte) *x509.CertPool {
		p := x509.NewCertPool()
		require.True(t, p.AppendCertsFromPEM(pem))
		return p
	}
	cfg := relay.Config{
		Settings:    relay.Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": topic}, PollInterval: 20 * time.Millisecond},
		DatabaseTLS: &tls.Config{RootCAs: roots(ca.PEM), MinVersion: tls.VersionTLS12},
	}

	// Another CA: refused, and nothing is claimed.
	other, err := testenv.NewCA("someone-else")
	require.NoError(t, err)
	wrong := cfg
	wrong.DatabaseTLS = &tls.Config{RootCAs: roots(other.PEM), MinVersion: tls.VersionTLS12}
	r, err := relay.New(wrong)
	require.NoError(t, err)
	require.Eventually(t, func() bool { // the reload that turns TLS on completes asynchronously
		err = r.Check(ctx)
		return err != nil && (containsAny(err.Error(), "certificate signed by unknown authority", "certificate is not trusted"))
	}, 10*time.Second, 100*time.Millisecond, "refused for its certificate: %v", err)
	require.NoError(t, r.Close())

	// The right CA: published, over TLS.
	outboxtest.Start(t, cfg)
	require.Eventually(t, func() bool {
		var n int
		return db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n) == nil && n == 0
	}, 30*time.Second, 50*time.Millisecond)
	var sessions int
	var allTLS bool
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*), COALESCE(bool_and(s.ssl), false) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
		WHERE a.application_name = 'outbox-relay'`).Scan(&sessions, &allTLS))
	require.Positive(t, sessions)
	require.True(t, allTLS, "every relay session is TLS, although the DSN says sslmode=disable")
	require.Len(t, testenv.Broker().Consume(t, topic, 20, 30*time.Second), 20)
}

func containsAny(s string, subs ...string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// With Config.DatabaseTokens every session the relay opens (its pool, the
// membership and wake-up sessions) logs in with the provider's token, here
// against a PostgreSQL that lets the role in only with the token last
// handed out and only over TLS; without TLS the relay refuses to start
// rather than send a token in plain text.
func TestDatabaseTokenAuth(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, ca, err := testenv.StartPostgresTLS(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Close() })
	_, err = pg.CreateDatabase(ctx, "tok")
	require.NoError(t, err)
	require.NoError(t, pg.Exec(ctx, "tok", outbox.SchemaDDL(outbox.Table{Name: "outbox"})+`
		CREATE ROLE relay_iam LOGIN;
		GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO relay_iam;`))
	require.NoError(t, pg.RequirePassword("relay_iam"))
	admin, err := pgxpool.New(ctx, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/tok?sslmode=disable", pg.Port))
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	for i := range 10 {
		_, err := admin.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
			VALUES ($1, 'Order', $2, 'E', '{}', $2)`, outbox.NewEventID(), fmt.Sprint(i))
		require.NoError(t, err)
	}
	var issued atomic.Int32
	tokens := dbauth.NewSource(dbauth.ProviderFunc(func(ctx context.Context, tg dbauth.Target) (dbauth.Token, error) {
		tok := fmt.Sprintf("iam-token-%d", issued.Add(1))
		_, err := admin.Exec(ctx, fmt.Sprintf(`ALTER ROLE %s PASSWORD '%s'`, tg.User, tok))
		return dbauth.Token{Value: tok, Expiry: time.Now().Add(15 * time.Minute)}, err
	}))
	topic := testenv.Broker().TopicName(t, "dbtoken")
	testenv.Broker().CreateTopic(t, topic, 1)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(ca.PEM))
	dsn := fmt.Sprintf("postgres://relay_iam@127.0.0.1:%d/tok?sslmode=disable", pg.Port)
	cfg := relay.Config{
		Settings:       relay.Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": topic}, PollInterval: 20 * time.Millisecond, Notify: true},
		DatabaseTokens: tokens,
	}
	_, err = relay.New(cfg)
	require.ErrorContains(t, err, "connect with TLS", "a token is never sent in plain text")
	require.ErrorContains(t, err, "--database-auth: ", "the error names the flag that asks for tokens")
	require.ErrorContains(t, err, "--database-tls-ca-file gives the CA bundle", "and the flag that mends it")

	cfg.DatabaseTLS = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	outboxtest.Start(t, cfg)
	require.Eventually(t, func() bool {
		var n int
		return admin.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n) == nil && n == 0
	}, 30*time.Second, 50*time.Millisecond)
	require.Len(t, testenv.Broker().Consume(t, topic, 10, 30*time.Second), 10)
	var sessions, asRole int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE usename = 'relay_iam')
		FROM pg_stat_activity WHERE application_name = 'outbox-relay'`).Scan(&sessions, &asRole))
	require.GreaterOrEqual(t, sessions, 2, "the pool and the wake-up session")
	require.Equal(t, sessions, asRole)
	require.EqualValues(t, 1, issued.Load(), "one token served every session while it was fresh")
}
