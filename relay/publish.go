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
func (r *Relay) publish(ctx context.Context, rows []row) ([]int64, error) {
	msgs := make([]kafka.Message, 0, len(rows))
	idx := make([]int, 0, len(rows)) // msgs[i] is rows[idx[i]]
	outcomes := make([]outcome, len(rows))
	errs := make([]error, len(rows))
	for i, x := range rows {
		m := r.message(x)
		if messageSize(m) > maxMessageBytes {
			// kafka-go refuses the whole call for one oversized record; decide it here.
			outcomes[i], errs[i] = permanent, kafka.MessageSizeTooLarge
			continue
		}
		msgs = append(msgs, m)
		idx = append(idx, i)
	}
	r.write(ctx, msgs, func(j int, o outcome, err error) { outcomes[idx[j]], errs[idx[j]] = o, err })

	published := make([]int64, 0, len(rows))
	var transientErr error
	now := time.Now()
	for i, x := range rows {
		if outcomes[i] == permanent {
			// A partition batch fails as a whole; send this row alone to
			// learn whether it is the culprit.
			r.write(ctx, []kafka.Message{r.message(x)}, func(_ int, o outcome, err error) { outcomes[i], errs[i] = o, err })
			if messageSize(r.message(x)) > maxMessageBytes {
				outcomes[i], errs[i] = permanent, kafka.MessageSizeTooLarge
			}
		}
		switch outcomes[i] {
		case acked:
			published = append(published, x.id)
			r.m.published.WithLabelValues(r.cfg.Topics[x.eventType]).Inc()
			r.m.latency.Observe(now.Sub(x.createdAt).Seconds())
		case transient:
			r.m.publishErrors.WithLabelValues("transient").Inc()
			transientErr = errs[i]
		case permanent:
			r.m.publishErrors.WithLabelValues("permanent").Inc()
			if r.deadLetter(ctx, x, errs[i]) {
				published = append(published, x.id)
			} else {
				r.held[x.id] = now
				r.log.Error("row refused by Kafka and held; it is retried later", "id", x.id, "event_id", x.eventID,
					"event_type", x.eventType, "topic", r.cfg.Topics[x.eventType], "err", errs[i])
			}
		}
	}
	r.m.held.WithLabelValues("failed").Set(float64(len(r.held)))
	if transientErr != nil {
		r.setKafkaErr(transientErr)
		return published, fmt.Errorf("publish to Kafka: %w", transientErr)
	}
	r.setKafkaErr(nil)
	return published, nil
}

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
