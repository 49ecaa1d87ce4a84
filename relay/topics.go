package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
)

// defaultMaxRecordBytes is Kafka's default max.message.bytes, used for a
// topic until the broker has told its own.
const defaultMaxRecordBytes = 1048588

// topicState is what the relay knows of each topic it writes: whether it is
// available now, and the largest record it takes. The loop reads it; the
// stats loop refreshes it from the broker.
type topicState struct {
	mu   sync.Mutex
	down outages
	// failing are the topics whose rows all failed transiently in a
	// polling batch with no ordering (Relay.topicsFailing): left out of
	// the claims for a backoff, they are not unavailable.
	failing  outages
	maxBytes map[string]int
	// oldest is how far before the broker's clock a topic takes a record's
	// timestamp (timestampWindow); none when it takes any.
	oldest     map[string]time.Duration
	partitions map[string]int // partition counts, from the latest metadata
	// reads numbers the reads of the brokers' view of the topics
	// (readStarted); limitsRead and partitionsRead are, per topic, the
	// number of the read whose answer stands. Reads overlap (the stats loop
	// every few seconds, a batch's read again before it judges a row), and
	// an answer that arrives after a later read's is older than it: applied
	// over it, a limit raised meanwhile went back to the old one, and a row
	// the topic takes could be dead-lettered as too large.
	reads                      uint64
	limitsRead, partitionsRead map[string]uint64
	compressed                 bool // the writer compresses record batches
	// aloneMax is, when compressed, the most a record may hold uncompressed
	// (kafka-go's accounting, recordSize) and still be sent, alone, for the
	// broker to judge: the relay's byte budget per claim
	// (Config.MaxBatchBytes), which bounds what it holds in memory.
	aloneMax int
	// aside are the partitions whose leader did not answer a write within
	// the publish timeout (Relay.write): their records are not sent until
	// the backoff ends, so that each batch does not wait the timeout out.
	aside map[topicPartition]*topicOutage
	// refused counts, for each partition, the calls in a row whose every
	// record it refused for itself (Relay.settle); a call that gets a
	// record acknowledged ends the count.
	refused map[topicPartition]int
}

// topicPartition names one partition of a topic.
type topicPartition struct {
	topic     string
	partition int
}

// partitionAsideError is the error of a record that was not sent because
// its partition is set aside (topicState.setAside): a transient failure,
// as the timeout that set the partition aside was.
type partitionAsideError struct {
	topicPartition
	until time.Time
	cause error
	// refused: set aside for refusing every record of writes in a row
	// (setRefused), not for running out the publish timeout.
	refused bool
}

func (e *partitionAsideError) Error() string {
	why := "did not answer within the publish timeout"
	if e.refused {
		why = "refused every record of writes in a row"
	}
	return fmt.Sprintf("partition %d of topic %s %s; its records wait until %s, then it is tried again: %v",
		e.partition, e.topic, why, e.until.Format(time.RFC3339), e.cause)
}

func (e *partitionAsideError) Unwrap() error { return e.cause }

// outages are topics the relay leaves out for now, with why and until when.
type outages map[string]*topicOutage

// mark sets topic's backoff (doubled, up to limit) and error; it reports
// whether topic was not marked before.
func (o outages) mark(topic string, err error, now time.Time, limit time.Duration) bool {
	d, was := o[topic]
	if !was {
		d = &topicOutage{}
		o[topic] = d
	}
	d.backoff = min(max(2*d.backoff, 100*time.Millisecond), limit)
	d.until = now.Add(jitter(d.backoff))
	d.err = err
	return !was
}

// clear removes topic; it reports whether it was marked.
func (o outages) clear(topic string) bool {
	_, ok := o[topic]
	delete(o, topic)
	return ok
}

