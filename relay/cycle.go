package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// inFlight is a batch that was claimed and published and waits for its mark
// and commit.
type inFlight struct {
	ctx    context.Context
	cancel context.CancelFunc
	tx     pgx.Tx
	start  time.Time
	rows   []row
	full   bool
	cut    bool // the byte budget cut it: it holds locks on rows it did not return
	// aside: it left rows out for a partition set aside (asideRows): they
	// stay locked until it commits, and a claim beside that commit that
	// released them would skip them and publish their keys' later rows.
	aside bool
	// unsent: it left a row it claimed neither published, held nor aside
	// (behind a row of its key that failed, or was dead-lettered or held,
	// in this batch; or failed itself while other keys' rows went out):
	// the row stays locked until it commits, and a claim beside that
	// commit would skip it and publish its key's later rows first.
	unsent    bool
	big       bool
	published []int64
	holds     []heldRecord // rows held in this batch, recorded in its transaction
	unhold    []int64      // published rows whose held record goes
	// heldLost: the held table refused the batch's records (recordHolds),
	// which the batch committed without; the loop logs it (noteHeldLost).
	heldLost error
	perr     error      // publish failures that make the loop back off
	retry    []int64    // with logical replication capture: rows to publish again first (publish)
	done     chan error // the mark and commit's result
}

// Run claims, publishes and marks batches until ctx is cancelled. A batch in
// flight when ctx ends is finished (publish, mark, commit) or rolled back,
// never abandoned with rows locked. Transient errors are retried with capped,
// jittered exponential backoff; Run returns nil on cancellation.
//
// With OrderingNone and MaxInFlight 2, while a full batch marks and commits
// the next one is claimed and published on another connection, so
// PostgreSQL, Kafka and the relay work at once; its publish still starts
// after the previous one ended, so rows reach Kafka in id order per replica.
func (r *Relay) Run(ctx context.Context) error {
	statsDone := make(chan struct{})
	hctx, cancel := context.WithTimeout(ctx, statsTimeout)
	r.refreshHeld(hctx) // before the first claim: a restarted relay does not retry its holds early
	cancel()
	go func() { defer close(statsDone); r.statsLoop(ctx) }()
	defer func() { <-statsDone }()
	if r.cfg.KeepPublishedFor > 0 || r.shape.byCreatedAt { // a pruner may have left partitions detached (restoreDetached)
		pruneDone := make(chan struct{})
		pr := r.newPruner()
		go func() { defer close(pruneDone); pr.loop(ctx) }()
		defer func() { <-pruneDone }()
	}
	if r.cfg.Notify {
		listenDone := make(chan struct{})
		go func() { defer close(listenDone); r.listen(ctx) }()
		defer func() { <-listenDone }()
	}
	defer r.leave() // hand this replica's buckets to the others at once
	if r.cfg.Capture == CaptureLogicalReplication {
		if r.capture == nil {
			return errors.New("logical-replication capture: Check has not run")
		}
		r.runCapture(ctx)
		return nil
	}
	r.poll(ctx, func() bool { return false })
	return nil
}

// poll is the polling loop: claim, publish and mark until ctx ends or
// stop says so (checked before each claim).
func (r *Relay) poll(ctx context.Context, stop func() bool) {
	var backoff time.Duration
	var pending *inFlight
	empty := 0 // claims in a row that found nothing
	for ctx.Err() == nil && !stop() {
		now := time.Now()
		r.health.iteration(now)
		b, err := r.claimAndPublish(ctx)
		if pending != nil {
			err = firstErr(err, r.finish(pending))
			pending = nil
		}
		if b != nil {
			if r.mayPipeline(b, err) {
				pending = r.commitAsync(b)
			} else {
				b.done <- r.markAndCommit(b)
				err = firstErr(err, r.finish(b))
			}
		}
		if err != nil {
			r.health.batchFailed(now, err)
			backoff = min(max(2*backoff, 100*time.Millisecond), r.cfg.MaxBackoff)
			r.log.Warn("batch failed; retrying", "err", err, "backoff", backoff)
			d := jitter(backoff)
			r.health.idleUntil(time.Now().Add(d))
			sleep(ctx, d)
			continue
		}
		backoff = 0
		switch {
		case b != nil && b.full:
			empty = 0 // drain on at once
		case b != nil:
			// Rows are arriving: the next ones are likely there after
			// Linger. Each empty claim in a row doubles the wait, up to
			// PollInterval, so an idle table costs a few claims a second
			// and a busy one gets its rows out within milliseconds.
			empty = 0
			r.pause(ctx, min(r.cfg.Linger, r.cfg.PollInterval))
		default:
			empty = min(empty+1, 16)
			r.pause(ctx, jitter(min(r.cfg.Linger<<empty, r.cfg.PollInterval)))
		}
	}
	if pending != nil {
		r.finish(pending) //nolint:errcheck // logged in finish; the loop is ending
	}
}

func firstErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// mayPipeline reports whether polled batch b, claimed and published with
// err, may commit beside the next claim: a full one (a short batch means
// the next claim waits anyway) that commitsBeside allows.
func (r *Relay) mayPipeline(b *inFlight, err error) bool {
	return err == nil && b.full && r.commitsBeside(b)
}

// commitsBeside reports whether batch b may commit beside the next claim
// and publish: all of it acknowledged, not a large one (two would hold
// twice the memory), in a mode that pipelines, and not one the byte budget
// cut, that left rows out for a partition set aside, or that left a row
// unsent: the rows it locked but did not return or send stay locked until
// it commits, and a claim beside that commit would skip them and publish
// the rows after them first. Before, a batch that dead-lettered a row and
// left its key's later rows for the next batch committed beside that
// batch's claim, which took the key's rows after them, and the key's
// order turned.
func (r *Relay) commitsBeside(b *inFlight) bool {
	return b.perr == nil && !b.cut && !b.aside && !b.unsent && !b.big && r.pipelined()
}

// pipelined reports whether a second batch may be claimed while one commits.
// Partition-key mode claims on its one membership session, which fences
// its buckets and runs one transaction at a time, so it never pipelines.
func (r *Relay) pipelined() bool {
	return r.cfg.MaxInFlight > 1 && r.cfg.Ordering == OrderingNone
}

// begin says where this batch's claim runs: nil when this replica must not
// claim now (a replica of the other ordering mode is live) or, in
// partition-key mode, owns no bucket.
func (r *Relay) begin(ctx context.Context, now time.Time) (beginner, error) {
	if r.lanes != nil && r.brokersDown(now) {
		// Its keys' rows would wait for as long as it cannot reach Kafka:
		// it leaves, its buckets go to the replicas that can, and it
		// joins again once the brokers answer its probe.
		if r.member.conn != nil {
			r.log.Warn("the brokers have not answered for the stall timeout; leaving the table's replicas so that the others publish this replica's keys, until they answer again",
				"err", *r.kafkaErr.Load())
			r.leave()
		}
		return nil, nil
	}
	fenced, err := r.fenced(ctx, now)
	if err != nil || fenced {
		return nil, err
	}
	if r.lanes == nil {
		return r.pool, nil
	}
	db, err := r.lanes.prepare(ctx, now)
	if err != nil {
		r.leave()
		return nil, err
	}
	return db, nil
}

// brokersDown reports whether the stats loop's probe of the brokers has
// failed, every time, for the stall timeout up to now: the replica cannot
// reach Kafka, though others may. A replica in partition-key mode then
// gives its buckets up (begin); before, it kept them, publishing nothing,
// and their keys waited for as long as it could not reach Kafka, while its
// loop, claiming and backing off, looked alive.
func (r *Relay) brokersDown(now time.Time) bool {
	since := r.brokersDownSince.Load()
	return since != 0 && now.Sub(time.Unix(0, since)) >= r.cfg.StallTimeout
}

