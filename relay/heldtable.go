package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// HeldRow is one row of the held table: an outbox row the relays hold back.
type HeldRow struct {
	ID           int64     `json:"id"`
	EventID      string    `json:"eventId"`
	EventType    string    `json:"eventType"`
	Reason       string    `json:"reason"`
	Error        string    `json:"error"`
	Attempts     int       `json:"attempts"`
	FirstAttempt time.Time `json:"firstAttempt"`
	LastAttempt  time.Time `json:"lastAttempt"`
	RetryAt      time.Time `json:"retryAt"`
}

// HeldFilter selects rows of the held table: every row with All; else
// those that match each kind of selector given (one of the ids, if any;
// one of the reasons, if any; one of the event types, if any), and none
// when none is given.
type HeldFilter struct {
	IDs     []int64
	Reasons []string
	Types   []string
	All     bool
}

// Empty reports whether f selects nothing.
func (f HeldFilter) Empty() bool {
	return !f.All && len(f.IDs) == 0 && len(f.Reasons) == 0 && len(f.Types) == 0
}

func (f HeldFilter) args() []any {
	return []any{f.IDs, f.Reasons, f.Types, f.All}
}

// heldConn is what ListHeld and Redrive need of a connection or pool.
type heldConn interface {
	querier
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// ListHeld returns up to limit rows of t's held table that f selects, in
// id order.
func ListHeld(ctx context.Context, conn heldConn, t outbox.Table, f HeldFilter, limit int) ([]HeldRow, error) {
	h := t.HeldTable()
	rows, err := conn.Query(ctx, NewSQL(t).ListHeld, append(f.args(), limit)...)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", h, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (HeldRow, error) {
		var x HeldRow
		err := r.Scan(&x.ID, &x.EventID, &x.EventType, &x.Reason, &x.Error, &x.Attempts, &x.FirstAttempt, &x.LastAttempt, &x.RetryAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", h, err)
	}
	return out, nil
}

// Redrive releases the held rows f selects: they are tried again at once,
// by every replica within statsInterval (when it next reads the held
// table). A row that fails again is held again, one attempt more; a batch
// that was trying it when Redrive ran leaves it released (where the held
// table has redriven_at). It returns how many rows it released.
func Redrive(ctx context.Context, conn heldConn, t outbox.Table, f HeldFilter) (int64, error) {
	h := t.HeldTable()
	var opts []SQLOption
	redrivenAt, err := hasColumn(ctx, conn, h, "redriven_at")
	if err != nil {
		return 0, err
	}
	if redrivenAt {
		opts = append(opts, WithHeldRedrivenAt())
	}
	tag, err := conn.Exec(ctx, NewSQL(t, opts...).Redrive, f.args()...)
	if err != nil {
		return 0, fmt.Errorf("release rows of %s: %w", h, err)
	}
	return tag.RowsAffected(), nil
}