// topicOutage is a topic the relay may not write to for now (unknown, deleted,
// not authorized, refused by policy). Its rows are held, the other topics'
// rows flow, and the topic is tried again after a growing backoff.
type topicOutage struct {
	until   time.Time
	backoff time.Duration
	err     error
	// refused: set aside for refusing records (setRefused), not for
	// running out the publish timeout (setAside).
	refused bool
}

// newTopicState returns the state of a relay's topics; aloneMax is
// topicState.aloneMax, read only when compressed.
func newTopicState(compressed bool, aloneMax int) *topicState {
	return &topicState{down: outages{}, failing: outages{}, maxBytes: map[string]int{}, oldest: map[string]time.Duration{},
		partitions: map[string]int{}, limitsRead: map[string]uint64{}, partitionsRead: map[string]uint64{}, compressed: compressed, aloneMax: aloneMax, aside: map[topicPartition]*topicOutage{},
		refused: map[topicPartition]int{}}
}

// setAside sets p aside after a write to it timed out, for first the
// first time and twice as long each time it times out again, up to limit.
// It reports whether p was not aside before.
func (s *topicState) setAside(p topicPartition, err error, now time.Time, first, limit time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, was := s.aside[p]
	fresh := !was || d.refused // refusing, it had not run out the timeout
	if fresh {
		d = &topicOutage{backoff: first / 2}
		s.aside[p] = d
	}
	d.backoff = min(2*d.backoff, max(limit, first))
	d.until = now.Add(jitter(d.backoff))
	d.err = err
	return fresh
}

// setRefused sets p aside for backoff (±20 %) because it refused every
// record of writes in a row (Relay.settle), unless it is aside for not
// answering, whose longer backoff stands. Trying a partition that answers
// at once costs little, so its backoff does not grow. It reports whether p
// was not aside before.
func (s *topicState) setRefused(p topicPartition, err error, now time.Time, backoff time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, was := s.aside[p]
	if was && !d.refused {
		return false
	}
	if !was {
		d = &topicOutage{refused: true}
		s.aside[p] = d
	}
	d.backoff, d.until, d.err = backoff, now.Add(jitter(backoff)), err
	return !was
}

// asideError is the error to report for a record of p while p is aside
// at now; nil when it is not.
func (s *topicState) asideError(p topicPartition, now time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if d, ok := s.aside[p]; ok && now.Before(d.until) {
		return &partitionAsideError{topicPartition: p, until: d.until, cause: d.err, refused: d.refused}
	}
	return nil
}

// clearAside clears p once a write to it got a record acknowledged, and
// ends its count of refused calls. It reports whether p was aside.
func (s *topicState) clearAside(p topicPartition) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.aside[p]
	delete(s.aside, p)
	delete(s.refused, p)
	return ok
}

// anyAside reports whether a partition is set aside, or was within grace
// before now: it failed, and no write to it got a record acknowledged
// since. One whose rows all went elsewhere (held, or its topic made again
// with fewer partitions) is not written to again, and counts no longer.
func (s *topicState) anyAside(now time.Time, grace time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.aside {
		if now.Before(d.until.Add(grace)) {
			return true
		}
	}
	return false
}

// notRefused ends p's count of refused calls: a call failed otherwise.
func (s *topicState) notRefused(p topicPartition) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.refused, p)
}

// refusedAgain counts a call whose every record p refused for itself and
// reports whether the call before it was one too.
func (s *topicState) refusedAgain(p topicPartition) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refused[p]++
	return s.refused[p] >= 2
}

// asideRows are the rows that polling with no ordering did not send
// because their partition was set aside: the claims leave them out until
// its backoff ends (release), so a claim of only its rows, the oldest,
// does not keep the rows of the topic's other partitions behind them for
// as long as the leader hangs. They are then claimed again from the start
// of the index, in id order. A later row of a key with a row left out is
// not sent either (behind): it is left out with it, for the same
// partition, so the key's order holds when the partition answers again
// between a claim and its write, or when the topic's partitions change
// and the key now goes elsewhere (then the rows come back at once). At
// most heldCacheRows are kept: a row past that is claimed on its turn and
// set aside again, and a batch of only such rows leaves its topic out of
// the claims for a backoff (Relay.topicsFailing), which costs the topic's
// other rows time, never a row. Loop state.
type asideRows struct {
	rows  map[int64]asideRow
	lanes map[lane]topicPartition // the lanes with a row left out, and the partition they wait for
}

