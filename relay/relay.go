// Package relay moves committed outbox rows from PostgreSQL to Kafka: it
// claims unpublished rows in id order with FOR UPDATE SKIP LOCKED, publishes
// the batch with acks=all, and marks what Kafka acknowledged, all in one
// transaction, so any number of replicas share a table without duplicates in
// steady state and nothing is lost when a process, the broker or the
// database fails (docs/relay.md, docs/architecture.md).
package relay

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// MessageWriter is the part of *kafka.Writer the relay uses; tests inject faults through it.
// The relay calls it from several goroutines at once: a call for each
// topic partition's share of a publish.
type MessageWriter interface {
	WriteMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Relay is one relay process's loop over one outbox table.
type Relay struct {
	cfg       Config
	table     outbox.Table
	sql       SQL
	shape     tableShape    // read by Check
	capture   *captureState // the slot and publication (logical-replication capture); set by Check
	pool      *pgxpool.Pool
	own       boundedPool   // the pool, for the stream's own statements
	writer    MessageWriter // an injected writer; nil when the relay makes its own (writerFor)
	newWriter func(writerKind) *kafka.Writer
	wmu       sync.Mutex
	writers   map[writerKind]*kafka.Writer
	// balancer chooses each record's partition, for the writers and for
	// the relay's split of a publish by partition (write): Murmur2 of the
	// key, what Java clients pick, unless the row chose its partition.
	balancer kafka.Balancer
	client   *kafka.Client
	// transport is the writers' and client's: kafka-go answers metadata
	// requests from its cache, up to its MetadataTTL old.
	transport *kafka.Transport
	// heldAlterTried: the server answered this process's try to add
	// redriven_at to the held table (ensureHeldTable), made once.
	heldAlterTried bool
	// heldLostLogged is when the loop last logged that the held table
	// refused a batch's records (noteHeldLost).
	heldLostLogged time.Time
	// metadataReset is when freshMetadata last dropped its pools.
	metadataReset atomic.Pointer[time.Time]
	m             *metrics
	log           *slog.Logger
	types         []string     // mapped event types, sorted
	tracer        trace.Tracer // nil when tracing is off

	// Loop state, owned by Run's goroutine.
	claimer claimer // the ordering mode's claim
	lanes   *byKey  // partition-key mode's lanes and buckets; nil in OrderingNone
	member  *member
	cur     cursor
	held    *heldRows
	aside   asideRows // rows of partitions set aside, left out of the claims (no ordering, polling)
	// available are the mapped types the last claim took: the rows of a
	// type available again may lie behind the cursor. A count would miss
	// one topic coming back while another went down.
	available []string

	// Shared with the stats loop and the probes.
	topics     *topicState
	health     *health
	filter     atomic.Pointer[claimFilter]  // the last claim's filters, for the stall check
	heldSnap   atomic.Pointer[heldSnapshot] // the held table's last reload, for the loop to merge
	mu         sync.Mutex
	unroutable map[string]bool // event types already logged as unmapped
	dbErr      atomic.Pointer[error]
	kafkaErr   atomic.Pointer[error]
	// brokersDownSince is when the stats loop's probe of the brokers first
	// failed of the failures in a row up to now (Unix nanoseconds; 0 while
	// they answer).
	brokersDownSince atomic.Int64
	wake             chan struct{} // a notification arrived (--notify)

	// Owned by the stats loop.
	heldSweeps int
}

// claimFilter is what the last claim left out, so the stall check counts
// only the rows this replica could claim.
type claimFilter struct {
	types []string
	held  []int64
	// keys[i] with keyTypes[i]: the rows of that partition key and event
	// type wait (partition-key mode; never nil: a NULL array matches no row).
	keys, keyTypes []string
	// largest is the largest record any topic takes (largestRecord).
	largest int
	// buckets are the key-hash buckets this replica claims from
	// (partition-key mode; nil: every row).
	buckets []int32
}

// connect opens a session of its own (not the pool's) with the pool's
// connection settings and, with Config.DatabaseTokens, a token.
func (r *Relay) connect(ctx context.Context) (*pgx.Conn, error) {
	return r.cfg.DatabaseTokens.Connect(ctx, r.pool.Config().ConnConfig)
}

// applyDatabaseLogin makes cc connect over t (verifying the server's host
// name, with no plain-text fallback) when t is set, and refuses a cc that
// would send tokens' password in plain text.
func applyDatabaseLogin(cc *pgx.ConnConfig, t *tls.Config, tokens *dbauth.Source) error {
	if t != nil {
		err := dbauth.OverTLS(&cc.Config, func(host string) (*tls.Config, error) {
			c := t.Clone()
			if c.ServerName == "" {
				c.ServerName = host
			}
			return c, nil
		})
		if err != nil {
			return err
		}
	}
	if tokens != nil {
		if err := dbauth.RequireTLS(&cc.Config); err != nil {
			return fmt.Errorf("--%s: %w; --%s gives the CA bundle",
				relayconfig.FlagDatabaseAuth, err, relayconfig.FlagDatabaseCAFile)
		}
	}
	return nil
}

// Connect opens one session to dsn as a relay with Config.DatabaseTLS t and
// Config.DatabaseTokens tokens (either may be nil) connects: for the
// commands that work on the table beside the relays (ListHeld, Redrive).
func Connect(ctx context.Context, dsn string, t *tls.Config, tokens *dbauth.Source) (*pgx.Conn, error) {
	cc, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("dsn: %w", err)
	}
	if err := applyDatabaseLogin(cc, t, tokens); err != nil {
		return nil, err
	}
	cc.RuntimeParams["application_name"] = "outbox-relay-cli"
	return tokens.Connect(ctx, cc)
}

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
	tuning := cfg.validateTuning()
	cfg = cfg.withDefaults()
	if err := errors.Join(tuning, cfg.Settings.Validate()); err != nil {
		return nil, err
	}
	table, _ := outbox.ParseTable(cfg.Table)
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("dsn: %w", err)
	}
	if err := applyDatabaseLogin(pcfg.ConnConfig, cfg.DatabaseTLS, cfg.DatabaseTokens); err != nil {
		return nil, err
	}
	if cfg.DatabaseTokens != nil {
		pcfg.BeforeConnect = cfg.DatabaseTokens.BeforeConnect
	}
	rp := pcfg.ConnConfig.RuntimeParams
	rp["application_name"] = "outbox-relay"
	// A claim transaction never idles longer than one publish; if the relay
	// hangs, PostgreSQL ends the transaction and releases the rows.
	rp["idle_in_transaction_session_timeout"] = strconv.FormatInt((cfg.PublishTimeout + 20*time.Second).Milliseconds(), 10)
	rp["statement_timeout"] = strconv.FormatInt(statementTimeout.Milliseconds(), 10)
	// pgx prepares statements, and a generic plan made while the table was
	// tiny can stay a sequential scan as it grows, every mark reading the
	// whole table: always plan with the real parameters.
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
	pcfg.MaxConns = int32(cfg.MaxInFlight) + 1 // the batches in flight and the stats loop
	pcfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return nil, fmt.Errorf("dsn: %w", err)
	}
	transport := &kafka.Transport{TLS: cfg.TLS, SASL: cfg.SASL, DialTimeout: 5 * time.Second, MetadataTTL: 30 * time.Second, ClientID: "outbox-relay"}
	now := time.Now()
	r := &Relay{
		cfg:        cfg,
		table:      table,
		sql:        NewSQL(table),
		pool:       pool,
		own:        boundedPool{pool},
		writer:     w,
		client:     &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 10 * time.Second, Transport: transport},
		transport:  transport,
		m:          newMetrics(cfg.Registerer),
		log:        cfg.Logger.With("table", table.String()),
		member:     &member{mode: cfg.Ordering},
		cur:        newCursor(cfg.FullRescanInterval, cfg.Ordering == OrderingPartitionKey),
		held:       newHeldRows(),
		aside:      newAsideRows(),
		topics:     newTopicState(compression(cfg.Compression) != 0, cfg.MaxBatchBytes),
		health:     newHealth(cfg.StallTimeout, wedgedAfter(cfg), now),
		unroutable: map[string]bool{},
		wake:       make(chan struct{}, 1),
	}
	if cfg.TracerProvider != nil {
		r.tracer = cfg.TracerProvider.Tracer(tracerName)
	}
	r.writers = map[writerKind]*kafka.Writer{}
	r.balancer = explicitBalancer{hash: &kafka.Murmur2Balancer{}}
	r.newWriter = func(k writerKind) *kafka.Writer {
		codec := kafka.Compression(0)
		if k.compressed {
			codec = compression(cfg.Compression)
		}
		return &kafka.Writer{
			Addr:         kafka.TCP(cfg.Brokers...),
			Balancer:     r.balancer,
			RequiredAcks: kafka.RequireAll,
			// The writer batches per partition and a partial batch waits
			// BatchTimeout; the relay hands over whole batches, so send at once.
			BatchTimeout: time.Microsecond,
			BatchSize:    cfg.BatchSize,
			// The broker applies max.message.bytes to a partition's whole
			// record batch: the writer splits a partition's share of a call
			// at the topics' budget (topicState.budget), so a hot key or
			// large payloads go out in a few full requests, never refused
			// as a whole and never one request per row.
			BatchBytes:      int64(k.batchBytes),
			MaxAttempts:     3,
			Compression:     codec,
			WriteBackoffMin: 50 * time.Millisecond,
			WriteBackoffMax: 500 * time.Millisecond,
			ReadTimeout:     cfg.PublishTimeout,
			WriteTimeout:    cfg.PublishTimeout,
			Transport:       transport,
		}
	}
	for t := range cfg.Topics {
		r.types = append(r.types, t)
	}
	slices.Sort(r.types)
	r.claimer, r.lanes = newModes(r)
	errNotChecked := errors.New("not connected yet")
	r.dbErr.Store(&errNotChecked)
	r.kafkaErr.Store(&errNotChecked)
	return r, nil
}

