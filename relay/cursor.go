package relay

import "time"

// cursor is where claims start in the partial index. Claims normally
// continue after the highest id claimed, so they do not walk the dead index
// entries of rows already published: measured here over a 1M-row drain at
// batch 500, claiming from the start of the index fell from 43k to 26k rows/s
// (to 2k rows/s with a long transaction open elsewhere), claiming after the
// cursor stayed flat. A row whose id was taken before the cursor but that
// committed later would be behind it: a floor scan (after each short batch,
// and at least every second) starts at the cursor of the previous floor
// scan, and a full rescan from the start runs every FullRescanInterval for
// transactions that stayed open longer than that. The cursor moves only here.
type cursor struct {
	pos        int64 // highest id this replica claimed
	floorMark  int64 // pos at the previous floor scan
	nextFloor  time.Time
	nextFull   time.Time
	lastShort  bool
	fullRescan time.Duration
}

// from picks where the next claim starts.
func (c *cursor) from(now time.Time) int64 {
	switch {
	case now.After(c.nextFull):
		c.nextFull = now.Add(c.fullRescan)
		c.nextFloor = now.Add(time.Second)
		c.floorMark = c.pos
		return 0
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
// back to the batch's end.
func (c *cursor) claimed(rows []row, full bool) {
	c.lastShort = !full
	if len(rows) == 0 {
		return
	}
	if last := rows[len(rows)-1].id; full {
		c.pos = last
	} else {
		c.pos = max(c.pos, last)
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

// rescanSoon makes the next claim scan the index from the start (rows
// released from holding, or buckets newly owned, lie behind the cursor).
func (c *cursor) rescanSoon() { c.nextFull = time.Time{} }
