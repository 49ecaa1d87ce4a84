package relay

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// pruneLockTimeout bounds every lock wait of the pruner's session. The
// detach and the attach take SHARE UPDATE EXCLUSIVE on the outbox, which
// neither the claims nor the writers conflict with, but a wait of theirs
// would queue other DDL and vacuum behind it; a detach that gives up stays
// pending and the next pass finishes it.
const pruneLockTimeout = 10 * time.Second

// partition is one partition of a partitioned outbox, or a table the pruner
// detached from it and has not dropped yet.
type partition struct {
	name    string     // as a regclass prints it: quoted and qualified where needed
	bound   string     // "FOR VALUES FROM (…) TO (…)", as pg_get_expr prints it
	lo, hi  *time.Time // the range; nil for MINVALUE / MAXVALUE
	leaf    bool       // a plain table, not itself partitioned
	pending bool       // a DETACH … CONCURRENTLY that did not finish
	marked  bool       // a pruner began to detach it (detachedMark)
	old     bool       // the range ended more than KeepPublishedFor ago
	isDef   bool       // the DEFAULT partition
}

// detachedMark starts the comment the pruner puts on a partition before it
// detaches it, followed by the parent's oid and the bound: a pruner that
// dies between the detach and the drop leaves a table the next pass finds,
// checks, and drops or attaches again.
const detachedMark = "outbox relay: detaching from "

var boundRE = regexp.MustCompile(`^FOR VALUES FROM \((MINVALUE|'[^']*')\) TO \((MAXVALUE|'[^']*')\)$`)

// partitions lists the table's partitions in range order, and the tables
// the pruner detached and has not dropped (pending true, see detachedMark);
// and the cut: ranges that ended before it are old.
func (pr *pruner) partitions(ctx context.Context, conn *pgx.Conn, parent uint32) ([]partition, time.Time, error) {
	rows, err := conn.Query(ctx, sqlPartitions,
		parent, detachedMark+strconv.FormatUint(uint64(parent), 10)+": ")
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("list the partitions of %s: %w", pr.table, err)
	}
	var parts []partition
	for rows.Next() {
		var p partition
		if err := rows.Scan(&p.name, &p.bound, &p.leaf, &p.pending, &p.marked, &p.lo, &p.hi, &p.isDef); err != nil {
			return nil, time.Time{}, fmt.Errorf("list the partitions of %s: %w", pr.table, err)
		}
		parts = append(parts, p)
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, fmt.Errorf("list the partitions of %s: %w", pr.table, err)
	}
	var cut time.Time
	if err := conn.QueryRow(ctx, sqlPruneCut, pr.cfg.KeepPublishedFor.Seconds()).Scan(&cut); err != nil {
		return nil, time.Time{}, fmt.Errorf("read the time: %w", err)
	}
	for i := range parts {
		parts[i].old = parts[i].hi != nil && !parts[i].hi.After(cut)
	}
	slices.SortFunc(parts, func(a, b partition) int { return compareLow(a.lo, b.lo) })
	return parts, cut, nil
}

func compareLow(a, b *time.Time) int {
	switch {
	case a == nil && b == nil:
		return 0
	case a == nil:
		return -1
	case b == nil:
		return 1
	}
	return a.Compare(*b)
}

