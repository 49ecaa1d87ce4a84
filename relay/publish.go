package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"go.opentelemetry.io/otel/trace"
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

// outcome is what became of one claimed row in a batch.
type outcome int

const (
	skipped     outcome = iota // not sent in this batch; stays unpublished
	acked                      // Kafka acknowledged it
	transient                  // failed in a way a retry may fix
	permanent                  // Kafka will never take this record (a verdict on the record alone)
	refusedWith                // Kafka refused the request that carried it with others; the culprit is unknown
	topicDown                  // its topic is unavailable
	staleTime                  // its topic refuses its timestamp (publish sends it again with the publish time)
)

// recordSize is kafka-go's accounting of a record's size, the one its
// writer splits a partition's batches by (BatchBytes): key, value and
// headers with their length prefixes, and the record's fixed fields.
func recordSize(m kafka.Message) int {
	n := 4 + 1 + 1 + 4 + len(m.Key) + 4 + len(m.Value) + 8 + varintSize(len(m.Headers))
	for _, h := range m.Headers {
		n += varintSize(len(h.Key)) + len(h.Key) + varintSize(len(h.Value)) + len(h.Value)
	}
	return n
}

// aloneRecordSize is m's exact size as the only record of a record batch
// (magic v2): its length, attributes, timestamp and offset deltas (zero for
// the first record), key, value and headers. kafka-go's accounting
// (recordSize) counts fixed widths instead, some 10 bytes more.
func aloneRecordSize(m kafka.Message) int {
	body := 1 + 1 + 1 + bytesFieldSize(m.Key) + bytesFieldSize(m.Value) + varintSize(len(m.Headers))
	for _, h := range m.Headers {
		body += varintSize(len(h.Key)) + len(h.Key) + bytesFieldSize(h.Value)
	}
	return varintSize(body) + body
}

// bytesFieldSize is the size of b as a record's field: its length as a
// varint (-1, one byte, for null), then its bytes.
func bytesFieldSize(b []byte) int {
	if b == nil {
		return 1
	}
	return varintSize(len(b)) + len(b)
}

// varintSize is the length of n as a zig-zag varint, as Kafka encodes lengths.
func varintSize(n int) int {
	u := uint64(n) << 1
	size := 1
	for u >= 0x80 {
		u >>= 7
		size++
	}
	return size
}

// batch is one claimed batch on its way to Kafka: each row's outcome and error.
type batch struct {
	rows  []row
	out   []outcome
	errs  []error
	spans []trace.Span // each admitted row's producer span, when tracing
	// stops, outside partition-key mode (which keeps lanes of its own),
	// are each lane's first row that did not go out (a lane is a key on a
	// topic): the later rows of its lane in the batch are not sent, so
	// that they go out after it, in id order when polling and in commit
	// order with logical replication (retry).
	stops map[lane]int
	// restamped are the rows sent again with the publish time once their
	// topic refused their created_at (restamp).
	restamped map[int]bool
	// limitsRead are the topics whose limit this batch read again before
	// it found a record too large for it (admit).
	limitsRead map[string]error
	// partitionsRead are the topics whose partition count this batch read
	// again before it found a row naming a partition past it, and whether
	// the read succeeded (partitionsReadAgain).
	partitionsRead map[string]bool
}

