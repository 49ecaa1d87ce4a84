package relay

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// pruneKey is the advisory-lock key (in the table's membership lock class)
// whose holder prunes; the other replicas wait their turn.
const pruneKey = 3

// pruneEvery is how often a replica tries to become the pruner, and how long
// the pruner rests after a pass that found nothing more to delete.
const pruneEvery = 10 * time.Second

// pruner is the relay's maintenance, apart from its claim–publish–mark
// loop: it deletes published rows past retention (prune.go) and, on a
// partitioned table, drops whole published partitions (partitions.go). It
// needs only the table, the settings, the statements, a way to connect,
// the metrics and the log; Run starts it beside the loop.
type pruner struct {
	table   outbox.Table
	cfg     Config
	sql     SQL
	shape   tableShape
	connect func(context.Context) (*pgx.Conn, error) // a session of its own
	m       *metrics
	log     *slog.Logger

	// tail is where the last pass's look past the old rows of a plain
	// table ended (pruneTail): ids that do not follow creation (ranges
	// of their own, a sequence counting down) put old rows after young
	// ones, which the walks from the head never reach.
	tail int64

	warnedDefault bool // the DEFAULT partition that stops partition drops was logged
	// fences are what each old partition waits for before it is detached
	// (fenced), by partitionKey; those of partitions gone are forgotten.
	fences map[string]*dropFence
}

// newPruner is r's pruner, once Check has read the table.
func (r *Relay) newPruner() *pruner {
	return &pruner{table: r.table, cfg: r.cfg, sql: r.sql, shape: r.shape, connect: r.connect, m: r.m, log: r.log, tail: indexStart}
}

// loop deletes published rows older than KeepPublishedFor (on a
// partitioned table: whole partitions, see prunePartitions). Exactly one
// replica of a table prunes at a time (a session advisory lock on its own
// connection), in transactions of at most PruneBatchSize rows with
// PrunePause between them. It only deletes rows whose published_at is set
// and skips rows another transaction holds, so it never touches an
// unpublished row and never waits on a claim or a writer.
//
// With retention off (on a partitioned table only) it attaches again, at
// start and every restoreEvery, the partitions a pruner detached and did
// not drop (restoreDetached).
func (pr *pruner) loop(ctx context.Context) {
	every := pruneEvery
	if pr.cfg.KeepPublishedFor == 0 {
		every = restoreEvery
	}
	for ctx.Err() == nil {
		if err := pr.prune(ctx); err != nil && ctx.Err() == nil {
			pr.m.pruneErrors.Inc()
			pr.log.Warn("pruning failed; retrying", "err", err, "in", every)
		}
		sleep(ctx, jitter(every))
	}
}

// tailBatches is how many batches past the old rows each pass looks at,
// beyond as many as its walk from the head deleted from.
const tailBatches = 10

// pruneBatch looks at the batch of rows after id after and deletes those
// old enough (SQL.Prune).
func (pr *pruner) pruneBatch(ctx context.Context, conn *pgx.Conn, after int64) (deleted, last, old int64, err error) {
	start := time.Now()
	if err := conn.QueryRow(ctx, pr.sql.Prune, after, pr.cfg.KeepPublishedFor.Seconds(), pr.cfg.PruneBatchSize).Scan(&deleted, &last, &old); err != nil {
		return 0, 0, 0, fmt.Errorf("prune %s: %w", pr.table, err)
	}
	pr.m.pruneDuration.Observe(time.Since(start).Seconds())
	pr.m.pruned.Add(float64(deleted))
	return deleted, last, old, nil
}

// pruneTail looks at batches batches from where the last pass's look
// ended (from head on, the end of the rows this pass walked, when that is
// further), wrapping at the table's end, and deletes what is old enough.
func (pr *pruner) pruneTail(ctx context.Context, conn *pgx.Conn, head int64, batches int) (int64, error) {
	after, deleted := max(pr.tail, head), int64(0)
	for range batches {
		n, last, _, err := pr.pruneBatch(ctx, conn, after)
		if err != nil {
			return deleted, err
		}
		deleted += n
		if last == after { // the table's end: the next pass starts from its head
			after = indexStart
			break
		}
		after = last
		sleep(ctx, pr.cfg.PrunePause)
	}
	pr.tail = after
	return deleted, nil
}

// restoreEvery is how often, with retention off, a replica looks for
// partitions a pruner detached and did not drop (restoreDetached): only a
// pruner of an older setting, or of another replica still running with
// retention on, leaves one.
const restoreEvery = 10 * time.Minute

// prune holds the prune lock for as long as pruning keeps finding rows.
func (pr *pruner) prune(ctx context.Context) error {
	conn, err := pr.connect(ctx)
	if err != nil {
		return fmt.Errorf("connect pruning session: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	oid, err := tableOID(ctx, conn, pr.table)
	if err != nil {
		return err
	}
	var mine bool
	if err := conn.QueryRow(ctx, sqlTryLock, int32(oid&0x1fffffff)<<1, pruneKey).Scan(&mine); err != nil {
		return fmt.Errorf("take the prune lock of %s: %w", pr.table, err)
	}
	if !mine {
		// Another replica prunes and reports the delays; this one's last
		// reading would outlast what it measured.
		pr.dropDelays(nil)
		return nil
	}
	if pr.shape.partitioned {
		// Detaching and attaching partitions: every lock wait is bounded.
		if _, err := conn.Exec(ctx, sqlSetSession, "lock_timeout", strconv.FormatInt(pruneLockTimeout.Milliseconds(), 10)); err != nil {
			return fmt.Errorf("set lock_timeout on the pruning session: %w", err)
		}
		if pr.cfg.KeepPublishedFor == 0 { // only a table a pruner may have pruned gets here (Run)
			return pr.restoreDetached(ctx, conn, oid)
		}
		return pr.prunePartitions(ctx, conn, oid)
	}
	// A walk in id order, a batch of rows at a time, up to the first batch
	// with no row old enough: past it, rows are kept, as ids follow
	// creation, but for transactions that ran long, whose rows a later
	// walk takes. Then a look further on, from where the last pass's
	// ended (pruneTail), for ids that do not follow creation: the whole
	// table in turn.
	after, deleted, moved := int64(indexStart), int64(0), 0
	for ctx.Err() == nil {
		n, last, old, err := pr.pruneBatch(ctx, conn, after)
		if err != nil {
			return err
		}
		deleted += n
		if n > 0 {
			moved++ // the old rows' edge moves on by about a batch
		}
		sleep(ctx, pr.cfg.PrunePause) // paced also through batches it deleted nothing of: each read a batch
		if old > 0 {
			after = last
			continue
		}
		// As many batches more as the walk from the head deleted from,
		// and tailBatches: the look gains on the old rows' edge however
		// fast rows age past it.
		n, err = pr.pruneTail(ctx, conn, last, tailBatches+moved)
		if err != nil {
			return err
		}
		if deleted += n; deleted == 0 {
			return nil // nothing old enough
		}
		// Rows skipped (held by others) are looked at again.
		after, deleted, moved = indexStart, 0, 0
		sleep(ctx, jitter(pruneEvery))
	}
	return nil
}
