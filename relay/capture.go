package relay

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// Capture is how the relay learns of new rows.
type Capture = relayconfig.Capture

// The capture modes.
const (
	// CapturePoll claims unpublished rows in id order.
	CapturePoll = relayconfig.CapturePoll
	// CaptureLogicalReplication streams the table's inserts from a logical
	// replication slot and publishes them in commit order.
	CaptureLogicalReplication = relayconfig.CaptureLogicalReplication
)

// This file is the logical replication capture. One replica streams the
// table's inserts from a slot (pgoutput) at a time: PostgreSQL lets one
// connection use a slot, so the others find it busy and wait as hot
// standbys, trying again every standbyRetry. The stream says which rows
// committed, in commit order; the relay claims those rows from the table
// by id (FOR UPDATE SKIP LOCKED, only the unpublished ones), publishes and
// marks them as polling does, in one transaction, and only then confirms
// the slot's position past their commit. So the table stays the source of
// truth: a row the stream delivers twice (after a crash, before the
// confirmation) is found published and skipped, and what the stream cannot
// deliver (rows from before the slot, held rows released, a lost slot) is
// published by a sweep, when streaming starts (sweepBeforeSlot) and every
// FullRescanInterval (sweepFence), and by polling while the relay cannot
// stream.
const (
	// standbyRetry is how often a standby tries to take the slot over.
	standbyRetry = time.Second
	// statusInterval is how often the streaming replica reports its
	// position to the server when nothing else makes it (the server
	// drops a silent client after wal_sender_timeout, 60 s by default;
	// statusEvery shortens it for a shorter one).
	statusInterval = 10 * time.Second
	// streamGap is how long the stream waits for the rest of what has
	// arrived on its socket before it publishes the rows it holds (see
	// the streaming loop: with nothing arrived it does not wait at all).
	// While messages keep coming the first waiting row waits at most
	// Settings.Linger.
	streamGap = time.Millisecond
	// shortWait is the longest wait for a message that does not watch the
	// relay's context (receive).
	shortWait = 50 * time.Millisecond
	// slotCheckInterval is how often the streaming replica reads its
	// slot's retained WAL.
	slotCheckInterval = 5 * time.Second
	// filterRefresh is how often the streaming loop tells the stall check
	// which rows it holds (polling does so with every claim).
	filterRefresh = time.Second
	// fallbackPeriod is how long the relay polls after it gave up or lost
	// its slot, before it makes a new one.
	fallbackPeriod = time.Minute
	// captureLockCheck is how often a replica polling in the stream's
	// stead checks that the session holding its capture lock lives
	// (pollFor).
	captureLockCheck = time.Second
	// sweepRetry is when a sweep that failed runs again (sweepFailed).
	sweepRetry = time.Second
	// fenceAsk is how often the streaming loop asks the server how far the
	// stream has read while a sweep waits for it (sweepFence).
	fenceAsk = 20 * time.Millisecond
	// sweepChunk is how many batches' worth of ids a sweep behind the
	// stream reads at a time (SQL.SweepIDs).
	sweepChunk = 8
	// walPageHeaderMax is the size of the longest WAL page header, the
	// first page's of a segment (SizeOfXLogLongPHD).
	walPageHeaderMax = 40
)

// The wait for the writer-deletes lock (lockWriterDeletes), and between
// its tries.
const (
	writerDeletesLockWait  = 2 * time.Second
	writerDeletesLockRetry = 2 * time.Millisecond
)

// The wait for the capture lock (tryCaptureLock), and between its tries:
// a session this relay just closed may hold it until its backend exits.
const (
	captureLockWait  = 500 * time.Millisecond
	captureLockRetry = 20 * time.Millisecond
)

// errSlotBusy: another replica streams from the slot, or polls in the
// stream's stead.
var errSlotBusy = errors.New("another replica streams from the replication slot or polls in its stead")

// errSlotGone: the slot was lost (invalidated) or given up (too much
// retained WAL); the relay polls for fallbackPeriod and makes a new one.
var errSlotGone = errors.New("the replication slot is gone")

// errCannotStream is a failure to stream that trying again soon does not
// mend: the relay polls between its attempts at once (runCapture).
var errCannotStream = errors.New("cannot stream")

// errReadAgain ends a stream that must read a transaction again, keeping
// more of it (captureState.rereads): the relay streams again at once.
var errReadAgain = errors.New("reading a transaction again")

// errStreamAgain ends a stream that the relay starts again at once, with
// nothing failed (keepMarked).
var errStreamAgain = errors.New("streaming again")

// captureState is what the streaming needs beyond the relay.
type captureState struct {
	slot, publication string
	role              string // the relay's, on the database
	// namespace is the table's schema, as the start-up check found it.
	namespace string
	// lockedDeletes: with writer deletes, the stream marked the
	// publication and took the writer-deletes lock when it started, so the
	// writers delete (keepMarked); unmarkedSaid: the stream said that the
	// mark is gone and it may not set it again.
	lockedDeletes, unmarkedSaid bool
	// oid is the table's, as the stream last learned it (tableReplaced).
	oid atomic.Uint32
	// relations are the relation ids whose inserts the stream takes: the
	// table's at the start-up check, and each table that took its name
	// while this relay streamed (tableReplaced), the earlier ones kept for
	// their changes a stream reads again. Stream state.
	relations map[uint32]bool
	// retryGivenUp: a batch's rows failed for StreamRetryLimit, and the
	// stream leaves the rows that fail to the sweep until a batch goes
	// out whole while no partition is set aside (retryIDs, retryAgain).
	retryGivenUp bool
	// polling: the relay polls in the stream's stead (pollInStead), and
	// sets a failing partition's rows aside as polling does (setsAside).
	// Loop state.
	polling bool
	// progressedAt is when a stream last confirmed a position past the
	// one it started from, or had streamed for failingLimit since its
	// first sweep: it works. A stream that starts and then fails (its
	// first sweep, or its first decode) does not count.
	progressedAt time.Time
	// failingLimit is how long the stream may keep failing before the
	// relay polls between its attempts (streamFailingLimit).
	failingLimit time.Duration
	// beforeSlot is what the slot saw when it was made, until a sweep
	// before the slot has published its rows: from this process's making
	// it, or from the publication's comment (noteBeforeSlot), which it is
	// noted in when beforeSlotNoted.
	beforeSlot      *slotSnapshot
	beforeSlotNoted bool
	// streamPID is the server's process id of the replication session
	// last started, as the session itself reads it (a pooler or proxy in
	// front can hand the client another at connect); 0 when unknown.
	streamPID int32
	// streamStart is when that session began (pg_stat_activity's
	// backend_start, in microseconds since 1970): with the pid it names the
	// session on whatever server the pool reaches. 0 when unknown.
	streamStart int64
	// txTupleLimit bounds the memory the stream keeps of an open
	// transaction's inserts without writer deletes (maxTxTuples).
	txTupleLimit int
	// rereads are the transactions, by their commit's position, that
	// deleted rows they inserted past txTupleLimit, whose tuples the
	// stream had not kept: each is read again, keeping those rows'
	// tuples to put them back. They outlive the stream that found them,
	// until the slot is confirmed past their commit.
	rereads map[pglogrepl.LSN]*rereadTx
}

// rereadTx is a transaction the stream reads again: its id, and the ids
// (sorted) of the rows it inserted and deleted whose tuples to keep.
type rereadTx struct {
	xid uint32
	ids []int64
}

// maxTxTuples is how many bytes of an open transaction's inserts the
// stream keeps, without writer deletes, in case the transaction deletes
// them (restore). Past it the stream keeps only the ids, which the claim
// needs: a transaction of any size streams in bounded memory, and one
// that also deletes rows past it, which only a writer with writer deletes
// does, is read again (rereads).
const maxTxTuples = 8 << 20

// slotSnapshot is the snapshot a slot's creation exports: the
// transactions it sees had ended before the slot's first position, so the
// stream carries none of their rows, and the others are after it. The
// slot's catalog horizon is no such bound: it is the oldest transaction
// running anywhere on the server when the slot began to be made, and the
// rows of transactions after it that ended before the slot's position
// would otherwise go out only with a sweep behind the stream, after later
// rows of their keys.
type slotSnapshot struct {
	xmax string  // the first transaction it does not see, without its epoch
	xip  []int64 // the transactions before xmax it does not see, without their epochs
}

// beforeSlotNote starts the line of the publication's comment (sqlSetNote)
// that keeps the snapshot of the slot's creation until a sweep has
// published the rows it sees: a replica that streams from the slot after
// its maker stopped sweeps them first too (readBeforeSlot).
const beforeSlotNote = "outbox-relay: the slot's snapshot, whose rows go out before the stream's:"

// note is s as the line beforeSlotNote starts.
func (s *slotSnapshot) note() string {
	xip := make([]string, len(s.xip))
	for i, x := range s.xip {
		xip[i] = strconv.FormatInt(x, 10)
	}
	return beforeSlotNote + " xmax=" + s.xmax + " xip=" + strings.Join(xip, ",")
}

// parseSlotSnapshot reads a line note made.
func parseSlotSnapshot(line string) (*slotSnapshot, error) {
	rest, ok := strings.CutPrefix(line, beforeSlotNote+" xmax=")
	xmax, list, ok2 := strings.Cut(rest, " xip=")
	if !ok || !ok2 {
		return nil, fmt.Errorf("not a slot's snapshot: %q", line)
	}
	if _, err := strconv.ParseUint(xmax, 10, 32); err != nil {
		return nil, fmt.Errorf("not a slot's snapshot: %q: %w", line, err)
	}
	s := &slotSnapshot{xmax: xmax, xip: []int64{}}
	for _, x := range strings.Split(list, ",") {
		if x == "" {
			continue
		}
		id, err := strconv.ParseUint(x, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("not a slot's snapshot: %q: %w", line, err)
		}
		s.xip = append(s.xip, int64(id))
	}
	return s, nil
}

// noteBeforeSlot keeps snap on the publication until sweepBeforeSlot has
// published its rows. Only the publication's owner may; a relay that may
// not says what that risks, and goes on.
func (r *Relay) noteBeforeSlot(ctx context.Context, db snapshotDB, snap *slotSnapshot) {
	pub := r.capture.publication
	_, err := db.Exec(ctx, sqlSetNote(pub, beforeSlotNote, snap.note()))
	r.capture.beforeSlotNoted = err == nil
	if err != nil {
		r.log.Warn("the relay may not keep the slot's snapshot on the publication: should this replica stop before it has published the rows committed before the slot, the replica that streams next would publish some of them after later rows of their keys; make the relay's role the publication's owner",
			"publication", pub, "err", err,
			"fix", "ALTER PUBLICATION "+pgx.Identifier{pub}.Sanitize()+" OWNER TO "+pgx.Identifier{r.capture.role}.Sanitize())
	}
}

// readBeforeSlot takes the snapshot noteBeforeSlot kept, if any: the rows
// committed before the slot are not all published yet (its maker, or this
// replica's last stream, stopped before its first sweep ended). A note
// this replica kept and that is gone now was removed by the replica that
// published them; one it could not keep, it keeps in memory.
func (r *Relay) readBeforeSlot(ctx context.Context) error {
	c := r.capture
	var line string
	err := r.own.QueryRow(ctx, sqlNote, c.publication, beforeSlotNote).Scan(&line)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		if c.beforeSlotNoted {
			c.beforeSlot, c.beforeSlotNoted = nil, false
		}
		return nil
	case err != nil:
		return fmt.Errorf("read the snapshot of slot %s: %w", c.slot, err)
	}
	snap, err := parseSlotSnapshot(line)
	if err != nil {
		return fmt.Errorf("read the snapshot of slot %s from the comment of publication %s: %w", c.slot, c.publication, err)
	}
	r.log.Info("the rows committed before the slot was made are not all published yet; publishing them first", "slot", c.slot)
	c.beforeSlot, c.beforeSlotNoted = snap, true
	return nil
}