// publish sends the batch and returns the ids of the rows to mark
// published: those Kafka acknowledged, and those that went to the
// dead-letter topic. A row that cannot go out now is held or left for a
// later batch, and never stops the rows of other keys or topics; the
// ordering mode decides what it does to the later rows of its key. With
// logical replication capture, retry lists, in the batch's order, the rows
// to publish again before any later row of their keys: those that failed
// transiently, and those that waited behind such a row of their lane
// (rows held, or of a topic that is unavailable, are not among them). The
// error reports rows that failed transiently when the loop should back off.
func (r *Relay) publish(ctx context.Context, rows []row) (published, retry []int64, err error) {
	now := time.Now()
	b := &batch{rows: rows, out: make([]outcome, len(rows)), errs: make([]error, len(rows))}
	if r.lanes == nil {
		b.stops = map[lane]int{}
	}
	if r.tracer != nil {
		b.spans = make([]trace.Span, len(rows))
		defer r.endSpans(b)
	}
	var msgs []kafka.Message
	var idx []int // msgs[j] is rows[idx[j]]
	for i := range rows {
		if m, ok := r.admit(ctx, b, i, now); ok {
			msgs = append(msgs, m)
			idx = append(idx, i)
		}
	}
	r.sendRounds(ctx, b, msgs, idx)
	r.isolate(ctx, b)

	published = make([]int64, 0, len(rows))
	var transientErr error
	failed, aside, settled := 0, 0, 0 // settled: acknowledged, dead-lettered or held
	for i, x := range rows {
		if b.out[i] == staleTime {
			r.restamp(ctx, b, i)
		}
		switch b.out[i] {
		case acked:
			if b.restamped[i] || r.cfg.RecordTimestamp == RecordTimestampCreatedAt && r.topics.tooOld(r.cfg.Topics[x.eventType], x.createdAt, now) {
				r.m.restamped.Inc()
			}
			if r.laneStopped(b, x, i) {
				r.log.Error("a row was acknowledged after an older row of its key failed; its order may be broken",
					"id", x.id, "partition_key", x.partitionKey)
			}
			settled++
			published = append(published, x.id)
			r.m.published.WithLabelValues(r.cfg.Topics[x.eventType]).Inc()
			r.m.latency.Observe(now.Sub(x.createdAt).Seconds())
			if r.lanes != nil {
				r.lanes.sent(x)
			}
		case transient:
			r.m.publishErrors.WithLabelValues("transient").Inc()
			failed++
			transientErr = b.errs[i]
			var pa *partitionAsideError
			if r.setsAside() && errors.As(b.errs[i], &pa) {
				aside++ // not sent: no reason to slow the others' rows down
				n, _ := r.topics.partitionCount(pa.topic)
				r.aside.wait(x.id, laneOf(r.cfg.Topics, x), pa.topicPartition, n)
			}
			if r.lanes != nil {
				r.lanes.failed(x, i, now)
			} else {
				r.stopLane(b, x, i, time.Time{})
			}
		case skipped:
			r.stopLane(b, x, i, time.Time{}) // its key's later rows wait for the next batch
		case topicDown:
			r.m.publishErrors.WithLabelValues(HeldTopicUnavailable).Inc()
			r.topicFailed(r.cfg.Topics[x.eventType], x, b.errs[i], now)
			r.stopLane(b, x, i, now.Add(r.cfg.MaxBackoff))
		case permanent:
			if r.laneStopped(b, x, i) {
				// admit found it too large before an older row of its key
				// failed: it waits behind that row for a later batch, and
				// is decided then. Before, it was dead-lettered (or held,
				// blocking its key for HeldRetryInterval) ahead of it.
				b.out[i] = skipped
				r.stopLane(b, x, i, time.Time{})
				continue
			}
			r.m.publishErrors.WithLabelValues("permanent").Inc()
			settled++
			out, dlErr := r.deadLetter(ctx, x, b.errs[i])
			if out == acked {
				published = append(published, x.id)
				r.stopLane(b, x, i, time.Time{}) // its key's later rows go in the next batch
				continue
			}
			reason := HeldRefused
			if errors.Is(b.errs[i], kafka.MessageSizeTooLarge) || errors.As(b.errs[i], new(kafka.MessageTooLargeError)) {
				reason = HeldTooLarge
			}
			until, err := now.Add(r.cfg.HeldRetryInterval), b.errs[i]
			if out == transient {
				// The dead-letter topic did not answer in time, or its
				// partition had no leader: a retry may get the copy out,
				// so the row is held for the longest backoff of a failed
				// row only. A hold, not a retry in place: a stream does
				// not wait for it, polling does not back off for it, and
				// outside partition-key mode its key's later rows do not
				// wait (its record goes to another topic). Before, it was
				// held for HeldRetryInterval (a minute), and in
				// partition-key mode its key's later rows waited as long.
				until = now.Add(r.cfg.MaxBackoff)
				err = fmt.Errorf("%w; its dead-letter copy failed (%v), and it is tried again at %s", err, dlErr, until.Format(time.RFC3339))
			}
			r.held.hold(r.log, x, reason, until, err)
			r.stopLane(b, x, i, until)
		}
	}
	if r.capture != nil && b.stops != nil {
		retry = b.retry(r, time.Now()) // polling claims them again by itself
	}
	if r.setsAside() {
		r.topicsFailing(b, now)
		r.m.setAside.Set(float64(len(r.aside.rows)))
	}
	if transientErr != nil {
		// Whether the brokers answer is the stats loop's probe's to say:
		// records fail for a partition's sake (its leader refusing or
		// hung) while the brokers answer, and /readyz says so only once
		// nothing goes out for the stall timeout (rows_waiting,
		// batch_failing). Before, each such batch said Kafka was
		// unreachable until the next probe, and the pod flapped NotReady
		// while the other partitions' rows went out.
		// Polling with no ordering backs off for records Kafka failed, not
		// for those of a partition set aside, which were not sent: the
		// claims leave them out until their partition's backoff ends
		// (asideRows), and the others flow. Partition-key mode backs off
		// only when nothing went out (settled none): the next claim, of
		// other keys, could fail all alike. Before, it counted rows its
		// later rounds skipped behind a failed row as gone out.
		if r.claimer.backOff(failed-aside, settled) {
			return published, retry, fmt.Errorf("publish to Kafka: %w", transientErr)
		}
		return published, retry, nil // only some keys failed; they wait, the rest flows
	}
	if len(msgs) > 0 {
		r.setKafkaErr(nil)
	}
	return published, retry, nil
}

// partitionsReadAgain reads topic's partition count from the brokers
// again, once per batch (b.partitionsRead), before a row is held for
// naming a partition past the count the relay last read (every few
// seconds): partitions added meanwhile take the row at once. Before, it
// was held as an invalid row for HeldRetryInterval. It reports whether the
// count was read.
func (r *Relay) partitionsReadAgain(ctx context.Context, b *batch, topic string) bool {
	if read, ok := b.partitionsRead[topic]; ok {
		return read
	}
	if b.partitionsRead == nil {
		b.partitionsRead = map[string]bool{}
	}
	r.freshMetadata() // the transport answers a metadata request from its cache, read up to MetadataTTL ago
	read := r.topics.readStarted()
	md, err := r.client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err == nil {
		r.topics.setPartitions(read, md)
	}
	b.partitionsRead[topic] = err == nil
	return err == nil
}

// setsAside reports whether the rows of a partition that fails are set
// aside (asideRows), left out of the claims until its backoff ends: when
// the relay polls with no ordering, in the stream's stead too
// (pollInStead). Partition-key mode moves the key's bucket on instead, and
// a stream retries the rows in place, in commit order (retryIDs).
func (r *Relay) setsAside() bool {
	return r.lanes == nil && (r.capture == nil || r.capture.polling)
}

