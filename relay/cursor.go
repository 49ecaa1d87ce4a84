package relay

import (
	"math"
	"time"
)

// cursor is where claims start in the partial index. Claims normally
// continue after the highest id claimed, so they do not walk the dead index
// entries of rows already published, which slow a claim from the start of
// the index more with every row published (far more with a long
// transaction open elsewhere, which keeps vacuum from removing them). A row whose id was taken before the cursor but that
// committed later would be behind it: a floor scan (after each short batch,
// and at least every second) starts at the cursor of the previous floor
// scan, and a full rescan from the start runs every FullRescanInterval for
// transactions that stayed open longer than that. The cursor moves only here.
//
// That is not enough for partition-key ordering (guard): a row of key K
// whose transaction commits after other keys' rows moved the cursor past
// it, followed by K's next row (its writer waited on the aggregate's lock),
// would go out after that next row. There every claim starts at or before
// the safe floor instead: the cursor as of the newest claim all of whose
// concurrent transactions have ended. A row with an id at or below a
// claim's cursor that the claim did not see was written by a transaction
// running then, which took its id before the claim's own (the claim's
// transaction takes one when it locks its first row, after its snapshot):
// the mark's bound. Once the oldest transaction still running (xmin), read
// before a later claim's statement, is at or past that bound, every such
// row was committed (or gone) before that later claim looked, and the
// later claim, starting at the old floor, saw it; the claims after it may
// start at the mark's cursor (settle). A snapshot's xmax is no such bound:
// it is one past the latest transaction that ended, and one that took its
// id before may still run. The writer must hold a transaction id when it
// takes the row's id: a row lock on the aggregate (which the order of
// concurrent writers of one key already asks for) or an earlier write
// does; an advisory lock does not. The cost: while a transaction stays
// open anywhere on the server, claims walk the index entries of every row
// published since.
type cursor struct {
	pos        int64 // highest id this replica claimed
	floorMark  int64 // pos at the previous floor scan
	nextFloor  time.Time
	nextFull   time.Time
	lastShort  bool
	fullRescan time.Duration
	// rescanning: the claim in progress started at the index's start.
	rescanning bool

	guard bool        // partition-key ordering: claims start at or before safe
	safe  int64       // every row at or below it was committed or gone before a claim from an older floor looked
	marks []claimMark // claims not yet safe, oldest first
}

// indexStart is where a claim from the start of the index starts after:
// every id but int64's least is above it. Before, it was 0, so a row with
// an id of 0 or below (a sequence that starts there, an id given by hand)
// was never claimed, and never published.
const indexStart = math.MinInt64

// newCursor is a cursor at the index's start.
func newCursor(fullRescan time.Duration, guard bool) cursor {
	return cursor{pos: indexStart, floorMark: indexStart, safe: indexStart, fullRescan: fullRescan, guard: guard}
}

// claimMark is the cursor after a claim and the claim's own transaction
// id: every transaction that could hold a row at or below pos that the
// claim did not see has an id below bound.
type claimMark struct{ pos, bound int64 }

// maxClaimMarks bounds the marks kept while a long transaction holds xmin
// back: past it, pairs merge into their later mark, which only delays the
// floor.
const maxClaimMarks = 1024

// from picks where the next claim starts.
func (c *cursor) from(now time.Time) int64 {
	from := c.next(now)
	if c.guard {
		return min(from, c.safe)
	}
	return from
}

// next is where the next claim starts without the guard.
func (c *cursor) next(now time.Time) int64 {
	c.rescanning = false
	switch {
	case now.After(c.nextFull):
		c.nextFull = now.Add(c.fullRescan)
		c.nextFloor = now.Add(time.Second)
		c.floorMark = c.pos
		c.rescanning = true
		return indexStart
	case c.lastShort || now.After(c.nextFloor):
		from := min(c.floorMark, c.pos) // the cursor may have moved back since
		c.floorMark = c.pos
		c.nextFloor = now.Add(time.Second)
		return from
	default:
		return c.pos
	}
}

// claimed moves the cursor past a claim. A full batch from a rescan may end
// below the cursor: the rows between are unclaimed, so the cursor comes
// back to the batch's end. A short claim from the index's start found every
// row there is to claim: the cursor comes back to its last. Before, it
// stayed where it was, so after the ids started over (TRUNCATE … RESTART
// IDENTITY, a sequence that cycles) every new row waited for the next full
// rescan until the ids passed the old cursor. An empty rescan leaves the
// cursor: an idle relay's claims do not walk the index from its start, and
// a first row under the cursor waits one rescan at most.
//
// When the cursor comes back, the floor scans start from there too, and
// with the guard the safe floor goes back to the start until the claims
// from here are safe (record, settle): rows under the old floor, such as
// those of ids started over, were never covered by it.
func (c *cursor) claimed(rows []row, full bool) {
	c.lastShort = !full
	rescan := c.rescanning
	c.rescanning = false
	if len(rows) == 0 {
		return
	}
	old := c.pos
	if last := rows[len(rows)-1].id; full || rescan {
		c.pos = last
	} else {
		c.pos = max(c.pos, last)
	}
	if c.pos < old {
		c.floorMark = min(c.floorMark, c.pos)
		if c.guard {
			c.safe, c.marks = indexStart, nil
		}
	}
}

// claimFailed puts back a full rescan the failed claim was to make: the
// rows it was for (released from a hold, a topic back) would otherwise
// wait for the next one.
func (c *cursor) claimFailed() {
	if c.rescanning {
		c.rescanning = false
		c.rescanSoon()
	}
}

// settled moves the cursor back before the first claimed row that is
// neither published nor held, so the next claims find it at once.
func (c *cursor) settled(rows []row, done func(id int64) bool) {
	for _, x := range rows {
		if !done(x.id) {
			c.pos = min(c.pos, x.id-1)
			return
		}
	}
}

// before moves the cursor back before id, a row a claim locked and left
// for the next claim. A claimed id is above indexStart: id-1 does not wrap.
func (c *cursor) before(id int64) { c.pos = min(c.pos, id-1) }

// wantsXmin reports whether the next claim should read the oldest running
// transaction before its statement: with the guard, while claims wait to
// be safe.
func (c *cursor) wantsXmin() bool { return c.guard && len(c.marks) > 0 }

// wantsBound reports whether the claim just made moved the cursor past
// every mark, and so needs its transaction id recorded (record).
func (c *cursor) wantsBound() bool {
	n := len(c.marks)
	return c.guard && c.pos > c.safe && (n == 0 || c.marks[n-1].pos < c.pos)
}

// settle, after a claim, lets the claims after it start at the cursor of
// every mark whose bound xmin (read before that claim's statement, so the
// claim saw what those transactions wrote) is at or past.
func (c *cursor) settle(xmin int64) {
	i := 0
	for ; i < len(c.marks) && c.marks[i].bound <= xmin; i++ {
		c.safe = max(c.safe, c.marks[i].pos)
	}
	c.marks = c.marks[i:]
}

// record notes the claim just made (the cursor now) with its transaction's
// id.
func (c *cursor) record(bound int64) {
	if len(c.marks) >= maxClaimMarks {
		kept := c.marks[:0]
		for j := 1; j < len(c.marks); j += 2 {
			kept = append(kept, c.marks[j])
		}
		c.marks = kept
	}
	c.marks = append(c.marks, claimMark{pos: c.pos, bound: bound})
}

// rescanSoon makes the next claim scan the index from the start (rows
// released from holding, or buckets newly owned, lie behind the cursor).
func (c *cursor) rescanSoon() { c.nextFull = time.Time{} }
