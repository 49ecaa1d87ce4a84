package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// keysOn returns n keys that the writers' balancer puts on partition p of
// a topic of two.
func keysOn(p, n int) []string {
	var keys []string
	for i := 0; len(keys) < n; i++ {
		k := fmt.Sprintf("k%d", i)
		if (&kafka.Murmur2Balancer{}).Balance(kafka.Message{Key: []byte(k)}, 0, 1) == p {
			keys = append(keys, k)
		}
	}
	return keys
}

// kfakeRelay is a relay of cfg's settings on the fake cluster c, with no
// database, which has not read its topics yet.
func kfakeRelay(t *testing.T, c *kfake.Cluster, cfg Config) *Relay {
	t.Helper()
	cfg.DSN, cfg.Brokers = "postgres://u@127.0.0.1:1/db", c.ListenAddrs()
	r, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return r
}

// One partition's leader taking longer than the publish timeout fails only
// that partition's records: the rows Kafka acknowledged on the other
// partition are published. Before, kafka-go's call for the whole batch
// returned the context's error alone, every row went out again at each
// retry, and none was marked for as long as the leader hung (0 of 5 here).
// The partition is then set aside: the next batches send it nothing, so
// they do not wait the timeout out again, and a polling loop does not back
// off for its rows; once its backoff ends it is tried again. Before, each
// batch that held one of its rows waited the whole timeout.
func TestHungPartitionLeavesTheOthersAcknowledged(t *testing.T) {
	for _, mode := range []Ordering{OrderingNone, OrderingPartitionKey} {
		t.Run(string(mode), func(t *testing.T) {
			c, err := kfake.NewCluster(kfake.NumBrokers(2), kfake.SeedTopics(2, "t"))
			require.NoError(t, err)
			defer c.Close()
			require.NoError(t, c.MoveTopicPartition("t", 0, 0))
			require.NoError(t, c.MoveTopicPartition("t", 1, 1))
			hung := make(chan struct{})
			defer close(hung)
			var mu sync.Mutex
			var toHung [][]byte // the record batches partition 0's leader got
			c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
				c.KeepControl()
				if c.CurrentNode() == 0 { // partition 0's leader answers only once the test ends
					mu.Lock()
					for _, t := range req.(*kmsg.ProduceRequest).Topics {
						for _, p := range t.Partitions {
							toHung = append(toHung, p.Records)
						}
					}
					mu.Unlock()
					c.SleepControl(func() { <-hung })
				}
				return nil, nil, false
			})
			// reached reports whether the leader got the record of the event
			// (uncompressed: its headers are in the batch as they are). The
			// writer may send a record again after its call ended, so what
			// each batch sends is told by its own event ids.
			reached := func(eventID string) bool {
				mu.Lock()
				defer mu.Unlock()
				return slices.ContainsFunc(toHung, func(b []byte) bool { return bytes.Contains(b, []byte(eventID)) })
			}
			r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: time.Second, Ordering: mode}})
			r.refreshKafka(context.Background()) // the topic's partitions, as Check reads them
			next, batches := int64(0), 0
			// batch returns rows on partition 1 and, last, one on partition
			// 0, of a key of its own (a key whose row failed waits in
			// partition-key mode), with that one's event id.
			batch := func() (rows []row, healthy []int64, hungID string) {
				batches++
				keys := append(keysOn(1, 5), keysOn(0, batches)[batches-1])
				for i, k := range keys {
					next++
					id := fmt.Sprintf("event-%03d", next)
					rows = append(rows, row{id: next, eventID: id, eventType: "E", partitionKey: k, payload: []byte(`{}`), createdAt: time.Now()})
					if i < len(keys)-1 {
						healthy = append(healthy, next)
					} else {
						hungID = id
					}
				}
				return rows, healthy, hungID
			}
			rows, healthy, hungID := batch()
			published, _, _ := r.publish(context.Background(), rows)
			require.ElementsMatch(t, healthy, published, "the rows Kafka acknowledged on partition 1")
			require.True(t, reached(hungID))
			aside := topicPartition{topic: "t", partition: 0}
			require.Error(t, r.topics.asideError(aside, time.Now()), "partition 0 is set aside")

			r.topics.aside[aside].until = time.Now().Add(time.Hour) // however slow the machine, still aside
			rows, healthy, hungID = batch()
			published, _, err = r.publish(context.Background(), rows)
			require.ElementsMatch(t, healthy, published, "the other partition's rows flow")
			if mode == OrderingNone {
				require.NoError(t, err, "no backoff for the rows of a partition set aside")
			}
			require.False(t, reached(hungID), "nothing was sent to the partition set aside")

			// A batch all aside does not make the loop claim it again at
			// once: partition-key mode backs off when nothing went out (the
			// next claim, of other keys, could be all aside again); with no
			// ordering the claims leave its rows out, not their topic.
			onlyHung := []row{rows[len(rows)-1]}
			onlyHung[0].id, onlyHung[0].eventID, onlyHung[0].partitionKey = 1000, "event-only", keysOn(0, 10)[9]
			_, _, err = r.publish(context.Background(), onlyHung)
			if mode == OrderingPartitionKey {
				require.Error(t, err, "backs off")
			} else {
				require.NoError(t, err)
				require.True(t, r.aside.has(1000), "the row is left out of the claims")
				require.True(t, r.topics.available("t", time.Now()), "its topic is not")
			}

			r.topics.aside[aside].until = time.Now() // its backoff is over
			rows, healthy, _ = batch()
			published, _, _ = r.publish(context.Background(), rows)
			require.ElementsMatch(t, healthy, published)
			// Only a call to it that ran out the timeout sets it aside again
			// (its record may not reach the leader: the writer keeps a
			// partition's batches in order, behind the first one's retries).
			require.Equal(t, 2*time.Second, r.topics.aside[aside].backoff, "tried again once its backoff ended, and set aside for twice as long")

			// A call cut short by the batch's own end says nothing of the leader.
			r.topics.aside[aside].until = time.Now()
			short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			rows, _, _ = batch()
			_, _, _ = r.publish(short, rows)
			require.Contains(t, r.topics.aside, aside, "still set aside")
			require.Equal(t, 2*time.Second, r.topics.aside[aside].backoff, "for as long as before")
		})
	}
}