// snapshotDB is where the slot's snapshot is read and noted: a session of
// its own while polling may hold the pool's connections.
type snapshotDB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// readSlotSnapshot imports the snapshot name a slot's creation exported
// (valid until the creating connection's next command).
func (r *Relay) readSlotSnapshot(ctx context.Context, db snapshotDB, name string) (*slotSnapshot, error) {
	var snap slotSnapshot
	err := pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET TRANSACTION SNAPSHOT `+outbox.QuoteLiteral(name)); err != nil {
			return err
		}
		return tx.QueryRow(ctx, sqlSlotSnapshot).Scan(&snap.xmax, &snap.xip)
	})
	if err != nil {
		return nil, fmt.Errorf("read the snapshot of slot %s: %w", r.capture.slot, err)
	}
	return &snap, nil
}

// checkReplicaIdentity checks that the table's deletes (or each leaf
// partition's) say which row they deleted. With no replica identity
// PostgreSQL refuses every delete on a table whose publication publishes
// deletes: the writers' with writer deletes, the relay's with
// --on-publish delete, the pruner's; a relay that makes any of them
// refuses to start. With one that leaves the id out (an index on
// event_id), a row its writer deleted under writer deletes cannot be told
// from one it kept: the relay would claim it from the table, find it
// gone, and move the slot past an event that reached no topic; a relay
// with writer deletes refuses to start. Other relays warn: nothing they
// do needs it, and a table that worked with it before keeps working.
func (r *Relay) checkReplicaIdentity(ctx context.Context, oid uint32) error {
	var rel, ident string
	var keyless bool
	err := r.pool.QueryRow(ctx, sqlReplicaIdentityWithoutID, oid).Scan(&rel, &ident, &keyless)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read the replica identity of %s: %w", r.table, err)
	}
	what := map[string]string{"n": "is NOTHING", "d": "is DEFAULT, and its primary key has no id", "i": "is an index without id"}[ident]
	if keyless && ident == "d" {
		what = "is DEFAULT, and it has no primary key"
	}
	if what == "" {
		what = fmt.Sprintf("is %q", ident)
	}
	fix := fmt.Sprintf("ALTER TABLE %s REPLICA IDENTITY FULL (or DEFAULT, with a primary key on id)", rel)
	deletes := r.cfg.WriterDeletes || r.cfg.OnPublish == OnPublishDelete || r.cfg.KeepPublishedFor > 0
	switch {
	case keyless && deletes:
		return fmt.Errorf("--%s %s: the replica identity of %s %s, so PostgreSQL refuses every delete on it once the publication publishes deletes (the relay deletes rows with --%s, --%s=%s or --%s); as the table's owner, run: %s",
			relayconfig.FlagCapture, CaptureLogicalReplication, rel, what, relayconfig.FlagWriterDeletes, relayconfig.FlagOnPublish, OnPublishDelete, relayconfig.FlagKeepPublishedFor, fix)
	case r.cfg.WriterDeletes:
		return fmt.Errorf("--%s: the replica identity of %s %s, so a writer's delete in the stream does not say which row it deleted, and the relay would take a row its writer deleted for one it kept; as the table's owner, run: %s",
			relayconfig.FlagWriterDeletes, rel, what, fix)
	}
	r.log.Warn("the replica identity of the table does not key a delete by id: writer deletes would need it, and with none PostgreSQL refuses the table's deletes once they are published",
		"relation", rel, "replica_identity", what, "fix", fix)
	return nil
}

// foldsToSlot sorts the other tables a publication named slot publishes
// (others quoted, with their schemas and names): the first whose
// name folds to slot, as a relay of it names its slot with or without the
// schema (SlotName), which would share the slot and the stream; and the
// rest, whose relay would not. A migration that renames the table away
// leaves the earlier table in the publication, and the stream reads its
// changes as an earlier table's (tableReplaced); before, a relay refused to
// start beside it.
func foldsToSlot(database, slot string, others, schemas, names []string) (taken *string, extra []string) {
	// A relay takes a table by a plain lower-case name only (ParseTable):
	// by its name alone (found on its search_path), or with its schema.
	named := func(t outbox.Table) bool {
		_, err := outbox.ParseTable(t.String())
		return err == nil && outbox.SlotName(database, t) == slot
	}
	for i, name := range names {
		if named(outbox.Table{Name: name}) || named(outbox.Table{Schema: schemas[i], Name: name}) {
			if taken == nil {
				taken = &others[i]
			}
			continue
		}
		extra = append(extra, others[i])
	}
	return taken, extra
}

// checkCapture verifies what logical replication needs and names the fix
// of what is missing: wal_level, the role's replication privilege, and
// the publication of the table, which it creates when it may.
func (r *Relay) checkCapture(ctx context.Context) error {
	var level, database, role string
	if err := r.pool.QueryRow(ctx, sqlCaptureSettings).Scan(&level, &database, &role); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if level != "logical" {
		return fmt.Errorf("--%s %s needs wal_level = logical (it is %s): set it and restart PostgreSQL (Amazon RDS: the parameter rds.logical_replication = 1; Cloud SQL: the flag cloudsql.logical_decoding = on; Azure: azure.replication_support = logical)",
			relayconfig.FlagCapture, CaptureLogicalReplication, level)
	}
	var canReplicate bool
	if err := r.pool.QueryRow(ctx, sqlCanReplicate).Scan(&canReplicate); err != nil {
		return fmt.Errorf("read the role's privileges: %w", err)
	}
	quotedRole := pgx.Identifier{role}.Sanitize()
	if !canReplicate {
		return fmt.Errorf("--%s %s: the role %s may not stream from a replication slot; grant it with: ALTER ROLE %s REPLICATION (Amazon RDS: GRANT rds_replication TO %s)",
			relayconfig.FlagCapture, CaptureLogicalReplication, role, quotedRole, quotedRole)
	}
	slot := outbox.SlotName(database, r.table)
	pub := slot
	var exists, published, deletes, viaRoot, inserts, narrowed bool
	var oid uint32
	if err := r.pool.QueryRow(ctx, sqlPublishes, pub, r.table.Quoted()).Scan(&exists, &published, &oid, &deletes, &viaRoot, &inserts, &narrowed); err != nil {
		return fmt.Errorf("read publication %s: %w", pub, err)
	}
	var others, otherSchemas, otherNames []string
	var otherDatabase *string
	if err := r.pool.QueryRow(ctx, sqlNameTaken, pub, r.table.Quoted()).Scan(&others, &otherSchemas, &otherNames, &otherDatabase); err != nil {
		return fmt.Errorf("read publication %s: %w", pub, err)
	}
	otherTable, extra := foldsToSlot(database, slot, others, otherSchemas, otherNames)
	if len(extra) > 0 {
		r.log.Warn("the publication also publishes tables whose names do not fold to its own (an earlier table of the table's name renamed away by a migration, or a table added by hand): the stream reads their changes and skips those of tables that are not the table or an earlier one of its name; drop them from the publication once the slot's confirmed position is past the migration",
			"publication", pub, "tables", extra,
			"fix", "ALTER PUBLICATION "+pgx.Identifier{pub}.Sanitize()+" DROP TABLE "+strings.Join(extra, ", "))
	}
	switch {
	case otherTable != nil:
		return fmt.Errorf("--%s %s: the publication %s, named after %s, publishes the table %s too: both names fold to one slot name, and one stream would serve both (its relay would never stream the other's rows); capture one of them with --%s %s",
			relayconfig.FlagCapture, CaptureLogicalReplication, pub, r.table, *otherTable, relayconfig.FlagCapture, CapturePoll)
	case otherDatabase != nil:
		return fmt.Errorf("--%s %s: the replication slot %s, named after %s in database %s, belongs to database %s: slot names are the server's, and both names fold to this one; capture one of them with --%s %s",
			relayconfig.FlagCapture, CaptureLogicalReplication, slot, r.table, database, *otherDatabase, relayconfig.FlagCapture, CapturePoll)
	}
	if !published {
		create := sqlCreatePublication(pub, r.table)
		if exists { // made for a table of this name that was dropped since
			create = sqlAddToPublication(pub, r.table)
		}
		if _, err := r.pool.Exec(ctx, create); err != nil {
			if publicationRetriable(err) { // not a privilege: Check tries again
				return &UnreachableError{fmt.Errorf("run %s: %w", create, err)}
			}
			return fmt.Errorf("--%s %s: the publication %s of %s is missing and the relay's role may not create it (%v); as the table's owner, run: %s",
				relayconfig.FlagCapture, CaptureLogicalReplication, pub, r.table, err, create)
		}
		r.log.Info("created the publication of the table", "publication", pub)
	}
	if exists && r.shape.partitioned && !viaRoot {
		// Its partitions' inserts would carry their own relations: the
		// stream would skip every one, and with writer deletes lose it.
		alter := sqlAlterPublication(pub)
		if _, err := r.pool.Exec(ctx, alter); err != nil {
			if publicationRetriable(err) { // not a privilege: Check tries again
				return &UnreachableError{fmt.Errorf("run %s: %w", alter, err)}
			}
			return fmt.Errorf("--%s %s: the table %s is partitioned, so its publication %s must publish its partitions' changes as the table's own, and the relay's role may not alter it (%v); as its owner, run: %s",
				relayconfig.FlagCapture, CaptureLogicalReplication, r.table, pub, err, alter)
		}
		r.log.Info("the publication publishes the partitions' changes as the table's now", "publication", pub)
		deletes, inserts = true, true // the same statement
	}
	if exists && !inserts {
		// The stream would carry none of the table's rows: without writer
		// deletes each would wait for the sweep and go out in id order,
		// and the writers would keep theirs (outbox.DeletesOnStore).
		alter := sqlAlterPublication(pub)
		if _, err := r.pool.Exec(ctx, alter); err != nil {
			if publicationRetriable(err) { // not a privilege: Check tries again
				return &UnreachableError{fmt.Errorf("run %s: %w", alter, err)}
			}
			return fmt.Errorf("--%s %s: the publication %s publishes no inserts, so the stream would carry none of the rows of %s, and the relay's role may not alter it (%v); as its owner, run: %s",
				relayconfig.FlagCapture, CaptureLogicalReplication, pub, r.table, err, alter)
		}
		r.log.Info("the publication publishes inserts now", "publication", pub)
		deletes = true // the same statement
	}
	if published && narrowed {
		// The stream would leave out the rows the filter drops (they
		// would wait for the sweep and go out in id order) or the
		// columns the list leaves out (a row put back or published from
		// the stream would lack them).
		whole := sqlPublishWhole(pub, r.table)
		if _, err := r.pool.Exec(ctx, whole); err != nil {
			if publicationRetriable(err) { // not a privilege: Check tries again
				return &UnreachableError{fmt.Errorf("run %s: %w", whole, err)}
			}
			return fmt.Errorf("--%s %s: the publication %s carries only some rows or columns of %s (a row filter or a column list), so the stream would leave the rest out, and the relay's role may not alter it (%v); as its owner, run: %s",
				relayconfig.FlagCapture, CaptureLogicalReplication, pub, r.table, err, whole)
		}
		r.log.Info("the publication publishes every row and column of the table now", "publication", pub)
	}
	if exists && !deletes {
		// Without deletes a relay that claims what it streams cannot tell
		// a row its writer deleted (under writer deletes) from one
		// published, and would lose it.
		alter := sqlAlterPublication(pub)
		if _, err := r.pool.Exec(ctx, alter); err != nil {
			if publicationRetriable(err) { // not a privilege: Check tries again
				return &UnreachableError{fmt.Errorf("run %s: %w", alter, err)}
			}
			if r.cfg.WriterDeletes {
				return fmt.Errorf("--%s: the publication %s must publish deletes, so that a relay run without --%s later publishes the rows the writers deleted, and the relay's role may not alter it (%v); as its owner, run: %s",
					relayconfig.FlagWriterDeletes, pub, relayconfig.FlagWriterDeletes, err, alter)
			}
			r.log.Warn("the publication publishes no deletes, so rows written with writer deletes that this relay streams would be lost; as its owner, run the fix",
				"publication", pub, "err", err, "fix", alter)
		} else {
			r.log.Info("the publication publishes deletes now", "publication", pub)
		}
	}
	if err := r.checkReplicaIdentity(ctx, oid); err != nil {
		return err
	}
	if r.cfg.WriterDeletes {
		var generated []string
		var canInsert bool
		if err := r.pool.QueryRow(ctx, sqlWriterDeletesTable, oid).Scan(&generated, &canInsert); err != nil {
			return fmt.Errorf("read the generated columns of %s: %w", r.table, err)
		}
		if !canInsert {
			return fmt.Errorf("--%s: the relay's role %s may not insert into %s, which it does to put back a row it cannot publish; grant it with: GRANT INSERT ON %s TO %s",
				relayconfig.FlagWriterDeletes, quotedRole, r.table, r.table.Quoted(), quotedRole)
		}
		if len(generated) > 0 {
			// The stream leaves them out, so a row could not be put back as
			// it was written.
			return fmt.Errorf("--%s: %s has generated columns (%s), which the stream leaves out, so a row the relay cannot publish could not be put back; drop them or run without --%s",
				relayconfig.FlagWriterDeletes, r.table, strings.Join(generated, ", "), relayconfig.FlagWriterDeletes)
		}
	}
	var schema string
	if err := r.pool.QueryRow(ctx, sqlTableSchema, oid).Scan(&schema); err != nil {
		return fmt.Errorf("read the schema of %s: %w", r.table, err)
	}
	r.capture = &captureState{slot: slot, publication: pub, role: role, namespace: schema, relations: map[uint32]bool{oid: true},
		failingLimit: streamFailingLimit, txTupleLimit: maxTxTuples}
	r.capture.oid.Store(oid)
	r.m.slotMaxRetainedWAL.Set(float64(r.cfg.MaxRetainedWAL))
	if r.cfg.WriterDeletes {
		// Each stream marks it again; this says at start-up when the
		// relay cannot.
		if err := r.markWriterDeletes(ctx); err != nil {
			r.warnUnmarked(err)
		}
	}
	return nil
}

// publicationRetriable reports whether a failed statement on the
// publication is one a later start-up check may not meet: a lock wait or a
// failover (checkTransient), or another replica's check making or altering
// the publication at once. Replicas that start together each find it
// missing and make it; the one that loses gets duplicate_object, or a
// unique violation on the catalog when the other had not committed yet,
// and of two ALTERs the later gets "tuple concurrently updated". Read as
// the role's refusal, that ended the process; its restart then passed.
func publicationRetriable(err error) bool {
	switch code := pgCode(err); {
	case code == "42710", code == "23505": // duplicate_object, unique_violation
		return true
	case code == "XX000":
		var pgErr *pgconn.PgError
		return errors.As(err, &pgErr) && strings.Contains(pgErr.Message, "concurrently updated")
	}
	return checkTransient(err)
}

// streamFailingLimit is how long a relay whose stream fails (PostgreSQL
// restarting, its walsender ended) only tries to stream again, before it
// polls between the attempts.
const streamFailingLimit = 30 * time.Second

// runCapture streams while it can; a standby waits for the slot, and a
// relay that cannot stream (the slot lost, or streaming failing for
// streamFailingLimit) polls, so rows flow whatever becomes of the slot.
func (r *Relay) runCapture(ctx context.Context) {
	var backoff time.Duration
	var failing failingClock
	for ctx.Err() == nil {
		began := time.Now()
		r.health.iteration(began)
		err := r.stream(ctx)
		if r.capture.progressedAt.After(began) {
			backoff = 0
			failing.reset()
		}
		if !errors.Is(err, errSlotBusy) {
			failing.active(began, r.capture.failingLimit)
		}
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, errReadAgain), errors.Is(err, errStreamAgain):
			continue // it said why; nothing failed
		case errors.Is(err, errSlotBusy):
			backoff = 0
			failing.standby(began)
			r.m.slotRetainedWAL.Set(0) // another replica streams, and reports it

			r.health.batchDone(time.Now(), 0, 0) // a standby has nothing to do: that is progress
			r.health.idleUntil(time.Now().Add(standbyRetry))
			sleep(ctx, standbyRetry)
		case errors.Is(err, errSlotGone):
			backoff = 0
			failing.reset() // the new slot's stream gets a failing limit of its own
			r.log.Warn("polling until a new replication slot is made", "err", err, "for", fallbackPeriod)
			r.pollFor(ctx, fallbackPeriod)
		default:
			backoff = min(max(2*backoff, 100*time.Millisecond), r.cfg.MaxBackoff)
			now := time.Now()
			failed := failing.failed(now)
			if failed >= r.capture.failingLimit {
				// It no longer reads the slot, and its last reading would
				// stand for good: another replica may stream now, and the
				// alert takes the largest. A stream that fails and streams
				// again within the limit keeps it, so the alert, which
				// needs 5 minutes above its bound, still fires then.
				r.m.slotRetainedWAL.Set(0)
			}
			if failed < r.capture.failingLimit && !errors.Is(err, errCannotStream) {
				// Polling now would publish in id order what the stream
				// publishes in commit order.
				r.log.Warn("streaming failed; streaming again", "err", err, "in", backoff)
				r.health.batchFailed(now, err)
				d := jitter(backoff)
				r.health.idleUntil(now.Add(d))
				sleep(ctx, d)
				continue
			}
			r.log.Warn("streaming failed; polling, then streaming again", "err", err, "in", backoff)
			r.pollFor(ctx, jitter(backoff))
		}
	}
}

// failingClock measures how long this replica's own stream has been
// failing, which streamFailingLimit bounds before it polls between its
// attempts: its attempts, and its waits between them, since the first
// failure after the stream last worked (reset). Standby time does not
// count: another replica streamed meanwhile, or failed on its own, and two
// replicas whose streams fail alike, taking the slot in turns, each build
// up their own time and poll. A standby as long as the limit starts it
// again: another replica held the slot that long, which a stream failing
// alike does not (it polls for a backoff at most). Before, a failure
// before hours of standby counted at the first failure after a takeover,
// which then polled, in id order.
type failingClock struct {
	since        time.Time // the first failure; zero when none
	standbySince time.Time // the first standby attempt of a run of them; zero when none
}

func (c *failingClock) reset() { c.since = time.Time{} }

// standby notes an attempt, begun at at, that found another replica
// holding the slot.
func (c *failingClock) standby(at time.Time) {
	if c.standbySince.IsZero() {
		c.standbySince = at
	}
}

// active notes an attempt, begun at at, that was no standby: a standby
// before it ended then, and its time is taken out, or, as long as limit,
// starts the clock again.
func (c *failingClock) active(at time.Time, limit time.Duration) {
	if c.standbySince.IsZero() {
		return
	}
	switch standby := at.Sub(c.standbySince); {
	case standby >= limit:
		c.since = time.Time{}
	case !c.since.IsZero():
		c.since = c.since.Add(standby)
	}
	c.standbySince = time.Time{}
}

// failed notes a failure at now and returns the failing time.
func (c *failingClock) failed(now time.Time) time.Duration {
	if c.since.IsZero() {
		c.since = now
	}
	return now.Sub(c.since)
}

// pollFor polls for d: the relay's rows flow while it cannot stream. It
// polls holding the slot's capture lock, on a session of its own (the
// pool's connections are the batches'; an ordinary one, which takes no
// walsender), so no other replica streams meanwhile; when another replica
// holds it, that one publishes, and this one waits as a standby.
func (r *Relay) pollFor(ctx context.Context, d time.Duration) {
	until := time.Now().Add(d)
	var backoff time.Duration
	for ctx.Err() == nil {
		conn, err := r.connect(ctx)
		if err == nil {
			if err = r.tryCaptureLock(ctx, conn.PgConn()); err != nil {
				conn.Close(context.WithoutCancel(ctx))
			}
		}
		if err == nil {
			r.pollHolding(ctx, conn, until)
			conn.Close(context.WithoutCancel(ctx))
			return
		}
		now := time.Now()
		if errors.Is(err, errSlotBusy) {
			r.health.batchDone(now, 0, 0) // a standby has nothing to do: that is progress
			r.health.idleUntil(now.Add(standbyRetry))
			sleep(ctx, standbyRetry)
			return
		}
		// A refused session or a dropped network may pass: try again within
		// d, so that rows flow for as much of it as they can. Before, one
		// failure left them for the whole of d (a minute after a slot was
		// given up).
		backoff = min(max(2*backoff, 100*time.Millisecond), r.cfg.MaxBackoff)
		wait := min(jitter(backoff), until.Sub(now))
		r.log.Warn("cannot take the capture lock to poll in the stream's stead", "err", err, "retry in", wait)
		r.health.batchFailed(now, err)
		r.health.idleUntil(now.Add(wait))
		sleep(ctx, wait)
		if !time.Now().Before(until) {
			return
		}
	}
}

// pollHolding polls until until on behalf of conn's session, which holds
// the capture lock, or until that session ends.
func (r *Relay) pollHolding(ctx context.Context, conn *pgx.Conn, until time.Time) {
	var nextCheck time.Time
	r.pollInStead(ctx, func() bool {
		now := time.Now()
		if !now.Before(until) {
			return true
		}
		if now.Before(nextCheck) {
			return false
		}
		// Its session ended (PostgreSQL ended it, the network dropped it):
		// the lock went with it, and another replica may stream now, in
		// commit order, while this one would poll in id order.
		nextCheck = now.Add(captureLockCheck)
		pctx, cancel := context.WithTimeout(ctx, captureLockCheck)
		defer cancel()
		if err := conn.Ping(pctx); err != nil && ctx.Err() == nil {
			r.log.Warn("lost the session that holds the capture lock; polling stops", "err", err)
			return true
		}
		return false
	})
}

// pollInStead polls (poll) in the stream's stead until stop says so. A
// partition that fails has its rows set aside as polling sets them aside
// (setsAside), and a topic whose rows all fail is left out of the claims
// for a backoff (topicsFailing), so that they do not fill every claim
// while they fail, and the other rows go out meanwhile. Once polling ends
// both are dropped: the stream retries failing rows in place, in commit
// order, and sets none aside; a topic left out of its claims would send
// its rows to the sweep, after later rows of their keys.
func (r *Relay) pollInStead(ctx context.Context, stop func() bool) {
	r.m.captureFallback.Set(1)
	r.capture.polling = true
	defer func() {
		r.capture.polling = false
		r.aside = newAsideRows()
		r.topics.clearAllFailing() // the stream retries its rows in place; a topic left out of its claims went to the sweep
		r.cur.rescanSoon()         // the rows set aside lie behind the cursor, which the next polling starts from
		r.m.setAside.Set(0)
		r.m.captureFallback.Set(0)
	}()
	r.poll(ctx, stop)
}

// tryCaptureLock takes the slot's capture lock on conn (sqlTryCaptureLock):
// errSlotBusy when another session holds it for captureLockWait.
func (r *Relay) tryCaptureLock(ctx context.Context, conn *pgconn.PgConn) error {
	q := sqlTryCaptureLock(outbox.QuoteLiteral(r.capture.slot))
	for deadline := time.Now().Add(captureLockWait); ; {
		res, err := conn.Exec(ctx, q).ReadAll()
		if err != nil {
			return fmt.Errorf("take the capture lock of slot %s: %w", r.capture.slot, err)
		}
		if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 1 {
			return fmt.Errorf("take the capture lock of slot %s: unexpected result", r.capture.slot)
		}
		switch {
		case string(res[0].Rows[0][0]) == "t":
			return nil
		case time.Now().After(deadline) || ctx.Err() != nil:
			return errSlotBusy
		}
		sleep(ctx, captureLockRetry)
	}
}

// replicationConn opens a replication connection with the pool's
// connection settings (TLS, token) and none of its session settings.
func (r *Relay) replicationConn(ctx context.Context) (*pgconn.PgConn, error) {
	cfg := r.pool.Config().ConnConfig.Config.Copy()
	// DateStyle and TimeZone fix the text form of the decoded rows'
	// timestamps (parseTimestamptz).
	app := "outbox-relay"
	if r.cfg.WriterDeletes {
		app = outbox.WriterDeletesRelay // the writers delete their rows only while it streams
	}
	cfg.RuntimeParams = map[string]string{"application_name": app, "replication": "database", "DateStyle": "ISO", "TimeZone": "UTC"}
	for _, p := range []string{"tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count"} {
		if v, ok := r.pool.Config().ConnConfig.RuntimeParams[p]; ok {
			cfg.RuntimeParams[p] = v
		}
	}
	if r.cfg.DatabaseTokens != nil {
		if err := r.cfg.DatabaseTokens.Apply(ctx, cfg); err != nil {
			return nil, err
		}
	}
	return pgconn.ConnectConfig(ctx, cfg)
}

// startReplication starts streaming from the slot on conn. It first takes
// the slot's capture lock on conn (errSlotBusy when another replica
// streams or polls in the stream's stead) and, with writer deletes once it
// marked the publication, the slot's writer-deletes lock, which the
// writers test before they delete (outbox.DeleteOnStoreCondition); both
// go with the session.
func (r *Relay) startReplication(ctx context.Context, conn *pgconn.PgConn, opts pglogrepl.StartReplicationOptions) error {
	if err := r.tryCaptureLock(ctx, conn); err != nil {
		return err
	}
	r.capture.streamPID, r.capture.streamStart = 0, 0
	if res, err := conn.Exec(ctx, sqlOwnSession).ReadAll(); err == nil && len(res) == 1 && len(res[0].Rows) == 1 {
		row := res[0].Rows[0]
		pid, err1 := strconv.ParseInt(string(row[0]), 10, 32)
		start, err2 := strconv.ParseInt(string(row[1]), 10, 64)
		if err1 == nil && err2 == nil {
			r.capture.streamPID, r.capture.streamStart = int32(pid), start
		}
	}
	if c := r.capture; r.cfg.WriterDeletes {
		// The mark first: the writers delete only while it is there and the
		// lock is held. A writer in a repeatable-read transaction reads the
		// mark as its snapshot saw it, which may be before it was removed;
		// so a relay that may not mark takes no lock, and its writers keep
		// their rows whatever their snapshot says.
		c.lockedDeletes, c.unmarkedSaid = false, false
		if err := r.markWriterDeletes(ctx); err != nil {
			r.warnUnmarked(err)
		} else {
			if err := lockWriterDeletes(ctx, conn, c.slot); err != nil {
				return err
			}
			c.lockedDeletes = true
		}
	}
	return pglogrepl.StartReplication(ctx, conn, r.capture.slot, 0, opts)
}

// lockWriterDeletes takes the slot's writer-deletes lock on conn, unless
// another session streams from the slot (errSlotBusy). A writer holds the
// lock shared only while it tests it, so a failed try is tried again
// until writerDeletesLockWait has passed.
func lockWriterDeletes(ctx context.Context, conn *pgconn.PgConn, slot string) error {
	name := outbox.QuoteLiteral(slot)
	q := `SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name::text = ` + name + ` AND active_pid IS NOT NULL)
        THEN NULL ELSE pg_try_advisory_lock(` + outbox.WriterDeletesLock(name) + `) END`
	for deadline := time.Now().Add(writerDeletesLockWait); ; {
		res, err := conn.Exec(ctx, q).ReadAll()
		if err != nil {
			return fmt.Errorf("take the writer-deletes lock of slot %s: %w", slot, err)
		}
		if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 1 {
			return fmt.Errorf("take the writer-deletes lock of slot %s: unexpected result", slot)
		}
		switch v := res[0].Rows[0][0]; {
		case v == nil:
			return errSlotBusy
		case string(v) == "t":
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("%w: the writer-deletes lock of slot %s is held by a session that does not stream from it", errCannotStream, slot)
		}
		sleep(ctx, writerDeletesLockRetry)
	}
}

// slotWaitLogged is how long making the slot waits before the relay says
// what it waits for.
const slotWaitLogged = 5 * time.Second

// makeSlot makes the slot on conn, exporting its snapshot (slotSnapshot).
// PostgreSQL makes it once every transaction that had taken an id when it
// began has ended, anywhere on the server, which a long one (a migration,
// a batch job) can put off for as long as it runs. The loop counts as
// moving meanwhile, so /healthz does not fail and the pod is not restarted
// for a wait that is not its own.
func (r *Relay) makeSlot(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.CreateReplicationSlotResult, error) {
	done := make(chan struct{})
	defer close(done)
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for start, told := time.Now(), false; ; {
			select {
			case <-done:
				return
			case now := <-t.C:
				r.health.iteration(now)
				if !told && now.Sub(start) >= slotWaitLogged {
					told = true
					r.log.Info("making the replication slot waits until every transaction that had taken an id when it began has ended (a long one anywhere on the server holds it back)",
						"slot", r.capture.slot, "waited", now.Sub(start).Round(time.Second))
				}
			}
		}
	}()
	return pglogrepl.CreateReplicationSlot(ctx, conn, r.capture.slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{SnapshotAction: "EXPORT_SNAPSHOT"})
}

// slotWaitPolls is how long making the slot may take before the relay
// polls meanwhile: long enough that a slot not held back by a long
// transaction is made first (polling's own transactions, each open for
// one batch, are among those making it waits for).
const slotWaitPolls = slotWaitLogged

// makeSlotPolling makes the slot on conn (makeSlot), calls made with it as
// soon as it exists, and, once making it has taken slotWaitPolls, polls
// the table until then: behind a long transaction, making it can take as
// long as that runs, and no other replica publishes meanwhile (conn holds
// the capture lock). The fallback from a slot that held back too much WAL
// comes here: the transaction that pinned the WAL is likely still open.
// The sweep before the slot skips what polling published; the stream's
// claims skip rows marked published. made may run beside a poll batch, so
// it uses a session of its own; conn is left for the slot's snapshot until
// the caller streams.
func (r *Relay) makeSlotPolling(ctx context.Context, conn *pgconn.PgConn, made func(pglogrepl.CreateReplicationSlotResult)) error {
	done := make(chan error, 1)
	go func() {
		res, err := r.makeSlot(ctx, conn)
		if err == nil {
			made(res)
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(slotWaitPolls):
	}
	r.log.Info("polling while the replication slot is made", "slot", r.capture.slot)
	var err error
	finished := false
	r.pollInStead(ctx, func() bool {
		select {
		case err = <-done:
			finished = true
		default:
		}
		return finished
	})
	if !finished { // ctx ended: making the slot ends with it
		err = <-done
	}
	return err
}

// stream takes the slot (making it when missing), sweeps what it does not
// carry, and publishes what the stream delivers until an error, the slot
// is given up, or ctx ends.
func (r *Relay) stream(ctx context.Context) error {
	c := r.capture
	conn, err := r.replicationConn(ctx)
	if err != nil {
		return fmt.Errorf("connect for replication: %w", err)
	}
	defer func() { conn.Close(context.WithoutCancel(ctx)) }()
	opts := pglogrepl.StartReplicationOptions{PluginArgs: []string{"proto_version '1'", "publication_names '" + c.publication + "'"}}
	err = r.startReplication(ctx, conn, opts)
	madeHere := false
	if pgCode(err) == "42704" { // no such slot: make it, on a connection of its own (the failed start leaves this one unusable)
		conn.Close(context.WithoutCancel(ctx))
		var fresh *pgconn.PgConn // conn stays the closed one, never nil, if this fails
		if fresh, err = r.replicationConn(ctx); err != nil {
			return fmt.Errorf("connect for replication: %w", err)
		}
		conn = fresh
		// The capture lock first: no other replica streams from the slot
		// before its snapshot is noted (noteBeforeSlot).
		if err := r.tryCaptureLock(ctx, conn); err != nil {
			return err
		}
		var before *slotSnapshot
		var snapErr error
		err = r.makeSlotPolling(ctx, conn, func(made pglogrepl.CreateReplicationSlotResult) {
			// At once, while polling may still finish a batch (on a
			// session of its own: the batch may hold the pool's
			// connections until its publish ends): a replica that stops
			// now leaves the snapshot for the next one.
			db, err := r.connect(ctx)
			if err != nil {
				snapErr = fmt.Errorf("connect to read the snapshot of slot %s: %w", c.slot, err)
				return
			}
			defer db.Close(context.WithoutCancel(ctx))
			if before, snapErr = r.readSlotSnapshot(ctx, db, made.SnapshotName); snapErr == nil {
				r.noteBeforeSlot(ctx, db, before)
			}
		})
		switch {
		case pgCode(err) == "42710": // another replica made it: that one sweeps before it
		case err != nil:
			return fmt.Errorf("create replication slot %s: %w", c.slot, err)
		case snapErr != nil:
			// Never streamed from, so the writers never deleted for it:
			// made again, it loses nothing.
			r.dropSlot(ctx, c.slot)
			return snapErr
		default:
			c.beforeSlot = before
			madeHere = true
			r.log.Info("created the replication slot", "slot", c.slot)
		}
		err = r.startReplication(ctx, conn, opts)
	}
	switch {
	case pgCode(err) == "55006": // object_in_use: another connection streams
		return errSlotBusy
	case pgCode(err) == "55000" || (err != nil && strings.Contains(err.Error(), "invalidated")):
		conn.Close(context.WithoutCancel(ctx))
		r.dropSlot(ctx, c.slot)
		return fmt.Errorf("%w: %v", errSlotGone, err)
	case err != nil:
		return fmt.Errorf("start replication from slot %s: %w", c.slot, err)
	}
	if !madeHere {
		if err := r.readBeforeSlot(ctx); err != nil {
			return err
		}
	}
	r.m.captureStreaming.Set(1)
	defer r.m.captureStreaming.Set(0)
	if c.lockedDeletes {
		r.m.captureWriterDeletes.Set(1)
		defer r.m.captureWriterDeletes.Set(0)
	}
	r.log.Info("streaming the table's inserts", "slot", c.slot, "publication", c.publication)

	s := &streamState{r: r, conn: conn, walSenderTimeout: r.walSenderTimeout(ctx)}
	s.statusEvery = statusEvery(s.walSenderTimeout)
	// The stream starts where the slot was confirmed, and its keepalives
	// report positions from the slot's restart point on, before that:
	// confirming one of those would take the slot back on a server that
	// lets it move backwards, and publish again what lies between.
	var confirmed *string
	if err := r.own.QueryRow(ctx, sqlSlotConfirmed, c.slot).Scan(&confirmed); err != nil {
		return fmt.Errorf("read where slot %s was confirmed: %w", c.slot, err)
	}
	if confirmed != nil {
		if at, err := pglogrepl.ParseLSN(*confirmed); err == nil {
			s.confirmed = at
		}
	}
	s.from = s.confirmed
	s.nextStatus = time.Now().Add(s.statusEvery)
	s.heard = time.Now()
	defer func() { _ = s.settle(context.WithoutCancel(ctx)) }() // a batch whose commit runs is finished, never abandoned
	// What the held table says before the first sweep.
	r.mergeHeld()
	if err := r.sweepBeforeSlot(ctx, s.keepAlive); err != nil {
		return err // before streaming: what the stream delivers is later than these rows
	}
	s.nextSweep = time.Now() // the sweep behind the stream, at once
	s.nextCheck = time.Now()
	swept := time.Now()
	for ctx.Err() == nil {
		now := time.Now()
		r.health.iteration(now)
		if now.Sub(swept) >= c.failingLimit {
			// Streaming this long without a failure is working, also on
			// an idle database, where no position moves.
			c.progressedAt = now
		}
		r.mergeHeld()
		if !now.Before(s.nextFilter) {
			// The stall check leaves out what this loop holds; the stream's
			// claims are not the polling loop's, which records its filter.
			s.nextFilter = now.Add(filterRefresh)
			r.storeFilter(now)
		}
		if err := s.checkSlotDue(ctx, now); err != nil {
			return err
		}
		if len(s.pending) == 0 && !s.inTx {
			sweep, err := s.sweepDue(ctx, now)
			if err != nil {
				return err
			}
			var due []int64
			if !sweep {
				due = r.held.releaseIDs(now)
			}
			if sweep || len(due) > 0 {
				// The streamed batch whose commit runs is settled first:
				// the sweep pipelines its own batches, and more than
				// MaxInFlight transactions would outgrow the pool.
				if err := s.settle(ctx); err != nil {
					return err
				}
			}
			if sweep {
				next, err := r.sweepBehind(ctx, s.keepAlive, s.fence)
				if err != nil {
					return err
				}
				s.nextSweep, s.fence = next, nil
			} else if len(due) > 0 {
				// Held rows due again are tried at once, by id, as polling
				// tries them with its next claim.
				if err := r.publishStreamed(ctx, due, nil, s.keepAlive); err != nil {
					return err
				}
			}
		}
		if !now.Before(s.nextStatus) {
			// Quiet for a report's interval: ask the server to answer, so
			// that a connection that no longer carries anything shows.
			if err := s.sendStatusAsking(ctx, now.Sub(s.heard) >= s.statusEvery); err != nil {
				return err
			}
		}
		deadline := minTime(s.nextStatus, s.nextCheck, now.Add(time.Second)) // held rows come due
		if len(s.pending) == 0 && !s.inTx {
			// Only then does the sweep run (above): while a transaction is
			// open, a sweep that is due must not end the wait at once, or
			// the loop would spin without ever reading the transaction's end.
			// One that waits for the stream waits for the next question.
			next := s.nextSweep
			if s.fence != nil {
				next = s.nextAsk
			}
			deadline = minTime(deadline, next)
		}
		if len(s.pending) > 0 {
			// The rows held go out as soon as nothing more has arrived:
			// the wait takes only what the connection has read already
			// (a deadline of now), unless its socket holds bytes not read
			// yet (s.arrived), whose messages it reads first, waiting at
			// most streamGap. So a lone row goes at once, rows that
			// arrive while a batch is published go together in the next
			// (the batches grow with the rate), and the linger bounds the
			// first waiting row's wait while messages keep coming.
			deadline = minTime(now, s.pendSince.Add(s.r.cfg.Linger))
			if s.arrived {
				deadline = minTime(now.Add(streamGap), s.pendSince.Add(s.r.cfg.Linger))
			}
			if !now.Before(s.pendSince.Add(s.r.cfg.Linger)) {
				if err := s.flush(ctx); err != nil {
					return err
				}
				continue
			}
		}
		msg, err := receive(ctx, conn, deadline)
		if err != nil {
			if pgconn.Timeout(err) && ctx.Err() == nil {
				if len(s.pending) > 0 && !s.arrived && unreadBytes(conn.Conn()) != 0 {
					s.arrived = true // more of the stream is here: read it first
					continue
				}
				s.arrived = false
				// Nothing waits on the socket either (a receive after a long
				// sweep or batch may time out at once, unread).
				if s.unanswered() && time.Since(s.askedAt) >= silentLimit(s.statusEvery, s.walSenderTimeout) && unreadBytes(conn.Conn()) == 0 {
					if err := s.silent(ctx); err != nil {
						return err
					}
				}
				if len(s.pending) == 0 {
					r.health.batchDone(time.Now(), 0, 0) // nothing committed: idle, as an empty claim is
				}
				if err := s.flush(ctx); err != nil {
					return err
				}
				continue
			}
			return fmt.Errorf("receive from replication slot %s: %w", c.slot, err)
		}
		s.arrived = false
		s.heard = now
		s.received++
		if err := s.handle(ctx, msg); err != nil {
			return err
		}
	}
	return nil
}

// silent decides what a question that no message followed for
// silentLimit means, reading the stream's session on the server through
// the pool (after closing the pool's connections: they went where the
// stream's did). A server busy with the stream, decoding a large
// transaction or reading it back from disk at its commit, answers only
// between its turns, every half wal_sender_timeout (older minor releases
// not until it is done): the loop asks again, where taking that for a lost
// connection would read the transaction again from the start, each time.
// Otherwise the connection is taken for lost and the stream ends, to start
// again on a new one. The session is ended on the server first: were it
// the client's side alone that went silent, the server would not hear the
// connection close, and would keep the slot active and the capture lock
// held until its wal_sender_timeout. Only this stream's own session is
// read and ended, known by its pid and its start: a pool that reaches a
// new primary after a failover finds none there (another replica's that
// reused the pid began at another time), and the stream ends.
func (s *streamState) silent(ctx context.Context) error {
	r, c := s.r, s.r.capture
	waited := time.Since(s.askedAt)
	r.pool.Reset()
	var event string
	err := r.own.QueryRow(ctx, sqlStreamSession, c.slot, c.streamPID, c.streamStart).Scan(&event)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr): // the server answers, if not this
		r.log.Warn("the replication session has not answered, and reading it on the server failed; asking again",
			"slot", c.slot, "waited", waited.Round(time.Second), "err", err)
		s.asking = false
		return nil
	case err == nil && !walSenderWaiting(event):
		r.log.Info("the replication session has not answered, but the server is busy with it; asking again",
			"slot", c.slot, "waited", waited.Round(time.Second), "wait_event", event)
		s.asking = false
		return nil
	case err == nil:
		var ended bool
		if err := r.own.QueryRow(ctx, sqlEndStreamSession, c.slot, c.streamPID, c.streamStart).Scan(&ended); err != nil {
			r.log.Warn("could not end the replication session that stopped answering; the slot stays busy until the server's wal_sender_timeout ends it",
				"slot", c.slot, "pid", c.streamPID, "err", err)
		} else if ended {
			r.log.Info("ended the replication session that stopped answering", "slot", c.slot, "pid", c.streamPID)
		}
	}
	return fmt.Errorf("the replication session of slot %s has not answered for %s, though asked (its connection dropped: a failover, a network partition); streaming again on a new one",
		c.slot, waited.Round(time.Second))
}

// walSenderWaiting reports whether a walsender's wait event says it waits
// for its client, for WAL or for a standby (a failover slot), not decoding
// (the names changed case in PostgreSQL 17).
func walSenderWaiting(event string) bool {
	switch strings.ToLower(event) {
	case "walsendermain", "walsenderwaitforwal", "walsenderwritedata", "waitforstandbyconfirmation":
		return true
	}
	return false
}

// silentLimit is how long after asking a stream that answers nothing is
// taken for lost (silent decides). Over a connection whose packets are
// dropped (a failover that leaves the old address silent) writes still
// succeed and reads only time out, which the loop took for an idle
// database: the stream waited on it until the kernel gave the connection
// up, about a quarter of an hour. The server answers at once when idle
// or reading WAL, but while it replays a transaction at its commit only
// every half wal_sender_timeout: the limit is that plus a report's
// interval, and two intervals at the least. Off Linux, where the socket's
// unread bytes cannot be counted (unreadBytes), the loop cannot tell
// silence from a read not tried, and leaves it to the kernel.
func silentLimit(statusEvery, walSenderTimeout time.Duration) time.Duration {
	return max(2*statusEvery, walSenderTimeout/2+statusEvery)
}

// receive reads the stream's next message, waiting until deadline. A short
// wait (rows are arriving) sets the deadline on the connection's socket, as
// pgconn does when a context ends: a context per message costs a timer
// and pgconn's watch of it, thousands of times a second at high rates. A
// longer one waits on ctx too, so the relay stops at once when it ends.
func receive(ctx context.Context, conn *pgconn.PgConn, deadline time.Time) (pgproto3.BackendMessage, error) {
	if time.Until(deadline) > shortWait {
		rctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		return conn.ReceiveMessage(rctx)
	}
	if err := conn.Conn().SetReadDeadline(deadline); err != nil {
		return nil, err
	}
	defer conn.Conn().SetReadDeadline(time.Time{}) //nolint:errcheck // a closed connection fails the next read
	return conn.ReceiveMessage(context.Background())
}

// streamState is one streaming session's position and what it holds.
type streamState struct {
	r    *Relay
	conn *pgconn.PgConn

	// arrived says the socket held bytes not read yet when the last wait
	// for a message ended with none (unreadBytes): the next wait reads them.
	arrived bool

	// rels are the relations the stream takes (the table now, and earlier
	// tables of its name: tableReplaced), as their last Relation message
	// in this session described them. Each change names its relation, and
	// pgoutput sends a relation's message again only when it changed, so
	// the stream keeps each: before, it kept only the last one sent, and
	// once an earlier table's message came again (a change to that table
	// after the table now's message) it left the table now's inserts out.
	rels map[uint32]streamRelation
	// rel and cur are the relation of the change being read (rels[rel]).
	rel uint32
	cur streamRelation
	// With writer deletes: the open transaction's rows, and the committed
	// rows not yet published (pending's ids).
	txRows, pendRows []streamedRow
	pendBytes        int64
	// putBack are the ids of rows put back into the table: their inserts
	// come back on the stream, to be left to the sweep (by when they were
	// put back, forgotten after putBackMemory).
	putBack map[int64]time.Time
	inTx    bool
	txIDs   []int64 // ids inserted by the open transaction
	// Without writer deletes: the open transaction's inserts, their
	// tuples copied into txRaw (the stream's buffer is reused by the next
	// message), in case the transaction deletes them (restore): those of
	// the first txKept of txIDs, as long as they take no more than the
	// capture's txTupleLimit (txBytes, and txFull once one did not fit),
	// and past them only those of txKeep, the rows a transaction read
	// again deletes (rereads). txDel are the ids the transaction deleted
	// after its first insert, matched with its inserts at its commit.
	txIns   []rawInsert
	txRaw   []byte
	txKept  int
	txBytes int // what the kept prefix takes, against the limit
	txFull  bool
	txKeep  []int64
	txDel   []relRow
	// txRels are, without writer deletes, the relations of txIDs' rows: at
	// the commit, of the rows of an earlier table of the table's name
	// (streamedRow.earlier) only those the transaction deleted stay, to be
	// put back (keptInEarlier).
	txRels []uint32
	// txCommit is the position of the open transaction's commit.
	txCommit pglogrepl.LSN
	// tuple is the columns of the message decode reads, within it
	// (tupleColumns), reused from message to message.
	tuple [][]byte
	// deleted, without writer deletes: whether the slot holds events
	// written with them that this stream has not published.
	deleted deletedRows
	pending []int64       // ids of committed transactions not yet published, in commit order
	pendLSN pglogrepl.LSN // the end of the last committed transaction in pending
	// txXid is the open transaction's id; pendXids are the ids of the
	// transactions whose rows are in pending (claimStreamed).
	txXid    uint32
	pendXids []int64
	// restore are the committed rows that a writer deleted in
	// the transaction that inserted them, to put back before pending's
	// claim (without writer deletes).
	restore []streamedRow
	// pendSince is when the first of pending arrived: the linger runs from it.
	pendSince time.Time
	// carry is the last published batch, its mark and commit still
	// running (beside the next batch's claim and publish); carryLSN is the
	// end of its transactions, confirmed once it committed.
	carry    *inFlight
	carryLSN pglogrepl.LSN
	// confirmed is how far the server may discard: every row before it is
	// published or in the table for the sweep.
	confirmed pglogrepl.LSN
	// passed is how far the stream has been read: every transaction that
	// ended before it has been decoded.
	passed pglogrepl.LSN
	// fence is the sweep that waits for the stream to pass its position,
	// nil when none does; nextAsk is when the loop next asks the server
	// for the stream's position meanwhile.
	fence   *sweepFence
	nextAsk time.Time
	// heard is when the loop last read a message of the stream, received
	// how many it has read. asking says a question to the server (a report
	// that asks for an answer) waits for a message after it: asked at
	// askedAt, after received was askedRecv (silentLimit).
	heard     time.Time
	received  uint64
	asking    bool
	askedAt   time.Time
	askedRecv uint64

	nextSweep, nextStatus, nextCheck, nextFilter time.Time
	// nextAlive is when keepAlive next looks for the replication session.
	nextAlive time.Time
	// statusEvery is how often the position is reported when nothing
	// else makes it (statusEvery), from the server's wal_sender_timeout
	// (0: none).
	statusEvery, walSenderTimeout time.Duration
	// from is where the slot was confirmed when the stream started.
	from pglogrepl.LSN
}

// handle processes one message of the replication protocol.
func (s *streamState) handle(ctx context.Context, msg pgproto3.BackendMessage) error {
	if err := s.handleMessage(ctx, msg); err != nil {
		return err
	}
	if len(s.pending) == 0 && !s.inTx && s.carry == nil && len(s.restore) == 0 {
		// Nothing waits to be published: the stream is idle, as an empty
		// claim is. A busy server keeps its reads from timing out (each
		// write elsewhere brings a keepalive), so the message says so too;
		// a batch failing meanwhile (a flush the stream replays) stays
		// failing until one completes.
		s.r.health.idle(time.Now())
	}
	return nil
}

// handleMessage reads one message of the stream.
func (s *streamState) handleMessage(ctx context.Context, msg pgproto3.BackendMessage) error {
	switch msg := msg.(type) {
	case *pgproto3.ErrorResponse:
		return fmt.Errorf("replication: %w", pgconn.ErrorResponseToPgError(msg))
	case *pgproto3.CopyData:
		if len(msg.Data) == 0 {
			return nil
		}
		switch msg.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			k, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
			if err != nil {
				return fmt.Errorf("replication keepalive: %w", err)
			}
			s.passed = max(s.passed, k.ServerWALEnd) // the end of the last record decoded
			if len(s.pending) == 0 && !s.inTx && s.carry == nil && k.ServerWALEnd > s.confirmed {
				s.confirmed = k.ServerWALEnd // nothing of ours before it is unpublished
			}
			if k.ReplyRequested {
				return s.sendStatus(ctx)
			}
		case pglogrepl.XLogDataByteID:
			x, err := pglogrepl.ParseXLogData(msg.Data[1:])
			if err != nil {
				return fmt.Errorf("replication data: %w", err)
			}
			return s.decode(ctx, x.WALData)
		}
	}
	return nil
}

// decode reads one pgoutput message: the table's relation, transaction
// boundaries and its inserts. Inserts and deletes, a message per row, are
// read in place: pglogrepl.Parse copies each column into an allocation of
// its own.
func (s *streamState) decode(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return errors.New("decode pgoutput: an empty message")
	}
	if data[0] == byte(pglogrepl.MessageTypeInsert) || data[0] == byte(pglogrepl.MessageTypeDelete) {
		return s.decodeRowChange(data)
	}
	m, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("decode pgoutput: %w", err)
	}
	switch m := m.(type) {
	case *pglogrepl.RelationMessage:
		// A relation of the table's name that is not the table now, taken
		// as an earlier table or not, is looked up again: a table renamed
		// away and back during a migration is the table now once more.
		if m.RelationName == s.r.table.Name && m.RelationID != s.r.capture.oid.Load() {
			if err := s.r.tableReplaced(ctx, m.RelationID, m.Namespace); err != nil {
				return err
			}
		}
		if s.r.capture.relations[m.RelationID] { // by oid: a dropped table of the same name in older WAL is another relation
			rel, err := s.r.readRelation(m)
			if err != nil {
				return err
			}
			if s.rels == nil {
				s.rels = map[uint32]streamRelation{}
			}
			s.rels[m.RelationID] = rel
		}
	case *pglogrepl.BeginMessage:
		s.inTx, s.txIDs, s.txRows, s.txIns, s.txRaw = true, s.txIDs[:0], s.txRows[:0], s.txIns[:0], s.txRaw[:0]
		s.txXid, s.txCommit = m.Xid, m.FinalLSN
		s.txKept, s.txBytes, s.txFull, s.txKeep, s.txDel = 0, 0, false, nil, s.txDel[:0]
		s.txRels = s.txRels[:0]
		s.readAgain()
	case *pglogrepl.CommitMessage:
		if len(s.txDel) > 0 {
			if err := s.matchDeleted(); err != nil {
				return err
			}
		}
		// Which rows are of an earlier table is judged here, once: a
		// Relation message within the transaction may have replaced the
		// table (tableReplaced).
		now := s.r.capture.oid.Load()
		if slices.ContainsFunc(s.txRels, func(rel uint32) bool { return rel != now }) {
			s.keptInEarlier(now)
		}
		s.inTx, s.passed = false, max(s.passed, m.TransactionEndLSN)
		if len(s.pending) == 0 && len(s.txIDs) > 0 {
			s.pendSince = time.Now()
		}
		base := len(s.pending)
		s.pending = append(s.pending, s.txIDs...)
		if len(s.txIDs) > 0 || len(s.txRows) > 0 {
			s.pendXids = append(s.pendXids, int64(s.txXid))
		}
		for _, x := range s.txRows {
			x.earlier = x.rel != now
			s.pendRows, s.pendBytes = append(s.pendRows, x), s.pendBytes+x.size
		}
		// The rows' places in pending, for rows put back under new ids
		// (restoreDeleted): by relation too, as two tables' rows may share
		// an id.
		var at map[relRow]int
		for _, x := range s.txIns {
			if x.deleted {
				cols, err := tupleColumns(s.txRaw[x.from:x.to], s.tuple)
				if err != nil {
					return err // read once already, as the insert came
				}
				s.tuple = cols
				if at == nil {
					at = make(map[relRow]int, len(s.txIDs))
					for i, id := range s.txIDs {
						at[relRow{rel: s.txRels[i], id: id}] = base + i
					}
				}
				back := tupleText(x.id, x.names, cols)
				back.rel, back.earlier, back.pendingAt = x.rel, x.rel != now, at[relRow{rel: x.rel, id: x.id}]
				s.restore = append(s.restore, back)
			}
		}
		s.txIDs, s.txRows, s.txIns, s.txDel, s.txRels = s.txIDs[:0], s.txRows[:0], s.txIns[:0], s.txDel[:0], s.txRels[:0]
		if cap(s.txRaw) > maxKeptTxRaw {
			s.txRaw, s.tuple = nil, nil // a large transaction's, not kept while the stream is idle
		}
		if cap(s.txDel) > maxKeptTxRaw/16 { // 16 bytes a row
			s.txDel = nil
		}
		if cap(s.txRels) > maxKeptTxRaw/4 { // 4 bytes a row
			s.txRels = nil
		}
		s.pendLSN = m.TransactionEndLSN
		if len(s.pending) == 0 && s.carry == nil {
			s.confirmed = max(s.confirmed, m.TransactionEndLSN)
		} else if len(s.pending) >= s.r.cfg.BatchSize || s.pendBytes >= int64(s.r.cfg.MaxBatchBytes) {
			return s.flush(ctx)
		}
	}
	return nil
}

// maxKeptTxRaw is the most capacity the stream's copy of a transaction's
// inserts (streamState.txRaw) keeps after its commit, for the next one.
const maxKeptTxRaw = 1 << 20

// rawInsert is an insert of the open transaction, without writer deletes:
// its tuple is txRaw[from:to], its columns' names names.
type rawInsert struct {
	id       int64
	from, to int
	names    []string
	rel      uint32 // its relation
	deleted  bool   // the transaction deleted the row
}

// rawInsertSize is what a rawInsert takes beside its tuple, counted
// against the capture's txTupleLimit.
const rawInsertSize = 64

// readAgain looks up the transaction that begins among those to read
// again (rereads), and forgets those the slot is confirmed past.
func (s *streamState) readAgain() {
	c := s.r.capture
	if len(c.rereads) == 0 {
		return
	}
	for at := range c.rereads {
		if at < s.confirmed {
			delete(c.rereads, at)
		}
	}
	if x := c.rereads[s.txCommit]; x != nil && x.xid == s.txXid {
		s.txKeep = x.ids
		s.r.log.Info("reading again a transaction that deleted rows it inserted, keeping those rows to put them back",
			"xid", s.txXid, "commit_lsn", s.txCommit, "rows", len(x.ids))
	}
}

// keepInsert keeps an insert's tuple, without writer deletes, when the
// open transaction's kept inserts stay within the capture's txTupleLimit,
// or the transaction is read again for that row (txKeep). Past the limit
// txRaw grows no further than it, so the memory held is the limit's.
func (s *streamState) keepInsert(id int64, tuple []byte) {
	keep := false
	if !s.txFull {
		if n := s.txBytes + len(tuple) + rawInsertSize; n <= s.r.capture.txTupleLimit {
			keep, s.txBytes, s.txKept = true, n, len(s.txIDs)
		} else {
			s.txFull = true // the kept ones stay a prefix of txIDs
		}
	}
	if !keep && s.txKeep != nil {
		_, keep = slices.BinarySearch(s.txKeep, id)
	}
	if !keep {
		return
	}
	if need := len(s.txRaw) + len(tuple); need > cap(s.txRaw) {
		n := max(need, 2*cap(s.txRaw))
		if need <= s.r.capture.txTupleLimit {
			n = min(n, s.r.capture.txTupleLimit)
		}
		raw := make([]byte, len(s.txRaw), n)
		copy(raw, s.txRaw)
		s.txRaw = raw
	}
	s.txIns = append(s.txIns, rawInsert{id: id, rel: s.rel, from: len(s.txRaw), to: len(s.txRaw) + len(tuple), names: s.cur.names})
	s.txRaw = append(s.txRaw, tuple...)
}

// matchDeleted marks, at the commit, the kept inserts that the open
// transaction deleted (txDel), to be restored. When it deleted a row whose
// tuple was not kept (past the limit), the row could not be put back: the
// stream ends, errReadAgain, and starts again where the slot was
// confirmed, before this transaction, which it then reads again keeping
// those rows' tuples (readAgain). The slot is confirmed past no more than
// the transactions before it whose rows were published and committed, so
// nothing is lost, and the rows the stream delivers again are found
// published by their claim and skipped: each row goes out once, in commit
// order.
func (s *streamState) matchDeleted() error {
	slices.SortFunc(s.txDel, compareRelRows)
	s.txDel = slices.Compact(s.txDel)
	for i := range s.txIns {
		if _, ok := slices.BinarySearchFunc(s.txDel, relRow{rel: s.txIns[i].rel, id: s.txIns[i].id}, compareRelRows); ok {
			s.txIns[i].deleted = true
		}
	}
	var lost []int64
	for i, id := range s.txIDs[s.txKept:] {
		if _, ok := slices.BinarySearchFunc(s.txDel, relRow{rel: s.txRels[s.txKept+i], id: id}, compareRelRows); !ok {
			continue
		}
		if _, kept := slices.BinarySearch(s.txKeep, id); !kept {
			lost = append(lost, id)
		}
	}
	if len(lost) == 0 {
		return nil
	}
	c := s.r.capture
	if c.rereads == nil {
		c.rereads = map[pglogrepl.LSN]*rereadTx{}
	}
	x := c.rereads[s.txCommit]
	if x == nil {
		x = &rereadTx{xid: s.txXid}
		c.rereads[s.txCommit] = x
	}
	x.ids = append(x.ids, lost...)
	slices.Sort(x.ids)
	x.ids = slices.Compact(x.ids)
	s.r.log.Warn("a transaction larger than the stream keeps in memory deleted rows it inserted (a writer with writer deletes, while this relay runs without them), which must go back into the table; streaming again from the slot's confirmed position to read it again, keeping those rows",
		"xid", s.txXid, "commit_lsn", s.txCommit, "rows", len(s.txIDs), "deleted", len(lost), "kept_bytes", c.txTupleLimit)
	return fmt.Errorf("%w: transaction %d (commit %s) deleted %d rows it inserted past the %d bytes of its inserts the stream keeps",
		errReadAgain, s.txXid, s.txCommit, len(lost), c.txTupleLimit)
}

// tableReplaced takes up relation oid, named as the table in schema
// namespace, if it is the table now: the table was dropped or renamed away
// and another made in its place (a migration), which a DBA, or a replica's
// start-up check, then added to the publication. Its inserts were
// otherwise left out of the stream: with writer deletes, whose writers
// delete again once the table is published, they were lost; without, they
// waited for the sweep and went out in id order. The table's earlier
// relations stay taken, for the changes of theirs a stream reads again.
//
// It also takes up an earlier table of the name, one the stream reads
// before the table now (a relay that started, or a standby that took over,
// after the table was replaced, with the slot's confirmed position before
// it): the rows its writers deleted are in no table, and go out from the
// stream, with writer deletes, or are put back into the table now
// (restore), without. Before, they were left out and lost; without writer
// deletes (switched off right after the replacement, or a writer that
// deletes while the publication is not marked) too. The rows they kept
// are in that table, not this one (streamedRow.earlier, publishDecoded,
// keptInEarlier). The table's schema is the one the start-up check found:
// mid-migration, no table may have the name.
func (r *Relay) tableReplaced(ctx context.Context, oid uint32, namespace string) error {
	var now *uint32 // NULL when no table has its name
	if err := r.own.QueryRow(ctx, sqlTableOID, r.table.Quoted()).Scan(&now); err != nil {
		return fmt.Errorf("read the oid of %s: %w", r.table, err)
	}
	switch {
	case now != nil && *now == oid:
		r.capture.relations[oid] = true
		r.capture.oid.Store(oid)
		r.log.Warn("the table was replaced by another of its name (dropped or renamed away, then made again and published); the stream takes the new table's inserts",
			"oid", oid) // r.log names the table
	case namespace == r.capture.namespace && !r.capture.relations[oid]:
		r.capture.relations[oid] = true
		r.log.Warn("the stream reads inserts of an earlier table of the table's name (dropped or renamed away, and made again, before this relay started); it publishes the rows their writers deleted, and leaves those they kept in that table",
			"oid", oid)
	}
	return nil // otherwise: a table of another schema, or an earlier table taken already
}

// streamRelation is what the stream knows of a relation it takes, from
// its Relation message.
type streamRelation struct {
	idCol int            // the index of the id column in its tuples
	names []string       // its columns' names, in its tuples' order; rows keep theirs
	cols  *streamColumns // with writer deletes: where each column the relay reads is
}

// readRelation reads relation m's columns (with writer deletes, where
// each column the relay reads is).
func (r *Relay) readRelation(m *pglogrepl.RelationMessage) (streamRelation, error) {
	x := streamRelation{idCol: -1, names: make([]string, len(m.Columns))}
	for i, c := range m.Columns {
		x.names[i] = c.Name
		if c.Name == "id" {
			x.idCol = i
		}
	}
	if x.idCol < 0 {
		return x, fmt.Errorf("the stream's %s.%s has no id column", m.Namespace, m.RelationName)
	}
	if r.cfg.WriterDeletes {
		cols, err := newStreamColumns(m, r.cfg.PartitionColumn)
		if err != nil {
			return x, err
		}
		x.cols = cols
	}
	return x, nil
}

// decodeRowChange reads an insert or a delete of the table: an insert's
// id, with writer deletes its whole row; a delete's id, to mark a row the
// same transaction inserted.
func (s *streamState) decodeRowChange(data []byte) error {
	rel, tuple, err := rowChange(data)
	if err != nil {
		return err
	}
	x, ok := s.rels[rel]
	if !ok {
		return nil // not a relation the stream takes
	}
	s.rel, s.cur = rel, x
	cols, err := tupleColumns(tuple, s.tuple)
	if err != nil {
		return fmt.Errorf("decode pgoutput %q message: %w", data[0], err)
	}
	s.tuple = cols
	if s.cur.idCol >= len(cols) {
		return nil
	}
	if data[0] == byte(pglogrepl.MessageTypeDelete) {
		// A row deleted by the transaction that inserted it was stored by
		// a writer with writer deletes: it is in no table, and the claim
		// would find it gone. Without writer deletes it goes back into
		// the table before the claim (restoreDeleted), so it is published
		// with the rest in commit order; with them it is published from
		// the stream, and a row its writer kept is claimed from the table
		// (publishDecoded). Deletes of earlier rows (published ones) are
		// not the stream's concern.
		id, err := strconv.ParseInt(string(cols[s.cur.idCol]), 10, 64)
		if err != nil {
			return nil // a key without the id: not a row this transaction inserted
		}
		// From the last: a writer deletes each row right after inserting
		// it, so the match is the last row or near it. Before, every delete
		// scanned the whole transaction: a transaction of 100,000 rows
		// took seconds, of a million minutes.
		// By relation too: the tables of the name may share ids (a new
		// table's start over), and a migration that copies rows into the
		// table now and deletes them from the earlier one would have
		// marked the copies deleted, published them from the stream, and
		// left them in the table for the sweep to publish again.
		for i := len(s.txRows) - 1; i >= 0; i-- {
			if s.txRows[i].id == id && s.txRows[i].rel == rel {
				s.txRows[i].deleted = true
				break // a transaction inserts an id once into a table
			}
		}
		if s.cur.cols == nil && len(s.txIDs) > 0 {
			// Matched with the inserts at the commit (matchDeleted); a
			// transaction that has inserted nothing deletes earlier rows.
			s.txDel = append(s.txDel, relRow{rel: rel, id: id})
		}
		return nil
	}
	if s.cur.cols != nil {
		x, err := s.cur.cols.decodeRow(cols)
		if err != nil {
			return err
		}
		x.rel, x.earlier = s.rel, s.rel != s.r.capture.oid.Load()
		if _, ok := s.putBack[x.id]; ok && !x.earlier { // the relay puts back into the table now, never an earlier one
			delete(s.putBack, x.id) // the relay's own insert: the row is in the table
			return nil
		}
		s.txIDs, s.txRows = append(s.txIDs, x.id), append(s.txRows, x)
		return nil
	}
	id, err := strconv.ParseInt(string(cols[s.cur.idCol]), 10, 64)
	if err != nil {
		return fmt.Errorf("the stream's id %q: %w", cols[s.cur.idCol], err)
	}
	s.txIDs, s.txRels = append(s.txIDs, id), append(s.txRels, s.rel)
	s.keepInsert(id, tuple) // until the commit, in case the transaction deletes the row
	return nil
}

// relRow is a row of a relation the stream takes, by its id.
type relRow struct {
	rel uint32
	id  int64
}

func compareRelRows(a, b relRow) int {
	return cmp.Or(cmp.Compare(a.id, b.id), cmp.Compare(a.rel, b.rel))
}

// keptInEarlier takes out of txIDs, at the open transaction's commit, the
// rows it inserted into an earlier table of the table's name and did not
// delete: they are in that table (or went with it), and the table now's
// row of their id, if any, is another event's, which the claim would
// publish out of its place. The rows it deleted stay, to be put back into
// the table now (restore), as with writer deletes (publishDecoded).
//
// now is the table now's relation.
func (s *streamState) keptInEarlier(now uint32) {
	deleted := make(map[relRow]bool, len(s.txIns))
	for _, x := range s.txIns {
		if x.deleted { // each stays: it is put back (restore, which finds its place by its relation and id)
			deleted[relRow{rel: x.rel, id: x.id}] = true
		}
	}
	var left []int64
	kept, rels := s.txIDs[:0], s.txRels[:0]
	for i, id := range s.txIDs {
		if rel := s.txRels[i]; rel != now && !deleted[relRow{rel: rel, id: id}] {
			left = append(left, id)
			continue
		}
		kept, rels = append(kept, id), append(rels, s.txRels[i])
	}
	s.txIDs, s.txRels = kept, rels
	if len(left) > 0 {
		s.r.log.Warn(keptInEarlierLog, "ids", left)
	}
}

// keptInEarlierLog is what the stream logs of rows inserted into an
// earlier table of the table's name that their writers kept.
const keptInEarlierLog = "rows their writers kept in an earlier table of the table's name stay there: the relay claims from the table now"

// rowChange splits pgoutput's insert or delete message (protocol version
// 1: its kind, the relation's id, the kind of tuple, the tuple) into the
// relation and the tuple.
func rowChange(data []byte) (rel uint32, tuple []byte, err error) {
	if len(data) < 6 {
		return 0, nil, fmt.Errorf("decode pgoutput %q message: %d bytes", data[0], len(data))
	}
	switch k := data[5]; {
	case data[0] == byte(pglogrepl.MessageTypeInsert) && k == 'N',
		data[0] == byte(pglogrepl.MessageTypeDelete) && (k == pglogrepl.DeleteMessageTupleTypeKey || k == pglogrepl.DeleteMessageTupleTypeOld):
		return binary.BigEndian.Uint32(data[1:5]), data[6:], nil
	default:
		return 0, nil, fmt.Errorf("decode pgoutput %q message: a tuple of kind %q", data[0], k)
	}
}

// tupleColumns splits pgoutput's TupleData (a column count, then each
// column's kind and, for a text or binary one, its length and bytes) into
// cols, reused: each column's bytes within tuple, nil for NULL or a TOASTed
// value left unchanged. The bytes are the message's: what outlives it
// must be copied.
func tupleColumns(tuple []byte, cols [][]byte) ([][]byte, error) {
	if len(tuple) < 2 {
		return nil, errors.New("no column count")
	}
	n := int(binary.BigEndian.Uint16(tuple))
	rest, cols := tuple[2:], cols[:0]
	for i := range n {
		if len(rest) == 0 {
			return nil, fmt.Errorf("it ends before column %d of %d", i+1, n)
		}
		kind := rest[0]
		rest = rest[1:]
		switch kind {
		case pglogrepl.TupleDataTypeText, pglogrepl.TupleDataTypeBinary:
			if len(rest) < 4 || uint64(binary.BigEndian.Uint32(rest)) > uint64(len(rest)-4) {
				return nil, fmt.Errorf("it ends within column %d of %d", i+1, n)
			}
			l := int(binary.BigEndian.Uint32(rest))
			cols, rest = append(cols, rest[4:4+l:4+l]), rest[4+l:]
		case pglogrepl.TupleDataTypeNull, pglogrepl.TupleDataTypeToast:
			cols = append(cols, nil)
		default:
			return nil, fmt.Errorf("column %d of %d is of kind %q", i+1, n, kind)
		}
	}
	return cols, nil
}

// flush publishes the pending rows; their last batch's mark and commit go
// on beside what comes next, and the slot's position is confirmed past a
// batch's transactions once it committed. On an error nothing more is
// confirmed: the stream starts again from the last confirmed position, and
// rows already published are skipped then.
func (s *streamState) flush(ctx context.Context) error {
	if len(s.pending) == 0 {
		return s.settle(ctx)
	}
	if s.cur.cols != nil {
		if err := s.publishDecoded(ctx, s.pendRows); err != nil {
			return err // nothing confirmed: the stream delivers them again
		}
		s.confirmed = max(s.confirmed, s.pendLSN)
		clear(s.pendRows) // their payloads
		s.pending, s.pendRows, s.pendBytes, s.pendXids = s.pending[:0], s.pendRows[:0], 0, s.pendXids[:0]
		return s.sendStatus(ctx)
	}
	if len(s.restore) > 0 {
		moved, err := s.r.restoreDeleted(ctx, s.restore)
		if err != nil {
			return err
		}
		for _, m := range moved { // each in its own place: two tables' rows may share an id
			for _, x := range s.restore {
				if x.id == m.from && x.column("event_id") == m.eventID {
					s.pending[x.pendingAt] = m.to
				}
			}
		}
		s.restore = s.restore[:0]
	}
	carried := s.carry != nil
	last, err := s.r.publishStreamedFrom(ctx, s.pending, s.pendXids, s.carry, s.keepAlive)
	s.carry = nil // settled by publishStreamedFrom, whatever its error
	if err != nil {
		if last != nil {
			_ = s.r.finish(last)
		}
		return err
	}
	if carried {
		s.confirmed = max(s.confirmed, s.carryLSN)
	}
	if last != nil {
		s.carry, s.carryLSN = last, s.pendLSN
	} else {
		s.confirmed = max(s.confirmed, s.pendLSN)
	}
	s.pending, s.pendXids = s.pending[:0], s.pendXids[:0]
	return s.sendStatus(ctx)
}

// settle waits for the carried batch's commit and confirms past it.
func (s *streamState) settle(ctx context.Context) error {
	if s.carry == nil {
		return nil
	}
	err := s.r.finish(s.carry)
	s.carry = nil
	if err != nil {
		return err
	}
	s.confirmed = max(s.confirmed, s.carryLSN)
	return s.sendStatus(ctx)
}

// checkSlotDue checks the slot (checkSlot) when its check is due, from the
// stream's loop or from keepAlive within a sweep or a batch: a slot past
// MaxRetainedWAL, or lost, ends the stream (errSlotGone) after it is
// dropped; with writer deletes it keeps the publication marked.
func (s *streamState) checkSlotDue(ctx context.Context, now time.Time) error {
	if now.Before(s.nextCheck) {
		return nil
	}
	r, slot := s.r, s.r.capture.slot
	s.nextCheck = now.Add(slotCheckInterval)
	marked, mayMark, err := r.checkSlot(ctx, slot, r.cfg.WriterDeletes || r.holdsDeleted(ctx, &s.deleted, s.confirmed))
	if err != nil {
		s.conn.Close(context.WithoutCancel(ctx))
		r.dropSlot(ctx, slot)
		return err
	}
	if r.cfg.WriterDeletes {
		return r.keepMarked(ctx, marked, mayMark)
	}
	return nil
}

// keepAlive reports the position when it is due while the loop does
// something other than read the stream: a sweep through a backlog can
// outlast wal_sender_timeout, after which the server ends a session that
// said nothing. It also fails, ending the work in hand, once the
// replication session is gone (a failed report, a closed connection, or,
// looked at once a second, no such backend on the server: terminated,
// or ended by wal_sender_timeout): the capture lock went with it, so
// another replica may be streaming the same rows already, and this one
// must not go on through a large transaction or a sweep beside it.
func (s *streamState) keepAlive(ctx context.Context) error {
	if s.conn.IsClosed() {
		return errors.New("the replication session is closed")
	}
	now := time.Now()
	if !now.Before(s.nextStatus) {
		if err := s.sendStatus(ctx); err != nil {
			return err
		}
	}
	// A sweep can last long (Kafka down, rows piling up, each batch
	// failing after its retries): the bound on the slot's WAL holds
	// meanwhile too.
	if err := s.checkSlotDue(ctx, now); err != nil {
		return err
	}
	if now.Before(s.nextAlive) {
		return nil
	}
	s.nextAlive = now.Add(captureLockCheck)
	pid := s.r.capture.streamPID
	if pid == 0 {
		return nil // not known: the stream's next read tells
	}
	var live bool
	if err := s.r.own.QueryRow(ctx, sqlBackendLive, pid).Scan(&live); err != nil {
		return fmt.Errorf("look for the replication session: %w", err)
	}
	if !live {
		return fmt.Errorf("the replication session (backend %d) has ended, and the capture lock with it", pid)
	}
	return nil
}

// walSenderTimeout is the server's wal_sender_timeout; 0 when it is off
// or cannot be read.
func (r *Relay) walSenderTimeout(ctx context.Context) time.Duration {
	var timeout float64
	if err := r.own.QueryRow(ctx, sqlWALSenderTimeout).Scan(&timeout); err != nil || timeout <= 0 {
		return 0
	}
	return time.Duration(timeout * float64(time.Second))
}

// statusEvery is how often a stream reports its position unasked:
// statusInterval, or a third of the server's wal_sender_timeout when that
// is shorter (0 turns the timeout off).
func statusEvery(walSenderTimeout time.Duration) time.Duration {
	if walSenderTimeout <= 0 {
		return statusInterval
	}
	return min(statusInterval, walSenderTimeout/3)
}

// unanswered reports whether the stream has read no message since the
// oldest question to the server it sent.
func (s *streamState) unanswered() bool { return s.asking && s.received == s.askedRecv }

// sendStatus tells the server how far it may discard the slot's WAL.
func (s *streamState) sendStatus(ctx context.Context) error {
	return s.sendStatusAsking(ctx, false)
}

// sendStatusAsking reports the position and, when ask, asks the server to
// answer with its own (a keepalive: how far the stream has been read).
func (s *streamState) sendStatusAsking(ctx context.Context, ask bool) error {
	at := time.Now()
	s.nextStatus = at.Add(s.statusEvery)
	err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: s.confirmed, WALFlushPosition: s.confirmed, WALApplyPosition: s.confirmed, ReplyRequested: ask,
	})
	if err != nil {
		return fmt.Errorf("confirm replication position: %w", err)
	}
	if ask && !s.unanswered() {
		s.asking, s.askedAt, s.askedRecv = true, at, s.received
	}
	if s.confirmed > s.from {
		s.r.capture.progressedAt = time.Now()
	}
	return nil
}

// publishStreamed claims, publishes and marks the rows of ids (in commit
// order), a batch at a time, as a poll batch does; rows already published,
// held or unmapped are not claimed. With MaxInFlight 2 a batch's mark and
// commit run beside the next batch's claim and publish (its publish starts
// after the previous one ended, so the stream's order holds); it returns
// once every batch committed. It calls alive before each batch (keepAlive).
func (r *Relay) publishStreamed(ctx context.Context, ids, xids []int64, alive func(context.Context) error) error {
	last, err := r.publishStreamedFrom(ctx, ids, xids, nil, alive)
	if last != nil {
		err = firstErr(err, r.finish(last))
	}
	return err
}

// publishStreamedFrom is publishStreamed after the batch carry, whose
// commit may still run: it waits for it before its first claim's publish
// is settled, and returns its own last batch with its commit running
// (nil when none), for the caller to finish.
func (r *Relay) publishStreamedFrom(ctx context.Context, ids, xids []int64, carry *inFlight, alive func(context.Context) error) (*inFlight, error) {
	pending := carry
	settle := func(err error) error {
		if pending != nil {
			err = firstErr(err, r.finish(pending))
			pending = nil
		}
		return err
	}
	for len(ids) > 0 {
		// A large transaction's rows can take longer than wal_sender_timeout.
		if err := alive(ctx); err != nil {
			return nil, settle(err)
		}
		// Each chunk is a batch of the loop, bounded by batchDeadline: a
		// sweep or a transaction of many batches is a loop that moves.
		r.health.iteration(time.Now())
		chunk := ids[:min(len(ids), r.cfg.BatchSize)]
		b, err := r.claimStreamed(ctx, chunk, xids, alive)
		if err = settle(err); err != nil {
			if b != nil {
				b.done <- r.markAndCommit(b)
				_ = r.finish(b)
			}
			return nil, err
		}
		if b == nil { // nothing of the chunk to publish
			ids = ids[len(chunk):]
			continue
		}
		cut := b.cut
		if len(b.retry) > 0 {
			// Some rows did not go out: they go before the chunks after
			// this one, which hold the later rows of their keys.
			left, err := r.retryStreamed(ctx, b, alive)
			if err != nil {
				return nil, err
			}
			if cut && len(left) > 0 {
				// Left to the sweep: the chunk is claimed again without
				// them. They were unpublished and not held, so the claim
				// took them first again, failed them at once, and spun on
				// the chunk for as long as their partition was down, while
				// nothing behind them went out.
				gone := make(map[int64]bool, len(left))
				for _, id := range left {
					gone[id] = true
				}
				// left is of the chunk, ids[:len(chunk)].
				ids = slices.Concat(slices.DeleteFunc(slices.Clone(chunk), func(id int64) bool { return gone[id] }), ids[len(chunk):])
			}
		} else if r.commitsBeside(b) {
			pending = r.commitAsync(b)
		} else {
			b.done <- r.markAndCommit(b)
			if err := r.finish(b); err != nil {
				return nil, err
			}
		}
		if !cut {
			ids = ids[len(chunk):]
		}
	}
	return pending, nil
}

// retryStreamed commits batch b, then publishes again the rows it did not
// get out (b.retry) before anything else (retryIDs), and returns those it
// left to the sweep.
func (r *Relay) retryStreamed(ctx context.Context, b *inFlight, alive func(context.Context) error) ([]int64, error) {
	ids, perr := b.retry, b.perr
	b.done <- r.markAndCommit(b)
	if err := r.finish(b); err != nil && err != perr { //nolint:errorlint // finish returns perr itself
		return nil, err
	}
	return r.retryIDs(ctx, ids, perr, alive)
}

// retryIDs publishes again, from the table, the rows of ids that a
// streamed batch did not get out (publish's retry; perr its error), with
// backoff, until none is left: the stream reads and publishes nothing else
// meanwhile, so each key's rows reach Kafka in commit order through broker
// failures, as a stream that stopped until Kafka took them would. Rows
// Kafka refuses are held and rows of a topic that is unavailable are left
// to the sweep, as in any batch (publish). Past StreamRetryLimit it leaves
// the rest to the sweep too, and retries nothing in place until a batch
// goes out whole again while no partition is set aside (retryAgain). It
// returns the rows it left to the sweep; the error is the database's or
// ctx's.
func (r *Relay) retryIDs(ctx context.Context, ids []int64, perr error, alive func(context.Context) error) ([]int64, error) {
	if r.capture.retryGivenUp {
		return ids, nil
	}
	var backoff time.Duration
	failed := ids // the rows the last try did not get out; ids may hold rows not tried yet too (retriedNext)
	for until := time.Now().Add(r.cfg.StreamRetryLimit); len(ids) > 0; {
		now := time.Now()
		r.health.iteration(now)
		if perr != nil {
			r.health.batchFailed(now, perr)
		}
		// Given up on rows that failed only: when the last try failed none,
		// the rows left are past its cut, not tried yet.
		if !now.Before(until) && len(failed) > 0 {
			r.capture.retryGivenUp = true
			r.m.streamLeftBehind.Add(float64(len(failed)))
			r.log.Warn("rows failed for longer than the stream retries them in place; the sweep publishes them, after later rows of their keys",
				"rows", len(failed), "for", r.cfg.StreamRetryLimit, "err", perr)
			return failed, nil
		}
		if backoff > 0 {
			d := jitter(backoff)
			r.health.idleUntil(now.Add(d))
			if err := alive(ctx); err != nil {
				return nil, err
			}
			if sleep(ctx, d); ctx.Err() != nil {
				return nil, ctx.Err()
			}
		}
		backoff = min(max(2*backoff, 100*time.Millisecond), r.cfg.MaxBackoff)
		if err := alive(ctx); err != nil {
			return nil, err
		}
		b, err := r.claimStreamed(ctx, ids, nil, alive)
		if err != nil {
			return nil, err
		}
		if b == nil {
			return nil, nil // published or held meanwhile
		}
		if len(b.retry) < len(ids) && b.perr == nil {
			backoff = 0 // rows went out: those that waited behind them go at once
		}
		ids, failed, perr = retriedNext(ids, b), b.retry, b.perr
		b.done <- r.markAndCommit(b)
		if err := r.finish(b); err != nil && err != perr { //nolint:errorlint // as above
			return nil, err
		}
	}
	return nil, nil
}

// retriedNext are the rows of ids that retryIDs claims next after batch
// b: those b did not get out, and, when its byte budget or a repeated id
// cut its claim short, those it did not claim, in commit order. (The
// table measures a row by its stored size, which for a jsonb array of
// small numbers is several times its text, the size a streamed batch was
// cut by.) Before, the rows past the cut were left to the sweep, which
// published them after the later rows of their keys. An id twice in ids
// (two rows of a partitioned table) loses one place per row of it b
// published, its first.
func retriedNext(ids []int64, b *inFlight) []int64 {
	if !b.cut {
		return b.retry
	}
	published := make(map[int64]int, len(b.published))
	for _, id := range b.published {
		published[id]++
	}
	return slices.DeleteFunc(slices.Clone(ids), func(id int64) bool {
		if published[id] > 0 {
			published[id]--
			return true
		}
		return false
	})
}

// retryAgain is called when a streamed batch went out whole: rows that
// fail are retried in place again (retryIDs), unless a partition is set
// aside, or was within StreamRetryLimit. A batch of other partitions' rows says nothing of it: before,
// any such batch ended the stream's giving up, and each new row of a
// partition that stayed down held the whole stream for StreamRetryLimit.
func (r *Relay) retryAgain() {
	if !r.topics.anyAside(time.Now(), r.cfg.StreamRetryLimit) {
		r.capture.retryGivenUp = false
	}
}

// waitVisible waits, up to StreamRetryLimit from start, until every one
// of xids, the transactions that wrote rows a claim asked for, is
// visible. The stream can deliver a commit before the transaction is
// visible: with synchronous replication a commit is written, and sent to
// logical replication, before the standby confirms it, and the
// transaction stays in progress for every session until then; a claim then
// leaves its rows to a sweep, after later rows of their keys. Past the
// limit it returns, and they are.
func (r *Relay) waitVisible(ctx context.Context, xids []int64, start time.Time, alive func(context.Context) error) error {
	for waited := false; ; waited = true {
		var invisible int
		if err := r.own.QueryRow(ctx, sqlInvisible, xids).Scan(&invisible); err != nil {
			return r.dbFailed(fmt.Errorf("read whether the stream's transactions are visible: %w", err))
		}
		switch {
		case invisible == 0:
			return nil
		case time.Since(start) > r.cfg.StreamRetryLimit || ctx.Err() != nil:
			r.log.Warn("transactions the stream delivered are still not visible; the sweep publishes their rows",
				"transactions", invisible, "waited", time.Since(start).Round(time.Millisecond))
			return nil
		case !waited:
			r.log.Info("waiting for transactions the stream delivered to become visible (synchronous replication?)", "transactions", invisible)
		}
		r.health.iteration(time.Now())
		// The wait can outlast wal_sender_timeout: report the position,
		// and stop if the session has ended meanwhile.
		if err := alive(ctx); err != nil {
			return err
		}
		sleep(ctx, visibleRetry)
	}
}

// visibleRetry is how often waitVisible looks again.
const visibleRetry = 5 * time.Millisecond

// claimStreamed claims the unpublished rows of ids and publishes them; its
// cut says the byte budget left some of them for another batch. Nil when
// it claimed nothing. xids, when not nil, are the transactions that wrote
// ids: a claim that finds fewer rows than ids (published, held, of a type
// no topic takes now, locked by another transaction, or not visible yet)
// waits until they are all visible (waitVisible) and claims again, waiting
// up to lockWait for rows another transaction has locked (another
// relay's batch, during a switch from polling, or an application's): a
// row it skipped would go out with a sweep, after later rows of its key.
func (r *Relay) claimStreamed(ctx context.Context, ids, xids []int64, alive func(context.Context) error) (*inFlight, error) {
	start := time.Now()
	f := claimFilter{types: r.availableTypes(start), held: r.held.ids(), largest: r.largestRecord()}
	claim := r.sql.ClaimIDs
	for {
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchDeadline(r.cfg))
		tx, err := r.pool.Begin(bctx)
		if err != nil {
			cancel()
			return nil, r.dbFailed(fmt.Errorf("begin claim transaction on %s: %w", r.table, err))
		}
		waiting := claim == r.sql.ClaimIDsWaiting
		if waiting {
			// lock_timeout bounds each lock wait; statement_timeout their sum.
			_, err = tx.Exec(bctx, sqlBoundWaits, strconv.FormatInt(r.lockWait().Milliseconds(), 10))
		}
		var rows []row
		var locked int
		if err == nil {
			pos, lo := commitOrder(ids)
			var rs pgx.Rows
			if rs, err = tx.Query(bctx, claim, ids, f.types, f.held, r.cfg.MaxBatchBytes, f.largest, pos, lo); err == nil {
				rows, _, locked, _, err = r.scanClaim(rs, f, false)
			}
		}
		if waiting && err == nil {
			// The mark and the commit run in this transaction too, under the
			// session's bounds.
			_, err = tx.Exec(bctx, sqlUnboundWaits)
		}
		if err == nil && len(xids) > 0 && locked < len(ids) {
			tx.Rollback(bctx) //nolint:errcheck // claimed again once they are visible
			cancel()
			err = r.waitVisible(ctx, xids, start, alive)
			if err == nil {
				xids, claim = nil, r.sql.ClaimIDsWaiting // once: the claim after the wait sees them all
				continue
			}
			return nil, err
		}
		if code := pgCode(err); waiting && (code == "55P03" || code == "57014" || code == "40P01") { // lock_not_available, query_canceled, deadlock_detected
			tx.Rollback(bctx) //nolint:errcheck // claimed again, without waiting
			cancel()
			r.log.Warn("rows the stream delivered stayed locked by another transaction, or the claim outlasted its wait; a sweep publishes the rows it skips, after later rows of their keys",
				"waited", r.lockWait(), "err", err)
			claim = r.sql.ClaimIDs
			continue
		}
		if err != nil {
			tx.Rollback(bctx) //nolint:errcheck // the claim's error is the one to report
			cancel()
			return nil, r.dbFailed(fmt.Errorf("claim streamed rows from %s: %w", r.table, err))
		}
		return r.publishClaimed(bctx, cancel, tx, start, rows, locked)
	}
}

// lockWait is how long a streamed claim waits for rows another
// transaction has locked (claimStreamed): as long as another relay's batch
// may take to publish, --publish-timeout, but no longer than its default,
// which leaves the claim's own publish its time within batchDeadline.
func (r *Relay) lockWait() time.Duration {
	return min(r.cfg.PublishTimeout, relayconfig.DefaultPublishTimeout)
}

// publishClaimed publishes the rows a streamed claim (on tx) returned.
func (r *Relay) publishClaimed(bctx context.Context, cancel context.CancelFunc, tx pgx.Tx, start time.Time, rows []row, locked int) (*inFlight, error) {
	r.setDBErr(nil)
	r.m.claimDuration.Observe(time.Since(start).Seconds())
	if len(rows) == 0 {
		defer cancel()
		r.health.batchDone(start, 0, 0)
		return nil, r.commit(bctx, tx)
	}
	rows, rest := r.uptoRepeatedID(rows)
	cut := len(rows) < locked || len(rest) > 0
	b := &inFlight{ctx: bctx, cancel: cancel, tx: tx, start: start, rows: rows, cut: cut,
		big: payloadBytes(rows) > bigBatchBytes, done: make(chan error, 1)}
	pctx, pcancel := publishing(bctx)
	b.published, b.retry, b.perr = r.publish(pctx, rows)
	pcancel()
	if len(b.retry) == 0 {
		r.retryAgain()
	}
	for _, x := range rest { // in commit order, before any later row: retryIDs claims them after the commit
		b.retry = append(b.retry, x.id)
	}
	b.holds, b.unhold = r.held.take(), r.held.forget(b.published)
	return b, nil
}

// denseOrderSpan bounds commitOrder's lookup: at most this many entries
// per id of the chunk.
const denseOrderSpan = 8

// commitOrder is the lookup SQL.ClaimIDs reads the ids' order from: pos
// holds, at an id less lo, its 1-based place in ids (0 at ids not among
// them), where the ids span no more than denseOrderSpan entries per id, as
// a stream's ids do unless a long transaction's commit brings an old one.
// Otherwise pos is nil and the claim looks each row up in ids.
func commitOrder(ids []int64) (pos []int32, lo int64) {
	if len(ids) == 0 {
		return nil, 0
	}
	lo, hi := slices.Min(ids), slices.Max(ids)
	if uint64(hi)-uint64(lo) >= uint64(denseOrderSpan*len(ids)) { // unsigned: ids of both signs cannot overflow it
		return nil, 0
	}
	pos = make([]int32, hi-lo+1)
	for i, id := range ids {
		if pos[id-lo] == 0 { // the first place, as array_position's
			pos[id-lo] = int32(i + 1)
		}
	}
	return pos, lo
}

// sweepFailed logs a failed sweep and says when to sweep again.
func (r *Relay) sweepFailed(err error) time.Time {
	r.log.Warn("sweep failed; sweeping again soon", "err", err, "in", sweepRetry)
	return time.Now().Add(sweepRetry)
}

// sweepFence holds a sweep while streaming back until the stream has read
// what the sweep could overtake. A sweep that claimed every unpublished
// row would race the stream: a row committed after one the stream has not
// read yet would go out first, and with writer deletes that earlier row is
// not in the table at all (TestWriterDeletesSweepsNeverOvertakeTheStream).
// So the sweep takes only rows last written by transactions before
// horizon, all of which had ended when lsn was read, and only once the
// stream has read past lsn: by then the stream has published (or put back)
// every row of theirs it carries. Rows of later transactions it leaves to
// the stream, or to the next sweep.
type sweepFence struct {
	horizon string        // a transaction id's text form
	lsn     pglogrepl.LSN // the WAL's insert position, read after horizon
	ids     []int64       // the first of the rows to sweep (SQL.SweepIDs)
}

// sweepDue says whether the sweep runs now: it is due and the stream has
// read past its fence. The first time it is due, it reads the fence and
// the rows to sweep; with none, the sweep is done until the next one.
// Meanwhile it asks the server every fenceAsk how far the stream has read:
// the server tells that when asked, or when it has more to send.
func (s *streamState) sweepDue(ctx context.Context, now time.Time) (bool, error) {
	if now.Before(s.nextSweep) {
		return false, nil
	}
	if s.fence == nil {
		f, err := s.r.readSweepFence(ctx)
		if err != nil {
			s.nextSweep = s.r.sweepFailed(err)
			return false, nil
		}
		if len(f.ids) == 0 {
			s.nextSweep = now.Add(s.r.cfg.FullRescanInterval)
			return false, nil
		}
		s.fence, s.nextAsk = f, now
	}
	if s.passed >= s.fence.lsn {
		return true, nil
	}
	if now.Before(s.nextAsk) {
		return false, nil
	}
	s.nextAsk = now.Add(fenceAsk)
	return false, s.sendStatusAsking(ctx, true)
}

// readSweepFence reads a sweep's fence and the first rows it sweeps.
func (r *Relay) readSweepFence(ctx context.Context) (*sweepFence, error) {
	var horizon, lsn string
	var page int64
	if err := r.own.QueryRow(ctx, sqlSweepFence).Scan(&horizon, &lsn, &page); err != nil {
		return nil, fmt.Errorf("read the sweep's transaction horizon: %w", err)
	}
	at, err := pglogrepl.ParseLSN(lsn)
	if err != nil {
		return nil, fmt.Errorf("read the sweep's transaction horizon: %w", err)
	}
	ids, err := r.sweepIDs(ctx, indexStart, horizon, nil)
	if err != nil {
		return nil, err
	}
	return &sweepFence{horizon: horizon, lsn: fencePosition(at, page), ids: ids}, nil
}

// fencePosition is the stream position that passes the WAL's insert
// position at, on WAL pages of page bytes. When the last record ends at a
// page's start, the insert position is past the page's header, and the
// stream's (the end of the last record it decoded) stays at the page's
// start until another record is written, which on an idle database may be
// never; no record ends inside a header, so the page's start is as good.
func fencePosition(at pglogrepl.LSN, page int64) pglogrepl.LSN {
	if off := int64(at) % page; off <= walPageHeaderMax {
		return at - pglogrepl.LSN(off)
	}
	return at
}

// sweepIDs reads the next ids to sweep after from (SQL.SweepIDs): rows
// of transactions before horizon, or seen by before when not nil, that a
// claim would take (rows held or of a type no topic takes now are left
// out, so a sweep does not walk through all of them each time).
func (r *Relay) sweepIDs(ctx context.Context, from int64, horizon string, before *slotSnapshot) ([]int64, error) {
	var xmax *string
	xip := []int64{}
	if before != nil {
		xmax, xip = &before.xmax, before.xip
	}
	rs, err := r.own.Query(ctx, r.sql.SweepIDs, from, horizon, r.availableTypes(time.Now()), r.held.ids(), sweepChunk*r.cfg.BatchSize, xmax, xip)
	if err != nil {
		return nil, r.dbFailed(fmt.Errorf("read the rows to sweep from %s: %w", r.table, err))
	}
	ids, err := pgx.CollectRows(rs, pgx.RowTo[int64])
	if err != nil {
		return nil, r.dbFailed(fmt.Errorf("read the rows to sweep from %s: %w", r.table, err))
	}
	return ids, nil
}

// sweepBehind is the sweep while streaming, once the stream passed f: it
// publishes the rows f found, and those after them that transactions
// before f's horizon wrote, by id, as the stream publishes its own. It
// returns when the next sweep is due: after FullRescanInterval, or after
// sweepRetry when this one failed (the database; Kafka's failures it
// retries in place, retryIDs): the rows it could not publish wait in the
// table, and no stream delivers them. It fails only when alive gave the
// slot up (errSlotGone) or asks for a new stream (errStreamAgain), which
// ends this one.
func (r *Relay) sweepBehind(ctx context.Context, alive func(context.Context) error, f *sweepFence) (next time.Time, err error) {
	if err := r.sweepBefore(ctx, alive, f.horizon, nil, f.ids); err != nil {
		if errors.Is(err, errSlotGone) || errors.Is(err, errStreamAgain) {
			return time.Time{}, err // the stream ends: alive gave the slot up, or it streams again to take the writer-deletes lock
		}
		return r.sweepFailed(err), nil
	}
	return time.Now().Add(r.cfg.FullRescanInterval), nil
}

// sweepBeforeSlot is the sweep when streaming starts. It publishes first
// the rows the stream does not carry because their transactions ended
// before the slot's position: those before the slot's catalog horizon
// (catalog_xmin, the oldest transaction the slot's decoding may still
// meet, never past its position) and, when this process made the slot,
// those its snapshot sees (slotSnapshot). The rows of later transactions
// it leaves to the stream, which publishes them in commit order (a sweep
// that took them too would put them out before earlier rows only the
// stream has, as in sweepFence), and the sweep behind the stream, due at
// once, the rest: rows the stream delivered before and left in the table
// (held, or failed past StreamRetryLimit), and rows from before a slot
// whose maker stopped before its first sweep ended. When it fails, the
// stream does not start: rows it then delivered would go out before these
// older ones.
func (r *Relay) sweepBeforeSlot(ctx context.Context, alive func(context.Context) error) error {
	var horizon *string
	if err := r.own.QueryRow(ctx, sqlSlotHorizon, r.capture.slot).Scan(&horizon); err != nil {
		return fmt.Errorf("read the catalog horizon of slot %s: %w", r.capture.slot, err)
	}
	before := r.capture.beforeSlot
	if horizon == nil && before == nil {
		return nil
	}
	h := "0" // no transaction precedes the invalid one (its age is the largest)
	if horizon != nil {
		h = *horizon
	}
	ids, err := r.sweepIDs(ctx, indexStart, h, before)
	if err == nil {
		err = r.sweepBefore(ctx, alive, h, before, ids)
	}
	if err != nil {
		return fmt.Errorf("sweep the rows before slot %s: %w", r.capture.slot, err)
	}
	if r.capture.beforeSlotNoted {
		// A note left behind is harmless: the rows its snapshot sees are
		// older than all the stream carries. Only this snapshot's goes: a
		// newer slot's maker may have noted its own meanwhile.
		if _, err := r.own.Exec(ctx, sqlRemoveNote(r.capture.publication, before.note())); err != nil {
			r.log.Warn("could not remove the slot's snapshot from the publication", "publication", r.capture.publication, "err", err)
		}
		r.capture.beforeSlotNoted = false
	}
	r.capture.beforeSlot = nil // what it left (held) the sweeps behind the stream publish
	return nil
}

// sweepBefore publishes, by id, the unpublished rows that transactions
// before horizon wrote, or that before sees (when not nil), from ids (the
// first of them, SQL.SweepIDs) on.
func (r *Relay) sweepBefore(ctx context.Context, alive func(context.Context) error, horizon string, before *slotSnapshot, ids []int64) error {
	for len(ids) > 0 && ctx.Err() == nil {
		if err := alive(ctx); err != nil {
			return err
		}
		if err := r.publishStreamed(ctx, ids, nil, alive); err != nil {
			return err
		}
		if len(ids) < sweepChunk*r.cfg.BatchSize {
			return nil
		}
		var err error
		if ids, err = r.sweepIDs(ctx, ids[len(ids)-1], horizon, before); err != nil {
			return err
		}
	}
	return nil
}

// checkSlot reads the slot's retained WAL; a slot past MaxRetainedWAL is
// given up, unless it holds rows their writers deleted, and a lost one is
// gone. It also reads whether the publication carries
// outbox.WriterDeletesMark and whether the relay may mark it (keepMarked;
// marked and not mayMark when the read failed: nothing to mend, nothing to
// try).
func (r *Relay) checkSlot(ctx context.Context, slot string, holdsDeleted bool) (marked, mayMark bool, err error) {
	var retained int64
	var status string
	if err := r.own.QueryRow(ctx, sqlSlotState, slot, r.capture.publication, outbox.WriterDeletesMark).Scan(&retained, &status, &marked, &mayMark); err != nil {
		// The stream goes on (it fails on its own if the database is
		// gone), but the retained-WAL bound is not checked meanwhile.
		r.log.Warn("could not read the replication slot's state; --max-retained-wal is not checked until it reads", "slot", slot, "err", err)
		return true, false, nil
	}
	r.m.slotRetainedWAL.Set(float64(retained))
	switch {
	case status == "lost" && holdsDeleted:
		r.log.Error("PostgreSQL invalidated the replication slot: the events written with writer deletes in the WAL it lost are gone, they were in no table; making a new slot",
			"slot", slot, "fix", "raise max_slot_wal_keep_size, and keep the relay streaming")
		return true, true, fmt.Errorf("%w: PostgreSQL invalidated slot %s (max_slot_wal_keep_size)", errSlotGone, slot)
	case status == "lost":
		return true, true, fmt.Errorf("%w: PostgreSQL invalidated slot %s (max_slot_wal_keep_size)", errSlotGone, slot)
	case retained > r.cfg.MaxRetainedWAL && holdsDeleted:
		// The slot is the only copy of the events it holds back: keep it.
		r.log.Error("the replication slot holds back more WAL than --max-retained-wal; it is kept, since it holds events written with writer deletes and its WAL is their only copy",
			"slot", slot, "retained_bytes", retained, "max", r.cfg.MaxRetainedWAL)
	case retained > r.cfg.MaxRetainedWAL:
		r.log.Error("the replication slot holds back more WAL than allowed; dropping it and polling",
			"slot", slot, "retained_bytes", retained, "max", r.cfg.MaxRetainedWAL)
		return true, true, fmt.Errorf("%w: slot %s retained %d bytes of WAL, more than --%s %d", errSlotGone, slot, retained, relayconfig.FlagMaxRetainedWAL, r.cfg.MaxRetainedWAL)
	}
	return marked, mayMark, nil
}

// markWriterDeletes adds outbox.WriterDeletesMark to the publication's
// comment; the writers delete only while it is there. Only the
// publication's owner may, and a DBA often makes it: a relay that may not
// streams all the same (warnUnmarked), takes no writer-deletes lock, and
// the writers keep their rows, which it claims from the table as a relay
// without writer deletes does.
func (r *Relay) markWriterDeletes(ctx context.Context) error {
	// On a connection of the pool: a replication connection of
	// PostgreSQL 14.0 and 14.1 takes no statement holding a ';'.
	_, err := r.own.Exec(ctx, sqlSetNote(r.capture.publication, outbox.WriterDeletesMark, outbox.WriterDeletesMark))
	return err
}

// warnUnmarked says that the relay may not mark the publication
// (markWriterDeletes failed with err), with the fix.
func (r *Relay) warnUnmarked(err error) {
	r.log.Warn("the relay may not mark the publication as streamed with writer deletes, so the writers keep their rows and the relay claims them from the table, as without writer deletes; make the relay's role the publication's owner",
		"publication", r.capture.publication, "err", err,
		"fix", "ALTER PUBLICATION "+pgx.Identifier{r.capture.publication}.Sanitize()+" OWNER TO "+pgx.Identifier{r.capture.role}.Sanitize())
}

// keepMarked keeps the publication marked while a relay with writer
// deletes streams; marked and mayMark are what the slot's check read. A
// mark removed (by hand, or by a relay without writer deletes just before
// its session ended) is set again at once: the writers keep their rows
// until it is. A stream that could not mark when it started tries again
// once its role may (a DBA made it the publication's owner) and ends
// (errStreamAgain), so that the next one takes the writer-deletes lock
// and the writers delete. It tries nothing while the role may not: each
// refusal would be an error in the server's log.
func (r *Relay) keepMarked(ctx context.Context, marked, mayMark bool) error {
	c := r.capture
	if (marked && c.lockedDeletes) || !mayMark {
		if !marked && c.lockedDeletes && !c.unmarkedSaid {
			c.unmarkedSaid = true
			r.log.Warn("the publication's writer-deletes mark is gone and the relay's role may no longer set it, so the writers keep their rows; make the relay's role the publication's owner",
				"publication", c.publication)
		}
		return nil
	}
	if err := r.markWriterDeletes(ctx); err != nil {
		r.log.Warn("could not mark the publication as streamed with writer deletes; the writers keep their rows until the relay does", "publication", c.publication, "err", err)
		return nil
	}
	if !c.lockedDeletes {
		r.log.Info("the relay may mark the publication now; streaming again to take the writer-deletes lock, after which the writers delete", "publication", c.publication)
		return errStreamAgain
	}
	c.unmarkedSaid = false
	r.log.Warn("the publication's writer-deletes mark was gone, so the writers kept their rows; marked it again", "publication", c.publication)
	return nil
}

// deletedRows is what a relay without writer deletes knows of the events
// that a relay with them streamed from the slot while their writers
// deleted their rows: they are in no table, so until this relay has
// streamed past them the slot is their only copy, and it is kept past
// MaxRetainedWAL (holdsDeleted).
type deletedRows struct {
	read bool // the publication's mark was read
	// xmax is, when the publication is marked, the first transaction id
	// not begun when the mark was read, after the last relay with writer
	// deletes stopped streaming: every writer that deleted its row began
	// before it.
	xmax string
	// end is the WAL's insert position once every transaction before xmax
	// had ended: every event written with writer deletes is before it. 0
	// until then.
	end pglogrepl.LSN
	// past: this relay has published everything before end, or the
	// publication is not marked.
	past bool
}

// holdsDeleted reports whether the slot may hold events written with
// writer deletes that this relay, having published everything before
// confirmed, has not streamed yet. Once it has streamed past them, it
// removes the publication's mark. A read that fails answers true: the
// slot is kept until one succeeds.
func (r *Relay) holdsDeleted(ctx context.Context, d *deletedRows, confirmed pglogrepl.LSN) bool {
	pub := r.capture.publication
	if !d.read {
		var marked bool
		if err := r.own.QueryRow(ctx, sqlDeletedRowsMark, pub, outbox.WriterDeletesMark).Scan(&marked, &d.xmax); err != nil {
			r.log.Warn("could not read whether the slot was streamed with writer deletes; it is kept until that reads", "publication", pub, "err", err)
			return true
		}
		d.read, d.past = true, !marked
		if marked {
			r.log.Info("the slot was streamed with writer deletes: it is kept past --"+relayconfig.FlagMaxRetainedWAL+" until the relay has published the events written so", "publication", pub)
		}
	}
	if d.past {
		return false
	}
	if d.end == 0 {
		var ended bool
		var at string
		if err := r.own.QueryRow(ctx, sqlDeletedRowsEnd, d.xmax).Scan(&ended, &at); err != nil {
			r.log.Warn("could not read how far the events written with writer deletes reach", "err", err)
			return true
		}
		if !ended {
			return true
		}
		end, err := pglogrepl.ParseLSN(at)
		if err != nil {
			r.log.Warn("could not read how far the events written with writer deletes reach", "err", err)
			return true
		}
		d.end = end
	}
	if confirmed < d.end {
		return true
	}
	d.past = true
	// Only while this relay's session streams from the slot: one that
	// ended a moment ago may have let a relay with writer deletes take the
	// slot and mark it.
	if r.capture.streamPID == 0 {
		r.log.Warn("could not remove the writer-deletes mark of the publication: the relay could not read its own session's process id, so relays without writer deletes keep the slot past --"+relayconfig.FlagMaxRetainedWAL+" until one removes it",
			"publication", pub, "fix", sqlMarkPublication(pub, "NULL"))
	} else if _, err := r.own.Exec(ctx, sqlUnmarkWhileStreaming(pub, r.capture.slot, r.capture.streamPID)); err != nil {
		// The next stream reads the mark again, and keeps the slot until
		// it has streamed past a later position.
		r.log.Warn("could not remove the writer-deletes mark of the publication", "publication", pub, "err", err,
			"fix", sqlMarkPublication(pub, "NULL"))
	}
	r.log.Info("published every event written with writer deletes; --"+relayconfig.FlagMaxRetainedWAL+" bounds the slot again", "publication", pub)
	return false
}

// dropSlot drops the slot once no connection uses it (the walsender of a
// closed connection ends shortly after).
func (r *Relay) dropSlot(ctx context.Context, slot string) {
	if c := r.capture; c != nil {
		// The rows its snapshot sees are not the next slot's to sweep first.
		c.beforeSlot, c.beforeSlotNoted = nil, false
	}
	var err error
	for i := 0; i < 20 && ctx.Err() == nil; i++ {
		var dropped bool
		if err = r.own.QueryRow(ctx, sqlDropSlot, slot).Scan(&dropped); err == nil && dropped {
			r.log.Warn("dropped the replication slot", "slot", slot)
			r.m.slotRetainedWAL.Set(0) // it holds back nothing now
			return
		}
		sleep(ctx, 100*time.Millisecond)
	}
	r.log.Error("could not drop the replication slot; it holds back WAL until dropped", "slot", slot, "err", err,
		"fix", "SELECT pg_drop_replication_slot('"+slot+"')")
}

// storeFilter records what a claim now would leave out, for the stall
// check (stats.go) to count only the rows this replica could claim.
func (r *Relay) storeFilter(now time.Time) {
	r.filter.Store(&claimFilter{types: r.availableTypes(now), held: r.held.ids(), keys: []string{}, keyTypes: []string{}, largest: r.largestRecord()})
}

// pgCode is err's SQLSTATE, "" when it has none.
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

func minTime(a time.Time, more ...time.Time) time.Time {
	for _, t := range more {
		if t.Before(a) {
			a = t
		}
	}
	return a
}