// minServerVersion is the oldest PostgreSQL the relay runs on (server_version_num).
const minServerVersion = 140000

// checkTimeout bounds one start-up check (Check).
const checkTimeout = 30 * time.Second

// batchDeadline bounds one batch from begin to commit, even after SIGTERM.
func batchDeadline(cfg Config) time.Duration { return relayconfig.BatchDeadline(cfg.PublishTimeout) }

// statementTimeout bounds each statement of the relay's sessions.
const statementTimeout = 30 * time.Second

// boundedPool runs statements on the pool that no batch deadline bounds
// (the stream's own: its slot checks, its sweep's fence, its wait for a
// commit to be visible) within statementTimeout on the client too. The
// server's statement_timeout never answers over a connection whose packets
// are dropped (a failover that leaves the old address silent): such a
// statement waited until the liveness probe restarted the relay, where
// polling rides it out within its batch deadline. A statement that runs
// out of time closes the pool's idle connections: they went to the same
// address, and each would cost the next statement its 30 s.
type boundedPool struct{ pool *pgxpool.Pool }

func (b boundedPool) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	ctx, cancel := context.WithTimeout(ctx, statementTimeout)
	return cancelRow{b.pool.QueryRow(ctx, sql, args...), cancel, b}
}

func (b boundedPool) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	ctx, cancel := context.WithTimeout(ctx, statementTimeout)
	rows, err := b.pool.Query(ctx, sql, args...)
	if err != nil {
		cancel()
		return nil, b.failed(err)
	}
	return cancelRows{rows, cancel, b}, nil
}

