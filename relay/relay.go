// Package relay moves committed outbox rows from PostgreSQL to Kafka: it
// claims unpublished rows in id order with FOR UPDATE SKIP LOCKED, publishes
// the batch with acks=all, and marks what Kafka acknowledged, all in one
// transaction, so any number of replicas share a table without duplicates in
// steady state and nothing is lost when a process, the broker or the
// database fails (docs/relay.md).
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/segmentio/kafka-go"
)

// MessageWriter is the part of *kafka.Writer the relay uses; tests inject faults through it.
type MessageWriter interface {
	WriteMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Relay is one relay process's loop over one outbox table.
type Relay struct {
	cfg     Config
	table   outbox.Table
	pool    *pgxpool.Pool
	writer  MessageWriter
	kwriter *kafka.Writer // nil when a MessageWriter was injected
	client  *kafka.Client
	m       *metrics
	log     *slog.Logger
	types   []string // mapped event types

	claimSQL string
	markSQL  string

	// Loop state, owned by Run's goroutine.
	cursor    int64 // highest id this replica claimed
	floorMark int64 // cursor at the previous floor scan
	nextFloor time.Time
	nextFull  time.Time
	lastShort bool
	held      map[int64]time.Time // rows refused permanently with no dead-letter topic

	// OrderingPartitionKey state.
	own         owner
	fairShare   int
	blockedKeys map[string]time.Time // keys whose next row cannot be published yet
	keyBackoff  map[string]time.Duration

	mu         sync.Mutex
	unroutable map[string]bool // event types already logged as unmapped
	dbErr      atomic.Pointer[error]
	kafkaErr   atomic.Pointer[error]
}

// maxMessageBytes is the writer's batch byte cap; a single record above it
// is refused before it is sent (Kafka's default max.message.bytes).
const maxMessageBytes = 1 << 20

// New validates cfg and prepares a relay. It connects lazily: Check and Run
// open the connections.
func New(cfg Config) (*Relay, error) {
	return newRelay(cfg, nil)
}

// NewWithWriter is New with an injected Kafka writer (for fault-injection tests).
func NewWithWriter(cfg Config, w MessageWriter) (*Relay, error) {
	return newRelay(cfg, w)
}

func newRelay(cfg Config, w MessageWriter) (*Relay, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	table, _ := outbox.ParseTable(cfg.Table)
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("dsn: %w", err)
	}
	rp := pcfg.ConnConfig.RuntimeParams
	rp["application_name"] = "outbox-relay"
	// A claim transaction never idles longer than one publish; if the relay
	// hangs, PostgreSQL ends the transaction and releases the rows.
	rp["idle_in_transaction_session_timeout"] = strconv.FormatInt((cfg.PublishTimeout + 20*time.Second).Milliseconds(), 10)
	rp["statement_timeout"] = "30000"
	// A generic plan made while the table was tiny can stay a sequential
	// scan as it grows (PITFALLS 11b): always plan with the real parameters.
	rp["plan_cache_mode"] = "force_custom_plan"
	// With statistics older than the backlog (a busy table between two
	// ANALYZEs) the planner takes "id > cursor" for a handful of rows and
	// picks a bitmap scan of the whole backlog plus a sort, for every claim:
	// measured here, 56 ms per claim at a 67k-row backlog, so the relay fell
	// ever further behind. An index scan in id order stops after the batch.
	rp["enable_bitmapscan"] = "off"
	// Let the server notice a vanished relay within about 30 s, not the
	// OS default of hours: its row and bucket locks are released then.
	rp["tcp_keepalives_idle"] = "15"
	rp["tcp_keepalives_interval"] = "5"
	rp["tcp_keepalives_count"] = "3"
	pcfg.MaxConns = 3
	pcfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return nil, fmt.Errorf("dsn: %w", err)
	}
	transport := &kafka.Transport{TLS: cfg.TLS, SASL: cfg.SASL, DialTimeout: 5 * time.Second, MetadataTTL: 30 * time.Second, ClientID: "outbox-relay"}
	r := &Relay{
		cfg:         cfg,
		table:       table,
		pool:        pool,
		writer:      w,
		client:      &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 10 * time.Second, Transport: transport},
		m:           newMetrics(cfg.Registerer),
		log:         cfg.Logger.With("table", table.String()),
		held:        map[int64]time.Time{},
		blockedKeys: map[string]time.Time{},
		keyBackoff:  map[string]time.Duration{},
		unroutable:  map[string]bool{},
	}
	if w == nil {
		r.kwriter = &kafka.Writer{
			Addr:         kafka.TCP(cfg.Brokers...),
			Balancer:     &kafka.Murmur2Balancer{}, // what Java clients pick for a key
			RequiredAcks: kafka.RequireAll,
			// The writer batches per partition and a partial batch waits
			// BatchTimeout; the relay hands over whole batches, so send at once.
			BatchTimeout:    time.Microsecond,
			BatchSize:       cfg.BatchSize,
			BatchBytes:      maxMessageBytes,
			MaxAttempts:     3,
			WriteBackoffMin: 50 * time.Millisecond,
			WriteBackoffMax: 500 * time.Millisecond,
			ReadTimeout:     cfg.PublishTimeout,
			WriteTimeout:    cfg.PublishTimeout,
			Transport:       transport,
		}
		r.writer = r.kwriter
	}
	for t := range cfg.Topics {
		r.types = append(r.types, t)
	}
	slices.Sort(r.types)
	q := table.Quoted()
	r.claimSQL = `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, partition_key, payload, created_at
FROM ` + q + `
WHERE published_at IS NULL AND id > $1 AND event_type = ANY($2) AND id <> ALL($3)
ORDER BY id
LIMIT $4
FOR UPDATE SKIP LOCKED`
	if cfg.Ordering == OrderingPartitionKey {
		// Every mapped or unmapped row of the replica's buckets is claimed in
		// id order: an unpublishable row must stop the later rows of its key.
		r.claimSQL = `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, partition_key, payload, created_at
FROM ` + q + `
WHERE published_at IS NULL AND id > $1 AND id <> ALL($2) AND partition_key <> ALL($3)
  AND ` + bucketSQL + ` = ANY($4)
ORDER BY id
LIMIT $5
FOR UPDATE SKIP LOCKED`
	}
	r.markSQL = `UPDATE ` + q + ` SET published_at = now() WHERE id = ANY($1)`
	errNotChecked := errors.New("not connected yet")
	r.dbErr.Store(&errNotChecked)
	r.kafkaErr.Store(&errNotChecked)
	return r, nil
}

