package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A topic's timestamp window is the tighter of Kafka 3.6's
// message.timestamp.before.max.ms and the older difference.max.ms; the
// defaults (Long.MAX_VALUE) and LogAppendTime bound nothing.
func TestTimestampWindow(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		configs map[string]string
		want    time.Duration
		ok      bool
	}{
		{map[string]string{}, 0, false},
		{map[string]string{"message.timestamp.before.max.ms": "9223372036854775807", "message.timestamp.difference.max.ms": "9223372036854775807"}, 0, false},
		{map[string]string{"message.timestamp.before.max.ms": "3600000"}, time.Hour, true},
		{map[string]string{"message.timestamp.difference.max.ms": "86400000"}, 24 * time.Hour, true},
		{map[string]string{"message.timestamp.before.max.ms": "86400000", "message.timestamp.difference.max.ms": "3600000"}, time.Hour, true},
		{map[string]string{"message.timestamp.type": "LogAppendTime", "message.timestamp.before.max.ms": "3600000"}, 0, false},
		{map[string]string{"message.timestamp.type": "CreateTime", "message.timestamp.before.max.ms": "60000"}, time.Minute, true},
	} {
		d, ok := timestampWindow(c.configs)
		require.Equal(t, c.ok, ok, "%v", c.configs)
		require.Equal(t, c.want, d, "%v", c.configs)
	}
	s := newTopicState(false, 0)
	s.oldest["t"] = time.Hour
	now := time.Now()
	require.True(t, s.tooOld("t", now.Add(-59*time.Minute-time.Second), now), "within the last minute of the window: stamped anew")
	require.False(t, s.tooOld("t", now.Add(-58*time.Minute), now))
	require.False(t, s.tooOld("other", now.Add(-48*time.Hour), now), "a topic without a window takes any timestamp")
}