// mergeHeld takes in the held table's last reload (heldSnap), if there is
// a new one: rows other replicas (or this one's predecessor) hold are left
// out of the claims from then on, and rows released elsewhere (redrive)
// come due. The loop that claims calls it, polling or streaming.
func (r *Relay) mergeHeld() {
	if r.heldSnap.Load() == nil { // a read, not a write, on the streaming loop's every turn
		return
	}
	s := r.heldSnap.Swap(nil)
	if s == nil {
		return
	}
	early, learned := r.held.merge(*s)
	for _, h := range early {
		if r.lanes != nil {
			r.lanes.released(h.key, h.eventType)
		}
		r.cur.rescanSoon() // rows released elsewhere (redrive) are behind the cursor
	}
	if r.lanes != nil {
		for _, h := range learned {
			r.lanes.heldUntil(h.key, h.eventType, h.bucket, h.until) // its key's later rows wait behind it
		}
	}
	r.heldMetrics() // the reload may have dropped holds (published, redriven) with no batch to follow
}

// heldMetrics sets outbox_relay_rows_held for the reasons this replica keeps.
func (r *Relay) heldMetrics() {
	for _, reason := range []string{HeldInvalidRow, HeldTooLarge, HeldRefused} {
		r.m.held.WithLabelValues(reason).Set(float64(r.held.count(reason)))
	}
}

// typesBack reports whether now holds a type that prev did not: its topic
// is back, and its rows may lie behind the cursor. Counting them would miss
// one topic coming back while another went down.
func typesBack(prev, now []string) bool {
	return !slices.Equal(prev, now) && slices.ContainsFunc(now, func(et string) bool { return !slices.Contains(prev, et) })
}