// A leader that flaps between hanging and failing at once (a leader
// moving, a partition short of replicas) keeps its set-aside backoff
// growing: only a write that gets a record acknowledged clears it. Before,
// any write that ended within the timeout cleared it, so each hang after a
// quick error set the partition aside for the publish timeout again, and
// every batch holding one of its rows waited that long.
func TestFlappingLeaderKeepsDoublingItsBackoff(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	const timeout = time.Second // the shortest --publish-timeout
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: timeout}})
	w := &answerWriter{}
	r.writer = w
	r.topics.partitions["t"] = 1
	p := topicPartition{topic: "t", partition: 0}
	next := int64(0)
	publish := func(answer func(ctx context.Context) error) {
		w.answer = answer
		next++
		_, _, _ = r.publish(context.Background(), []row{{id: next, eventID: fmt.Sprintf("e%d", next), eventType: "E",
			partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()}})
	}
	hang := func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }
	notLeader := func(context.Context) error { return kafka.WriteErrors{kafka.NotLeaderForPartition} }
	ok := func(context.Context) error { return nil }
	over := func() { r.topics.aside[p].until = time.Now() } // its backoff is over

	publish(hang)
	require.Equal(t, timeout, r.topics.aside[p].backoff, "set aside for the publish timeout")
	over()
	publish(notLeader)
	require.Contains(t, r.topics.aside, p, "an error that comes at once leaves it as it was")
	require.Equal(t, timeout, r.topics.aside[p].backoff)
	r.topics.clearFailing("t") // the topic's own backoff for the failed record is over
	publish(hang)
	require.Equal(t, 2*timeout, r.topics.aside[p].backoff, "the next hang doubles the backoff")
	over()
	publish(ok)
	require.NotContains(t, r.topics.aside, p, "a record acknowledged clears it")
}

// A row left out of the claims for its partition set aside holds back its
// key's later rows: one claimed after the partition's backoff ended but
// before the claims took the older row back waits with it, and both come
// back together, in id order. Before, the later row went out first. The
// rows come back at once when the topic's partition count changes: the
// key may go to another partition now.
func TestRowLeftOutForAPartitionHoldsBackItsKeysLaterRows(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: time.Second}})
	r.writer = &answerWriter{answer: func(context.Context) error { return nil }}
	r.topics.partitions["t"] = 1
	p := topicPartition{topic: "t", partition: 0}
	ev := func(id int64, key string) row {
		return row{id: id, eventID: fmt.Sprint("e", id), eventType: "E", partitionKey: key, payload: []byte(`{}`), createdAt: time.Now()}
	}
	r.topics.setAside(p, errors.New("no answer"), time.Now(), time.Hour, time.Hour)
	published, _, _ := r.publish(context.Background(), []row{ev(1, "k")})
	require.Empty(t, published)
	require.True(t, r.aside.has(1), "left out of the claims")

	r.topics.aside[p].until = time.Now() // its backoff ended after the claim began
	published, _, _ = r.publish(context.Background(), []row{ev(2, "k"), ev(3, "other")})
	require.Equal(t, []int64{3}, published, "the key's later row is not sent before it; another key's is")
	require.True(t, r.aside.has(2), "it waits with it")

	require.True(t, r.aside.release(r.topics, time.Now()), "both come back")
	require.False(t, r.aside.has(1) || r.aside.has(2))

	r.topics.setAside(p, errors.New("no answer"), time.Now(), time.Hour, time.Hour)
	_, _, _ = r.publish(context.Background(), []row{ev(4, "k")})
	require.True(t, r.aside.has(4))
	require.False(t, r.aside.release(r.topics, time.Now()), "still aside")
	r.topics.partitions["t"] = 2
	require.True(t, r.aside.release(r.topics, time.Now()), "back once the topic's partitions changed")
	require.False(t, r.aside.has(4))
}

