package relay

import (
	"crypto/tls"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// With a CA (--database-ca-file, spec.database.tls) the relay keeps every
// host its DSN names, each verified under its own name: a DSN that names a
// primary and a standby still reaches the primary after a failover.
// Before, the CA dropped every host but the first.
func TestDatabaseTLSKeepsTheDSNsHosts(t *testing.T) {
	cc, err := pgx.ParseConfig("postgres://relay@primary:5432,standby:5432/orders?target_session_attrs=read-write")
	require.NoError(t, err)
	base := &tls.Config{MinVersion: tls.VersionTLS12}
	require.NoError(t, applyDatabaseLogin(cc, base, nil))
	require.Empty(t, base.ServerName, "the given configuration is not changed")
	require.Equal(t, "primary", cc.TLSConfig.ServerName)
	require.Len(t, cc.Fallbacks, 1)
	require.Equal(t, "standby", cc.Fallbacks[0].Host)
	require.Equal(t, "standby", cc.Fallbacks[0].TLSConfig.ServerName)

	named := &tls.Config{ServerName: "db.example", MinVersion: tls.VersionTLS12}
	cc, err = pgx.ParseConfig("postgres://relay@10.0.0.1,10.0.0.2/orders")
	require.NoError(t, err)
	require.NoError(t, applyDatabaseLogin(cc, named, nil))
	require.Equal(t, "db.example", cc.Fallbacks[0].TLSConfig.ServerName, "a name given is verified on every host")
}
