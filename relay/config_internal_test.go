package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// ConfigFrom and settings are inverses over the settings the loop uses, so
// a Config is checked by exactly the relay command's rules.
func TestConfigFromSettingsRoundTrip(t *testing.T) {
	t.Parallel()
	s := relayconfig.Defaults()
	s.DSN, s.Brokers, s.Topics, s.DeadLetterTopic = "postgres://x", []string{"k:9092"}, map[string]string{"E": "t"}, "dlt"
	s.Notify, s.KeepPublishedFor, s.Ordering = true, time.Hour, relayconfig.OrderingPartitionKey
	s.CloudEventsSource = "/src"
	got := ConfigFrom(s).settings()
	want := s
	want.MetricsAddr, want.LogFormat = "", "" // the process's own, not the loop's
	require.Equal(t, want, got)
	require.NoError(t, ConfigFrom(s).validate())
}
