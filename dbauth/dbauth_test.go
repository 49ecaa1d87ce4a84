package dbauth_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// clock is a settable time.
type clock struct{ t atomic.Pointer[time.Time] }

func newClock() *clock               { c := &clock{}; now := time.Unix(1_800_000_000, 0); c.t.Store(&now); return c }
func (c *clock) now() time.Time      { return *c.t.Load() }
func (c *clock) add(d time.Duration) { t := c.now().Add(d); c.t.Store(&t) }

// A token is fetched once per target, reused for three quarters of its
// life, fetched again after; a failed refresh falls back to the old token
// only while it has a minute left; an empty token is an error.
func TestSourceReusesAndRefreshes(t *testing.T) {
	ctx := context.Background()
	c := newClock()
	var calls atomic.Int32
	var fail atomic.Bool
	src := dbauth.NewSource(dbauth.ProviderFunc(func(_ context.Context, tg dbauth.Target) (dbauth.Token, error) {
		if fail.Load() {
			return dbauth.Token{}, errors.New("identity service down")
		}
		n := calls.Add(1)
		return dbauth.Token{Value: fmt.Sprintf("%s-%d", tg.User, n), Expiry: c.now().Add(20 * time.Minute)}, nil
	}))
	src.SetClock(c.now)
	a, b := dbauth.Target{Host: "db", Port: 5432, User: "a"}, dbauth.Target{Host: "db", Port: 5432, User: "b"}

	p, err := src.Password(ctx, a)
	require.NoError(t, err)
	require.Equal(t, "a-1", p)
	p, _ = src.Password(ctx, b)
	require.Equal(t, "b-2", p, "each target has its own token")
	c.add(14 * time.Minute) // before 3/4 of 20 minutes
	p, _ = src.Password(ctx, a)
	require.Equal(t, "a-1", p)
	require.EqualValues(t, 2, calls.Load())

	c.add(2 * time.Minute) // 16 minutes: past 3/4
	p, _ = src.Password(ctx, a)
	require.Equal(t, "a-3", p, "refreshed before it expires")

	fail.Store(true)
	c.add(16 * time.Minute) // a's token (fetched at 16) has 4 minutes left
	p, err = src.Password(ctx, a)
	require.NoError(t, err)
	require.Equal(t, "a-3", p, "a failed refresh keeps a token that is still valid")
	c.add(3*time.Minute + 30*time.Second) // 30 s left: too little to log in with
	_, err = src.Password(ctx, a)
	require.ErrorContains(t, err, "identity service down")
	require.ErrorContains(t, err, "a@db:5432")

	empty := dbauth.NewSource(dbauth.ProviderFunc(func(context.Context, dbauth.Target) (dbauth.Token, error) {
		return dbauth.Token{Expiry: time.Now().Add(time.Hour)}, nil
	}))
	_, err = empty.Password(ctx, a)
	require.ErrorContains(t, err, "empty token")
}

