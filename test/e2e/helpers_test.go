package e2e

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/examples/orderservice/orders"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// writer is the example order service confirming orders at a steady rate
// (its ConfirmOrder handler: order update and outbox row in one
// transaction). It remembers the event id of every committed confirmation.
type writer struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	ids    []string
	errs   []error
}

func startWriter(t *testing.T, db *pgxpool.Pool, rate float64) *writer {
	t.Helper()
	w, err := outbox.NewWriter(outbox.DefaultTable)
	require.NoError(t, err)
	h := &orders.ConfirmOrderHandler{DB: db, Outbox: w}
	ctx, cancel := context.WithCancel(context.Background())
	wr := &writer{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(wr.done)
		_ = orders.ConfirmOrders(ctx, h, rate, 0, func(_ orders.Order, evt orders.OrderConfirmedEvent, err error) error {
			wr.mu.Lock()
			defer wr.mu.Unlock()
			if err != nil {
				wr.errs = append(wr.errs, err)
			} else {
				wr.ids = append(wr.ids, evt.EventID)
			}
			return nil
		})
	}()
	t.Cleanup(func() { wr.cancel(); <-wr.done })
	return wr
}

// count is how many confirmations committed so far.
func (w *writer) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.ids)
}

// stop ends the writer and returns the event ids it committed.
func (w *writer) stop(t *testing.T) []string {
	t.Helper()
	w.cancel()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	require.Empty(t, w.errs, "the order service failed")
	require.NotEmpty(t, w.ids, "the order service wrote nothing")
	return append([]string(nil), w.ids...)
}

// collector reads topics from the beginning for the whole test, like an
// independent consumer, counting deliveries per event id.
type collector struct {
	broker  *testenv.KafkaBroker
	readers []*testenv.TopicReader
	mu      sync.Mutex
	counts  map[string]map[string]int // topic -> event id -> deliveries
	next    map[string]map[int]int64  // topic -> partition -> next offset read
}

func newCollector(broker *testenv.KafkaBroker) *collector {
	return &collector{broker: broker, counts: map[string]map[string]int{}, next: map[string]map[int]int64{}}
}

// watch starts reading topic.
func (c *collector) watch(t *testing.T, topic string) {
	t.Helper()
	c.mu.Lock()
	c.counts[topic], c.next[topic] = map[string]int{}, map[int]int64{}
	c.mu.Unlock()
	r, err := c.broker.ReadTopic(context.Background(), topic, func(m kafka.Message) {
		id := testenv.Header(m, relay.HeaderEventID)
		c.mu.Lock()
		defer c.mu.Unlock()
		c.counts[topic][id]++
		c.next[topic][m.Partition] = m.Offset + 1
	})
	require.NoError(t, err)
	c.readers = append(c.readers, r)
}

func (c *collector) close() {
	for _, r := range c.readers {
		r.Close()
	}
}

// waitCaughtUp waits until every message the broker holds on topic has been
// read. Called once the outbox rows are marked published, it sees every
// delivery there will be, duplicates included.
func (c *collector) waitCaughtUp(t *testing.T, topic string) {
	t.Helper()
	cl := &kafka.Client{Addr: kafka.TCP(c.broker.Addr()), Timeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	require.NoError(t, err)
	var reqs []kafka.OffsetRequest
	for _, p := range md.Topics[0].Partitions {
		reqs = append(reqs, kafka.LastOffsetOf(p.ID))
	}
	res, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, po := range res.Topics[topic] {
			if c.next[topic][po.Partition] < po.LastOffset {
				return false
			}
		}
		return true
	}, 30*time.Second, 20*time.Millisecond, "the consumer did not catch up with %s", topic)
}

// deliveries returns, for ids, the total duplicates and the ids missing on topic.
func (c *collector) deliveries(topic string, ids []string) (missing []string, dups int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range ids {
		switch n := c.counts[topic][id]; {
		case n == 0:
			missing = append(missing, id)
		case n > 1:
			dups += n - 1
		}
	}
	return missing, dups
}

// total is every delivery read from topic.
func (c *collector) total(topic string) (deliveries, distinct int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.counts[topic] {
		deliveries += n
	}
	return deliveries, len(c.counts[topic])
}

// waitPublished waits until the relay has marked every row of ids published.
func waitPublished(t *testing.T, db *pgxpool.Pool, ids []string, timeout time.Duration) {
	t.Helper()
	var left int
	require.Eventually(t, func() bool {
		err := db.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL`, ids).Scan(&left)
		return err == nil && left == 0
	}, timeout, 100*time.Millisecond, "rows still unpublished")
}

// requireDelivered waits until ids are published and read back, then asserts
// none is missing on topic and at most maxDups extra deliveries arrived.
func requireDelivered(t *testing.T, c *collector, db *pgxpool.Pool, topic string, ids []string, maxDups int) {
	t.Helper()
	waitPublished(t, db, ids, 60*time.Second)
	c.waitCaughtUp(t, topic)
	missing, dups := c.deliveries(topic, ids)
	t.Logf("%s: %d events written, %d missing, %d duplicate deliveries", topic, len(ids), len(missing), dups)
	require.Empty(t, missing, "events lost")
	require.LessOrEqual(t, dups, maxDups, "duplicate deliveries")
}

// kstatusOf computes the OutboxRelay's status the way GitOps tools do.
func kstatusOf(t *testing.T, name string) status.Status {
	t.Helper()
	s, err := computeKstatus(name)
	require.NoError(t, err)
	return s
}

func computeKstatus(name string) (status.Status, error) {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(outboxv1alpha1.GroupVersion.WithKind("OutboxRelay"))
	if err := stack.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, u); err != nil {
		return "", err
	}
	res, err := status.Compute(u)
	if err != nil {
		return "", err
	}
	return res.Status, nil
}

// manifests renders config/samples with the stack's addresses, one replica
// and edit applied, into a fresh folder, and returns the folder.
func manifests(t *testing.T, edit func(name string, b []byte) []byte) string {
	t.Helper()
	// Under the run's folder: later scenarios read the previous manifests.
	dir, err := os.MkdirTemp(topDir, "samples-")
	require.NoError(t, err)
	require.NoError(t, stack.RenderSamples(dir, func(name string, b []byte) []byte {
		if name == "outbox_v1alpha1_outboxrelay.yaml" {
			// One replica: scenario 1 is about the steady state of one relay.
			b = []byte(strings.Replace(string(b), "replicas: 2", "replicas: 1", 1))
		}
		if edit != nil {
			b = edit(name, b)
		}
		return b
	}))
	return dir
}

func kubectl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := stack.Kubectl(context.Background(), args...)
	require.NoError(t, err)
	return string(out)
}

func dumpFile(t *testing.T, path string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	t.Logf("---- tail of %s ----\n%s", path, b)
}
