// Package dbauth gives a PostgreSQL connection its password when it opens:
// a short-lived token from the platform's identity (AWS RDS IAM, Google
// Cloud SQL IAM, Azure AD) in place of a password kept in a Secret. The
// relay and the operator's backlog reads share it.
//
// A token is fetched for each new connection's host, port and user, reused
// until three quarters of its life have passed, and fetched again then, so
// a connection never opens with a token about to expire. An open
// connection is not affected by its token's expiry: PostgreSQL checks the
// password only at login.
package dbauth

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// ErrPlainText: the connection could send the token in plain text.
var ErrPlainText = errors.New("database token auth sends a token as the password: connect with TLS that does not fall back to plain text (a CA bundle, or sslmode=require, verify-ca or verify-full in the DSN)")

// ErrNoToken: the identity gave no token (the error it wraps says why).
var ErrNoToken = errors.New("no database token")

// Target is what a token is for: the server and the database user.
type Target struct {
	Host string
	Port uint16
	User string
}

// Token is a password with the time it stops being accepted.
type Token struct {
	Value  string
	Expiry time.Time
}

// Provider fetches a new token for a target.
type Provider interface {
	Token(ctx context.Context, t Target) (Token, error)
}

// ProviderFunc is a Provider.
type ProviderFunc func(ctx context.Context, t Target) (Token, error)

// Token calls f.
func (f ProviderFunc) Token(ctx context.Context, t Target) (Token, error) { return f(ctx, t) }

// Source hands out the tokens of a Provider, fetching one per target and
// reusing it until three quarters of its life have passed. When fetching a
// new one fails while the old one still has a minute, the old one is used.
type Source struct {
	provider Provider
	now      func() time.Time

	mu     sync.Mutex
	tokens map[Target]cached
	// fetching holds, for each target whose token is being fetched, a
	// channel closed when the fetch ends.
	fetching map[Target]chan struct{}
}

type cached struct {
	Token
	fetched time.Time
}

// minValidity is the least life a token must have left to be used after
// a failed refresh: enough for a connection to open with it.
const minValidity = time.Minute

// NewSource returns a Source of p's tokens.
func NewSource(p Provider) *Source {
	return &Source{provider: p, now: time.Now, tokens: map[Target]cached{}, fetching: map[Target]chan struct{}{}}
}

// SetClock makes s read the time from now (tests).
func (s *Source) SetClock(now func() time.Time) { s.now = now }

// Password is the token to log in to t with. One fetch runs per target at
// a time, and the callers for that target wait for it, each up to its own
// context's end; other targets do not wait. Before, one lock covered
// every target through the fetch: the operator shares a Source among all
// its relays' databases, and one slow call to a cloud's metadata server
// held every token login, past each caller's deadline.
func (s *Source) Password(ctx context.Context, t Target) (string, error) {
	for {
		s.mu.Lock()
		now := s.now()
		c, ok := s.tokens[t]
		if ok && now.Before(c.fetched.Add(c.Expiry.Sub(c.fetched)*3/4)) {
			s.mu.Unlock()
			return c.Value, nil
		}
		// Without a new token, the old one serves while it has a minute left.
		failed := func(err error) (string, error) {
			if ok && now.Add(minValidity).Before(c.Expiry) {
				return c.Value, nil
			}
			return "", fmt.Errorf("%w for %s@%s:%d: %w", ErrNoToken, t.User, t.Host, t.Port, err)
		}
		if fetched, busy := s.fetching[t]; busy {
			s.mu.Unlock()
			select {
			case <-fetched:
				continue // its token is in place, or it failed and this caller tries
			case <-ctx.Done():
				return failed(ctx.Err())
			}
		}
		fetched := make(chan struct{})
		s.fetching[t] = fetched
		s.mu.Unlock()
		tok, err := s.provider.Token(ctx, t)
		if err == nil && tok.Value == "" {
			err = errors.New("the provider gave an empty token")
		}
		s.mu.Lock()
		delete(s.fetching, t)
		close(fetched)
		if err == nil {
			s.tokens[t] = cached{Token: tok, fetched: now}
		}
		s.mu.Unlock()
		if err != nil {
			return failed(err)
		}
		return tok.Value, nil
	}
}