// claimAndPublish runs the first half of a batch: claim and publish. It
// returns nil when there was nothing to claim.
func (r *Relay) claimAndPublish(ctx context.Context) (*inFlight, error) {
	// Once begun, a batch finishes even if ctx is cancelled (SIGTERM): the
	// publish has its own deadline and the transaction is short.
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchDeadline(r.cfg))
	start := time.Now()
	r.mergeHeld()
	if r.held.release(start) {
		r.cur.rescanSoon() // released rows are behind the cursor
	}
	if r.aside.release(r.topics, start) {
		r.cur.rescanSoon() // their partition's backoff ended; they are behind the cursor
		r.m.setAside.Set(float64(len(r.aside.rows)))
	}
	db, err := r.begin(bctx, start)
	if err != nil {
		cancel()
		return nil, r.dbFailed(err)
	}
	if db == nil {
		cancel()
		r.health.batchDone(start, 0, 0)
		if r.lanes != nil {
			// No bucket is this replica's (the others hold them all, or it
			// left): no row waits for it. Before, the stall check kept the
			// last claim's buckets, and a row waiting in one of them, the
			// business of the replica that holds it now, failed this one's
			// /readyz.
			r.filter.Store(&claimFilter{types: r.availableTypes(start), held: []int64{}, keys: []string{}, keyTypes: []string{}, buckets: []int32{}})
		}
		return nil, nil
	}
	tx, err := db.Begin(bctx)
	if err != nil {
		cancel()
		return nil, r.dbFailed(fmt.Errorf("begin claim transaction on %s: %w", r.table, err))
	}
	// Never NULL arrays: id <> ALL(NULL) matches no row.
	f := claimFilter{types: r.availableTypes(start), held: []int64{}, keys: []string{}, keyTypes: []string{}, largest: r.largestRecord()}
	if typesBack(r.available, f.types) {
		r.cur.rescanSoon() // a topic back from its backoff: its rows may lie behind the cursor
	}
	r.available = f.types
	if r.lanes != nil {
		r.lanes.holdBack(&f, start) // before the cursor: an expired lane moves it back; the lanes keep held rows out
	} else {
		f.held = r.held.ids()
	}
	// The stall check counts the rows left out for a partition set aside:
	// they wait, and once nothing has gone out for the stall timeout the
	// relay says so (rows_waiting). Those another replica published since
	// are not counted.
	stalls := f
	r.filter.Store(&stalls)
	if r.lanes == nil {
		f.held = slices.Clone(f.held)
		for id := range r.aside.rows {
			f.held = append(f.held, id)
		}
	}
	xmin := int64(-1) // not read
	if r.cur.wantsXmin() {
		if err := tx.QueryRow(bctx, sqlOldestRunning).Scan(&xmin); err != nil {
			tx.Rollback(bctx) //nolint:errcheck // the read's error is the one to report
			cancel()
			return nil, r.dbFailed(fmt.Errorf("read the oldest running transaction before a claim from %s: %w", r.table, err))
		}
	}
	rows, fenced, locked, limited, err := r.claim(bctx, tx, r.cur.from(start), f)
	if err != nil {
		tx.Rollback(bctx) //nolint:errcheck // the claim's error is the one to report
		cancel()
		r.cur.claimFailed()
		return nil, r.dbFailed(err)
	}
	r.setDBErr(nil)
	r.m.claimDuration.Observe(time.Since(start).Seconds())
	rows, rest := r.uptoRepeatedID(rows)
	cut := len(rows) < locked || len(rest) > 0
	// The claim's limit counts its candidates: those another session holds
	// locked, and those a transaction changed while the claim ran so that
	// they no longer match, filled it too, and more rows may follow them.
	full := limited == r.cfg.BatchSize || cut
	if len(fenced) > 0 {
		// Before the publish: their lanes' later rows in this batch stay.
		for _, x := range r.lanes.fence(rows, fenced, start) {
			r.log.Info("a row another session holds locked waits, and its key's later rows on its topic wait behind it; the relay tries it again after a backoff",
				"id", x.id, "partition_key", x.partitionKey, "event_type", x.eventType)
		}
	}
	r.cur.claimed(rows, full)
	if len(rest) > 0 {
		r.cur.before(rest[0].id) // the next claim, after this batch's commit, takes them
	}
	if xmin >= 0 {
		r.cur.settle(xmin)
	}
	if r.cur.wantsBound() {
		var bound int64
		if err := tx.QueryRow(bctx, sqlClaimXid).Scan(&bound); err != nil {
			tx.Rollback(bctx) //nolint:errcheck // the read's error is the one to report
			cancel()
			return nil, r.dbFailed(fmt.Errorf("read the transaction id of a claim from %s: %w", r.table, err))
		}
		r.cur.record(bound)
	}
	if len(rows) == 0 {
		defer cancel()
		if !r.topics.anyFailing(start) {
			// Else the claim only left out rows that keep failing: nothing
			// is done, and the stalls say so.
			r.health.batchDone(start, 0, 0)
		}
		if err := tx.Commit(bctx); err != nil {
			return nil, r.dbFailed(fmt.Errorf("commit batch on %s: %w", r.table, err))
		}
		return nil, nil
	}
	b := &inFlight{ctx: bctx, cancel: cancel, tx: tx, start: start, rows: rows, full: full, cut: cut,
		big: payloadBytes(rows) > bigBatchBytes, done: make(chan error, 1)}
	if b.big {
		releaseMemory() // the claim's read buffers, before the publish builds its request
	}
	pctx, pcancel := publishing(bctx)
	b.published, _, b.perr = r.publish(pctx, rows)
	b.aside = slices.ContainsFunc(rows, func(x row) bool { return r.aside.has(x.id) })
	b.unsent = slices.ContainsFunc(rows, func(x row) bool {
		return !slices.Contains(b.published, x.id) && !r.aside.has(x.id) && !r.held.isHeld(x.id)
	})
	pcancel()
	b.holds, b.unhold = r.held.take(), r.held.forget(b.published)
	return b, nil
}

// markAndCommit runs the second half of a batch: mark what Kafka
// acknowledged, and commit. It touches nothing but the batch's transaction,
// so it may run beside the next claim.
func (r *Relay) markAndCommit(b *inFlight) error {
	defer b.cancel()
	defer b.tx.Rollback(b.ctx) //nolint:errcheck // no-op after commit
	if len(b.published) > 0 {
		stmt := r.sql.Mark
		if r.cfg.OnPublish == OnPublishDelete {
			stmt = r.sql.Delete
		}
		args := []any{b.published}
		if r.sql.Partitioned {
			oldest, newest := createdBounds(b.rows)
			args = append(args, oldest, newest, publishedCreatedAt(b.rows, b.published))
		}
		tag, err := b.tx.Exec(b.ctx, stmt, args...)
		if err != nil {
			return fmt.Errorf("mark %d rows published in %s: %w", len(b.published), r.table, err)
		}
		// Every published row is locked by the batch's transaction, so the
		// mark reaches each one, unless a partition of the table went
		// pending detach since the claim (the mark's new snapshot leaves it
		// out): then the batch fails, and its rows are claimed again, rather
		// than commit as if they were marked.
		if n, want := tag.RowsAffected(), distinct(b.published); n < want {
			return fmt.Errorf("mark rows published in %s: %d rows published, but the mark changed %d (a partition detached since the claim?); the batch is rolled back and its rows are claimed again",
				r.table, want, n)
		}
	}
	if err := r.recordHolds(b); err != nil {
		return err
	}
	if err := b.tx.Commit(b.ctx); err != nil {
		return fmt.Errorf("commit batch on %s: %w", r.table, err)
	}
	return nil
}