// isolate finds the rows Kafka refuses among those it refused with others
// (refusedWith): a partition's batch is refused as a whole, so its error
// says nothing about any one row. The refused rows go again in halves, in
// the batch's order; a half refused is halved again, down to rows sent
// alone, whose verdict is their own. A few culprits among n rows take a
// few times log2(n) writes; sending each row alone took n, one after the
// other, which for a large batch outlasted its deadline, so the whole
// batch failed, to be claimed and fail again. A row whose lane stopped
// earlier in the batch (an older row of its key failed, even transiently)
// is not sent: it waits for a later batch, never the dead-letter topic.
func (r *Relay) isolate(ctx context.Context, b *batch) {
	var refused []int
	for i, x := range b.rows {
		switch b.out[i] {
		case refusedWith:
			b.out[i] = skipped
			refused = append(refused, i)
		case transient, topicDown, permanent:
			r.stopLane(b, x, i, time.Time{}) // before any later row of its lane goes again
		}
	}
	r.halve(ctx, b, refused) // sent whole, they were just refused
}

// halve bisects each half of rows idx of b, the first first.
func (r *Relay) halve(ctx context.Context, b *batch, idx []int) {
	r.bisect(ctx, b, idx[:len(idx)/2])
	r.bisect(ctx, b, idx[len(idx)/2:])
}

// bisect sends rows idx of b in one call (isolate), but those whose lane
// stopped, and halves again what Kafka refused with others. Rows of more
// than one record batch of a topic (those of two refused rounds) are
// halved before they are sent: the writer would cut them in batches sent
// one after the other, and a later batch could go out while an earlier
// one, with an older row of its key, was refused.
func (r *Relay) bisect(ctx context.Context, b *batch, idx []int) {
	var send []int
	var msgs []kafka.Message
	used := map[string]int{}
	over := false
	for _, i := range idx {
		if x := b.rows[i]; !r.laneStopped(b, x, i) {
			m := r.message(x, r.cfg.Topics[x.eventType])
			used[m.Topic] += recordSize(m)
			over = over || used[m.Topic] > r.topics.budget(m.Topic)
			send, msgs = append(send, i), append(msgs, m)
		}
	}
	if over && len(send) > 1 {
		r.halve(ctx, b, send)
		return
	}
	r.write(ctx, msgs, func(j int, o outcome, err error) { b.out[send[j]], b.errs[send[j]] = o, err })
	var again []int
	for _, i := range send {
		if b.out[i] == staleTime {
			r.restamp(ctx, b, i) // now, before any later row of its key goes
		}
		switch b.out[i] {
		case refusedWith:
			b.out[i] = skipped
			again = append(again, i)
		case acked:
		default:
			// Its key's later rows wait as publish's verdict will have
			// them wait (stopLane knows which verdicts stop none).
			r.stopLane(b, b.rows[i], i, time.Time{})
		}
	}
	if len(again) > 0 {
		r.halve(ctx, b, again)
	}
}

// retry lists the rows of b that neither went out nor were held, in order,
// but those of a topic that is unavailable now (publish).
func (b *batch) retry(r *Relay, now time.Time) []int64 {
	var ids []int64
	for i, x := range b.rows {
		if b.out[i] != transient && b.out[i] != skipped || r.held.isHeld(x.id) {
			continue
		}
		if topic, ok := r.cfg.Topics[x.eventType]; ok && r.topics.available(topic, now) {
			ids = append(ids, x.id)
		}
	}
	return ids
}

// stopLane stops row i's lane: until until in partition-key mode
// (byKey.stop), otherwise for the rest of the batch (batch.stops), unless
// the row is held or dead-lettered.
func (r *Relay) stopLane(b *batch, x row, i int, until time.Time) {
	switch {
	case r.lanes != nil:
		r.lanes.stop(x, i, until)
	case b.stops != nil:
		if r.held.isHeld(x.id) || b.out[i] == acked || b.out[i] == permanent {
			return // a row held or dead-lettered does not hold back its key's later rows
		}
		l := laneOf(r.cfg.Topics, x)
		if j, ok := b.stops[l]; !ok || i < j {
			b.stops[l] = i
		}
	}
}

// laneStopped reports whether row i waits for an older row of its lane
// (stopLane).
func (r *Relay) laneStopped(b *batch, x row, i int) bool {
	switch {
	case r.lanes != nil:
		return r.lanes.stopped(x, i)
	case b.stops != nil:
		j, ok := b.stops[laneOf(r.cfg.Topics, x)]
		return ok && j < i
	}
	return false
}

