package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/relay"
)

// kafkaAlone names the capture-modes case of the Kafka hop with no
// database: what a row's latency cannot go below on this machine.
const kafkaAlone = "Kafka alone, no database"

// relayLikeWriter is a kafka-go Writer with the relay's produce settings:
// every replica's acknowledgement, no wait for a fuller batch, Murmur2 on
// the key as Java clients pick a partition.
func relayLikeWriter(addr string, batch int) *kafka.Writer {
	return &kafka.Writer{
		Addr:         kafka.TCP(addr),
		Balancer:     &kafka.Murmur2Balancer{},
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: time.Microsecond,
		BatchSize:    batch,
		BatchBytes:   1 << 20,
		MaxAttempts:  3,
		// Its own transport, as the relay has: the shared default one caches
		// metadata from before this run's topic existed.
		Transport: &kafka.Transport{},
	}
}

// kafkaAloneAt is the floor under every capture mode's latency at rate:
// o.producers paced producers, each publishing one ~300-byte event per
// call with the relay's produce settings, and a consumer of the topic;
// latency from the call to the consumer's receipt, over the same window
// as latencyRun's. No database is involved, so the commit, the claim and
// the stream all come on top of it.
func kafkaAloneAt(ctx context.Context, o *options, e *benchEnv, rate int) (map[string]float64, error) {
	topic, err := e.newTopic(o, fmt.Sprintf("kafka-alone-%d", rate))
	if err != nil {
		return nil, err
	}
	defer e.deleteTopic(topic)
	var (
		mu   sync.Mutex
		sent = map[string]time.Time{}
	)
	recv, err := e.readArrivals(ctx, topic)
	if err != nil {
		return nil, err
	}
	defer recv.close()
	w := relayLikeWriter(e.kafka.Addr(), 1)
	w.Topic = topic
	defer w.Close()
	prodStart := time.Now()
	start := prodStart.Add(o.warmUp())
	end := start.Add(o.latencyFor)
	payload := []byte(`{"pad":"` + strings.Repeat("x", 280) + `"}`)
	errs := make([]error, o.producers)
	var wg sync.WaitGroup
	for c := range o.producers {
		wg.Go(func() {
			more := pacedBy(rate, o.producers, c, prodStart, func() bool { return time.Now().Before(end) })
			for seq := 0; more() && ctx.Err() == nil; seq++ {
				id := uuid.NewString()
				at := time.Now()
				mu.Lock()
				sent[id] = at
				mu.Unlock()
				err := w.WriteMessages(ctx, kafka.Message{
					Key:     fmt.Appendf(nil, "order-%d", (c*1_000_003+seq)%1000),
					Value:   payload,
					Headers: []kafka.Header{{Key: relay.HeaderEventID, Value: []byte(id)}},
				})
				if err != nil {
					errs[c] = fmt.Errorf("kafka alone: produce: %w", err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	recv.waitFor(len(sent), 30*time.Second)
	recv.close()
	var lat []float64
	consumed := 0
	for id, at := range sent {
		r, ok := recv.at[id]
		if !ok {
			continue
		}
		consumed++
		if at.Before(start) {
			continue
		}
		lat = append(lat, float64(r.Sub(at).Microseconds())/1000)
	}
	sort.Float64s(lat)
	return map[string]float64{
		"inserted": float64(len(sent)),
		"consumed": float64(consumed),
		"p50_ms":   pct(lat, 0.50),
		"p99_ms":   pct(lat, 0.99),
	}, nil
}