// prunePartitions is pruning on a partitioned table: it detaches and drops
// each leaf partition whose range ended more than KeepPublishedFor ago and
// that holds no unpublished row, then deletes the event ids of the time
// ranges no partition covers any more. It never deletes rows one by one.
//
// A partition is checked for unpublished rows before the detach, and again
// once detached (locked, so nothing can change it): a writer whose
// transaction began inside the partition's range and committed a row into
// it after the first check is waited for by the detach, and the second
// check finds its row. Such a partition is attached again, and its rows are
// published as usual. DETACH … CONCURRENTLY waits for the transactions
// using the table instead of locking them out (it cannot run inside a
// transaction block, and not beside a DEFAULT partition).
func (pr *pruner) prunePartitions(ctx context.Context, conn *pgx.Conn, parent uint32) error {
	parts, cut, err := pr.partitions(ctx, conn, parent)
	if err != nil {
		return err
	}
	// What a pruner detached, or began to, and did not drop is settled
	// first, whatever its age: under a longer retention than the one it
	// was detached under, or beside a DEFAULT partition made since, the
	// pass below would pass it by, and its rows, an unpublished one too,
	// would stay in no partition of the table, neither claimed nor counted.
	errs := []error{pr.settleMarked(ctx, conn, parent, parts, false)}
	parts = slices.DeleteFunc(parts, marked)
	if slices.ContainsFunc(parts, func(p partition) bool { return p.isDef }) {
		if !pr.warnedDefault {
			pr.warnedDefault = true
			pr.log.Warn("the table has a DEFAULT partition; partitions cannot be detached concurrently beside one, so none is dropped while it exists")
		}
		delays := map[string]time.Duration{}
		for _, p := range parts {
			if p.old && p.leaf && !p.isDef && p.hi != nil {
				delays[dropWaitDefault] = max(delays[dropWaitDefault], cut.Sub(*p.hi))
			}
		}
		pr.dropDelays(delays)
		return errors.Join(errs...)
	}
	slot, err := pr.slotName(ctx, conn)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	fences := map[string]*dropFence{}
	delays := map[string]time.Duration{} // by what the drop waits for, the longest past its time
	overdue := func(reason string, p partition) {
		if p.hi != nil {
			delays[reason] = max(delays[reason], cut.Sub(*p.hi))
		}
	}
	for _, p := range parts {
		if ctx.Err() != nil {
			return nil
		}
		if !p.old || !p.leaf {
			continue
		}
		if !p.pending {
			waits, err := pr.fenced(ctx, conn, p, slot, fences)
			if err != nil {
				errs = append(errs, err)
				overdue(dropWaitFailing, p)
				continue
			}
			if waits != "" {
				overdue(waits, p)
				continue
			}
			var waiting bool
			if err := conn.QueryRow(ctx, sqlPartitionWaits(p.name)).Scan(&waiting); err != nil {
				errs = append(errs, fmt.Errorf("look for unpublished rows in %s: %w", p.name, err))
				overdue(dropWaitFailing, p)
				continue
			}
			if waiting {
				overdue(dropWaitUnpublished, p) // never dropped while a row waits
				continue
			}
		}
		start := time.Now()
		if err := pr.detach(ctx, conn, parent, p); err != nil {
			errs = append(errs, err)
			overdue(dropWaitFailing, p)
			continue
		}
		if err := pr.dropDetached(ctx, conn, p); err != nil {
			errs = append(errs, err)
			overdue(dropWaitFailing, p)
			continue
		}
		pr.m.pruneDuration.Observe(time.Since(start).Seconds())
		sleep(ctx, pr.cfg.PrunePause)
	}
	if ctx.Err() == nil {
		pr.fences = fences // those of partitions gone, or detached, are forgotten
		pr.dropDelays(delays)
	}
	if pr.shape.eventIDs && ctx.Err() == nil {
		errs = append(errs, pr.pruneEventIDs(ctx, conn, parent))
	}
	return errors.Join(errs...)
}

// What an old partition's drop waits for (fenced), in
// outbox_relay_partition_drop_delay_seconds{reason}.
const (
	// dropWaitTransactions: a transaction that may have begun before the
	// partition's range ended is still open (or prepared).
	dropWaitTransactions = "transactions"
	// dropWaitSlot: the table's replication slot has not confirmed past the
	// WAL's position once those transactions had ended.
	dropWaitSlot = "slot"
	// dropWaitDefault: the table has a DEFAULT partition, beside which no
	// partition can be detached concurrently, so none is dropped.
	dropWaitDefault = "default_partition"
	// dropWaitUnpublished: a row of the partition is not published yet
	// (held, say): the partition is never dropped while one waits.
	dropWaitUnpublished = "unpublished"
	// dropWaitFailing: a step of the drop failed (the relay's log says
	// which): a lock wait that ran out, a privilege missing.
	dropWaitFailing = "failing"
)