// admit decides whether row i can be sent in this batch and builds its record.
func (r *Relay) admit(ctx context.Context, b *batch, i int, now time.Time) (kafka.Message, bool) {
	x := b.rows[i]
	if r.laneStopped(b, x, i) {
		return kafka.Message{}, false // an older row of its key is not out yet
	}
	if x.invalid != "" {
		// Never sent: a NULL payload would be a tombstone, a NULL id or type
		// unroutable, an infinite created_at a wrong time.
		until := now.Add(r.cfg.HeldRetryInterval)
		r.held.hold(r.log, x, HeldInvalidRow, until, errors.New(x.invalid))
		r.stopLane(b, x, i, until)
		return kafka.Message{}, false
	}
	if x.oversize {
		// Its payload was never read: it could go to no topic.
		until := now.Add(r.cfg.HeldRetryInterval)
		what := "any of the relay's topics takes"
		if r.topics.compressed {
			what = "a compressing relay sends alone (its byte budget per claim, or its topic's limit if larger; raise --max-batch-bytes and redrive the row to publish it)"
		}
		err := fmt.Errorf("payload and headers of %d bytes, more than %s (%d bytes); held without reading them", x.size, what, r.largestRecord())
		if x.payload != nil { // streamed: read, and judged by its payload alone
			err = fmt.Errorf("a payload of %d bytes, more than %s (%d bytes)", len(x.payload), what, r.largestRecord())
		}
		r.held.hold(r.log, x, HeldTooLarge, until, err)
		r.stopLane(b, x, i, until)
		return kafka.Message{}, false
	}
	custom, skippedHeaders, err := rowHeaders(x.headers)
	if err == nil && r.cfg.Format != FormatRaw {
		x.ceAttrs, custom, err = ceAttributes(custom)
	}
	if err != nil {
		// Never sent without its headers: a consumer would miss what the
		// writer meant to tell it.
		until := now.Add(r.cfg.HeldRetryInterval)
		r.held.hold(r.log, x, HeldInvalidRow, until, fmt.Errorf("headers column: %w", err))
		r.stopLane(b, x, i, until)
		return kafka.Message{}, false
	}
	topic, ok := r.cfg.Topics[x.eventType]
	if !ok {
		// No claim returns unmapped rows (the claims' type filter); should
		// one, its key waits for the map.
		r.stopLane(b, x, i, now.Add(r.cfg.HeldRetryInterval))
		return kafka.Message{}, false
	}
	if !r.topics.available(topic, now) {
		r.stopLane(b, x, i, now.Add(r.cfg.MaxBackoff))
		return kafka.Message{}, false
	}
	if p, ok := r.aside.behind(laneOf(r.cfg.Topics, x)); ok {
		// An older row of its key waits for its partition's backoff,
		// left out of the claims: this one waits with it.
		b.out[i], b.errs[i] = transient, r.topics.behindError(p)
		return kafka.Message{}, false
	}
	if x.partition != nil {
		n, known := r.topics.partitionCount(topic)
		if !known {
			// The brokers' metadata did not list its topic when the relay
			// last read it (missing, or created since): as for a topic
			// down, its rows wait a backoff until the next read. Left for
			// the next batch, they were claimed again at once, batch after
			// batch, until that read.
			b.out[i], b.errs[i] = topicDown, fmt.Errorf("topic %s: its partitions are not known (the brokers' metadata did not list it when the relay last read it)", topic)
			r.stopLane(b, x, i, time.Time{}) // before its key's later rows are sent
			return kafka.Message{}, false
		}
		confirmed := true
		if *x.partition >= int64(n) {
			if confirmed = r.partitionsReadAgain(ctx, b, topic); confirmed {
				n, _ = r.topics.partitionCount(topic)
			}
		}
		if p := *x.partition; p < 0 || p >= int64(n) {
			// Never sent elsewhere: the writer chose this partition.
			until := now.Add(r.cfg.HeldRetryInterval)
			err := fmt.Errorf("partition column %s: %d is not a partition of topic %s (0 to %d)", r.cfg.PartitionColumn, p, topic, n-1)
			if !confirmed {
				err = fmt.Errorf("%w; the topic's partitions could not be read again to confirm it", err)
			}
			r.held.hold(r.log, x, HeldInvalidRow, until, err)
			r.stopLane(b, x, i, until)
			return kafka.Message{}, false
		}
	}
	if skippedHeaders > 0 {
		r.m.headersSkipped.Add(float64(skippedHeaders))
	}
	x.custom = custom
	if r.tracer != nil {
		b.spans[i] = r.startSpan(&x, topic)
	}
	b.rows[i] = x // later records of this row (sent alone, dead-lettered) carry the same headers
	m := r.message(x, topic)
	err = r.topics.tooLarge(topic, m)
	if err != nil && r.topics.limitKnown(topic) && !errors.Is(err, errAloneMax) {
		// About to be judged too large by a limit read up to a few seconds
		// ago: the limit is read again first, once per topic and batch, so
		// that one raised meanwhile takes the row rather than the
		// dead-letter topic. A limit that cannot be read again holds it.
		if b.limitsRead == nil {
			b.limitsRead = map[string]error{}
		}
		rerr, read := b.limitsRead[topic]
		if !read {
			rerr = r.topics.refreshLimits(ctx, r.client, []string{topic}, r.cfg.HeldRetryInterval)
			b.limitsRead[topic] = rerr
		}
		if rerr == nil {
			err = r.topics.tooLarge(topic, m)
		} else {
			err = fmt.Errorf("%w; the topic's max.message.bytes could not be read again to confirm it (%v), so the row is held, not dead-lettered", err, rerr)
		}
	}
	if err != nil {
		var held error
		switch {
		case errors.Is(err, errAloneMax):
			// Over what the relay sends, not what Kafka takes.
			held = err
		case !r.topics.limitKnown(topic):
			// Over a guessed limit only: the topic may take it.
			held = fmt.Errorf("%w; the topic's max.message.bytes could not be read (the relay's principal needs DESCRIBE_CONFIGS on it), so the default was assumed and the row is held, not dead-lettered", err)
		case b.limitsRead[topic] != nil:
			held = err
		}
		if held != nil {
			// Held and tried again, never dead-lettered.
			until := now.Add(r.cfg.HeldRetryInterval)
			r.held.hold(r.log, x, HeldTooLarge, until, held)
			r.stopLane(b, x, i, until)
			return kafka.Message{}, false
		}
		// Decided here: sent, it would fail the whole partition batch.
		b.out[i], b.errs[i] = permanent, err
		r.stopLane(b, x, i, time.Time{})
		return kafka.Message{}, false
	}
	return m, true
}

