package relay

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// unordered is OrderingNone: replicas share rows through SKIP LOCKED, rows
// are independent of each other, and a row that cannot go out now is simply
// claimed again later. Only rows of mapped types whose topic is available
// are claimed, leaving out the held rows.
type unordered struct {
	sql    string // SQL.Claim
	limits claimLimits
}

func (u unordered) claim(ctx context.Context, tx pgx.Tx, from int64, f claimFilter) (pgx.Rows, error) {
	return tx.Query(ctx, u.sql, from, f.types, f.held, u.limits.rows, u.limits.bytes, f.largest)
}

// backOff: any transient failure backs the loop off; its rows are claimed again.
func (unordered) backOff(failed, _ int) bool { return failed > 0 }