// answerWriter answers every call with answer, and shows each record it
// answers with no error to sent, if set.
type answerWriter struct {
	answer func(ctx context.Context) error
	sent   func(kafka.Message)
}

func (w *answerWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	err := w.answer(ctx)
	if err == nil && w.sent != nil {
		for _, m := range msgs {
			w.sent(m)
		}
	}
	return err
}

// A row's partition column names a partition the relay knows but the
// writer's cached metadata does not yet (partitions were just added): the
// record is not sent elsewhere. It fails as transient, and goes to the
// partition its row chose once the writer knows it. Before, the balancer
// fell back to the key's hash, and the record was acknowledged on another
// partition.
func TestExplicitPartitionTheWriterDoesNotKnowYetIsNotSentElsewhere(t *testing.T) {
	r, cl, x := afterPartitionAdded(t, Config{})
	r.topics.partitions["t"] = 3 // the relay read the new count; the writer's cache is older
	published, _, _ := r.publish(context.Background(), []row{x})
	require.Empty(t, published, "not acknowledged on a partition its row did not choose")

	// The failure dropped the writer's cached metadata, which would
	// otherwise serve for MetadataTTL (30 s).
	require.Eventually(t, func() bool {
		published, _, _ = r.publish(context.Background(), []row{x})
		return len(published) == 1
	}, 10*time.Second, 200*time.Millisecond, "published once the writer knows the partition")
	requireOnPartitionTwo(t, cl)
}

// A row naming a partition added since the relay last read the topic's
// partition count goes there, not to the held table: the relay reads the
// count again, past the transport's cached metadata, before it holds the
// row. Before, the row was held as an invalid row for HeldRetryInterval (a
// minute), though the partition was there.
func TestAPartitionAddedSinceTheLastReadTakesItsRow(t *testing.T) {
	r, cl, x := afterPartitionAdded(t, Config{HeldRetryInterval: time.Minute})
	published, _, _ := r.publish(context.Background(), []row{x})
	require.False(t, r.held.isHeld(x.id), "not held: partition 2 is there")
	n, _ := r.topics.partitionCount("t")
	require.Equal(t, 3, n, "the count read again")
	require.Eventually(t, func() bool {
		if len(published) == 0 {
			published, _, _ = r.publish(context.Background(), []row{x})
		}
		return len(published) == 1
	}, 10*time.Second, 200*time.Millisecond, "published once the writer knows the partition")
	requireOnPartitionTwo(t, cl)
}

// afterPartitionAdded is a relay of cfg on a fake cluster whose topic t had
// two partitions when the relay last read its count and published a first
// record (its transport caches two), and has three now; x is a row whose
// partition column names partition 2, and cl a client of the cluster.
func afterPartitionAdded(t *testing.T, cfg Config) (r *Relay, cl *kadm.Client, x row) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "t"))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	cfg.Topics, cfg.PublishTimeout = map[string]string{"E": "t"}, 5*time.Second
	r = kfakeRelay(t, c, cfg)
	r.topics.partitions["t"] = 2
	warm := row{id: 1, eventID: "warm", eventType: "E", partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()}
	published, _, err := r.publish(context.Background(), []row{warm})
	require.NoError(t, err)
	require.Equal(t, []int64{1}, published)

	kc, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...))
	require.NoError(t, err)
	t.Cleanup(kc.Close)
	cl = kadm.NewClient(kc)
	_, err = cl.CreatePartitions(context.Background(), 1, "t")
	require.NoError(t, err)
	two := int64(2)
	return r, cl, row{id: 2, eventID: "on-two", eventType: "E", partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now(), partition: &two}
}