func (b boundedPool) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	ctx, cancel := context.WithTimeout(ctx, statementTimeout)
	defer cancel()
	tag, err := b.pool.Exec(ctx, sql, args...)
	return tag, b.failed(err)
}

// failed returns err, first closing the pool's idle connections when it
// is the client's timeout.
func (b boundedPool) failed(err error) error {
	if err != nil && pgconn.Timeout(err) {
		b.pool.Reset()
	}
	return err
}

// cancelRow ends its statement's deadline once scanned.
type cancelRow struct {
	pgx.Row
	cancel context.CancelFunc
	b      boundedPool
}

func (r cancelRow) Scan(dest ...any) error {
	defer r.cancel()
	return r.b.failed(r.Row.Scan(dest...))
}

// cancelRows ends its statement's deadline once closed.
type cancelRows struct {
	pgx.Rows
	cancel context.CancelFunc
	b      boundedPool
}

func (r cancelRows) Close() {
	r.Rows.Close()
	_ = r.b.failed(r.Rows.Err()) // a timeout while reading the rows
	r.cancel()
}

// wedgedAfter is how long the loop may go without a turn before /healthz
// fails: the longest wait that reports none, a batch (batchDeadline) or
// one statement of the stream's own (statementTimeout), and the stall
// timeout past it. Before, it was the batch's deadline alone plus the stall
// timeout: at the least stall timeout (5 s) 30 s, which one statement of
// 30 s could reach, and the kubelet restarted a relay that was waiting.
func wedgedAfter(cfg Config) time.Duration {
	return max(batchDeadline(cfg), statementTimeout) + cfg.StallTimeout
}

// markReserve is the part of a batch's deadline kept for its mark (or
// put-back) and commit.
const markReserve = 5 * time.Second

// publishing is the context of a batch's publish, within the batch's
// bctx: it ends markReserve before bctx's deadline, whatever rounds,
// halvings or dead-letter writes (each up to --publish-timeout) it still
// had to make. What Kafka acknowledged by then is marked; the rest is
// claimed again. Before, a publish that spent the whole deadline (rounds
// waiting on a hung partition) left the mark none: the batch rolled back,
// acknowledged rows and all, and went out again, for ever.
func publishing(bctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := bctx.Deadline()
	if !ok {
		return context.WithCancel(bctx)
	}
	return context.WithDeadline(bctx, deadline.Add(-markReserve))
}

// poolCloseWait is how long Close waits for the pool's connections to close.
const poolCloseWait = 2 * time.Second

// Close releases the database connections and the Kafka writer. Call it
// after Run has returned.
func (r *Relay) Close() error {
	r.leave()
	// pgx closes a connection whose statement was cancelled by reading
	// what the server still sends, for up to 15 s: on a connection that
	// went silent (a failover) that is all of it, and the pod's grace
	// period would pass waiting. What is left the process's exit closes.
	closed := make(chan struct{})
	go func() { r.pool.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(poolCloseWait):
		r.log.Warn("closing the database connections takes long (some went silent, or are still in use); leaving them to close on their own", "waited", poolCloseWait)
	}
	r.wmu.Lock()
	defer r.wmu.Unlock()
	var errs []error
	for _, w := range r.writers {
		errs = append(errs, w.Close())
	}
	return errors.Join(errs...)
}

// writerKind is what tells the relay's writers apart: the batch size they
// split partitions' shares at, and whether they compress.
type writerKind struct {
	batchBytes int
	compressed bool
}

// writerFor returns the relay's writer of kind k, made on first use
// (topics usually share one limit, so one).
func (r *Relay) writerFor(k writerKind) *kafka.Writer {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	w, ok := r.writers[k]
	if !ok {
		w = r.newWriter(k)
		r.writers[k] = w
	}
	return w
}