// recordHolds writes the batch's holds to the held table and removes the
// records of its published rows that had been held, in its transaction,
// within a savepoint: a held table that refuses them (dropped, a privilege
// revoked, a constraint added since the start-up check) loses the records,
// not the batch. Rolled back, the batch's rows that Kafka acknowledged
// would go out again, at every retry of a row it holds. The records
// refused are left in b.heldLost; the holds stay in memory.
func (r *Relay) recordHolds(b *inFlight) error {
	if len(b.holds) == 0 && len(b.unhold) == 0 {
		return nil
	}
	sp, err := b.tx.Begin(b.ctx)
	if err != nil {
		return fmt.Errorf("record held rows in %s: %w", r.table.HeldTable(), err)
	}
	if err := r.writeHolds(b, sp); err != nil {
		if !heldTableRefused(err) {
			return err
		}
		if rerr := sp.Rollback(b.ctx); rerr != nil {
			return fmt.Errorf("%w (and rolling its savepoint back: %v)", err, rerr)
		}
		b.heldLost = err
		return nil
	}
	if err := sp.Commit(b.ctx); err != nil {
		return fmt.Errorf("record held rows in %s: %w", r.table.HeldTable(), err)
	}
	return nil
}

// heldTableRefused reports whether err is the held table refusing a
// statement for what it is, not for the connection's state: the table or
// a column missing or of another type, a privilege revoked, a constraint
// (class 23) or a value it does not take (22). Another failure, the
// relay's own SQL among them, fails the batch as before.
func heldTableRefused(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) != 5 {
		return false
	}
	switch pgErr.Code {
	// undefined table, insufficient privilege, undefined column, datatype
	// mismatch, no unique constraint for ON CONFLICT (a table made again
	// without its key), not a table, no such schema
	case "42P01", "42501", "42703", "42804", "42P10", "42809", "3F000":
		return true
	}
	return pgErr.Code[:2] == "23" || pgErr.Code[:2] == "22"
}

// noteHeldLost logs, at most once a minute, that the held table refused a
// batch's records (b.heldLost). Only the loop calls it.
func (r *Relay) noteHeldLost(b *inFlight) {
	if b.heldLost == nil || time.Since(r.heldLostLogged) < time.Minute {
		return
	}
	r.heldLostLogged = time.Now()
	r.log.Error("the held table refused the records of held rows; they are held in memory only (retried sooner after a reload of the table, not in `relay held` nor the OutboxRelay's status), and the batch's other rows are published",
		"table", r.table.HeldTable().String(), "err", b.heldLost,
		"fix", "create the held table with the DDL from `relay schema`, and GRANT SELECT, INSERT, UPDATE, DELETE ON it to the relay's role")
}

// writeHolds runs recordHolds' statements in tx.
func (r *Relay) writeHolds(b *inFlight, tx pgx.Tx) error {
	if len(b.holds) > 0 {
		n := len(b.holds)
		ids, eventIDs, types, reasons, errs, waits := make([]int64, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]float64, n)
		for i, h := range b.holds {
			ids[i], eventIDs[i], types[i], reasons[i], errs[i], waits[i] = h.id, h.eventID, h.eventType, h.reason, h.err, h.wait.Seconds()
		}
		args := []any{ids, eventIDs, types, reasons, errs, waits}
		if r.sql.HoldKeepsRedrives {
			args = append(args, time.Since(b.start).Seconds())
		}
		if _, err := tx.Exec(b.ctx, r.sql.Hold, args...); err != nil {
			return fmt.Errorf("record %d held rows in %s: %w", n, r.table.HeldTable(), err)
		}
	}
	if len(b.unhold) > 0 {
		if _, err := tx.Exec(b.ctx, r.sql.Unhold, b.unhold); err != nil {
			return fmt.Errorf("remove %d published rows from %s: %w", len(b.unhold), r.table.HeldTable(), err)
		}
	}
	return nil
}

