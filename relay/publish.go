package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"
)

// Header keys the relay sets on every record.
const (
	HeaderEventID       = "event_id"
	HeaderEventType     = "event_type"
	HeaderAggregateType = "aggregate_type"
	HeaderAggregateID   = "aggregate_id"
	// HeaderError and HeaderOriginalTopic are set on dead-lettered records.
	HeaderError         = "outbox_error"
	HeaderOriginalTopic = "outbox_original_topic"
)

type outcome int

const (
	acked outcome = iota
	transient
	permanent
	skipped // not sent in this batch; stays unpublished
)

func (r *Relay) message(x row) kafka.Message {
	return kafka.Message{
		Topic: r.cfg.Topics[x.eventType],
		Key:   []byte(x.partitionKey),
		Value: x.payload,
		Headers: []kafka.Header{
			{Key: HeaderEventID, Value: []byte(x.eventID)},
			{Key: HeaderEventType, Value: []byte(x.eventType)},
			{Key: HeaderAggregateType, Value: []byte(x.aggregateType)},
			{Key: HeaderAggregateID, Value: []byte(x.aggregateID)},
		},
	}
}

// messageSize is kafka-go's accounting of a record's size.
func messageSize(m kafka.Message) int {
	n := 8 + 4 + 4 + len(m.Key) + len(m.Value) + len(m.Topic)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value) + 8
	}
	return n
}

// publish writes the batch in one WriteMessages call and returns the ids of
// the rows to mark published: those Kafka acknowledged, and those that went
// to the dead-letter topic. Rows refused permanently without a dead-letter
// topic are held. The error reports rows that failed transiently.
//
// In partition-key ordering mode a row that cannot be published now (its
// type is unmapped, Kafka refused it, the byte budget ran out) stops the
// later rows of its key in this batch, and its key is kept out of claims
// for a while, so no row is ever published ahead of an older row of its key.
func (r *Relay) publish(ctx context.Context, rows []row) ([]int64, error) {
	ordered := r.cfg.Ordering == OrderingPartitionKey
	now := time.Now()
	// firstStop[key] is the index of the key's first row that cannot go out
	// now; the key's later rows wait (ordered mode).
	firstStop := map[string]int{}
	stopped := func(key string, i int) bool { j, ok := firstStop[key]; return ok && j < i }
	stopAt := func(key string, i int) {
		if _, ok := firstStop[key]; !ok {
			firstStop[key] = i
		}
	}
	block := func(key string, i int, d time.Duration) {
		stopAt(key, i)
		r.blockKey(key, now.Add(d))
	}

	msgs := make([]kafka.Message, 0, len(rows))
	idx := make([]int, 0, len(rows)) // msgs[i] is rows[idx[i]]
	outcomes := make([]outcome, len(rows))
	errs := make([]error, len(rows))
	budget := orderedByteBudget
	for i, x := range rows {
		if ordered && stopped(x.partitionKey, i) {
			outcomes[i] = skipped
			continue
		}
		if _, ok := r.cfg.Topics[x.eventType]; !ok {
			// Only claimed in ordered mode: the key waits for the map.
			outcomes[i] = skipped
			block(x.partitionKey, i, r.cfg.HeldRetryInterval)
			continue
		}
		m := r.message(x)
		size := messageSize(m)
		if size > maxMessageBytes {
			// kafka-go refuses the whole call for one oversized record; decide
			// it here. Its key's later rows wait for its dead-lettering.
			outcomes[i], errs[i] = permanent, kafka.MessageSizeTooLarge
			stopAt(x.partitionKey, i)
			continue
		}
		if ordered {
			// One produce batch per partition keeps a key's rows all-or-nothing.
			if budget -= size; budget < 0 {
				outcomes[i] = skipped
				stopAt(x.partitionKey, i)
				continue
			}
		}
		msgs = append(msgs, m)
		idx = append(idx, i)
	}
	r.write(ctx, msgs, func(j int, o outcome, err error) { outcomes[idx[j]], errs[idx[j]] = o, err })

	published := make([]int64, 0, len(rows))
	var transientErr error
	sent, failed := len(msgs), 0
	for i, x := range rows {
		key := x.partitionKey
		if outcomes[i] == skipped {
			continue
		}
		if outcomes[i] == permanent {
			if ordered && stopped(key, i) {
				continue // an older row of the key is not out yet
			}
			// A partition batch fails as a whole; send this row alone to
			// learn whether it is the culprit.
			if m := r.message(x); messageSize(m) <= maxMessageBytes {
				r.write(ctx, []kafka.Message{m}, func(_ int, o outcome, err error) { outcomes[i], errs[i] = o, err })
			}
		}
		switch outcomes[i] {
		case acked:
			if ordered && stopped(key, i) {
				r.log.Error("a row was acknowledged after an older row of its key failed; its order may be broken",
					"id", x.id, "partition_key", key)
			}
			published = append(published, x.id)
			r.m.published.WithLabelValues(r.cfg.Topics[x.eventType]).Inc()
			r.m.latency.Observe(now.Sub(x.createdAt).Seconds())
			delete(r.keyBackoff, key)
		case transient:
			r.m.publishErrors.WithLabelValues("transient").Inc()
			failed++
			transientErr = errs[i]
			if ordered && !stopped(key, i) {
				d := min(max(2*r.keyBackoff[key], 100*time.Millisecond), r.cfg.MaxBackoff)
				r.keyBackoff[key] = d
				block(key, i, jitter(d))
			}
		case permanent:
			r.m.publishErrors.WithLabelValues("permanent").Inc()
			if r.deadLetter(ctx, x, errs[i]) {
				published = append(published, x.id)
				continue
			}
			r.held[x.id] = now
			if ordered {
				block(key, i, r.cfg.HeldRetryInterval)
			}
			r.log.Error("row refused by Kafka and held; it is retried later", "id", x.id, "event_id", x.eventID,
				"event_type", x.eventType, "topic", r.cfg.Topics[x.eventType], "err", errs[i])
		}
	}
	r.m.held.WithLabelValues("failed").Set(float64(len(r.held)))
	// Move the cursor back before the first row left unpublished (failed
	// transiently, or not sent), so the next claims find it at once.
	done := make(map[int64]bool, len(published))
	for _, id := range published {
		done[id] = true
	}
	for _, x := range rows {
		if _, isHeld := r.held[x.id]; !done[x.id] && !isHeld {
			r.cursor = min(r.cursor, x.id-1)
			break
		}
	}
	if transientErr != nil {
		r.setKafkaErr(transientErr)
		if !ordered || failed == sent {
			// Back off the whole loop: Kafka is failing everything (or, without
			// ordering, the failed rows are simply claimed again first).
			return published, fmt.Errorf("publish to Kafka: %w", transientErr)
		}
		return published, nil // only some keys failed; they are blocked, the rest flows
	}
	r.setKafkaErr(nil)
	return published, nil
}