// Apply sets cfg's password to the token for cfg's host, port and user.
func (s *Source) Apply(ctx context.Context, cfg *pgconn.Config) error {
	p, err := s.Password(ctx, Target{Host: cfg.Host, Port: cfg.Port, User: cfg.User})
	if err != nil {
		return err
	}
	cfg.Password = p
	for _, fb := range cfg.Fallbacks {
		if fb.Host != cfg.Host || fb.Port != cfg.Port {
			return fmt.Errorf("database token auth: the DSN names more than one host (%s:%d, %s:%d); give one", cfg.Host, cfg.Port, fb.Host, fb.Port)
		}
	}
	return nil
}

// BeforeConnect is a pgxpool.Config.BeforeConnect that applies the token.
func (s *Source) BeforeConnect(ctx context.Context, cfg *pgx.ConnConfig) error {
	return s.Apply(ctx, &cfg.Config)
}

// Connect opens one connection with cfg (copied) and the token.
func (s *Source) Connect(ctx context.Context, cfg *pgx.ConnConfig) (*pgx.Conn, error) {
	c := cfg.Copy()
	if s != nil {
		if err := s.Apply(ctx, &c.Config); err != nil {
			return nil, err
		}
	}
	return pgx.ConnectConfig(ctx, c)
}

// OverTLS makes every host of cfg connect over TLS with tlsFor's
// configuration for that host (its CA, and the host's name to verify): the
// DSN's first host and each other host it names, once, in order. The
// DSN's plain-text fallbacks go. Before, a CA dropped the other hosts
// along with them, so a relay whose DSN named a primary and a standby
// (target_session_attrs=read-write) could reach no primary after a
// failover.
func OverTLS(cfg *pgconn.Config, tlsFor func(host string) (*tls.Config, error)) error {
	t, err := tlsFor(cfg.Host)
	if err != nil {
		return err
	}
	cfg.TLSConfig = t
	addr := func(host string, port uint16) string { return net.JoinHostPort(host, strconv.Itoa(int(port))) }
	seen := map[string]bool{addr(cfg.Host, cfg.Port): true}
	var hosts []*pgconn.FallbackConfig
	for _, fb := range cfg.Fallbacks {
		if seen[addr(fb.Host, fb.Port)] {
			continue
		}
		seen[addr(fb.Host, fb.Port)] = true
		t, err := tlsFor(fb.Host)
		if err != nil {
			return err
		}
		hosts = append(hosts, &pgconn.FallbackConfig{Host: fb.Host, Port: fb.Port, TLSConfig: t})
	}
	cfg.Fallbacks = hosts
	return nil
}

// RequireTLS refuses a configuration that could send a token in plain
// text: one without TLS or with a plain-text fallback (sslmode allow,
// prefer or disable).
func RequireTLS(cfg *pgconn.Config) error {
	plain := cfg.TLSConfig == nil
	for _, fb := range cfg.Fallbacks {
		plain = plain || fb.TLSConfig == nil
	}
	if plain {
		return ErrPlainText
	}
	return nil
}

// New is the Provider of method (none for password: the DSN's own
// password is used). region is the AWS region for aws-rds-iam (default:
// the SDK's, from AWS_REGION).
func New(ctx context.Context, method relayconfig.DatabaseAuth, region string) (Provider, error) {
	switch method {
	case relayconfig.DatabaseAuthPassword, "":
		return nil, nil
	case relayconfig.DatabaseAuthAWSRDSIAM:
		return NewAWSRDSIAM(ctx, region)
	case relayconfig.DatabaseAuthGCPCloudSQLIAM:
		return NewGCPCloudSQLIAM(ctx)
	case relayconfig.DatabaseAuthAzureAD:
		return NewAzureAD()
	}
	return nil, fmt.Errorf("database auth %q is not one of %v", method, relayconfig.DatabaseAuths)
}
