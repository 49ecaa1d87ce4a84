package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// noPartition reports whether err is the server's refusal of a row whose
// partition key no partition of the table covers: a check_violation from
// the routine that routes a row to its partition (the message itself is
// translated under another lc_messages).
func noPartition(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23514" &&
		(pgErr.Routine == "ExecFindPartition" || strings.HasPrefix(pgErr.Message, "no partition of relation"))
}

// insertRecords runs the put-back's insert stmt of records (the text forms
// of rows) in tx. On a table partitioned by created_at, a row whose
// partition is gone (dropped by hand, or by a partition manager, while the
// row was in the slot only) would be refused at every retry, and the
// stream would wait behind it for ever: the relay attaches a partition
// over the stretch no partition covers around its created_at
// (restorePartitions) and inserts again.
// It returns the ids stmt returned: those of the rows it inserted.
func (r *Relay) insertRecords(ctx context.Context, tx pgx.Tx, stmt string, records []string, rows []streamedRow, oid uint32) ([]int64, error) {
	insert := func(q pgx.Tx) ([]int64, error) {
		res, err := q.Query(ctx, stmt, records)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(res, pgx.RowTo[int64])
	}
	if !r.shape.byCreatedAt {
		return insert(tx)
	}
	sp, err := tx.Begin(ctx) // a savepoint: the transaction goes on after a refusal
	if err != nil {
		return nil, err
	}
	ids, err := insert(sp)
	if err == nil {
		return ids, sp.Commit(ctx)
	}
	if rerr := sp.Rollback(ctx); rerr != nil || !noPartition(err) {
		return nil, err
	}
	made, rerr := r.restorePartitions(ctx, rows, oid)
	if rerr != nil || made == 0 {
		if rerr != nil {
			r.log.Warn("could not make a partition for rows the stream puts back", "err", rerr)
		}
		return nil, err
	}
	return insert(tx)
}

// restorePartitions attaches, for each of rows whose created_at no
// partition of the table (oid) covers, a partition over the stretch between the
// partitions around it, made as the partitions function of the shipped DDL
// makes one (outbox.QueueTableSettings), and returns how many it attached. It makes none
// for a stretch that ends after now (writers and the partitions function
// would go there) or that has no partition after it, and none where a
// table a pruner detached and has not dropped covers the row (the pruner
// settles it first: drops it, or attaches it again).
func (r *Relay) restorePartitions(ctx context.Context, rows []streamedRow, oid uint32) (int, error) {
	var texts []string
	for _, x := range rows {
		if i := slices.Index(x.names, "created_at"); i >= 0 && x.text[i] != nil {
			texts = append(texts, *x.text[i])
		}
	}
	if len(texts) == 0 {
		return 0, nil
	}
	c, err := r.pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer c.Release()
	conn := c.Conn()
	var (
		times []time.Time
		now   time.Time
		nsp   string
	)
	if err := conn.QueryRow(ctx, sqlRestoreInputs, texts, oid).Scan(&times, &now, &nsp); err != nil {
		return 0, fmt.Errorf("read the created_at of rows put back: %w", err)
	}
	parts, _, err := r.newPruner().partitions(ctx, conn, oid)
	if err != nil {
		return 0, err
	}
	made := 0
	for _, at := range times {
		lo, hi, ok := gapAround(parts, at)
		if !ok || hi == nil || hi.After(now) {
			continue
		}
		part := outbox.Table{Schema: nsp, Name: r.table.Name}.Suffixed("_restored_" + at.UTC().Format("20060102150405")).Quoted()
		from := "MINVALUE"
		if lo != nil {
			from = outbox.QuoteLiteral(lo.UTC().Format("2006-01-02 15:04:05.999999+00"))
		}
		bound := "FOR VALUES FROM (" + from + ") TO (" + outbox.QuoteLiteral(hi.UTC().Format("2006-01-02 15:04:05.999999+00")) + ")"
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'`); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `CREATE TABLE `+part+` (LIKE `+r.table.Quoted()+` INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE)
				WITH (`+outbox.QueueTableSettings+`)`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sqlAttach(r.table.Quoted(), part, bound))
			return err
		})
		if err != nil {
			return made, fmt.Errorf("attach partition %s %s to %s for rows put back: %w", part, bound, r.table, err)
		}
		made++
		parts = append(parts, partition{name: part, bound: bound, lo: lo, hi: hi, leaf: true})
		slices.SortFunc(parts, func(a, b partition) int { return compareLow(a.lo, b.lo) })
		r.log.Warn("a row the stream puts back had no partition (it was dropped); attached one over the stretch no partition covered",
			"partition", part, "range", bound, "created_at", at)
	}
	return made, nil
}

// sqlRestoreInputs: the text forms $1 of created_at as timestamptz, the
// time, and the schema of the table whose oid is $2.
const sqlRestoreInputs = `SELECT ARRAY(SELECT x::timestamptz FROM unnest($1::text[]) x), now(),
	(SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $2)`

// gapAround is the stretch around at that no partition of parts (in range
// order; tables a pruner detached count as covering) covers: from the end
// of the last partition before it (nil: MINVALUE) to the start of the
// first after it (nil: none); ok is false when one covers at.
func gapAround(parts []partition, at time.Time) (lo, hi *time.Time, ok bool) {
	for _, p := range parts {
		if p.isDef {
			return nil, nil, false
		}
		covers := (p.lo == nil || !p.lo.After(at)) && (p.hi == nil || p.hi.After(at))
		if covers {
			return nil, nil, false
		}
		if p.hi != nil && !p.hi.After(at) && (lo == nil || p.hi.After(*lo)) {
			h := *p.hi
			lo = &h
		}
		if p.lo != nil && p.lo.After(at) && (hi == nil || p.lo.Before(*hi)) {
			l := *p.lo
			hi = &l
		}
	}
	return lo, hi, true
}