// Check verifies the table's columns and partial index, reads each topic's
// partitions and largest record size from the broker, and leaves a mapped
// topic that is missing or may not be used out of the claims, as down.
func (r *Relay) Check(ctx context.Context) (err error) {
	// A failure a later try may not meet (the connection lost mid-check, a
	// server restarting, a lock wait or the check's deadline run out) is
	// the dependency's: the caller waits and checks again. Before, only a
	// failed connect was, and the others ended the process, which the
	// kubelet then restarted with a growing delay.
	// Until the database's part passed, /readyz names the database as the
	// dependency waited for: it named Kafka, not checked yet, while the
	// check waited behind a migration's lock.
	databaseChecked := false
	defer func() {
		var unreachable *UnreachableError
		if err != nil && !errors.As(err, &unreachable) && checkTransient(err) {
			err = &UnreachableError{err}
		}
		if !databaseChecked && errors.As(err, &unreachable) {
			r.setDBErr(err)
		}
	}()
	// Until Run starts, the checks are the relay's loop: a relay waiting
	// for its dependencies is not wedged, and /healthz passes.
	now := time.Now()
	r.health.iteration(now)
	// No claim has run: a wait for the dependencies is no stall, and
	// /readyz names the one waited for. Before, past the stall timeout it
	// said "claimed rows but published none".
	r.health.idle(now)
	r.health.idleUntil(now.Add(checkTimeout))
	defer func() { // Run's loop is watched from its end on
		r.health.iteration(time.Now())
		r.health.idleUntil(time.Time{})
	}()
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	if err := r.pool.Ping(ctx); err != nil {
		r.setDBErr(err)
		return &UnreachableError{fmt.Errorf("connect to PostgreSQL: %w", err)}
	}
	r.setDBErr(nil)
	var version int
	if err := r.pool.QueryRow(ctx, sqlServerVersion).Scan(&version); err != nil {
		return fmt.Errorf("read the server version: %w", err)
	}
	if version < minServerVersion {
		return fmt.Errorf("PostgreSQL %d.%d is too old: the relay needs 14 or later (idle_session_timeout, pg_column_compression)",
			version/10000, version%10000)
	}
	if err := CheckSchema(ctx, r.pool, r.table); err != nil {
		return err
	}
	headers, err := hasColumn(ctx, r.pool, r.table, "headers")
	if err != nil {
		return err
	}
	var opts []SQLOption
	if headers {
		opts = append(opts, WithHeadersColumn())
	} else {
		r.log.Info("the table has no headers column; records carry only the relay's headers",
			"fix", "ALTER TABLE "+r.table.Quoted()+" ADD COLUMN headers jsonb")
	}
	var payloadType string
	if err := r.pool.QueryRow(ctx, sqlColumnType, r.table.Quoted(), "payload").Scan(&payloadType); err != nil {
		return fmt.Errorf("read the type of %s.payload: %w", r.table, err)
	}
	if payloadType == "bytea" {
		opts = append(opts, WithByteaPayload())
	}
	if c := r.cfg.PartitionColumn; c != "" {
		if err := checkPartitionColumn(ctx, r.pool, r.table, c); err != nil {
			return err
		}
		opts = append(opts, WithPartitionColumn(c))
	}
	shape, err := readShape(ctx, r.pool, r.table)
	if err != nil {
		return err
	}
	if shape.partitioned {
		opts = append(opts, WithPartitions())
		if err := r.checkPartitioned(shape); err != nil {
			return err
		}
	}
	r.shape = shape
	if err := r.checkTablePrivileges(ctx, headers); err != nil {
		return err
	}
	recorded, redrivenAt, err := r.ensureHeldTable(ctx)
	if err != nil {
		return err
	}
	if redrivenAt {
		opts = append(opts, WithHeldRedrivenAt())
	}
	r.useSQL(NewSQL(r.table, opts...))
	if r.cfg.Capture == CaptureLogicalReplication {
		if err := r.checkCapture(ctx); err != nil {
			return err
		}
	}
	r.held.recorded = recorded
	databaseChecked = true
	read := r.topics.readStarted()
	md, err := r.client.Metadata(ctx, &kafka.MetadataRequest{Topics: r.allTopics()})
	if err != nil {
		r.setKafkaErr(err)
		return &UnreachableError{fmt.Errorf("read Kafka metadata from %v: %w", r.cfg.Brokers, err)}
	}
	r.setKafkaErr(nil)
	r.topics.setPartitions(read, md)
	exists := map[string]bool{}
	why := map[string]string{} // the broker's error for a topic it answered about
	for _, t := range md.Topics {
		if t.Error == nil {
			exists[t.Name] = true
		} else if !errors.Is(t.Error, kafka.UnknownTopicOrPartition) {
			why[t.Name] = t.Error.Error() // not authorized to see it, say: not "does not exist"
		}
	}
	problem := func(t string) string {
		if w, ok := why[t]; ok {
			return "cannot be used: the broker says " + w
		}
		return "does not exist in Kafka"
	}
	// A topic that is missing or may not be used holds only its own rows,
	// as when it goes while the relay runs: they wait, counted as
	// topic_unavailable, and the topic is tried again with backoff. Were it
	// fatal here, one deleted topic, or one revoked ACL, would stop every
	// topic's rows at the next restart of a pod, in a crash loop that a
	// restart does not cure.
	for _, et := range r.types {
		if t := r.cfg.Topics[et]; !exists[t] {
			err := fmt.Errorf("topic %q (for event type %q) %s", t, et, problem(t))
			if r.topics.markDown(t, err, time.Now(), r.cfg.HeldRetryInterval) {
				r.log.Error("a mapped topic cannot be used; its rows are held and it is tried again, while the other topics' rows flow",
					"topic", t, "event_type", et, "reason", HeldTopicUnavailable, "err", err)
			}
		}
	}
	if t := r.cfg.DeadLetterTopic; t != "" && !exists[t] {
		r.log.Error("the dead-letter topic cannot be used; rows Kafka refuses are held (refused) until it can",
			"topic", t, "err", fmt.Errorf("dead-letter topic %q %s", t, problem(t)))
	}
	if err := r.topics.refreshLimits(ctx, r.client, r.allTopics(), r.cfg.HeldRetryInterval); err != nil {
		r.log.Warn("could not read the topics' record size limits; assuming Kafka's default", "err", err, "bytes", defaultMaxRecordBytes)
	}
	return nil
}

