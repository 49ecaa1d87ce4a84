package relay

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// A table dropped after the start-up check is named as missing by the
// sessions that resolve it again (retention's, membership's), not
// "cannot scan NULL" (to_regclass's NULL scanned into a number).
func TestAMissingTableIsNamed(t *testing.T) {
	ctx := context.Background()
	dsn, pool := outboxDB(t)
	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": "t"}}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	_, err = pool.Exec(ctx, `DROP TABLE outbox`)
	require.NoError(t, err)
	err = r.newPruner().prune(ctx)
	require.ErrorIs(t, err, errNoTable)
	require.EqualError(t, err, "table outbox does not exist")
	require.EqualError(t, r.join(ctx), "table outbox does not exist")
}

// A negative duration among the library's own fields is refused by New,
// naming each field; zero takes the default.
func TestNewRefusesNegativeTuning(t *testing.T) {
	settings := Settings{DSN: "postgres://u@127.0.0.1:1/db", Brokers: []string{"127.0.0.1:1"}, Topics: map[string]string{"E": "t"}}
	_, err := New(Config{Settings: settings, MaxBackoff: -time.Second, HeldRetryInterval: -time.Minute})
	require.EqualError(t, err, "relay.Config.HeldRetryInterval: -1m0s is negative (0 takes the default)\nrelay.Config.MaxBackoff: -1s is negative (0 takes the default)")
	r, err := New(Config{Settings: settings})
	require.NoError(t, err)
	require.NoError(t, r.Close())
	require.Equal(t, DefaultMaxBackoff, r.cfg.MaxBackoff)
}