// dropWaitReasons are every reason, for the gauge's series.
var dropWaitReasons = []string{dropWaitTransactions, dropWaitSlot, dropWaitDefault, dropWaitUnpublished, dropWaitFailing}

// dropDelays sets outbox_relay_partition_drop_delay_seconds from a pass:
// per reason, how long ago the drop of the partition waiting longest for it
// became due (its range end plus KeepPublishedFor), 0 when none waits. It
// is derived from the table's ranges and the server's clock, not from this
// replica's memory, so it reads the same whichever replica prunes; a
// replica that does not prune at a pass reports 0 (prune).
func (pr *pruner) dropDelays(delays map[string]time.Duration) {
	for _, reason := range dropWaitReasons {
		pr.m.partitionDropDelay.WithLabelValues(reason).Set(delays[reason].Seconds())
	}
}

// dropFence is what an old partition waits for before it is detached
// (fenced).
type dropFence struct {
	running []string // transactions that may have begun before its range ended, still running
	lsn     string   // the WAL's position once they had ended; "" until then
	logged  bool     // the wait was logged
}

// partitionKey names a partition and its range for the pruner's fences.
func partitionKey(p partition) string { return p.name + " " + p.bound }

// slotName is the name of the table's replication slot (outbox.SlotName),
// which may exist or not.
func (pr *pruner) slotName(ctx context.Context, conn *pgx.Conn) (string, error) {
	var db string
	if err := conn.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		return "", fmt.Errorf("read the database's name: %w", err)
	}
	return outbox.SlotName(db, pr.table), nil
}

// fenced reports what old partition p waits for (dropWaitTransactions,
// dropWaitSlot), or "" when it may be detached now: once every
// transaction that may have begun before its range ended has ended (a
// writer's row takes its transaction's start as created_at, so until then
// a row could still be committed into it, after the check for unpublished
// rows: a detach pending hides such a row from the claims), and, while
// the table's replication slot exists, once the slot has confirmed past
// the WAL's position read after they had ended. A row the stream has not
// confirmed may be in no table (its writer deleted it: writer deletes)
// and yet need to be put back into p (its type is unmapped, its topic is
// down, …); a p dropped before would leave it no partition to go to. What
// p waits for is noted the first time it is old, and kept across passes
// in next.
func (pr *pruner) fenced(ctx context.Context, conn *pgx.Conn, p partition, slot string, next map[string]*dropFence) (string, error) {
	key := partitionKey(p)
	f := pr.fences[key]
	if f == nil {
		f = &dropFence{}
		if err := conn.QueryRow(ctx, sqlRunningBefore, p.hi).Scan(&f.running); err != nil {
			return "", fmt.Errorf("list the transactions that may write into %s: %w", p.name, err)
		}
	}
	next[key] = f
	if len(f.running) > 0 {
		if err := conn.QueryRow(ctx, sqlStillRunning, f.running).Scan(&f.running); err != nil {
			return "", fmt.Errorf("list the transactions that may write into %s: %w", p.name, err)
		}
		if len(f.running) > 0 {
			if !f.logged {
				f.logged = true
				pr.log.Info("a partition old enough to drop waits for the transactions that may have begun before its range ended",
					"partition", p.name, "transactions", f.running)
			}
			return dropWaitTransactions, nil
		}
	}
	if f.lsn == "" {
		if err := conn.QueryRow(ctx, sqlWALInsert).Scan(&f.lsn); err != nil {
			return "", fmt.Errorf("read the WAL's position: %w", err)
		}
		f.logged = false
	}
	var past bool
	if err := conn.QueryRow(ctx, sqlSlotPast, slot, f.lsn).Scan(&past); err != nil {
		return "", fmt.Errorf("read the position of replication slot %s: %w", slot, err)
	}
	if past {
		return "", nil
	}
	if !f.logged {
		f.logged = true
		pr.log.Info("a partition old enough to drop waits for the replication slot to confirm past every transaction that may have written into it",
			"partition", p.name, "slot", slot, "lsn", f.lsn)
	}
	return dropWaitSlot, nil
}