// requireOnPartitionTwo checks that topic t holds afterPartitionAdded's
// first record and its row, the row on partition 2, and nothing else.
func requireOnPartitionTwo(t *testing.T, cl *kadm.Client) {
	t.Helper()
	ends, err := cl.ListEndOffsets(context.Background(), "t")
	require.NoError(t, err)
	end, ok := ends.Lookup("t", 2)
	require.True(t, ok)
	require.Equal(t, int64(1), end.Offset, "on partition 2")
	total := int64(0)
	ends.Each(func(o kadm.ListedOffset) { total += o.Offset })
	require.Equal(t, int64(2), total, "the warm-up record and the row, nothing elsewhere")
}

// A row whose partition column names a partition of a topic whose
// partitions the relay has not read yet (the brokers did not list it: it
// is missing, or was created since) waits as a row of a topic down: the
// claims leave the topic out for a backoff. Before, the row was only left
// for the next batch, which claimed it again at once, batch after batch,
// until the next metadata read.
func TestExplicitPartitionOfATopicNotReadYetWaitsABackoff(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: 5 * time.Second}})
	zero := int64(0)
	published, _, _ := r.publish(context.Background(), []row{{id: 1, eventID: "e1", eventType: "E", partitionKey: "k",
		payload: []byte(`{}`), createdAt: time.Now(), partition: &zero}})
	require.Empty(t, published)
	require.False(t, r.topics.available("t", time.Now()), "its topic is left out of the claims for a backoff")
	require.Contains(t, r.topics.downTopics(), "t")
}

// A row that waits because its topic's partitions are not read yet holds
// back its key's later rows in the batch, even those that name no
// partition, in partition-key mode and with logical replication capture
// (whose batches keep each key's order the same way). Without the lane's
// stop, the later row went out first.
func TestExplicitPartitionOfATopicNotReadYetHoldsItsKeysLaterRows(t *testing.T) {
	for _, capture := range []bool{false, true} {
		t.Run(fmt.Sprintf("capture=%v", capture), func(t *testing.T) {
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
			require.NoError(t, err)
			defer c.Close()
			cfg := Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: 5 * time.Second}}
			if !capture {
				cfg.Ordering = OrderingPartitionKey
			}
			r := kfakeRelay(t, c, cfg)
			if capture {
				r.capture = &captureState{}
			}
			zero := int64(0)
			published, _, _ := r.publish(context.Background(), []row{
				{id: 1, eventID: "e1", eventType: "E", partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now(), partition: &zero},
				{id: 2, eventID: "e2", eventType: "E", partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()},
			})
			require.Empty(t, published, "the later row of its key waits behind it")
		})
	}
}

// A record alone in its call is not dead-lettered on its batch's refusal
// while other calls of the same writer and topic ran beside it: when the
// writer's partition count is newer than the relay's (partitions were just
// added), two of the relay's partitions can be one of the writer's, and the
// writer puts the two calls' records in one record batch, refused as a
// whole for the other record. Here the relay knows two partitions, and the
// writer answers the first two calls as one batch. Before, both records
// were refused alone in their calls, and the valid one was dead-lettered.
func TestARecordInAMergedBatchIsNotDeadLetteredForAnother(t *testing.T) {
	for _, mode := range []Ordering{OrderingNone, OrderingPartitionKey} {
		t.Run(string(mode), func(t *testing.T) {
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t", "dlq"))
			require.NoError(t, err)
			defer c.Close()
			r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, DeadLetterTopic: "dlq",
				PublishTimeout: 5 * time.Second, Ordering: mode}})
			w := &mergingWriter{met: make(chan struct{})}
			r.writer = w
			r.topics.partitions["t"] = 2 // what the relay last read; the writer's batch is one
			rows := []row{
				{id: 1, eventID: "valid", eventType: "E", partitionKey: keysOn(0, 1)[0], payload: []byte(`{}`), createdAt: time.Now()},
				{id: 2, eventID: "poison", eventType: "E", partitionKey: keysOn(1, 1)[0], payload: []byte(`{}`), createdAt: time.Now()},
			}
			published, _, err := r.publish(context.Background(), rows)
			require.NoError(t, err)
			require.ElementsMatch(t, []int64{1, 2}, published, "one published, one dead-lettered")
			require.Equal(t, []string{"poison"}, w.deadLettered(), "only the record its topic refuses alone")
		})
	}
}