// createdBounds are the oldest and newest created_at of a batch's rows.
func createdBounds(rows []row) (oldest, newest time.Time) {
	oldest, newest = rows[0].createdAt, rows[0].createdAt
	for _, x := range rows[1:] {
		if x.createdAt.Before(oldest) {
			oldest = x.createdAt
		}
		if x.createdAt.After(newest) {
			newest = x.createdAt
		}
	}
	return oldest, newest
}

// batchMetrics records a settled batch of rows begun at start: the held
// rows by reason, and the batch's count, size and duration.
func (r *Relay) batchMetrics(start time.Time, rows int) {
	r.heldMetrics()
	r.m.batches.Inc()
	r.m.batchSize.Observe(float64(rows))
	r.m.batchDuration.Observe(time.Since(start).Seconds())
}

func (r *Relay) commitAsync(b *inFlight) *inFlight {
	go func() { b.done <- r.markAndCommit(b) }()
	return b
}

// finish waits for a batch's commit and settles it in the loop: the cursor,
// the held-row gauges, the metrics and the health tracker. A batch whose
// commit failed published rows that stay unpublished: they are claimed and
// published again (the duplicates at-least-once allows).
func (r *Relay) finish(b *inFlight) error {
	err := <-b.done
	r.held.committed(b.holds, time.Now())
	if err != nil {
		r.cur.settled(b.rows, func(int64) bool { return false })
		return r.dbFailed(err)
	}
	done := make(map[int64]bool, len(b.published))
	for _, id := range b.published {
		done[id] = true
	}
	r.cur.settled(b.rows, func(id int64) bool {
		return done[id] || r.aside.has(id) || r.held.isHeld(id)
	})
	r.noteHeldLost(b)
	if b.big {
		releaseMemory() // the batch's payloads and the publish's buffers
	}
	r.batchMetrics(b.start, len(b.rows))
	if b.perr != nil {
		// Rows that were not acknowledged stay unpublished and are claimed
		// again after the backoff.
		return b.perr
	}
	r.health.batchDone(b.start, len(b.rows), len(b.published))
	return nil
}

// uptoRepeatedID cuts a claim on a partitioned table before the first row
// whose id an earlier row of the claim has (the primary key there is the
// id with created_at): the relay tells the rows of a batch by id, and the
// mark by id and created_at (publishedCreatedAt) must know which of the two
// went out. Before, both went out and the mark left one to go out again.
// The rows cut off (rest) stay locked until the batch commits: it counts as
// cut, so no claim runs beside its commit, and the next one takes them.
func (r *Relay) uptoRepeatedID(rows []row) (kept, rest []row) {
	if !r.sql.Partitioned {
		return rows, nil
	}
	seen := make(map[int64]bool, len(rows))
	for i, x := range rows {
		if seen[x.id] {
			return rows[:i], rows[i:]
		}
		seen[x.id] = true
	}
	return rows, nil
}

// publishedCreatedAt is the created_at of each of published's rows among
// rows, in published's order: with the ids, a partitioned table's primary
// key (the Mark statement's $4). The rows have one id each (uptoRepeatedID).
func publishedCreatedAt(rows []row, published []int64) []time.Time {
	at := make(map[int64]time.Time, len(rows))
	for _, x := range rows {
		at[x.id] = x.createdAt
	}
	out := make([]time.Time, len(published))
	for i, id := range published {
		out[i] = at[id]
	}
	return out
}

// distinct counts the distinct ids among ids.
func distinct(ids []int64) int64 {
	seen := make(map[int64]struct{}, len(ids))
	for _, id := range ids {
		seen[id] = struct{}{}
	}
	return int64(len(seen))
}
