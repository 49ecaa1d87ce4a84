package main

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// consumed is one event read back from Kafka.
type consumed struct {
	at        time.Time
	partition int
	offset    int64
	eventID   string
	orderID   string
	customer  string
	kopecks   int64
}

// tail reads a topic's partitions from the start, like any consumer of the
// relay's events would, and keeps a count and the last few events.
type tail struct {
	mu     sync.Mutex
	count  int64
	last   []consumed
	reader *testenv.TopicReader
}

const keepLast = 6

func startTail(ctx context.Context, broker *testenv.KafkaBroker, topic string) (*tail, error) {
	t := &tail{}
	var err error
	if t.reader, err = broker.ReadTopic(ctx, topic, t.add); err != nil {
		return nil, err
	}
	return t, nil
}

func (t *tail) add(m kafka.Message) {
	var evt struct {
		OrderID    string `json:"order_id"`
		CustomerID string `json:"customer_id"`
		TotalRUB   int64  `json:"total_rub"`
	}
	_ = json.Unmarshal(m.Value, &evt)
	c := consumed{at: m.Time, partition: m.Partition, offset: m.Offset, eventID: testenv.Header(m, relay.HeaderEventID),
		orderID: evt.OrderID, customer: evt.CustomerID, kopecks: evt.TotalRUB}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.count++
	t.last = append(t.last, c)
	if len(t.last) > keepLast {
		t.last = t.last[len(t.last)-keepLast:]
	}
}

func (t *tail) snapshot() (int64, []consumed) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.count, append([]consumed(nil), t.last...)
}

// Close stops reading.
func (t *tail) Close() { t.reader.Close() }
