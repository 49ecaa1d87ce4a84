package relay

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// unordered is OrderingNone: replicas share rows through SKIP LOCKED, rows
// are independent of each other, and a row that cannot go out now is simply
// claimed again later. Only rows of mapped types whose topic is available
// are claimed.
type unordered struct{ r *Relay }

func (u *unordered) prepare(ctx context.Context, now time.Time) (beginner, error) {
	fenced, err := u.r.fenced(ctx, now)
	if err != nil || fenced {
		return nil, err
	}
	return u.r.pool, nil
}

func (u *unordered) claim(ctx context.Context, tx pgx.Tx, from int64, held []int64, f claimFilter) (pgx.Rows, error) {
	return tx.Query(ctx, u.r.sql.Claim, from, f.types, held, u.r.cfg.BatchSize, u.r.cfg.MaxBatchBytes, f.largest)
}

func (u *unordered) stop(row, int, time.Time)   {}
func (u *unordered) stopped(row, int) bool      { return false }
func (u *unordered) failed(row, int, time.Time) {}
func (u *unordered) sent(row)                   {}
func (u *unordered) backOff(failed, _ int) bool { return failed > 0 }
func (u *unordered) left()                      {}
func (u *unordered) released(string, string)    {}

func (u *unordered) waiting(now time.Time) claimFilter {
	return claimFilter{types: u.r.availableTypes(now), keys: []string{}, keyTypes: []string{}}
}