// A row admit finds too large waits behind an older row of its key that
// then fails transiently: it is neither dead-lettered nor held in this
// batch, and is decided in a later one, after that row. Before, it went to
// the dead-letter topic ahead of the older row, so the key's rows there
// could come in reverse order (with logical replication too, which keeps
// a key's order within a batch the same way; and polling with no ordering).
func TestATooLargeRowWaitsBehindItsKeysFailedRow(t *testing.T) {
	for _, name := range []string{"partition-key", "none", "none-capture"} {
		t.Run(name, func(t *testing.T) {
			mode := OrderingNone
			if name == "partition-key" {
				mode = OrderingPartitionKey
			}
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t", "dlq"))
			require.NoError(t, err)
			defer c.Close()
			r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, DeadLetterTopic: "dlq",
				PublishTimeout: time.Second, Ordering: mode}})
			if name == "none-capture" {
				r.capture = &captureState{}
			}
			var dead []string
			r.writer = writerFunc(func(_ context.Context, msgs ...kafka.Message) error {
				if msgs[0].Topic == "dlq" {
					for _, m := range msgs {
						dead = append(dead, eventIDOf(m))
					}
					return nil
				}
				errs := make(kafka.WriteErrors, len(msgs))
				for i := range errs {
					errs[i] = kafka.NotEnoughReplicas
				}
				return errs
			})
			r.topics.partitions["t"], r.topics.maxBytes["t"] = 1, 2000
			rows := []row{
				{id: 1, eventID: "valid", eventType: "E", partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()},
				{id: 2, eventID: "later-too-large", eventType: "E", partitionKey: "k", payload: bytes.Repeat([]byte("x"), 5000), createdAt: time.Now()},
			}
			published, retry, _ := r.publish(context.Background(), rows)
			require.Empty(t, published)
			require.Empty(t, dead, "nothing dead-lettered ahead of the key's older row")
			require.False(t, r.held.isHeld(2), "nor held")
			if name == "none-capture" {
				require.Equal(t, []int64{1, 2}, retry, "both again, in order")
			}
		})
	}
}

// A partition's share larger than one record batch goes as several, which
// kafka-go sends one after the other, each succeeding or failing on its
// own: when the first fails (its leader moved) and a later one is taken, a
// key's later rows were published before its earlier ones. The relay sends
// such a share in rounds of one record batch, and a key whose round failed
// sends nothing more in the batch, in every mode. Before, polling with no
// ordering sent the whole share in one call and published rows 3 and 4
// ahead of 1 and 2.
func TestAKeysLaterRecordBatchWaitsForItsFailedOne(t *testing.T) {
	for _, mode := range []string{"none", "none-capture", "partition-key"} {
		t.Run(mode, func(t *testing.T) {
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
			require.NoError(t, err)
			defer c.Close()
			ordering := OrderingNone
			if mode == "partition-key" {
				ordering = OrderingPartitionKey
			}
			r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: time.Second, Ordering: ordering}})
			if mode == "none-capture" {
				r.capture = &captureState{}
			}
			r.topics.partitions["t"], r.topics.maxBytes["t"] = 1, 2000
			budget := r.topics.budget("t")
			var calls [][]string
			// As kafka-go's writer does with a call: a record batch of the
			// records that fit the budget, then the next; the first fails.
			r.writer = writerFunc(func(_ context.Context, msgs ...kafka.Message) error {
				var ids []string
				errs := make(kafka.WriteErrors, len(msgs))
				used := 0
				for i, m := range msgs {
					ids = append(ids, eventIDOf(m))
					used += recordSize(m)
					if used <= budget && len(calls) == 0 {
						errs[i] = kafka.NotLeaderForPartition
					}
				}
				calls = append(calls, ids)
				return errs
			})
			var rows []row
			for id := int64(1); id <= 4; id++ {
				rows = append(rows, row{id: id, eventID: fmt.Sprint("e", id), eventType: "E", partitionKey: "k",
					payload: bytes.Repeat([]byte("x"), 700), createdAt: time.Now()})
			}
			published, _, _ := r.publish(context.Background(), rows)
			require.Empty(t, published, "no row of the key after its failed ones (calls: %v)", calls)
			require.Equal(t, []string{"e1", "e2"}, calls[0], "the first record batch")
		})
	}
}

// A partition whose leader moved is written to its new leader within a
// few tries: the old leader's answer drops the writers' cached metadata.
// Before, kafka-go wrote to the old leader until its metadata refresh
// came, at a random time within 30 s.
func TestAMovedLeaderIsFoundAtOnce(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(2), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: 2 * time.Second}})
	ev := row{id: 1, eventID: "e1", eventType: "E", partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()}
	published, _, err := r.publish(context.Background(), []row{ev})
	require.NoError(t, err)
	require.Equal(t, []int64{1}, published, "the writers know the first leader")
	require.NoError(t, c.MoveTopicPartition("t", 0, 1-c.LeaderFor("t", 0)))

	ev.id, ev.eventID = 2, "e2"
	start := time.Now()
	require.Eventually(t, func() bool {
		published, _, _ := r.publish(context.Background(), []row{ev})
		return len(published) == 1
	}, 5*time.Second, 50*time.Millisecond, "the new leader was not written to within 5 s")
	t.Logf("published on the new leader after %s", time.Since(start).Round(time.Millisecond))
}

