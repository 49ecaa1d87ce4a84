package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/internal/relayconfig"
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
	want := relayconfig.Settings{}
	want.DSN, want.Table, want.Brokers, want.Topics, want.DeadLetterTopic = s.DSN, s.Table, s.Brokers, s.Topics, s.DeadLetterTopic
	want.BatchSize, want.MaxBatchBytes, want.PollInterval = s.BatchSize, s.MaxBatchBytes, s.PollInterval
	want.PublishTimeout, want.StallTimeout, want.Ordering = s.PublishTimeout, s.StallTimeout, s.Ordering
	want.MaxInFlight, want.Notify, want.OnPublish, want.KeepPublishedFor = s.MaxInFlight, s.Notify, s.OnPublish, s.KeepPublishedFor
	want.PruneBatchSize, want.PrunePause = s.PruneBatchSize, s.PrunePause
	want.Format, want.CloudEventsSource, want.Compression = s.Format, s.CloudEventsSource, s.Compression
	require.Equal(t, want, got)
	require.NoError(t, ConfigFrom(s).validate())
}
