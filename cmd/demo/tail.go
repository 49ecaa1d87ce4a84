package main

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/relay"
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
	topic   string
	mu      sync.Mutex
	count   int64
	last    []consumed
	readers []*kafka.Reader
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

const keepLast = 6

func startTail(ctx context.Context, broker, topic string, partitions int) (*tail, error) {
	ctx, cancel := context.WithCancel(ctx)
	t := &tail{topic: topic, cancel: cancel}
	for p := 0; p < partitions; p++ {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: []string{broker}, Topic: topic, Partition: p,
			MinBytes: 1, MaxBytes: 4 << 20, MaxWait: 200 * time.Millisecond,
		})
		if err := r.SetOffset(kafka.FirstOffset); err != nil {
			cancel()
			return nil, err
		}
		t.readers = append(t.readers, r)
		t.wg.Add(1)
		go func() {
			defer t.wg.Done()
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					return
				}
				t.add(m)
			}
		}()
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
	c := consumed{at: m.Time, partition: m.Partition, offset: m.Offset, orderID: evt.OrderID, customer: evt.CustomerID, kopecks: evt.TotalRUB}
	for _, h := range m.Headers {
		if h.Key == relay.HeaderEventID {
			c.eventID = string(h.Value)
		}
	}
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

// Close stops the readers.
func (t *tail) Close() {
	t.cancel()
	t.wg.Wait()
	for _, r := range t.readers {
		r.Close()
	}
}