// A topic whose limit the relay can no longer read (its DESCRIBE_CONFIGS
// permission revoked, say) has no known limit: a record over the limit
// read before is sent, and the topic, which may have been made again
// with a larger one, takes it. Before, that old limit stood for good and
// the record was dead-lettered without the broker refusing it.
func TestALimitNoLongerReadIsNotKnown(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t", "dlq"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, DeadLetterTopic: "dlq", PublishTimeout: 2 * time.Second}})
	r.topics.maxBytes["t"] = 2000 // read before
	c.ControlKey(int16(kmsg.DescribeConfigs), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		dr := req.(*kmsg.DescribeConfigsRequest)
		resp := dr.ResponseKind().(*kmsg.DescribeConfigsResponse)
		for _, res := range dr.Resources {
			rr := kmsg.NewDescribeConfigsResponseResource()
			rr.ResourceType, rr.ResourceName, rr.ErrorCode = res.ResourceType, res.ResourceName, kerr.TopicAuthorizationFailed.Code
			resp.Resources = append(resp.Resources, rr)
		}
		return resp, nil, true
	})
	require.NoError(t, r.topics.refreshLimits(context.Background(), r.client, []string{"t"}, time.Minute))
	require.False(t, r.topics.limitKnown("t"))

	var dead int
	var mu sync.Mutex
	r.writer = writerFunc(func(ctx context.Context, msgs ...kafka.Message) error {
		if msgs[0].Topic == "dlq" {
			mu.Lock()
			dead += len(msgs)
			mu.Unlock()
		}
		return nil // the topic takes it
	})
	x := row{id: 1, eventID: "e1", eventType: "E", partitionKey: "k", payload: bytes.Repeat([]byte("x"), 5000), createdAt: time.Now()}
	published, _, err := r.publish(context.Background(), []row{x})
	require.NoError(t, err)
	require.Equal(t, []int64{1}, published)
	require.Zero(t, dead, "sent to its topic, not dead-lettered")
}

// writerFunc is a MessageWriter.
type writerFunc func(ctx context.Context, msgs ...kafka.Message) error

func (f writerFunc) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	return f(ctx, msgs...)
}

// mergingWriter answers its first two calls as one record batch: both are
// refused when either carries the record whose event id is "poison", as a
// partition's batch is. It answers every later call alone, and takes
// every record for the dead-letter topic dlq.
type mergingWriter struct {
	mu    sync.Mutex
	calls int
	batch []kafka.Message // the first two calls' records
	met   chan struct{}   // closed once both came
	dead  []string        // event ids written to dlq
}

func (w *mergingWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	if msgs[0].Topic == "dlq" {
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, m := range msgs {
			w.dead = append(w.dead, eventIDOf(m))
		}
		return nil
	}
	w.mu.Lock()
	w.calls++
	batch := msgs
	if w.calls <= 2 {
		w.batch = append(w.batch, msgs...)
		if w.calls == 2 {
			close(w.met)
		}
		w.mu.Unlock()
		select {
		case <-w.met:
		case <-ctx.Done():
			return ctx.Err()
		}
		w.mu.Lock()
		batch = w.batch
	}
	w.mu.Unlock()
	if !slices.ContainsFunc(batch, func(m kafka.Message) bool { return eventIDOf(m) == "poison" }) {
		return nil
	}
	errs := make(kafka.WriteErrors, len(msgs))
	for i := range errs {
		errs[i] = kafka.InvalidRecord
	}
	return errs
}

func (w *mergingWriter) deadLettered() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.dead)
}

func eventIDOf(m kafka.Message) string {
	for _, h := range m.Headers {
		if h.Key == HeaderEventID {
			return string(h.Value)
		}
	}
	return ""
}

// A topic that does not exist fails only its own rows, also when the
// others go through two writers (topics of different record limits).
// Before, kafka-go failed the whole call of the writer the missing topic
// shared with y, and y's row failed with it.
func TestMissingTopicFailsOnlyItsOwnRows(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "y", "z"))
	require.NoError(t, err)
	defer c.Close()
	// Its topics not read yet, as when x goes after the relay read them:
	// the relay does not know x is gone.
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"X": "x", "Y": "y", "Z": "z"}, PublishTimeout: 2 * time.Second}})
	r.topics.maxBytes["z"] = 2 << 20 // z takes larger records than x and y: a writer of its own
	ev := func(id int64, eventType string) row {
		return row{id: id, eventID: fmt.Sprint(id), eventType: eventType, partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()}
	}
	published, _, _ := r.publish(context.Background(), []row{ev(1, "Y"), ev(2, "Z")}) // the writers know y and z
	require.ElementsMatch(t, []int64{1, 2}, published)
	published, _, _ = r.publish(context.Background(), []row{ev(3, "X"), ev(4, "Y"), ev(5, "Z")})
	require.ElementsMatch(t, []int64{4, 5}, published, "y's and z's rows go out; only x's wait")
}