// checkTablePrivileges refuses to start a relay whose role lacks a
// privilege on the outbox table that publishing needs: reading the
// columns, locking the rows it claims (FOR UPDATE needs UPDATE on a
// column), marking them (UPDATE of published_at) or deleting them
// (--on-publish delete). Without one, every batch went out to Kafka and
// then rolled back at its mark: the same rows were published again at
// every retry, without end, while the relay looked alive. What retention
// needs (DELETE on a plain table; on a partitioned one the table's
// ownership, to detach its partitions, and the deletes of the event-id
// table) is logged as an error instead, naming the grants: the relay
// publishes, and prunes nothing until they are given (each failed pass
// counted in outbox_relay_prune_errors_total). Refused, a relay that
// published before an upgrade would stop publishing for want of pruning.
func (r *Relay) checkTablePrivileges(ctx context.Context, headers bool) error {
	var need []privilege
	on := func(t outbox.Table, p, c string) { need = append(need, privilege{t, p, c}) }
	read := append([]string{"id"}, outbox.RequiredColumns()...)
	read = append(read, "published_at")
	if headers {
		read = append(read, "headers")
	}
	if c := r.cfg.PartitionColumn; c != "" && !slices.Contains(read, c) {
		read = append(read, c)
	}
	if r.cfg.Ordering == OrderingPartitionKey {
		read = append(read, "ctid") // its claim reads the rows' heap addresses (and on a plain table locks by them)
	}
	if r.cfg.Capture == CaptureLogicalReplication {
		read = append(read, "xmin") // its sweep takes the rows of transactions before a horizon
	}
	for _, c := range read {
		on(r.table, "SELECT", c)
	}
	var why []string
	if r.cfg.OnPublish == OnPublishDelete {
		on(r.table, "UPDATE", "*")
		on(r.table, "DELETE", "")
		why = append(why, "--"+relayconfig.FlagOnPublish+" "+string(OnPublishDelete)+" deletes each row it published")
	} else {
		on(r.table, "UPDATE", "published_at")
		why = append(why, "it marks each row it published (UPDATE of published_at)")
	}
	publishing := len(need)
	if r.cfg.KeepPublishedFor > 0 && !r.shape.partitioned && r.cfg.OnPublish != OnPublishDelete {
		on(r.table, "DELETE", "")
	}
	ids := r.table.EventIDsTable()
	if r.cfg.KeepPublishedFor > 0 && r.shape.partitioned {
		on(r.table, privOwner, "")
		if r.shape.eventIDs {
			on(ids, "SELECT", "event_id")
			on(ids, "SELECT", "created_at")
			on(ids, "DELETE", "")
		}
	}
	role, missing, err := privilegesMissing(ctx, r.pool, need)
	if err != nil {
		return fmt.Errorf("read the privileges on %s: %w", r.table, err)
	}
	var onTable, forRetention []privilege
	for _, p := range missing {
		if slices.Index(need, p) < publishing {
			onTable = append(onTable, p)
		} else {
			forRetention = append(forRetention, p)
		}
	}
	grantee := pgx.Identifier{role}.Sanitize()
	if len(onTable) > 0 {
		return fmt.Errorf("the role %s lacks %s on %s: the relay reads the table, claims rows FOR UPDATE and %s; grant it with: %s",
			role, privilegeList(onTable), r.table, strings.Join(why, ", and "), grant(onTable, grantee))
	}
	if len(forRetention) > 0 {
		var lacks, fix []string
		var onIDs, onOutbox []privilege
		for _, p := range forRetention {
			if p.priv == privOwner {
				owner, super := "its owner", true // unread: advice without the owner's name
				if err := r.pool.QueryRow(ctx, sqlTableOwner, r.table.Quoted()).Scan(&owner, &super); err != nil {
					r.log.Warn("could not read the table's owner", "table", r.table.String(), "err", err)
				}
				lacks = append(lacks, "the ownership of "+r.table.String()+" (owned by "+owner+")")
				own := "make the role own the table and its partitions (ALTER TABLE " + r.table.Quoted() + " OWNER TO " + grantee + ", and each partition)"
				if !super { // a superuser's membership is never the advice
					own = "GRANT " + pgx.Identifier{owner}.Sanitize() + " TO " + grantee + " (the role gets every privilege of " + owner + "), or " + own
				}
				fix = append(fix, own)
				continue
			}
			if p.table == r.table {
				onOutbox = append(onOutbox, p)
			} else {
				onIDs = append(onIDs, p)
			}
		}
		what := "deletes published rows"
		if len(onOutbox) > 0 {
			lacks = append(lacks, privilegeList(onOutbox)+" on "+r.table.String())
			fix = append(fix, grant(onOutbox, grantee))
		}
		if r.shape.partitioned {
			what = "detaches and drops old partitions, which only the table's owner may, and deletes their event ids from " + ids.String()
		}
		if len(onIDs) > 0 {
			lacks = append(lacks, privilegeList(onIDs)+" on "+ids.String())
			fix = append(fix, grant(onIDs, grantee))
		}
		r.log.Error("the relay's role cannot prune: it publishes, and retention removes nothing until the role may",
			"role", role, "lacks", strings.Join(lacks, " and "), "why", "--"+relayconfig.FlagKeepPublishedFor+" "+what,
			"fix", strings.Join(fix, "; "))
	}
	return nil
}

// privOwner, as a privilege, is a table's ownership.
const privOwner = "OWNER"