// detach takes p out of the table: marks it (detachedMark), then DETACH …
// CONCURRENTLY, or … FINALIZE for a detach left pending.
func (pr *pruner) detach(ctx context.Context, conn *pgx.Conn, parent uint32, p partition) error {
	var attached bool
	if err := conn.QueryRow(ctx, sqlIsAttached, p.name).Scan(&attached); err != nil {
		return fmt.Errorf("find %s: %w", p.name, err)
	}
	if !attached {
		return nil // detached by an earlier pass that did not get to drop it
	}
	mark := detachedMark + strconv.FormatUint(uint64(parent), 10) + ": " + p.bound
	if _, err := conn.Exec(ctx, sqlComment(p.name, outbox.QuoteLiteral(mark))); err != nil {
		return fmt.Errorf("mark %s before detaching it: %w", p.name, err)
	}
	how := "CONCURRENTLY"
	if p.pending {
		how = "FINALIZE"
	}
	if _, err := conn.Exec(ctx, sqlDetach(pr.table.Quoted(), p.name, how)); err != nil {
		err = fmt.Errorf("detach %s from %s (%s): %w", p.name, pr.table, how, err)
		// A detach that failed before it began (its first lock wait timed
		// out) leaves the partition attached: the mark goes, or it would
		// claim a detach someone else later begins (restoreDetached).
		var pending bool
		if qerr := conn.QueryRow(ctx, sqlIsPending, p.name).Scan(&pending); qerr == nil && !pending {
			if _, cerr := conn.Exec(ctx, sqlComment(p.name, "NULL")); cerr != nil {
				err = errors.Join(err, fmt.Errorf("unmark %s: %w", p.name, cerr))
			}
		}
		return err
	}
	return nil
}

// restoreDetached attaches again every partition a pruner detached, or
// began to detach, and did not drop: with retention off nothing drops it,
// and its rows, published or not, would be in no partition of the table
// (a pruner that stopped between the detach and the drop, or a detach left
// pending, before retention was turned off). A detach someone else began
// (no detachedMark: a DBA's, or a partition manager's) is theirs to finish.
func (pr *pruner) restoreDetached(ctx context.Context, conn *pgx.Conn, parent uint32) error {
	parts, _, err := pr.partitions(ctx, conn, parent)
	if err != nil {
		return err
	}
	return pr.settleMarked(ctx, conn, parent, parts, true)
}

// marked reports whether p is a table a pruner detached, or began to
// detach, and did not drop (its detachedMark).
func marked(p partition) bool { return p.pending && p.marked && p.leaf }

// settleMarked finishes the detach of every marked table of parts, then
// drops it if it is old and all its rows are published, and attaches it
// again otherwise (always, with keepAll).
func (pr *pruner) settleMarked(ctx context.Context, conn *pgx.Conn, parent uint32, parts []partition, keepAll bool) error {
	var errs []error
	for _, p := range parts {
		if !marked(p) || ctx.Err() != nil {
			continue
		}
		if err := pr.detach(ctx, conn, parent, p); err != nil { // finishes a pending detach
			errs = append(errs, err)
			continue
		}
		errs = append(errs, pr.settleDetached(ctx, conn, p, keepAll || !p.old))
	}
	return errors.Join(errs...)
}

// dropDetached drops a detached partition whose rows are all published, or
// attaches it again when it holds an unpublished row.
func (pr *pruner) dropDetached(ctx context.Context, conn *pgx.Conn, p partition) error {
	return pr.settleDetached(ctx, conn, p, false)
}