// A topic created after the writers read the topics' metadata is only
// slow: its row fails transiently, not as a topic that is not there, and
// goes out at the next try. Before, the recheck asked the writers' own
// cached metadata, which still called the topic unknown: its rows were
// held as topic_unavailable and it was set aside, for up to a minute.
func TestTopicCreatedAfterTheWritersLookedIsNotDown(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t", "F": "t2"}, PublishTimeout: 2 * time.Second}})
	ev := func(id int64, eventType string) row {
		return row{id: id, eventID: fmt.Sprint(id), eventType: eventType, partitionKey: "k", payload: []byte(`{}`), createdAt: time.Now()}
	}
	published, _, _ := r.publish(context.Background(), []row{ev(1, "E")})
	require.Equal(t, []int64{1}, published)
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...))
	require.NoError(t, err)
	defer cl.Close()
	_, err = kadm.NewClient(cl).CreateTopic(context.Background(), 1, 1, nil, "t2")
	require.NoError(t, err)

	published, _, _ = r.publish(context.Background(), []row{ev(2, "F")})
	require.Empty(t, published, "the writers' metadata is from before t2")
	require.NotContains(t, r.topics.downTopics(), "t2", "the broker knows t2: not a topic down")
	require.Eventually(t, func() bool { // once the topic's backoff after a failure is over
		published, _, _ = r.publish(context.Background(), []row{ev(2, "F")})
		return slices.Equal(published, []int64{2})
	}, 10*time.Second, 100*time.Millisecond, "a later try sees t2")
}

// A write timed out when no answer came in time, for the call or for each
// of its records; a broker's answer, REQUEST_TIMED_OUT among them (the
// leader answered: its followers were slow), is none, and sets no
// partition aside.
func TestTimedOut(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{context.DeadlineExceeded, true},
		{fmt.Errorf("write: %w", context.DeadlineExceeded), true},
		{&net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, true},
		{kafka.WriteErrors{context.DeadlineExceeded, context.DeadlineExceeded}, true},
		{kafka.WriteErrors{context.DeadlineExceeded, nil}, false},
		{kafka.WriteErrors{context.DeadlineExceeded, kafka.NotLeaderForPartition}, false},
		{kafka.RequestTimedOut, false},
		{kafka.WriteErrors{kafka.RequestTimedOut}, false},
		{errors.New("connection refused"), false},
	} {
		require.Equal(t, c.want, timedOut(c.err), "%v", c.err)
	}
}

// A batch that left a row out for its partition set aside does not commit
// beside the next claim: its transaction locks that row until it commits,
// and a claim beside the commit, once the partition's backoff had ended,
// skipped the row and published its key's later row first. Here the key's
// two rows then go out in id order.
func TestBatchThatLeftARowOutCommitsBeforeTheNextClaim(t *testing.T) {
	dsn, pool := outboxDB(t)
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: c.ListenAddrs(), Topics: map[string]string{"E": "t"},
		BatchSize: 1, MaxInFlight: 2, PublishTimeout: time.Second}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	var sent []string
	r.writer = &answerWriter{answer: func(context.Context) error { return nil }, sent: func(m kafka.Message) { sent = append(sent, eventIDOf(m)) }}
	r.topics.partitions["t"] = 1
	p := topicPartition{topic: "t", partition: 0}
	r.topics.setAside(p, errors.New("no answer"), time.Now(), time.Hour, time.Hour)
	_, err = pool.Exec(context.Background(), `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ('00000000-0000-0000-0000-000000000001', 'O', 'k', 'E', '{}', 'k'), ('00000000-0000-0000-0000-000000000002', 'O', 'k', 'E', '{}', 'k')`)
	require.NoError(t, err)

	ctx := context.Background()
	b, err := r.claimAndPublish(ctx)
	require.NoError(t, err)
	require.True(t, r.aside.has(b.rows[0].id), "left out for its partition")
	pipelines := r.mayPipeline(b, nil)
	r.topics.aside[p].until = time.Now() // its backoff ended
	require.NoError(t, r.finish(r.commitAsync(b)))
	require.False(t, pipelines, "the next claim waits for its commit")
	for range 3 {
		if b, err = r.claimAndPublish(ctx); err == nil && b != nil {
			require.NoError(t, r.finish(r.commitAsync(b)))
		}
	}
	require.Equal(t, []string{"00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"}, sent, "the key's rows in id order")
}