// privilege is one privilege the relay's role needs on a table: on the
// table (column ""), on one column, on any one column ("*"), or the
// table's ownership (privOwner).
type privilege struct {
	table        outbox.Table
	priv, column string
}

// String is the privilege as an error names it: "SELECT (event_id)",
// "DELETE".
func (p privilege) String() string {
	if p.column == "" || p.column == "*" {
		return p.priv
	}
	return p.priv + " (" + p.column + ")"
}

// privilegesMissing returns the current role, and those of need it lacks.
func privilegesMissing(ctx context.Context, db querier, need []privilege) (string, []privilege, error) {
	tables, privs, cols := make([]string, len(need)), make([]string, len(need)), make([]string, len(need))
	for i, p := range need {
		tables[i], privs[i], cols[i] = p.table.Quoted(), p.priv, p.column
	}
	var role string
	var ordinals []int64
	if err := db.QueryRow(ctx, sqlPrivilegesMissing, tables, privs, cols).Scan(&role, &ordinals); err != nil {
		return "", nil, err
	}
	missing := make([]privilege, len(ordinals))
	for i, o := range ordinals {
		missing[i] = need[o-1]
	}
	return role, missing, nil
}

// privilegeList names privileges, comma-separated.
func privilegeList(ps []privilege) string {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.String()
	}
	return strings.Join(names, ", ")
}

// grant is the GRANT of ps (on one table) to grantee, each privilege on the
// whole table.
func grant(ps []privilege, grantee string) string {
	var names []string
	for _, p := range ps {
		if !slices.Contains(names, p.priv) {
			names = append(names, p.priv)
		}
	}
	return "GRANT " + strings.Join(names, ", ") + " ON " + ps[0].table.Quoted() + " TO " + grantee
}

// ensureHeldTable creates the held table when it is missing, adds
// redriven_at to one made before that column existed, and reports whether
// the table exists and has the column. A relay whose role may not create it
// keeps its holds in memory only, as it says in its log: they are forgotten
// on restart and invisible to the operator and to `relay held`.
func (r *Relay) ensureHeldTable(ctx context.Context) (exists, redrivenAt bool, err error) {
	held := r.table.HeldTable()
	// A read or a create that failed for a reason a retry may not meet (a
	// connection lost, a lock wait) goes back to Check, which tries again:
	// before, it was taken for a missing table, or one the role may not
	// create, and the relay kept its holds in memory for as long as it ran.
	heldExists := func() (bool, error) {
		var ok bool
		if err := r.pool.QueryRow(ctx, r.sql.HeldExists).Scan(&ok); err != nil {
			return false, fmt.Errorf("look for %s: %w", held, err)
		}
		return ok, nil
	}
	hasRedrivenAt := func() bool {
		ok, err := hasColumn(ctx, r.pool, held, "redriven_at")
		return err == nil && ok
	}
	found, err := heldExists()
	if err != nil {
		return false, false, err
	}
	if !found {
		_, err := r.pool.Exec(ctx, r.sql.CreateHeld)
		if err != nil && checkTransient(err) {
			return false, false, fmt.Errorf("create %s: %w", held, err)
		}
		if err == nil {
			r.log.Info("made the held table, where held rows are recorded (unless another replica made it first)", "table", held.String())
		}
		// Checked as any found table: another replica may have made it
		// meanwhile (this create then failed, the name taken), and an
		// older one may lack redriven_at.
		if found, ferr := heldExists(); ferr != nil {
			return false, false, ferr
		} else if !found {
			r.log.Error("cannot create the held table; rows held back are kept in memory only (forgotten on restart, not in the OutboxRelay's status nor in `relay held`)",
				"table", held.String(), "err", err, "fix", "create it with the DDL from `relay schema`")
			return false, false, nil
		}
	}
	missing, err := heldPrivilegesMissing(ctx, r.pool, held)
	if err != nil && checkTransient(err) {
		return false, false, fmt.Errorf("read the privileges on %s: %w", held, err) // Check tries again
	}
	if err != nil || len(missing) > 0 {
		// Holds it could not record would roll back each batch that holds
		// a row, after its other rows went out (duplicates at every
		// retry); records it could not delete would pile up.
		r.log.Error("the relay's role lacks privileges on the held table; rows held back are kept in memory only (forgotten on restart, not in the OutboxRelay's status nor in `relay held`)",
			"table", held.String(), "missing", strings.Join(missing, ", "), "err", err,
			"fix", "GRANT SELECT, INSERT, UPDATE, DELETE ON "+held.Quoted()+" TO <the relay's role>")
		return false, false, nil
	}
	missing, err = heldShapeMissing(ctx, r.pool, held)
	if err != nil && checkTransient(err) {
		return false, false, fmt.Errorf("read the columns of %s: %w", held, err) // Check tries again
	}
	if err != nil || len(missing) > 0 {
		// Another table of that name (not made by a relay, or altered):
		// every hold recorded there would fail.
		r.log.Error("the held table is not one a relay made; rows held back are kept in memory only (forgotten on restart, not in the OutboxRelay's status nor in `relay held`)",
			"table", held.String(), "missing", strings.Join(missing, ", "), "err", err,
			"fix", "rename that table, or make it with the DDL from `relay schema`")
		return false, false, nil
	}
	if hasRedrivenAt() {
		return true, true, nil
	}
	if r.heldAlterTried {
		// Check runs again while Kafka or the database cannot be reached:
		// each try would queue the other replicas' holds behind its lock.
		return true, false, nil
	}
	// ADD COLUMN waits for the other replicas' reads and holds of the table
	// and queues theirs behind it: bounded, as the pruner's DDL is.
	err = pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlBoundWaits, strconv.FormatInt(pruneLockTimeout.Milliseconds(), 10)); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, r.sql.AddHeldRedrivenAt)
		return err
	})
	// Tried once the server answered (not the owner, a lock wait that ran
	// out): a lost connection is tried again at the next check.
	r.heldAlterTried = err == nil || errors.As(err, new(*pgconn.PgError))
	if err != nil {
		if hasRedrivenAt() { // another replica added it meanwhile
			return true, true, nil
		}
		r.log.Warn("cannot add redriven_at to the held table; a batch that holds a row again may undo a `relay redrive` issued while it ran",
			"table", held.String(), "err", err, "fix", r.sql.AddHeldRedrivenAt)
		return true, false, nil
	}
	r.log.Info("added redriven_at to the held table", "table", held.String())
	return true, true, nil
}

