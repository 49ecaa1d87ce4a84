package outbox_test

import (
	"context"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// hookTx is a transaction that calls before with each statement Store
// sends through it (and its arguments) before sending it on.
type hookTx struct {
	pgx.Tx
	before func(ctx context.Context, sql string, args []any)
}

func (h *hookTx) hook(ctx context.Context, sql string, args []any) {
	if h.before != nil {
		h.before(ctx, sql, args)
	}
}

func (h *hookTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	h.hook(ctx, sql, args)
	return h.Tx.Exec(ctx, sql, args...)
}

func (h *hookTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	h.hook(ctx, sql, args)
	return h.Tx.Query(ctx, sql, args...)
}

func (h *hookTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	h.hook(ctx, sql, args)
	return h.Tx.QueryRow(ctx, sql, args...)
}

// isDelete reports whether sql is a DELETE statement.
func isDelete(sql string) bool {
	return strings.HasPrefix(strings.TrimSpace(sql), "DELETE")
}