type asideRow struct {
	p     topicPartition
	l     lane
	count int // the topic's partition count when the row was left out
}

func newAsideRows() asideRows {
	return asideRows{rows: map[int64]asideRow{}, lanes: map[lane]topicPartition{}}
}

// wait leaves row id of lane l out of the claims while partition p is
// aside, p counting as one of count. It reports whether the row is kept
// (below heldCacheRows).
func (a asideRows) wait(id int64, l lane, p topicPartition, count int) bool {
	if _, ok := a.rows[id]; !ok && len(a.rows) >= heldCacheRows {
		return false
	}
	if q, ok := a.lanes[l]; ok {
		p = q // its key's older rows wait for q
	}
	a.rows[id] = asideRow{p: p, l: l, count: count}
	a.lanes[l] = p
	return true
}

// behind reports the partition an older row of lane l waits for, if one does.
func (a asideRows) behind(l lane) (topicPartition, bool) {
	p, ok := a.lanes[l]
	return p, ok
}

// has reports whether row id is left out.
func (a asideRows) has(id int64) bool { _, ok := a.rows[id]; return ok }

// release drops the rows of each partition that is no longer aside at now,
// or whose topic's partition count changed since one of its rows was left
// out (its keys may go elsewhere now). It reports whether it dropped any:
// they lie behind the cursor.
func (a asideRows) release(s *topicState, now time.Time) bool {
	back := map[topicPartition]bool{}
	for _, x := range a.rows {
		if back[x.p] {
			continue // one row says it for its partition's rows
		}
		n, _ := s.partitionCount(x.p.topic)
		back[x.p] = n != x.count || s.asideError(x.p, now) == nil
	}
	released := false
	for id, x := range a.rows {
		if back[x.p] {
			delete(a.rows, id)
			delete(a.lanes, x.l)
			released = true
		}
	}
	return released
}

// behindError is the error of a row not sent because an older row of its
// key waits for partition p, set aside (asideRows).
func (s *topicState) behindError(p topicPartition) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := &partitionAsideError{topicPartition: p, cause: errors.New("an older row of the record's key waits for this partition")}
	if d, ok := s.aside[p]; ok {
		e.until, e.cause, e.refused = d.until, fmt.Errorf("%w: %w", e.cause, d.err), d.refused
	}
	return e
}

// available reports whether rows of topic may be sent now.
func (s *topicState) available(topic string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range []outages{s.down, s.failing} {
		if d, ok := m[topic]; ok && now.Before(d.until) {
			return false
		}
	}
	return true
}

// markDown holds topic's rows for a backoff that doubles, up to limit, each
// time the topic fails again. It reports whether the topic was up before.
func (s *topicState) markDown(topic string, err error, now time.Time, limit time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.down.mark(topic, err, now, limit)
}

// markFailing leaves topic's rows out of the claims for a backoff that
// doubles, up to limit, each time they all fail again. It reports whether
// the topic was not failing before.
func (s *topicState) markFailing(topic string, err error, now time.Time, limit time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failing.mark(topic, err, now, limit)
}

// anyFailing reports whether a topic marked failing (markFailing) is
// still left out of the claims at now.
func (s *topicState) anyFailing(now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.failing {
		if now.Before(d.until) {
			return true
		}
	}
	return false
}

// clearFailing clears topic after it took a row. It reports whether it was failing.
func (s *topicState) clearFailing(topic string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failing.clear(topic)
}