// Close releases the database connections and the Kafka writer. Call it
// after Run has returned.
func (r *Relay) Close() error {
	r.dropOwner()
	r.pool.Close()
	if r.kwriter != nil {
		return r.kwriter.Close()
	}
	return nil
}

// Check verifies the table's columns and partial index and that every
// mapped topic (and the dead-letter topic) exists in Kafka.
func (r *Relay) Check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := r.pool.Ping(ctx); err != nil {
		r.setDBErr(err)
		return &UnreachableError{fmt.Errorf("connect to PostgreSQL: %w", err)}
	}
	r.setDBErr(nil)
	if err := CheckSchema(ctx, r.pool, r.table); err != nil {
		return err
	}
	md, err := r.client.Metadata(ctx, &kafka.MetadataRequest{Topics: r.allTopics()})
	if err != nil {
		r.setKafkaErr(err)
		return &UnreachableError{fmt.Errorf("read Kafka metadata from %v: %w", r.cfg.Brokers, err)}
	}
	r.setKafkaErr(nil)
	exists := map[string]bool{}
	for _, t := range md.Topics {
		if t.Error == nil {
			exists[t.Name] = true
		}
	}
	var missing []error
	for _, et := range r.types {
		if t := r.cfg.Topics[et]; !exists[t] {
			missing = append(missing, fmt.Errorf("topic %q (for event type %q) does not exist in Kafka", t, et))
		}
	}
	if r.cfg.DeadLetterTopic != "" && !exists[r.cfg.DeadLetterTopic] {
		missing = append(missing, fmt.Errorf("dead-letter topic %q does not exist in Kafka", r.cfg.DeadLetterTopic))
	}
	return errors.Join(missing...)
}