// sendRounds writes the admitted records. A call carries at most one
// record batch's worth per topic (its budget), so each partition's share is
// one batch that succeeds or fails as a whole: were a share split into
// several batches, which the writer sends one after the other, a later one
// could be taken while an earlier one of the same key is refused. The
// records beyond go in the next round, after the rows of every key and
// topic that did not go out in an earlier round are left for a later batch.
// (Per topic, not per partition: a writer whose partition count is newer
// than the relay's can put two of the relay's partitions in one batch.)
func (r *Relay) sendRounds(ctx context.Context, b *batch, msgs []kafka.Message, idx []int) {
	type lane struct{ key, topic string }
	failed := map[lane]bool{}
	for len(msgs) > 0 {
		var round, next []kafka.Message
		var ri, ni []int
		used := map[string]int{}
		full := map[string]bool{}
		for j, m := range msgs {
			i := idx[j]
			if failed[lane{b.rows[i].partitionKey, m.Topic}] {
				b.out[i] = skipped
				continue
			}
			size := recordSize(m)
			if full[m.Topic] || (used[m.Topic] > 0 && used[m.Topic]+size > r.topics.budget(m.Topic)) {
				full[m.Topic] = true // the topic's later records too, so no key's order turns
				next, ni = append(next, m), append(ni, i)
				continue
			}
			used[m.Topic] += size
			round, ri = append(round, m), append(ri, i)
		}
		r.send(ctx, b, round, ri)
		for j, i := range ri {
			if b.out[i] != acked {
				failed[lane{b.rows[i].partitionKey, round[j].Topic}] = true
			}
		}
		msgs, idx = next, ni
	}
}

// overBudget reports whether m is over its topic's budget: admitted
// because it fits alone, it goes through a writer of its own, and so in a
// round of its own for its topic, after the records before it.
func (r *Relay) overBudget(m kafka.Message) bool { return recordSize(m) > r.topics.budget(m.Topic) }

// send writes the admitted records (write makes a call of each topic's
// partition, so one unknown or forbidden topic fails only its own).
func (r *Relay) send(ctx context.Context, b *batch, msgs []kafka.Message, idx []int) {
	defer r.recheckUnknown(ctx, b, idx)
	r.write(ctx, msgs, func(j int, o outcome, err error) { b.out[idx[j]], b.errs[idx[j]] = o, err })
}

// restamp sends row i of b again stamped with the publish time: its topic
// refused its created_at as the record's timestamp (INVALID_TIMESTAMP:
// older than message.timestamp.before.max.ms, or further ahead of the
// broker's clock than message.timestamp.after.max.ms allows), which it
// would do at every retry while the row only grows older. The event is
// valid, so it is neither held nor dead-lettered.
func (r *Relay) restamp(ctx context.Context, b *batch, i int) {
	x := b.rows[i]
	m := r.message(x, r.cfg.Topics[x.eventType])
	created := m.Time
	m.Time = time.Time{} // the writer stamps it when it sends it
	r.write(ctx, []kafka.Message{m}, func(_ int, o outcome, err error) { b.out[i], b.errs[i] = o, err })
	if b.out[i] == acked {
		if b.restamped == nil {
			b.restamped = map[int]bool{}
		}
		b.restamped[i] = true
		r.log.Warn("the topic refused the row's created_at as the record's timestamp; it went out stamped with the publish time",
			"id", x.id, "event_id", x.eventID, "topic", m.Topic, "created_at", created)
	}
}

// recheckUnknown asks the broker about each topic a write called unknown:
// the writers know topics from the transport's cached metadata, which can
// lag behind a topic that was just created, and such a topic is only
// slow, not unavailable (a transient failure, retried at once). kafka-go
// answers a metadata request from that cache too, so the recheck first
// drops the transport's connection pools, and with them the cache
// (freshMetadata): the answer is the broker's, and the writers' next calls
// see it.
func (r *Relay) recheckUnknown(ctx context.Context, b *batch, idx []int) {
	exists := map[string]bool{}
	for _, i := range idx {
		if b.out[i] != topicDown || !errors.Is(b.errs[i], kafka.UnknownTopicOrPartition) {
			continue
		}
		topic := r.cfg.Topics[b.rows[i].eventType]
		known, checked := exists[topic]
		if !checked {
			if len(exists) == 0 {
				r.freshMetadata()
			}
			md, err := r.client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
			known = err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) > 0
			exists[topic] = known
		}
		if known {
			b.out[i] = transient
		}
	}
}

// metadataResetEvery is the least time between two drops of the
// transport's connection pools (freshMetadata): while leaders move, every
// batch can see a partition unknown, and each drop reconnects to every
// broker (a TLS and SASL handshake each).
const metadataResetEvery = 5 * time.Second

// freshMetadata drops the transport's connection pools, and so its cached
// metadata, unless it did less than metadataResetEvery ago. Calls in
// flight keep their pools until they end.
func (r *Relay) freshMetadata() {
	if r.transport == nil {
		return
	}
	now := time.Now()
	if last := r.metadataReset.Load(); last != nil && now.Sub(*last) < metadataResetEvery {
		return
	}
	r.metadataReset.Store(&now)
	r.transport.CloseIdleConnections()
}