// settleDetached drops a detached partition whose rows are all published,
// or attaches it again when it holds an unpublished row or keep is set.
func (pr *pruner) settleDetached(ctx context.Context, conn *pgx.Conn, p partition, keep bool) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("drop %s: %w", p.name, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	// Counting a large partition can outlast the session's statement
	// timeout; the table is detached and locked by this transaction alone,
	// so nothing waits on it meanwhile.
	if _, err := tx.Exec(ctx, sqlLongStatements); err != nil {
		return fmt.Errorf("drop %s: %w", p.name, err)
	}
	if _, err := tx.Exec(ctx, sqlLockAlone(p.name)); err != nil {
		return fmt.Errorf("lock detached partition %s: %w", p.name, err)
	}
	var rows, unpublished int64
	if err := tx.QueryRow(ctx, sqlCountRows(p.name)).Scan(&rows, &unpublished); err != nil {
		return fmt.Errorf("count the rows of detached partition %s: %w", p.name, err)
	}
	if unpublished > 0 || keep {
		if !boundRE.MatchString(p.bound) {
			return fmt.Errorf("detached partition %s holds %d unpublished rows and its bound %q cannot be read back; attach it again by hand", p.name, unpublished, p.bound)
		}
		if _, err := tx.Exec(ctx, sqlAttach(pr.table.Quoted(), p.name, p.bound)); err != nil {
			return fmt.Errorf("attach %s again (it holds %d unpublished rows): %w", p.name, unpublished, err)
		}
		if _, err := tx.Exec(ctx, sqlComment(p.name, "NULL")); err != nil {
			return fmt.Errorf("attach %s again: %w", p.name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("attach %s again (it holds %d unpublished rows): %w", p.name, unpublished, err)
		}
		if keep {
			pr.log.Warn("attached again a partition a pruner had detached and not dropped: retention is off, or keeps it longer now",
				"partition", p.name, "rows", rows, "unpublished", unpublished)
			return nil
		}
		pr.log.Warn("a detached partition holds unpublished rows (a writer whose transaction began inside its range committed late, or a pruner stopped between the detach and this check); attached it again",
			"partition", p.name, "unpublished", unpublished)
		return nil
	}
	if _, err := tx.Exec(ctx, sqlDrop(p.name)); err != nil {
		return fmt.Errorf("drop detached partition %s: %w", p.name, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("drop detached partition %s: %w", p.name, err)
	}
	pr.m.pruned.Add(float64(rows))
	pr.m.prunedPartitions.Inc()
	pr.log.Info("dropped a partition whose rows were all published", "partition", p.name, "rows", rows, "range", p.bound)
	return nil
}

// pruneEventIDs deletes, in batches of PruneBatchSize, the event ids whose
// created_at no partition covers (their partition was dropped), in the
// stretches that ended more than KeepPublishedFor ago. A store into such a
// stretch fails as a whole (no partition takes the row), so every id there
// belongs to a dropped row.
func (pr *pruner) pruneEventIDs(ctx context.Context, conn *pgx.Conn, parent uint32) error {
	parts, cut, err := pr.partitions(ctx, conn, parent)
	if err != nil {
		return err
	}
	ids := pr.table.EventIDsTable().Quoted()
	for _, g := range uncovered(parts, cut) {
		for ctx.Err() == nil {
			tag, err := conn.Exec(ctx, sqlDeleteEventIDs(ids),
				g.lo, g.hi, pr.cfg.PruneBatchSize)
			if err != nil {
				return fmt.Errorf("delete the event ids of dropped partitions from %s: %w", ids, err)
			}
			if tag.RowsAffected() < int64(pr.cfg.PruneBatchSize) {
				break
			}
			sleep(ctx, pr.cfg.PrunePause)
		}
	}
	return nil
}

// span is a stretch of created_at; a nil end is unbounded.
type span struct{ lo, hi *time.Time }

// uncovered returns the stretches below cut that no partition covers;
// parts are in range order.
func uncovered(parts []partition, cut time.Time) []span {
	var out []span
	var from *time.Time // where the current uncovered stretch starts; nil: -infinity
	for _, p := range parts {
		if p.lo != nil && (from == nil || from.Before(*p.lo)) {
			end := *p.lo
			if cut.Before(end) {
				end = cut
			}
			if from == nil || from.Before(end) {
				out = append(out, span{from, &end})
			}
		}
		if p.hi == nil {
			return out // covered to +infinity
		}
		if from == nil || p.hi.After(*from) {
			hi := *p.hi
			from = &hi
		}
	}
	if from == nil || from.Before(cut) {
		out = append(out, span{from, &cut})
	}
	return out
}