// orderedByteBudget caps the bytes one ordered batch sends, so that every
// partition's share fits one produce request (kafka-go's BatchBytes) and is
// appended all or nothing.
const orderedByteBudget = maxMessageBytes * 9 / 10

// write sends msgs in one call and reports each message's outcome.
func (r *Relay) write(ctx context.Context, msgs []kafka.Message, report func(int, outcome, error)) {
	if len(msgs) == 0 {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	err := r.writer.WriteMessages(pctx, msgs...)
	var werrs kafka.WriteErrors
	switch {
	case err == nil:
		for j := range msgs {
			report(j, acked, nil)
		}
	case errors.As(err, &werrs) && len(werrs) == len(msgs):
		for j, e := range werrs {
			switch {
			case e == nil:
				report(j, acked, nil)
			case isPermanent(e):
				report(j, permanent, e)
			default:
				report(j, transient, e)
			}
		}
	default:
		// Timeouts and connection errors say nothing about what was
		// delivered: mark nothing, publish again (at-least-once).
		for j := range msgs {
			report(j, transient, err)
		}
	}
}

// isPermanent reports errors that retrying the same record cannot fix.
func isPermanent(err error) bool {
	var tooLarge kafka.MessageTooLargeError
	if errors.As(err, &tooLarge) {
		return true
	}
	var kerr kafka.Error
	if errors.As(err, &kerr) {
		switch kerr {
		case kafka.MessageSizeTooLarge, kafka.RecordListTooLarge, kafka.InvalidTopic,
			kafka.InvalidRecord, kafka.TopicAuthorizationFailed, kafka.UnsupportedForMessageFormat,
			kafka.PolicyViolation:
			return true
		}
	}
	return false
}

// deadLetter publishes a refused row to the dead-letter topic and reports
// whether Kafka acknowledged it there.
func (r *Relay) deadLetter(ctx context.Context, x row, cause error) bool {
	if r.cfg.DeadLetterTopic == "" {
		return false
	}
	m := r.message(x)
	m.Headers = append(m.Headers,
		kafka.Header{Key: HeaderError, Value: []byte(cause.Error())},
		kafka.Header{Key: HeaderOriginalTopic, Value: []byte(m.Topic)})
	m.Topic = r.cfg.DeadLetterTopic
	ok := false
	var dlErr error
	if messageSize(m) > maxMessageBytes {
		// Too big for any topic: keep the record's metadata, drop the payload from the copy.
		m.Value = nil
	}
	r.write(ctx, []kafka.Message{m}, func(_ int, o outcome, err error) { ok, dlErr = o == acked, err })
	if !ok {
		r.log.Error("dead-letter publish failed", "id", x.id, "event_id", x.eventID, "err", dlErr)
		return false
	}
	r.m.deadLettered.Inc()
	r.log.Warn("row refused by Kafka went to the dead-letter topic", "id", x.id, "event_id", x.eventID,
		"event_type", x.eventType, "dead_letter_topic", r.cfg.DeadLetterTopic, "err", cause)
	return true
}