// topicsFailing leaves out of the claims, for a backoff, each topic whose
// rows in b all failed transiently (its partitions short of in-sync
// replicas, or without a leader), and clears each topic that took a row.
// Rows of a partition set aside that the claims leave out by themselves
// (asideRows) do not count: their topic's other partitions' rows flow.
// Polling with no ordering claims the rows that failed again first, so a
// topic whose rows keep failing would otherwise fill every claim and stop
// the other topics' rows behind its own. Partition-key ordering waits per
// key instead (its lanes), and logical replication retries rows in commit
// order.
func (r *Relay) topicsFailing(b *batch, now time.Time) {
	failed := map[string]error{}
	took := map[string]bool{}
	for i, x := range b.rows {
		topic := r.cfg.Topics[x.eventType]
		switch b.out[i] {
		case acked:
			took[topic] = true
		case transient:
			if !r.aside.has(x.id) { // else left out of the claims itself
				failed[topic] = b.errs[i]
			}
		}
	}
	for topic := range took {
		if r.topics.clearFailing(topic) {
			r.log.Info("the topic takes records again", "topic", topic)
		}
	}
	for topic, err := range failed {
		if !took[topic] && r.topics.markFailing(topic, err, now, r.cfg.MaxBackoff) {
			r.log.Warn("every record for the topic failed; its rows wait and it is tried again, while the other topics' rows flow",
				"topic", topic, "err", err)
		}
	}
}

// topicFailed holds a topic's rows for a backoff, logging once per outage.
func (r *Relay) topicFailed(topic string, x row, err error, now time.Time) {
	if r.topics.markDown(topic, err, now, r.cfg.HeldRetryInterval) {
		r.log.Error("topic unavailable; its rows are held and the topic is retried", "topic", topic,
			"id", x.id, "event_id", x.eventID, "reason", HeldTopicUnavailable, "err", err)
	}
}