// UnreachableError is a Check failure because PostgreSQL or Kafka could not
// be reached (worth retrying), as opposed to a missing table, index or topic.
type UnreachableError struct{ Err error }

func (e *UnreachableError) Error() string { return e.Err.Error() }
func (e *UnreachableError) Unwrap() error { return e.Err }

func (r *Relay) allTopics() []string {
	var ts []string
	for _, t := range r.cfg.Topics {
		if !slices.Contains(ts, t) {
			ts = append(ts, t)
		}
	}
	if r.cfg.DeadLetterTopic != "" {
		ts = append(ts, r.cfg.DeadLetterTopic)
	}
	return ts
}

func (r *Relay) setDBErr(err error)    { r.dbErr.Store(&err) }
func (r *Relay) setKafkaErr(err error) { r.kafkaErr.Store(&err) }

// Ready returns nil while the relay can reach PostgreSQL and Kafka.
func (r *Relay) Ready() error {
	if err := *r.dbErr.Load(); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	if err := *r.kafkaErr.Load(); err != nil {
		return fmt.Errorf("kafka: %w", err)
	}
	return nil
}

// Run claims, publishes and marks batches until ctx is cancelled. A batch in
// flight when ctx ends is finished (publish, mark, commit) or rolled back,
// never abandoned with rows locked. Transient errors are retried with capped,
// jittered exponential backoff; Run returns nil on cancellation.
func (r *Relay) Run(ctx context.Context) error {
	statsDone := make(chan struct{})
	go func() { defer close(statsDone); r.statsLoop(ctx) }()
	defer func() { <-statsDone }()
	defer r.dropOwner() // hand this replica's buckets to the others at once

	var backoff time.Duration
	for ctx.Err() == nil {
		n, err := r.processBatch(ctx)
		if err != nil {
			backoff = min(max(2*backoff, 100*time.Millisecond), r.cfg.MaxBackoff)
			r.log.Warn("batch failed; retrying", "err", err, "backoff", backoff)
			sleep(ctx, jitter(backoff))
			continue
		}
		backoff = 0
		r.lastShort = n < r.cfg.BatchSize
		if r.lastShort {
			sleep(ctx, jitter(r.cfg.PollInterval))
		}
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// jitter spreads d by ±20% so replicas do not poll in lockstep.
func jitter(d time.Duration) time.Duration {
	return d + time.Duration((rand.Float64()*0.4-0.2)*float64(d))
}

// row is one claimed outbox row.
type row struct {
	id            int64
	eventID       string
	eventType     string
	aggregateType string
	aggregateID   string
	partitionKey  string
	payload       []byte
	createdAt     time.Time
}

// scanFrom picks where this claim starts in the index. Claims normally
// continue after the cursor, so they do not walk the dead index entries of
// rows already published (PITFALLS 11a). A row whose id was taken before the
// cursor but that committed later would be behind it: a floor scan (after
// each short batch, and at least every second) starts at the cursor of the
// previous floor scan, and a full rescan from the start runs every
// FullRescanInterval for transactions that stayed open longer than that.
func (r *Relay) scanFrom(now time.Time) int64 {
	switch {
	case now.After(r.nextFull):
		r.nextFull = now.Add(r.cfg.FullRescanInterval)
		r.nextFloor = now.Add(time.Second)
		r.floorMark = r.cursor
		return 0
	case r.lastShort || now.After(r.nextFloor):
		from := min(r.floorMark, r.cursor) // the cursor may have moved back since
		r.floorMark = r.cursor
		r.nextFloor = now.Add(time.Second)
		return from
	default:
		return r.cursor
	}
}

// processBatch runs one claim-publish-mark transaction and returns the number
// of rows claimed.
func (r *Relay) processBatch(ctx context.Context) (int, error) {
	// Once begun, a batch finishes even if ctx is cancelled (SIGTERM): the
	// publish has its own deadline and the transaction is short.
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout+15*time.Second)
	defer cancel()
	start := time.Now()
	r.releaseHeld(start)

	var db interface {
		Begin(context.Context) (pgx.Tx, error)
	} = r.pool
	if r.cfg.Ordering == OrderingPartitionKey {
		if err := r.ensureOwner(bctx, start); err != nil {
			r.setDBErr(err)
			return 0, err
		}
		if len(r.own.mine) == 0 {
			return 0, nil // every bucket is taken by other replicas
		}
		db = r.own.conn
	}
	tx, err := db.Begin(bctx)
	if err != nil {
		r.dropOwner()
		r.setDBErr(err)
		r.m.publishErrors.WithLabelValues("database").Inc()
		return 0, fmt.Errorf("begin claim transaction on %s: %w", r.table, err)
	}
	defer tx.Rollback(bctx) //nolint:errcheck // no-op after commit

	// Unblocking a key rescans from the start: take the key list first.
	blocked := r.blockedKeyList(start)
	rows, err := r.claim(bctx, tx, r.scanFrom(start), blocked)
	if err != nil {
		r.dropOwner()
		r.setDBErr(err)
		r.m.publishErrors.WithLabelValues("database").Inc()
		return 0, err
	}
	r.setDBErr(nil)
	r.m.claimDuration.Observe(time.Since(start).Seconds())
	if len(rows) == 0 {
		return 0, tx.Commit(bctx)
	}
	if last := rows[len(rows)-1].id; len(rows) == r.cfg.BatchSize {
		// A full batch from a rescan may end below the cursor: the rows
		// between are unclaimed, so the cursor must come back to here.
		r.cursor = last
	} else {
		r.cursor = max(r.cursor, last)
	}

	published, perr := r.publish(bctx, rows)
	if len(published) > 0 {
		if _, err := tx.Exec(bctx, r.markSQL, published); err != nil {
			r.dropOwner()
			r.setDBErr(err)
			r.m.publishErrors.WithLabelValues("database").Inc()
			return 0, fmt.Errorf("mark %d rows published in %s: %w", len(published), r.table, err)
		}
	}
	if err := tx.Commit(bctx); err != nil {
		r.dropOwner()
		r.setDBErr(err)
		r.m.publishErrors.WithLabelValues("database").Inc()
		return 0, fmt.Errorf("commit batch on %s: %w", r.table, err)
	}
	r.m.batches.Inc()
	r.m.batchSize.Observe(float64(len(rows)))
	r.m.batchDuration.Observe(time.Since(start).Seconds())
	if perr != nil {
		// Rows that were not acknowledged stay unpublished and are claimed
		// again after the backoff; a short count keeps the loop from draining.
		return 0, perr
	}
	return len(rows), nil
}

func (r *Relay) claim(ctx context.Context, tx pgx.Tx, from int64, blocked []string) ([]row, error) {
	held := make([]int64, 0, len(r.held))
	for id := range r.held {
		held = append(held, id)
	}
	var rs pgx.Rows
	var err error
	if r.cfg.Ordering == OrderingPartitionKey {
		rs, err = tx.Query(ctx, r.claimSQL, from, held, blocked, r.own.mine, r.cfg.BatchSize)
	} else {
		rs, err = tx.Query(ctx, r.claimSQL, from, r.types, held, r.cfg.BatchSize)
	}
	if err != nil {
		return nil, fmt.Errorf("claim batch from %s: %w", r.table, err)
	}
	out := make([]row, 0, r.cfg.BatchSize)
	for rs.Next() {
		var x row
		if err := rs.Scan(&x.id, &x.eventID, &x.eventType, &x.aggregateType, &x.aggregateID, &x.partitionKey, &x.payload, &x.createdAt); err != nil {
			rs.Close()
			return nil, fmt.Errorf("claim batch from %s: %w", r.table, err)
		}
		out = append(out, x)
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("claim batch from %s: %w", r.table, err)
	}
	return out, nil
}

func (r *Relay) releaseHeld(now time.Time) {
	for id, since := range r.held {
		if now.Sub(since) >= r.cfg.HeldRetryInterval {
			delete(r.held, id)
			r.rescanSoon() // the row is behind the cursor
		}
	}
	r.m.held.WithLabelValues("failed").Set(float64(len(r.held)))
}