// clearAllFailing clears every topic marked failing (markFailing).
func (s *topicState) clearAllFailing() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.failing)
}

// markUp clears topic after a successful write. It reports whether it was down.
func (s *topicState) markUp(topic string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.down.clear(topic)
}

// downTopics returns the topics held now, with why.
func (s *topicState) downTopics() map[string]error {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]error, len(s.down))
	for t, d := range s.down {
		out[t] = d.err
	}
	return out
}

// limit is the largest record topic takes, as the broker last said.
func (s *topicState) limit(topic string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n, ok := s.maxBytes[topic]; ok {
		return n
	}
	return defaultMaxRecordBytes
}

// limitKnown reports whether the broker has told topic's limit: without
// DESCRIBE_CONFIGS on the topic it does not, and limit is a guess.
func (s *topicState) limitKnown(topic string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.maxBytes[topic]
	return ok
}

// tooLarge says why m is too large for topic, or nil when it is not. A
// batch holding m alone, uncompressed and sized exactly (aloneRecordSize),
// must be within the topic's max.message.bytes: budget keeps a margin for
// batches of many records, which a record alone does not need, so a record
// over budget that fits alone goes out in a batch of its own (Relay.write),
// without compression, so that its size is the one judged here. A limit
// the broker did not say is a guess: against it, kafka-go's count of m must
// be within budget.
//
// A compressing relay does not judge a record by its size: the broker
// measures a record batch after compression, so Kafka 4.1 takes, gzipped, a
// record several times its topic's limit uncompressed, and no size the
// relay could reckon before sending is the broker's. A record over budget
// goes out alone, compressed, and only the broker's refusal of it alone
// says it is too large. Such a record is too large here only over alone,
// the most the relay sends alone, which is no verdict of Kafka's:
// the row is held (outcome of errAloneMax), never dead-lettered.
func (s *topicState) tooLarge(topic string, m kafka.Message) error {
	if s.compressed {
		if size, most := recordSize(m), s.alone(topic); size > most {
			return fmt.Errorf("record of %d bytes uncompressed is more than a compressing relay sends alone (its byte budget per claim, or the topic's limit if larger: %d): %w",
				size, most, errAloneMax)
		}
		return nil
	}
	if !s.limitKnown(topic) {
		if size, budget := recordSize(m), s.budget(topic); size > budget {
			return fmt.Errorf("record of %d bytes is larger than topic %s takes (%d in a record batch under its max.message.bytes): %w",
				size, topic, budget, kafka.MessageSizeTooLarge)
		}
		return nil
	}
	if size, limit := recordBatchOverhead+aloneRecordSize(m), s.limit(topic); size > limit {
		return fmt.Errorf("a record batch holding only this record is %d bytes uncompressed, more than topic %s takes (its max.message.bytes is %d): %w",
			size, topic, limit, kafka.MessageSizeTooLarge)
	}
	return nil
}

// alone is the most a compressing relay sends alone to topic, in
// kafka-go's accounting (recordSize): aloneMax, or what the topic's limit
// takes uncompressed if that is more.
func (s *topicState) alone(topic string) int {
	return max(s.aloneMax, s.limit(topic)-recordBatchOverhead)
}

// errAloneMax is why a compressing relay holds a record larger than it
// sends alone (topicState.tooLarge): a limit of the relay's, not Kafka's.
var errAloneMax = errors.New("raise --max-batch-bytes and redrive the row to publish it")

// largest is the most a record for topic may hold and still be admitted
// (tooLarge): alone for a compressing relay; else within the batch
// header of the limit the broker said, or the budget of a guessed one.
func (s *topicState) largest(topic string) int {
	if s.compressed {
		return s.alone(topic)
	}
	if s.limitKnown(topic) {
		return s.limit(topic) - recordBatchOverhead
	}
	return s.budget(topic)
}

// recordBatchOverhead is a record batch's header (magic v2): the broker
// measures the whole batch, header included, against the topic's
// max.message.bytes.
const recordBatchOverhead = 61