// write sends msgs and reports each message's outcome. Each partition's
// share goes in a call of its own, and the calls run at once: a call whose
// context ends reports only that (kafka-go returns the context's error,
// not what each partition's broker answered), so one hung partition would
// fail every record beside it, and they would go out again at each retry
// (TestHungPartitionLeavesTheOthersAcknowledged). A call holds one topic,
// so one unknown or forbidden topic fails only its own records.
// A partition's share goes through the writer for its topic's batch
// size, which splits it to fit. A partition whose call ran out the
// publish timeout is set aside for a backoff (settle): its records fail
// at once, as transient, instead of making every batch that holds one
// wait the timeout out again.
func (r *Relay) write(ctx context.Context, msgs []kafka.Message, report func(int, outcome, error)) {
	if len(msgs) == 0 {
		return
	}
	now := time.Now()
	pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	groups := map[writeCall][]int{} // indexes into msgs
	var calls []writeCall
	partitions := map[string][]int{}
	at := make([]int, len(msgs)) // each message's partition, -1 when not known
	named := report
	report = func(j int, o outcome, err error) {
		if err != nil {
			err = &recordError{topicPartition: topicPartition{topic: msgs[j].Topic, partition: at[j]}, bytes: recordSize(msgs[j]), err: err}
		}
		named(j, o, err)
	}
	for j, m := range msgs {
		c := writeCall{topicPartition: topicPartition{topic: m.Topic, partition: r.partitionOf(m, partitions)}}
		at[j] = c.partition
		if c.partition >= 0 {
			if err := r.topics.asideError(c.topicPartition, now); err != nil {
				named(j, transient, err) // it names its partition
				continue
			}
		}
		if r.writer == nil { // not injected
			c.kind = writerKind{batchBytes: r.topics.budget(m.Topic), compressed: r.topics.compressed}
			if r.overBudget(m) {
				// Admitted because it fits alone (topicState.tooLarge): a
				// writer whose batches hold one such record at most. It goes
				// in a round of its own for its topic (sendRounds), so no
				// key's order turns.
				// Uncompressed: its size is then the one it was admitted by.
				c.kind = writerKind{batchBytes: r.topics.limit(m.Topic)}
				if r.topics.compressed {
					// Compressed, by a writer that takes it whatever its size
					// uncompressed: the broker judges it after compression.
					c.kind = writerKind{batchBytes: r.topics.alone(m.Topic), compressed: true}
				}
			}
		}
		if _, ok := groups[c]; !ok {
			calls = append(calls, c)
		}
		groups[c] = append(groups[c], j)
	}
	writer := func(c writeCall) MessageWriter {
		if r.writer != nil {
			return r.writer
		}
		return r.writerFor(c.kind)
	}
	if len(calls) == 1 && len(groups[calls[0]]) == len(msgs) {
		r.settle(ctx, calls[0], r.writeWith(pctx, writer(calls[0]), msgs, report), now)
		return
	}
	// A writer batches the records of calls that meet in one partition,
	// and the calls of two partitions can meet in one when the writer's
	// partition count is newer than the relay's (partitions were just
	// added): a record alone in its call is then not known to be alone in
	// its record batch, and a verdict on its batch is none on it. It goes
	// again in a write of its own (isolate), never to the dead-letter
	// topic on a refusal that may have been another record's.
	type writerTopic struct {
		kind  writerKind
		topic string
	}
	callsOf := map[writerTopic]int{}
	for _, c := range calls {
		callsOf[writerTopic{c.kind, c.topic}]++
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, c := range calls {
		idx := groups[c]
		part := make([]kafka.Message, len(idx))
		for n, j := range idx {
			part[n] = msgs[j]
		}
		shared := callsOf[writerTopic{c.kind, c.topic}] > 1
		wg.Go(func() {
			err := r.writeWith(pctx, writer(c), part, func(n int, o outcome, err error) {
				if shared && (o == permanent || o == staleTime) {
					o = refusedWith
				}
				mu.Lock()
				defer mu.Unlock()
				report(idx[n], o, err)
			})
			r.settle(ctx, c, err, now)
		})
	}
	wg.Wait()
}

// recordError is what Kafka answered for one record, with where it went:
// kafka-go's per-record errors name neither the topic nor the partition,
// and a log line or a held row's error read "[6] Not Leader For
// Partition" with nothing to look up.
type recordError struct {
	topicPartition // partition -1: the writer's balancer chose it
	bytes          int
	err            error
}

func (e *recordError) Error() string {
	if e.partition < 0 {
		return fmt.Sprintf("topic %s, a record of %d bytes: %v", e.topic, e.bytes, e.err)
	}
	return fmt.Sprintf("topic %s partition %d, a record of %d bytes: %v", e.topic, e.partition, e.bytes, e.err)
}

func (e *recordError) Unwrap() error { return e.err }

// writeCall is one call of write: a topic partition's share, through one
// writer.
type writeCall struct {
	topicPartition
	kind writerKind
}

// settle records what call c, begun at start, says of its partition's
// leader (its partition known): a call that ran out the publish timeout
// sets the partition aside, doubling the backoff each time up to
// HeldRetryInterval, and drops the cached metadata (the leader may have
// moved); a call that got a record acknowledged clears it. The second
// call in a row whose every record the partition refused for itself
// (partitionRefused: short of in-sync replicas, offline, a storage error),
// after the writer's own retries, sets it aside for MaxBackoff, again at
// each such call (setRefused): such a partition answers at once, so it
// never ran out the timeout, and its rows, the oldest, filled every claim
// of its topic for as long as it refused them. The first such call does
// not, so that a leader's move, which the next call after fresh metadata
// gets past, costs no backoff. Another failure of every
// record before the timeout leaves the partition as it was: a leader that
// flaps between hanging and answering with an error keeps doubling its
// backoff, where clearing it made every hang start again from the publish
// timeout. A call cut short by ctx's own end (the batch's deadline) says
// nothing of the leader.
func (r *Relay) settle(ctx context.Context, c writeCall, err error, start time.Time) {
	if c.partition < 0 || ctx.Err() != nil {
		return
	}
	var werrs kafka.WriteErrors
	if err == nil || errors.As(err, &werrs) && werrs.Count() < len(werrs) {
		if r.topics.clearAside(c.topicPartition) {
			r.log.Info("the partition answers again", "topic", c.topic, "partition", c.partition)
		}
		return
	}
	if partitionRefused(err) {
		if r.topics.refusedAgain(c.topicPartition) && r.topics.setRefused(c.topicPartition, err, time.Now(), r.cfg.MaxBackoff) {
			r.log.Warn("the partition refused every record twice in a row; its records wait and it is tried again, while the other partitions' records flow",
				"topic", c.topic, "partition", c.partition, "err", err)
		}
		r.freshMetadata()
		return
	}
	r.topics.notRefused(c.topicPartition)
	if !timedOut(err) {
		return
	}
	if r.topics.setAside(c.topicPartition, err, time.Now(), r.cfg.PublishTimeout, r.cfg.HeldRetryInterval) {
		r.log.Warn("the partition's leader did not answer within the publish timeout; its records wait and it is tried again, while the other partitions' records flow",
			"topic", c.topic, "partition", c.partition, "waited", time.Since(start).Round(time.Millisecond), "err", err)
	}
	r.freshMetadata()
}

// partitionRefused reports whether the broker refused every record of a
// write for their partition's sake, not theirs: its leader moved or is
// offline, it is short of in-sync replicas, its log's storage failed, or
// its replicas did not acknowledge within the broker's request timeout.
func partitionRefused(err error) bool {
	var werrs kafka.WriteErrors
	if !errors.As(err, &werrs) || len(werrs) == 0 || werrs.Count() < len(werrs) {
		return false
	}
	return !slices.ContainsFunc(werrs, func(e error) bool {
		return !leaderMoved(e) && !errors.Is(e, kafka.NotEnoughReplicas) && !errors.Is(e, kafka.NotEnoughReplicasAfterAppend) &&
			!errors.Is(e, kafka.RequestTimedOut)
	})
}

// timedOut reports whether a write ended because its time ran out, with
// no answer from the broker: the context's deadline (kafka-go returns it
// alone, for the whole call) or a network timeout, for the call or for
// each of its records. A broker's answer (a kafka.Error, REQUEST_TIMED_OUT
// among them) is one.
func timedOut(err error) bool {
	var werrs kafka.WriteErrors
	if errors.As(err, &werrs) {
		return len(werrs) > 0 && werrs.Count() == len(werrs) && !slices.ContainsFunc(werrs, func(e error) bool { return !timedOut(e) })
	}
	if errors.As(err, new(kafka.Error)) {
		return false
	}
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// partitionOf is the partition the writers' balancer sends m to, by its
// topic's partition count as last read (lists keeps each topic's list of
// partitions for the call); -1 while that count is not known.
func (r *Relay) partitionOf(m kafka.Message, lists map[string][]int) int {
	ps, ok := lists[m.Topic]
	if !ok {
		if n, known := r.topics.partitionCount(m.Topic); known {
			ps = make([]int, n)
			for p := range ps {
				ps[p] = p
			}
		}
		lists[m.Topic] = ps
	}
	if len(ps) == 0 {
		return -1
	}
	return r.balancer.Balance(m, ps...)
}

// writeWith sends msgs in one call of w, reports each message's outcome,
// and returns the call's error.
func (r *Relay) writeWith(ctx context.Context, w MessageWriter, msgs []kafka.Message, report func(int, outcome, error)) error {
	err := w.WriteMessages(ctx, msgs...)
	var werrs kafka.WriteErrors
	switch {
	case err == nil:
		for j, m := range msgs {
			if r.topics.markUp(m.Topic) {
				r.log.Info("topic available again", "topic", m.Topic)
			}
			report(j, acked, nil)
		}
	case errors.As(err, &werrs) && len(werrs) == len(msgs):
		for j, e := range werrs {
			switch {
			case e == nil:
				report(j, acked, nil)
			case isTopicUnavailable(e):
				report(j, topicDown, e)
			case errors.Is(e, kafka.InvalidTimestamp) && len(msgs) > 1:
				report(j, refusedWith, e)
			case errors.Is(e, kafka.InvalidTimestamp) && !msgs[j].Time.IsZero():
				report(j, staleTime, e)
			case isPermanent(e) && len(msgs) > 1:
				report(j, refusedWith, e)
			case isPermanent(e):
				report(j, permanent, e)
			case errors.Is(e, protocol.ErrNoPartition) || leaderMoved(e):
				// The writer's cached metadata lacks the partition its row
				// chose (explicitBalancer), or names a leader that moved:
				// kafka-go does not refresh it on such an answer, only at a
				// random time within MetadataTTL (30 s), and until then
				// every try went to the old leader (a rolling restart or a
				// preferred-leader election stalled the partition for as
				// long). Fresh metadata finds it.
				r.freshMetadata()
				report(j, transient, e)
			default:
				report(j, transient, e)
			}
		}
	case isTopicUnavailable(err):
		for j := range msgs {
			report(j, topicDown, err)
		}
	default:
		// Timeouts and connection errors say nothing about what was
		// delivered: mark nothing, publish again (at-least-once).
		for j := range msgs {
			report(j, transient, err)
		}
	}
	return err
}

// leaderMoved reports whether a broker answered that it no longer leads
// the partition, or that its leader is not known yet.
func leaderMoved(err error) bool {
	return errors.Is(err, kafka.NotLeaderForPartition) || errors.Is(err, kafka.LeaderNotAvailable) ||
		errors.Is(err, kafka.FencedLeaderEpoch) || errors.Is(err, kafka.UnknownLeaderEpoch) ||
		errors.Is(err, kafka.KafkaStorageError)
}

// deadLetter publishes a refused row, payload and all, to the dead-letter
// topic. It reports acked when Kafka acknowledged it there, transient when
// the write failed in a way a retry may fix (the row is tried again like
// any row that failed so), skipped when there is no dead-letter topic, and
// permanent when the dead-letter topic refused it, is unavailable, or is
// too small for it (the row is held).
func (r *Relay) deadLetter(ctx context.Context, x row, cause error) (outcome, error) {
	if r.cfg.DeadLetterTopic == "" {
		return skipped, nil
	}
	m := r.message(x, r.cfg.Topics[x.eventType])
	m.Headers = append(m.Headers,
		kafka.Header{Key: HeaderError, Value: []byte(cause.Error())},
		kafka.Header{Key: HeaderOriginalTopic, Value: []byte(m.Topic)})
	m.Topic = r.cfg.DeadLetterTopic
	m.WriterData = nil // the row's partition is one of its own topic's; the key's hash chooses here
	if err := r.topics.tooLarge(m.Topic, m); err != nil {
		r.log.Error("row fits neither its topic nor the dead-letter topic; it is held", "id", x.id, "event_id", x.eventID, "err", err)
		return permanent, err
	}
	// The dead-letter topic's window of timestamps is its own: a row its
	// topic takes by age can be too old for it. Such a record goes out
	// stamped with the publish time, as restamp does on the row's topic;
	// else it would be refused at every retry while the row grows older.
	if r.cfg.RecordTimestamp == RecordTimestampCreatedAt && r.topics.tooOld(m.Topic, x.createdAt, time.Now()) {
		m.Time = time.Time{}
	}
	var out outcome
	var dlErr error
	r.write(ctx, []kafka.Message{m}, func(_ int, o outcome, err error) { out, dlErr = o, err })
	if out == staleTime && !m.Time.IsZero() { // the window is not read yet, or changed
		m.Time = time.Time{}
		r.write(ctx, []kafka.Message{m}, func(_ int, o outcome, err error) { out, dlErr = o, err })
	}
	if out != acked {
		r.log.Error("dead-letter publish failed", "id", x.id, "event_id", x.eventID, "err", dlErr)
		if out != transient {
			out = permanent // refused, or the topic is unavailable: the row is held
		}
		return out, dlErr
	}
	r.m.deadLettered.Inc()
	r.log.Warn("row refused by Kafka went to the dead-letter topic", "id", x.id, "event_id", x.eventID,
		"event_type", x.eventType, "dead_letter_topic", r.cfg.DeadLetterTopic, "err", cause)
	return acked, nil
}
