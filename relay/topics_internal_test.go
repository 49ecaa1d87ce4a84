package relay

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
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

// describedLimit is a broker's answer that topic takes records up to n
// bytes.
func describedLimit(topic string, n int) *kafka.DescribeConfigsResponse {
	return &kafka.DescribeConfigsResponse{Resources: []kafka.DescribeConfigResponseResource{{
		ResourceName:  topic,
		ConfigEntries: []kafka.DescribeConfigResponseConfigEntry{{ConfigName: "max.message.bytes", ConfigValue: strconv.Itoa(n)}},
	}}}
}

// describedPartitions is a broker's answer that topic has n partitions.
func describedPartitions(topic string, n int) *kafka.MetadataResponse {
	return &kafka.MetadataResponse{Topics: []kafka.Topic{{Name: topic, Partitions: make([]kafka.Partition, n)}}}
}

// An answer about a topic that arrives after the answer of a later read
// does not undo it. The stats loop reads every topic's limit every few
// seconds, and a batch reads a topic's limit again before it judges a row
// too large: when the stats loop's answer, from before the limit was
// raised, landed after the batch's, the old limit came back, and a later
// row of the batch that the topic takes went to the dead-letter topic.
func TestAnOlderAnswerDoesNotUndoANewerOne(t *testing.T) {
	t.Parallel()
	s := newTopicState(false, 0)
	now := time.Now()
	record := kafka.Message{Topic: "t", Value: make([]byte, 1_500_000)}

	stats := s.readStarted() // the stats loop asks, while the limit is 1 MB
	again := s.readStarted() // the limit was raised; a batch asks again
	s.setLimits(again, describedLimit("t", 2_000_000), now, time.Minute)
	require.NoError(t, s.tooLarge("t", record))
	s.setLimits(stats, describedLimit("t", 1_000_000), now, time.Minute) // its answer arrives late
	require.Equal(t, 2_000_000, s.limit("t"))
	require.NoError(t, s.tooLarge("t", record), "the raised limit stands")

	s.setLimits(s.readStarted(), describedLimit("t", 1_000_000), now, time.Minute) // lowered since: a later read says so
	require.Equal(t, 1_000_000, s.limit("t"))
	require.Error(t, s.tooLarge("t", record))

	// An older answer that the topic was unknown neither forgets a newer
	// limit nor marks the topic down.
	stats, again = s.readStarted(), s.readStarted()
	s.setLimits(again, describedLimit("t", 2_000_000), now, time.Minute)
	s.setLimits(stats, &kafka.DescribeConfigsResponse{Resources: []kafka.DescribeConfigResponseResource{{
		ResourceName: "t", Error: kafka.UnknownTopicOrPartition}}}, now, time.Minute)
	require.True(t, s.limitKnown("t"))
	require.True(t, s.available("t", now))

	// Partition counts likewise: a row naming a partition added meanwhile
	// is not held as invalid on an older count.
	stats, again = s.readStarted(), s.readStarted()
	s.setPartitions(again, describedPartitions("t", 8))
	s.setPartitions(stats, describedPartitions("t", 4))
	n, ok := s.partitionCount("t")
	require.True(t, ok)
	require.Equal(t, 8, n)
}

// A partition's records wait, while it is set aside, with an error that
// says why it is: it ran out the publish timeout, or refused every record
// of writes in a row. Before, both said it did not answer in time.
func TestAsideErrorSaysWhyThePartitionIsAside(t *testing.T) {
	t.Parallel()
	s := newTopicState(false, 0)
	now := time.Now()
	hung, refusing := topicPartition{"t", 0}, topicPartition{"t", 1}
	s.setAside(hung, errors.New("deadline"), now, time.Second, time.Minute)
	s.setRefused(refusing, kafka.NotLeaderForPartition, now, time.Second)
	require.ErrorContains(t, s.asideError(hung, now), "did not answer within the publish timeout")
	require.ErrorContains(t, s.asideError(refusing, now), "refused every record of writes in a row")
	require.ErrorContains(t, s.behindError(refusing), "refused every record of writes in a row")
}