// budget is the most a partition's share of one request may hold in
// kafka-go's accounting (recordSize) for the broker to take it: the
// topic's limit less the batch header and a margin for what kafka-go's
// accounting leaves out (a few bytes of varints per record, the timestamp
// deltas). Compression usually shrinks a batch, but incompressible data
// grows by the codec's framing, so a compressed writer keeps 1 % more back.
// The writer of a topic splits each partition's share at this size (its
// BatchBytes), and a record larger than it is too large for the topic
// unless it fits alone (tooLarge).
func (s *topicState) budget(topic string) int {
	limit := s.limit(topic)
	b := limit - recordBatchOverhead - 64
	if s.compressed {
		b -= limit / 100
	}
	return max(b, 1)
}

// timestampConfigs are the topic settings that bound the timestamps a
// topic takes (timestampWindow).
var timestampConfigs = []string{"message.timestamp.type", "message.timestamp.before.max.ms", "message.timestamp.difference.max.ms"}

// timestampWindow is how far before the broker's clock a topic with
// configs (its values of timestampConfigs) takes a record's timestamp; ok
// is false when it takes any. Kafka 3.6 and later bound it with
// message.timestamp.before.max.ms, earlier ones with
// message.timestamp.difference.max.ms (both directions), and a topic
// stamped with LogAppendTime replaces the timestamp instead of refusing it.
func timestampWindow(configs map[string]string) (d time.Duration, ok bool) {
	if configs["message.timestamp.type"] == "LogAppendTime" {
		return 0, false
	}
	for _, name := range timestampConfigs[1:] {
		ms, err := strconv.ParseInt(configs[name], 10, 64)
		if err == nil && ms >= 0 && ms < int64(math.MaxInt64/time.Millisecond) && (!ok || time.Duration(ms)*time.Millisecond < d) {
			d, ok = time.Duration(ms)*time.Millisecond, true
		}
	}
	return d, ok
}

// tooOld reports whether topic would refuse a record stamped at: older than
// its timestamp window less a margin for the clocks' skew and the time the
// record takes to reach the broker (a tenth of the window, at most a minute).
func (s *topicState) tooOld(topic string, at, now time.Time) bool {
	s.mu.Lock()
	d, ok := s.oldest[topic]
	s.mu.Unlock()
	return ok && !at.IsZero() && at.Before(now.Add(-d+min(d/10, time.Minute)))
}

// refreshLimits reads max.message.bytes of every topic from the broker (a
// topic's value is its own setting or the broker's message.max.bytes), and
// the window of timestamps it takes (timestampWindow). Unknown topics are
// marked down, and topics that exist again are tried at once.
func (s *topicState) refreshLimits(ctx context.Context, c *kafka.Client, topics []string, limit time.Duration) error {
	read := s.readStarted()
	req := &kafka.DescribeConfigsRequest{}
	for _, t := range topics {
		req.Resources = append(req.Resources, kafka.DescribeConfigRequestResource{
			ResourceType: kafka.ResourceTypeTopic, ResourceName: t, ConfigNames: append([]string{"max.message.bytes"}, timestampConfigs...),
		})
	}
	resp, err := c.DescribeConfigs(ctx, req)
	if err != nil {
		return fmt.Errorf("describe topic configs: %w", err)
	}
	s.setLimits(read, resp, time.Now(), limit)
	return nil
}

// readStarted numbers a read of the topics' limits or partitions, taken
// before its request is sent; the answer is given to setLimits or
// setPartitions with it.
func (s *topicState) readStarted() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reads++
	return s.reads
}

// answers reports whether the answer of read about topic is the newest
// (seen holds the read whose answer stands), and if so records it.
func answers(seen map[string]uint64, topic string, read uint64) bool {
	if seen[topic] > read {
		return false
	}
	seen[topic] = read
	return true
}

