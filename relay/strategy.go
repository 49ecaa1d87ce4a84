package relay

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// strategy is what an ordering mode decides in the claim–publish–mark cycle:
// what to claim, what a row that cannot go out does to the rest of its
// batch, and what happens between batches. unordered (OrderingNone) and
// byKey (OrderingPartitionKey) implement it.
type strategy interface {
	// prepare runs before each batch. It returns where to run the claim
	// transaction, or nil when this replica has nothing to claim now.
	prepare(ctx context.Context, now time.Time) (beginner, error)
	// claim runs the mode's claim statement from id from, leaving out the
	// held rows and what waiting returned. Partition-key mode is handed no
	// held rows: a held row stops its lane (stop), and the lane, not the
	// row, stays out of claims, so that a lane never flows past its held row.
	claim(ctx context.Context, tx pgx.Tx, from int64, held []int64, f claimFilter) (pgx.Rows, error)
	// stop says that row i of the batch cannot go out now; its key's rows
	// are not claimed again before until (zero: only this batch waits).
	stop(x row, i int, until time.Time)
	// stopped reports whether row i must wait for an older row of its key.
	stopped(x row, i int) bool
	// failed records a transient failure of row i.
	failed(x row, i int, now time.Time)
	// sent records that row i was acknowledged.
	sent(x row)
	// backOff says whether transient failures of failed of sent rows make
	// the whole loop back off (rather than only their keys).
	backOff(failed, sent int) bool
	// waiting returns the claim's filters besides the held rows: the event
	// types to claim and the (key, event type) pairs to leave out. Call it
	// before the cursor picks where to start (an expiring filter moves the
	// cursor back).
	waiting(now time.Time) claimFilter
	// released says that a held row of key and event type was released
	// before its retry time (`relay redrive`): its key's rows may be claimed
	// again at once.
	released(key, eventType string)
	// left runs when the membership session is gone.
	left()
}

// beginner starts a transaction: the pool, or the membership session.
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// newStrategy returns the strategy of r's ordering mode.
func newStrategy(r *Relay) strategy {
	if r.cfg.Ordering == OrderingPartitionKey {
		return newByKey(r)
	}
	return &unordered{r: r}
}