// heldColumns are the held table's columns a relay reads and writes
// (outbox.HeldDDL), but redriven_at, which ensureHeldTable adds.
var heldColumns = []string{"id", "event_id", "event_type", "reason", "error", "attempts", "first_attempt", "last_attempt", "retry_at"}

// heldShapeMissing lists what held lacks of the shape outbox.HeldDDL gives:
// heldColumns, and the unique index on id.
func heldShapeMissing(ctx context.Context, db querier, held outbox.Table) ([]string, error) {
	var missing []string
	err := db.QueryRow(ctx, sqlHeldShapeMissing, held.Quoted(), heldColumns).Scan(&missing)
	return missing, err
}

// heldPrivilegesMissing lists the privileges on held that the relay's
// role needs and lacks: it reads, records, updates and removes holds.
func heldPrivilegesMissing(ctx context.Context, db querier, held outbox.Table) ([]string, error) {
	need := make([]privilege, len(heldPrivileges))
	for i, p := range heldPrivileges {
		need[i] = privilege{table: held, priv: p}
	}
	_, missing, err := privilegesMissing(ctx, db, need)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(missing))
	for i, p := range missing {
		names[i] = p.priv
	}
	return names, nil
}

// heldPrivileges are the privileges the relay's role needs on the held table.
var heldPrivileges = []string{"SELECT", "INSERT", "UPDATE", "DELETE"}

// checkPartitioned refuses retention on a partitioned table it cannot drop
// partitions of, and says what else it found.
func (r *Relay) checkPartitioned(shape tableShape) error {
	if r.cfg.KeepPublishedFor > 0 && !shape.byCreatedAt {
		return fmt.Errorf("table %s is partitioned, but not by RANGE (created_at) alone: retention on a partitioned table drops whole partitions by their created_at range; partition it by RANGE (created_at) (the DDL of `relay schema --partitioned`) or keep published rows (--keep-published-for 0s)", r.table)
	}
	retention := "none (--keep-published-for 0s)"
	if r.cfg.KeepPublishedFor > 0 {
		retention = "whole partitions, dropped once their range ended more than --keep-published-for ago and all their rows are published"
	}
	r.log.Info("the table is partitioned", "retention", retention)
	if r.cfg.KeepPublishedFor > 0 && shape.hasDefault {
		r.log.Warn("the table has a DEFAULT partition; partitions cannot be detached concurrently beside one, so none is dropped while it exists")
	}
	if !shape.eventIDs {
		r.log.Warn("the table is partitioned and has no event-id table; the writer (outbox.Store) keeps event_id unique through it and refuses to store without it",
			"table", r.table.EventIDsTable().String(), "fix", "the DDL of `relay schema --partitioned`")
	}
	return nil
}

// UnreachableError is a Check failure because PostgreSQL or Kafka could not
// be reached (worth retrying), as opposed to a missing table, index or topic.
type UnreachableError struct{ Err error }

func (e *UnreachableError) Error() string { return e.Err.Error() }
func (e *UnreachableError) Unwrap() error { return e.Err }

// checkTransient reports whether err is a failure that a later try may not
// meet: the connection lost or refused, the server shutting down, starting
// or out of connections, a statement canceled (its timeout), a lock wait
// or a serialization failure, a deadline. The server's other refusals (a
// missing table, a privilege) stand until someone fixes them.
func checkTransient(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch class := pgErr.Code[:min(2, len(pgErr.Code))]; {
		case class == "08", // connection exception
			class == "57",         // operator intervention: shutdown, canceled, cannot connect now
			class == "40",         // transaction rollback: serialization failure, deadlock
			class == "53",         // insufficient resources: too many connections, out of memory
			pgErr.Code == "55P03": // lock not available
			return true
		}
		return false
	}
	var netErr net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
		errors.As(err, &netErr) || pgconn.Timeout(err) || pgconn.SafeToRetry(err)
}

// largestRecord is the largest record any of the relay's topics (the
// dead-letter topic included) takes: a row larger can go nowhere, and the
// claim returns it without its payload (SQL.Claim).
func (r *Relay) largestRecord() int {
	n := 0
	for _, t := range r.allTopics() {
		n = max(n, r.topics.largest(t))
	}
	return n
}

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
	slices.Sort(ts)
	return ts
}

// availableTypes are the mapped event types whose topic may be written now.
func (r *Relay) availableTypes(now time.Time) []string {
	types := make([]string, 0, len(r.types))
	for _, et := range r.types {
		if r.topics.available(r.cfg.Topics[et], now) {
			types = append(types, et)
		}
	}
	return types
}