// setLimits applies the answer of read (refreshLimits) to each topic whose
// limits no later read has set.
func (s *topicState) setLimits(read uint64, resp *kafka.DescribeConfigsResponse, now time.Time, limit time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, res := range resp.Resources {
		if !answers(s.limitsRead, res.ResourceName, read) {
			continue
		}
		if res.Error != nil {
			if errors.Is(res.Error, kafka.UnknownTopicOrPartition) {
				s.down.mark(res.ResourceName, res.Error, now, limit)
			}
			// A limit read before is no longer known: the topic may have
			// been made again, or its limit raised, meanwhile. Against
			// a guess a row is held, not dead-lettered (admit). Before,
			// the last limit read stood for good, and a row the topic
			// now takes could be dead-lettered.
			delete(s.maxBytes, res.ResourceName)
			continue
		}
		configs := map[string]string{}
		for _, e := range res.ConfigEntries {
			configs[e.ConfigName] = e.ConfigValue
		}
		if d, ok := timestampWindow(configs); ok {
			s.oldest[res.ResourceName] = d
		} else {
			delete(s.oldest, res.ResourceName)
		}
		if n, err := strconv.Atoi(configs["max.message.bytes"]); err == nil && n > 0 {
			s.maxBytes[res.ResourceName] = n
			if d, ok := s.down[res.ResourceName]; ok && errors.Is(d.err, kafka.UnknownTopicOrPartition) {
				d.until = now // it exists again
			}
		}
	}
}

// isTopicUnavailable reports errors that concern a whole topic and that an
// operator fixes (create the topic, grant the ACL, relax the policy, raise
// the topic's message.format.version, which below 0.11 takes no record
// with headers, and every record the relay sends has some): the topic's
// rows are held and retried, never dead-lettered.
func isTopicUnavailable(err error) bool {
	var kerr kafka.Error
	if errors.As(err, &kerr) {
		switch kerr {
		case kafka.UnknownTopicOrPartition, kafka.TopicAuthorizationFailed, kafka.ClusterAuthorizationFailed,
			kafka.PolicyViolation, kafka.InvalidTopic, kafka.SASLAuthenticationFailed, kafka.UnsupportedForMessageFormat:
			return true
		}
	}
	return false
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
		case kafka.MessageSizeTooLarge, kafka.RecordListTooLarge, kafka.InvalidRecord:
			return true
		}
	}
	return false
}

// setPartitions records each topic's partition count from md, the answer
// of read (readStarted), unless a later read has set it.
func (s *topicState) setPartitions(read uint64, md *kafka.MetadataResponse) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range md.Topics {
		if t.Error == nil && len(t.Partitions) > 0 && answers(s.partitionsRead, t.Name, read) {
			s.partitions[t.Name] = len(t.Partitions)
		}
	}
}

// partitionCount is topic's partition count as the broker last said; false
// when it has not said yet.
func (s *topicState) partitionCount(topic string) (int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, ok := s.partitions[topic]
	return n, ok
}

// explicitPartition is a record's partition chosen by the row's partition
// column; the writer's balancer reads it from kafka.Message.WriterData.
type explicitPartition int

// explicitBalancer sends a record whose row chose its partition there
// (admit checked that the topic has it), and any other by hash's choice.
// It sends it there even when the writer's partitions, from its own cached
// metadata, lack it (partitions were just added, and the cache is older
// than the relay's count): the write then fails for that record alone, as
// transient, and it goes again once the writer knows the partition.
// Choosing by hash instead would put it on another partition than its row
// chose, and acknowledge it there.
type explicitBalancer struct{ hash kafka.Balancer }

// Balance implements kafka.Balancer.
func (b explicitBalancer) Balance(msg kafka.Message, partitions ...int) int {
	if p, ok := msg.WriterData.(explicitPartition); ok {
		return int(p)
	}
	return b.hash.Balance(msg, partitions...)
}