// A fetch that hangs holds only its own target's callers, each until its
// own context ends, and they take its token once it comes; another
// target's token is fetched meanwhile. Before, one lock covered every
// target through the fetch, so one slow call to a metadata server held
// every token login of the operator, past each caller's deadline.
func TestSourceFetchesEachTargetOnItsOwn(t *testing.T) {
	slow := make(chan struct{})
	var calls atomic.Int32
	src := dbauth.NewSource(dbauth.ProviderFunc(func(_ context.Context, tg dbauth.Target) (dbauth.Token, error) {
		calls.Add(1)
		if tg.Host == "slow" {
			<-slow
		}
		return dbauth.Token{Value: "token-" + tg.Host, Expiry: time.Now().Add(time.Hour)}, nil
	}))
	hung, other := dbauth.Target{Host: "slow", Port: 5432, User: "u"}, dbauth.Target{Host: "fast", Port: 5432, User: "u"}
	first := make(chan string, 1)
	go func() { p, _ := src.Password(context.Background(), hung); first <- p }()
	require.Eventually(t, func() bool { return calls.Load() == 1 }, 5*time.Second, time.Millisecond, "the slow fetch runs")

	done := make(chan error, 1)
	go func() { _, err := src.Password(context.Background(), other); done <- err }()
	select {
	case err := <-done:
		require.NoError(t, err, "another target's token comes while the slow fetch hangs")
	case <-time.After(5 * time.Second):
		t.Fatal("another target's token waits for the slow fetch")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := src.Password(ctx, hung)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a caller of the slow target waits only until its context ends")
	require.ErrorIs(t, err, dbauth.ErrNoToken)

	close(slow)
	require.Equal(t, "token-slow", <-first)
	p, err := src.Password(context.Background(), hung)
	require.NoError(t, err)
	require.Equal(t, "token-slow", p)
	require.EqualValues(t, 2, calls.Load(), "one fetch per target")
}

// A token never travels in plain text: a DSN without TLS or with a
// plain-text fallback is refused.
func TestRequireTLS(t *testing.T) {
	for dsn, ok := range map[string]bool{
		"postgres://u@db/x?sslmode=disable":     false,
		"postgres://u@db/x?sslmode=prefer":      false,
		"postgres://u@db/x?sslmode=allow":       false,
		"postgres://u@db/x":                     false, // pgx's default is prefer
		"postgres://u@db/x?sslmode=require":     true,
		"postgres://u@db/x?sslmode=verify-full": true,
	} {
		cfg, err := pgx.ParseConfig(dsn)
		require.NoError(t, err)
		if err := dbauth.RequireTLS(&cfg.Config); ok {
			require.NoError(t, err, dsn)
		} else {
			require.ErrorIs(t, err, dbauth.ErrPlainText, dsn)
		}
	}
}

// Over TLS every host of a DSN is kept, each verified under its own name,
// once, and the plain-text fallbacks go: a relay whose DSN names a primary
// and a standby still finds the primary after a failover. Before, a CA
// dropped every host but the first.
func TestOverTLSKeepsEveryHost(t *testing.T) {
	cfg, err := pgx.ParseConfig("host=a,b port=5432,5433 user=u dbname=x sslmode=prefer target_session_attrs=read-write")
	require.NoError(t, err)
	require.NoError(t, dbauth.OverTLS(&cfg.Config, func(host string) (*tls.Config, error) {
		return &tls.Config{ServerName: host, MinVersion: tls.VersionTLS12}, nil
	}))
	require.Equal(t, "a", cfg.TLSConfig.ServerName)
	require.Len(t, cfg.Fallbacks, 1, "b once, over TLS; no plain-text fallback")
	require.Equal(t, "b", cfg.Fallbacks[0].Host)
	require.Equal(t, uint16(5433), cfg.Fallbacks[0].Port)
	require.Equal(t, "b", cfg.Fallbacks[0].TLSConfig.ServerName)
	require.NoError(t, dbauth.RequireTLS(&cfg.Config))

	refused := errors.New("no CA")
	require.ErrorIs(t, dbauth.OverTLS(&cfg.Config, func(string) (*tls.Config, error) { return nil, refused }), refused)
}

// Against a real PostgreSQL that accepts only the latest token it handed
// out (the fake provider sets it as the role's password, as an identity
// service's token replaces the last): connections open with the cached
// token, connections opened after the refresh point (a pool recycling its
// connections) log in with a new one, and open connections keep working.
func TestTokensLogInToPostgres(t *testing.T) {
	ctx := context.Background()
	pg, ca, err := testenv.StartPostgresTLS(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Close() })
	_, err = pg.CreateDatabase(ctx, "tokens")
	require.NoError(t, err)
	require.NoError(t, pg.Exec(ctx, "tokens", `CREATE ROLE app LOGIN PASSWORD 'never-handed-out'`))
	require.NoError(t, pg.RequirePassword("app"))

	c := newClock()
	var issued atomic.Int32
	src := dbauth.NewSource(dbauth.ProviderFunc(func(ctx context.Context, tg dbauth.Target) (dbauth.Token, error) {
		tok := fmt.Sprintf("token-%d", issued.Add(1))
		if err := pg.Exec(ctx, "tokens", fmt.Sprintf(`ALTER ROLE %s PASSWORD '%s'`, tg.User, tok)); err != nil {
			return dbauth.Token{}, err
		}
		return dbauth.Token{Value: tok, Expiry: c.now().Add(15 * time.Minute)}, nil
	}))
	src.SetClock(c.now)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(ca.PEM))
	cfg, err := pgxpool.ParseConfig(fmt.Sprintf("postgres://app@127.0.0.1:%d/tokens?sslmode=verify-full", pg.Port))
	require.NoError(t, err)
	cfg.ConnConfig.TLSConfig = &tls.Config{RootCAs: roots, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	require.NoError(t, dbauth.RequireTLS(&cfg.ConnConfig.Config))
	cfg.BeforeConnect = src.BeforeConnect

	// Without a token the role cannot log in (the reload may still be on its way).
	require.Eventually(t, func() bool {
		c, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy())
		if err == nil {
			c.Close(ctx)
		}
		return err != nil
	}, 10*time.Second, 50*time.Millisecond, "the role logs in without the token")

	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	user := func() string {
		var u string
		require.NoError(t, pool.QueryRow(ctx, `SELECT current_user`).Scan(&u))
		return u
	}
	require.Equal(t, "app", user())
	own, err := src.Connect(ctx, cfg.ConnConfig)
	require.NoError(t, err, "a session of its own logs in with the cached token")
	require.EqualValues(t, 1, issued.Load())

	c.add(12 * time.Minute) // past three quarters of 15 minutes
	pool.Reset()            // the pool recycles its connections
	require.Equal(t, "app", user())
	require.EqualValues(t, 2, issued.Load(), "the recycled connection logged in with a new token")
	var one int
	require.NoError(t, own.QueryRow(ctx, `SELECT 1`).Scan(&one), "an open connection outlives its token")
	own.Close(ctx)
}