func (r *Relay) setDBErr(err error)    { r.dbErr.Store(&err) }
func (r *Relay) setKafkaErr(err error) { r.kafkaErr.Store(&err) }

// Ready returns nil while the relay can reach PostgreSQL and Kafka and
// events flow: it fails on each stall (see the Stall reasons). Its message
// never holds the connection errors themselves (they may name the
// database's host, user and database; the logs have them).
func (r *Relay) Ready() error {
	stalls := r.health.stalls(time.Now())
	for _, reason := range stallReasons {
		if msg, ok := stalls[reason]; ok {
			return fmt.Errorf("stalled (%s): %s", reason, msg)
		}
	}
	if err := *r.dbErr.Load(); err != nil {
		return errors.New("database: unreachable")
	}
	if err := *r.kafkaErr.Load(); err != nil {
		return errors.New("kafka: unreachable")
	}
	return nil
}

// Live returns nil unless the loop itself is wedged.
func (r *Relay) Live() error {
	if msg, ok := r.health.stalls(time.Now())[StallLoopWedged]; ok {
		return fmt.Errorf("stalled (%s): %s", StallLoopWedged, msg)
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
	invalid       string // what is wrong with the row's columns (NULLs, created_at out of range); empty when nothing
	headers       []byte // the headers column as stored; nil when NULL or absent
	partition     *int64 // the partition column (Settings.PartitionColumn); nil when NULL or none
	// size is the payload's and headers' size in the claim's byte budget.
	size int64
	// oversize: size, and the payload's own length, are more than any
	// topic takes; the claim returned no payload or headers (SQL.Claim).
	oversize bool
	// custom are the row's own headers the record carries (admit sets them).
	custom []kafka.Header
	// ceAttrs are the CloudEvents attributes the row's ce_* headers set, in
	// a CloudEvents format (admit sets them; they are not in custom then).
	ceAttrs map[string]string
}

// bigBatchBytes is the payload size above which a batch's memory is
// collected at once.
const bigBatchBytes = 8 << 20

// releaseMemory collects garbage at once, twice so buffers parked in
// sync.Pools (pgx's read buffers, the Kafka client's) go too. Without it a
// large batch's buffers stay until the heap has doubled, and the process's
// peak holds several batches; with it the next allocation reuses them
// (measured by TestLargePayloadsDrainInBoundedMemory). It costs a
// millisecond or two, only for batches above bigBatchBytes.
func releaseMemory() {
	runtime.GC()
	runtime.GC()
}

func payloadBytes(rows []row) int {
	n := 0
	for _, x := range rows {
		n += len(x.payload)
	}
	return n
}

// claim runs the mode's claim and reads the rows, how many rows it locked
// (more than it returned when the byte budget cut it), how many its limit
// counted (limited: the batch size when the claim was full), and in
// partition-key mode the rows it could not lock because another session
// holds them (fenced, SQL.ClaimBuckets), in id order: their lanes wait.
func (r *Relay) claim(ctx context.Context, tx pgx.Tx, from int64, f claimFilter) (rows, fenced []row, locked, limited int, err error) {
	rs, err := r.claimer.claim(ctx, tx, from, f)
	if err != nil {
		return nil, nil, 0, 0, fmt.Errorf("claim batch from %s: %w", r.table, err)
	}
	return r.scanClaim(rs, f, r.lanes != nil)
}

// scanClaim reads a claim's rows (SQL.Claim's result), how many rows it
// locked and how many its limit counted. With fences the result has two
// last columns, fenced and the candidates the limit counted
// (SQL.ClaimBuckets), and the rows it flags come apart, in fenced;
// without, the limit counted the rows locked.
func (r *Relay) scanClaim(rs pgx.Rows, f claimFilter, fences bool) (rows, fenced []row, locked, limited int, err error) {
	rows = make([]row, 0, r.cfg.BatchSize)
	for rs.Next() {
		var x row
		var isFenced bool
		dest := []any{&x.id, &x.eventID, &x.eventType, &x.aggregateType, &x.aggregateID, &x.partitionKey,
			&x.payload, &x.createdAt, &x.invalid, &x.headers, &x.size, &x.partition, &locked}
		if fences {
			dest = append(dest, &isFenced, &limited)
		}
		if err := rs.Scan(dest...); err != nil {
			rs.Close()
			return nil, nil, 0, 0, fmt.Errorf("claim batch from %s: %w", r.table, err)
		}
		if isFenced {
			fenced = append(fenced, x)
			continue
		}
		// Over the limit by its stored size, a row whose payload fits
		// comes with it (budgetedBy).
		x.oversize = x.size > int64(f.largest) && x.payload == nil
		rows = append(rows, x)
	}
	if err := rs.Err(); err != nil {
		return nil, nil, 0, 0, fmt.Errorf("claim batch from %s: %w", r.table, err)
	}
	if !fences {
		limited = locked
	}
	return rows, fenced, locked, limited, nil
}

func (r *Relay) commit(ctx context.Context, tx pgx.Tx) error {
	if err := tx.Commit(ctx); err != nil {
		return r.dbFailed(fmt.Errorf("commit batch on %s: %w", r.table, err))
	}
	return nil
}

// dbFailed records a database failure: the membership session goes (its
// transaction and locks with it) and /readyz says the database is failing.
func (r *Relay) dbFailed(err error) error {
	r.leave()
	r.setDBErr(err)
	r.m.publishErrors.WithLabelValues("database").Inc()
	return err
}