// Brokers that do not answer leave the stats loop's other refreshes their
// own time: the held table is read (a redrive seen, another replica's hold
// learned). Before, the brokers' probe used up the one budget of all
// three, and the held table went unread for as long as they did not
// answer.
func TestHeldTableIsReadBesideBrokersThatDoNotAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, pool := outboxDB(t)
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: c.ListenAddrs(), Topics: map[string]string{"E": "t"}}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'a', 'E', '{}', 'a');
		INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		SELECT id, event_id::text, event_type, 'refused', 'x', now() + interval '1 hour' FROM outbox`)
	require.NoError(t, err)
	r.held.recorded = true // as Check finds the held table

	hung := make(chan struct{})
	c.ControlKey(int16(kmsg.Metadata), func(kmsg.Request) (kmsg.Response, error, bool) {
		<-hung // past statsTimeout
		return nil, nil, false
	})
	defer close(hung)
	done := make(chan struct{})
	go func() { r.refreshStats(ctx); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * statsTimeout):
		t.Fatal("the stats refresh did not end")
	}
	snap := r.heldSnap.Load()
	require.NotNil(t, snap, "the held table was read")
	require.Contains(t, snap.rows, int64(1), "another replica's hold is learned")
}

// Partition-key mode backs the loop off when Kafka settled no row of a
// batch, also when the batch took more than one round and its later rounds
// skipped the rows behind the failed ones. Before, those skipped rows
// counted as sent, so a batch against brokers that fail every write did
// not back off, and the loop claimed lane after lane at full speed.
func TestPartitionKeyModeBacksOffWhenNothingSettled(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: time.Second, Ordering: OrderingPartitionKey}})
	var writes int
	r.writer = writerFunc(func(_ context.Context, msgs ...kafka.Message) error {
		writes++
		errs := make(kafka.WriteErrors, len(msgs))
		for i := range errs {
			errs[i] = kafka.NotEnoughReplicas
		}
		return errs
	})
	r.topics.partitions["t"], r.topics.maxBytes["t"] = 1, 1500
	ev := func(id int64, key string) row {
		return row{id: id, eventID: fmt.Sprint("e", id), eventType: "E", partitionKey: key, payload: bytes.Repeat([]byte("x"), 600), createdAt: time.Now()}
	}
	published, _, err := r.publish(context.Background(), []row{ev(1, "a"), ev(2, "b"), ev(3, "a"), ev(4, "b")})
	require.Empty(t, published)
	require.Equal(t, 1, writes, "the second round's rows wait behind their keys' failed rows")
	require.ErrorIs(t, err, kafka.NotEnoughReplicas, "nothing settled: the loop backs off")
}

// What Kafka answers for a record names neither its topic nor its
// partition ("[19] Not Enough Replicas"): the error the relay returns for
// a failed batch, logs and records for a held row names both, and the
// record's size, while still being the broker's error for errors.Is.
func TestABrokersAnswerNamesTheRecordsTopicAndPartition(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "t"))
	require.NoError(t, err)
	defer c.Close()
	r := kfakeRelay(t, c, Config{Settings: Settings{Topics: map[string]string{"E": "t"}, PublishTimeout: time.Second}})
	r.held.recorded = true
	r.topics.partitions["t"] = 2
	r.writer = writerFunc(func(_ context.Context, msgs ...kafka.Message) error {
		errs := make(kafka.WriteErrors, len(msgs))
		for i, m := range msgs {
			errs[i] = kafka.NotEnoughReplicas
			if eventIDOf(m) == "refused" {
				errs[i] = kafka.InvalidRecord
			}
		}
		return errs
	})
	rows := []row{
		{id: 1, eventID: "failing", eventType: "E", partitionKey: keysOn(0, 1)[0], payload: []byte(`{}`), createdAt: time.Now()},
		{id: 2, eventID: "refused", eventType: "E", partitionKey: keysOn(1, 1)[0], payload: []byte(`{"a":1}`), createdAt: time.Now()},
	}
	_, _, err = r.publish(context.Background(), rows)
	require.ErrorIs(t, err, kafka.NotEnoughReplicas)
	require.ErrorContains(t, err, "topic t partition 0, a record of ")
	held := r.held.take()
	require.Len(t, held, 1)
	require.Equal(t, int64(2), held[0].id)
	require.Contains(t, held[0].err, "topic t partition 1, a record of ")
	require.Contains(t, held[0].err, "Invalid Record")
}
