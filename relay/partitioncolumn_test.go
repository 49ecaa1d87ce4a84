package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// With a partition column, a row that sets it goes to that partition of a
// real broker's topic, also when it is sent again on its own; a row that
// leaves it NULL goes where its key's hash says (as without the column); a
// row naming a partition the topic lacks is held as invalid_row with the
// reason, and the rows behind it flow. Both ordering modes.
func TestPartitionColumnChoosesThePartition(t *testing.T) {
	t.Parallel()
	for _, ordering := range []relay.Ordering{relay.OrderingNone, relay.OrderingPartitionKey} {
		t.Run(string(ordering), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := outboxtest.NewFixture(t, 3, "E")
			f.Exec(`ALTER TABLE outbox ADD COLUMN kafka_partition smallint`)
			want := map[string]int{} // event_id → the partition it must reach
			for i := range 40 {
				var p any
				switch i % 4 {
				case 0, 1:
					p = i % 3
				case 2:
					p = nil
				case 3:
					if i == 7 {
						p = 7 // no such partition
					}
				}
				var id string
				require.NoError(t, f.Pool.QueryRow(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, kafka_partition)
					VALUES (gen_random_uuid(), 'Order', $1, 'E', '{}', $1, $2) RETURNING event_id::text`, fmt.Sprint("order-", i%5), p).Scan(&id))
				switch {
				case p == nil:
					want[id] = (&kafka.Murmur2Balancer{}).Balance(kafka.Message{Key: []byte(fmt.Sprint("order-", i%5))}, 0, 1, 2)
				case p != 7:
					want[id] = p.(int)
				}
			}
			cfg := f.Config()
			cfg.Ordering = ordering
			cfg.PartitionColumn = "kafka_partition"
			cfg.HeldRetryInterval = time.Hour
			run(t, cfg, nil)
			// In partition-key mode the held row's key waits behind it: the
			// rows of order-2 after it (ids 13, 18, …, 38) stay unpublished.
			blocked := 0
			if ordering == relay.OrderingPartitionKey {
				blocked = 6
				for id := range f.EventIDs(`WHERE partition_key = 'order-2' AND id > 8`) {
					delete(want, id)
				}
			}
			f.WaitDrained(1+blocked, 30*time.Second)
			msgs := testenv.Broker().Consume(t, f.Topics["E"], 39-blocked, 30*time.Second)
			require.Len(t, msgs, 39-blocked)
			for _, m := range msgs {
				id := header(m, relay.HeaderEventID)
				p, ok := want[id]
				require.True(t, ok, "event %s was not to be published", id)
				require.Equal(t, p, m.Partition, "event %s", id)
			}
			var held []relay.HeldRow
			require.Eventually(t, func() bool {
				var err error
				held, err = relay.ListHeld(ctx, f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{All: true}, 10)
				return err == nil && len(held) == 1
			}, 10*time.Second, 50*time.Millisecond)
			require.Equal(t, relay.HeldInvalidRow, held[0].Reason)
			require.Contains(t, held[0].Error, "partition column kafka_partition: 7 is not a partition of topic "+f.Topics["E"]+" (0 to 2)")
		})
	}
}

// The start-up check names a partition column the table lacks, with the
// DDL that adds it, and one of a type that is not an integer.
func TestPartitionColumnIsChecked(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(`ALTER TABLE outbox ADD COLUMN shard text`)
	for column, msg := range map[string]string{
		"kafka_partition": `--partition-column: table outbox has no column kafka_partition; add it with: ALTER TABLE "outbox" ADD COLUMN "kafka_partition" integer`,
		"shard":           `--partition-column: column shard of outbox has type text; want one of smallint, integer, bigint`,
	} {
		cfg := f.Config()
		cfg.PartitionColumn = column
		r, err := relay.New(cfg)
		require.NoError(t, err)
		require.EqualError(t, r.Check(context.Background()), msg)
		require.NoError(t, r.Close())
	}
	cfg := f.Config()
	cfg.PartitionColumn = "payload"
	_, err := relay.New(cfg)
	require.ErrorContains(t, err, `--partition-column: "payload" is a column the relay reads for its own purpose`)
}

func header(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
