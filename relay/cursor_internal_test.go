package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// With the guard, claims start at the safe floor: the cursor of the newest
// claim whose transaction id the oldest running transaction, read before a
// later claim's statement, has reached.
func TestGuardedCursorStartsAtTheSafeFloor(t *testing.T) {
	t.Parallel()
	now := time.Now()
	c := newCursor(time.Hour, true)
	c.nextFull, c.nextFloor = now.Add(time.Hour), now.Add(time.Hour)
	// claim runs one claim: xmin read before it (-1: none read), then its
	// rows up to last, then its transaction id when the cursor moved.
	claim := func(xmin, last, xid int64) int64 {
		require.Equal(t, xmin >= 0, c.wantsXmin(), "an xmin is read while claims wait to be safe")
		from := c.from(now)
		c.claimed([]row{{id: last}}, true)
		if xmin >= 0 {
			c.settle(xmin)
		}
		if c.wantsBound() {
			c.record(xid)
		}
		return from
	}
	require.Equal(t, int64(indexStart), claim(-1, 10, 100))
	require.Equal(t, int64(indexStart), claim(99, 20, 105), "transaction 99 may hold a row at or below 10")
	require.Equal(t, int64(indexStart), claim(100, 30, 110), "the claim's own id reached: the next claim may start at 10")
	require.Equal(t, int64(10), claim(104, 40, 115))
	require.Equal(t, int64(10), claim(105, 40, 0), "a claim that did not move the cursor records nothing")
	require.Equal(t, int64(20), c.from(now))
	require.Equal(t, []claimMark{{30, 110}, {40, 115}}, c.marks)
	c.settle(200)
	require.Equal(t, int64(40), c.from(now), "every claim's transaction has ended")
	require.False(t, c.wantsXmin(), "nothing waits: no read")

	// A transaction that stays open: the marks merge past the bound and
	// the floor stays.
	for i := range 3 * maxClaimMarks {
		xmin := int64(150)
		if i == 0 {
			xmin = -1 // nothing waits yet
		}
		claim(xmin, int64(41+i), int64(300+i))
		require.LessOrEqual(t, len(c.marks), maxClaimMarks)
	}
	require.Equal(t, int64(40), c.from(now))
	c.settle(int64(300 + 3*maxClaimMarks))
	require.Equal(t, c.pos, c.from(now), "once it ends, the floor is the cursor")

	// Without the guard the cursor alone decides.
	u := newCursor(time.Hour, false)
	u.nextFull, u.nextFloor = now.Add(time.Hour), now.Add(time.Hour)
	u.claimed([]row{{id: 50}}, true)
	require.False(t, u.wantsXmin())
	require.False(t, u.wantsBound())
	require.Equal(t, int64(50), u.from(now))
}

// A topic back from its backoff while another went down between two
// claims is a type back: its rows may lie behind the cursor. Before, only a
// larger count of available types made the next claim rescan.
func TestTypesBack(t *testing.T) {
	t.Parallel()
	require.True(t, typesBack([]string{"A"}, []string{"B"}), "one back, one down")
	require.True(t, typesBack([]string{"A"}, []string{"A", "B"}))
	require.False(t, typesBack([]string{"A", "B"}, []string{"A"}))
	require.False(t, typesBack([]string{"A", "B"}, []string{"A", "B"}))
}

// A short claim from the index's start found every row there is: the
// cursor comes back to it. Before, it stayed where it was, so after the
// ids started over (TRUNCATE … RESTART IDENTITY) every new row waited for
// the next full rescan, until the ids passed the old cursor.
func TestCursorComesBackAfterIdsStartOver(t *testing.T) {
	t.Parallel()
	now := time.Now()
	c := cursor{pos: 1_000_000, fullRescan: 10 * time.Second}
	require.Equal(t, int64(indexStart), c.from(now), "a full rescan is due")
	c.claimed([]row{{id: 5}}, false)
	require.LessOrEqual(t, c.from(now.Add(200*time.Millisecond)), int64(5), "the next claim starts at the new rows")
	require.LessOrEqual(t, c.from(now.Add(300*time.Millisecond)), int64(5))

	// A rescan that found nothing leaves the cursor: an idle relay's
	// claims do not walk the index from its start at every poll.
	c = cursor{pos: 1_000_000, fullRescan: 10 * time.Second}
	c.from(now)
	c.claimed(nil, false)
	require.Equal(t, int64(1_000_000), c.pos)
	require.Equal(t, int64(1_000_000), c.from(now.Add(time.Second/2)))

	// A claim after the cursor moves it only forward, as before.
	c.pos = indexStart
	c.claimed([]row{{id: 7}}, false)
	c.from(now.Add(time.Second / 2))
	c.claimed([]row{{id: 3}}, false)
	require.Equal(t, int64(7), c.pos)

	// A failed claim gives back the full rescan it was to make.
	c = cursor{pos: 100, fullRescan: time.Hour}
	require.Equal(t, int64(indexStart), c.from(now))
	c.claimFailed()
	require.Equal(t, int64(indexStart), c.from(now.Add(time.Millisecond)), "the rescan is made by the next claim, not an hour later")
}

// With the guard, a cursor that comes back takes the safe floor back to
// the start until the claims from there are safe: rows under the old floor
// (ids started over) were never covered by it. Before, the claims after a
// rescan that found ids 11 to 20 started at 20, and a key's row 10,
// committed later, went out after its row 21.
func TestGuardedCursorComingBackIsSafeAgainOnlyOnceSettled(t *testing.T) {
	t.Parallel()
	now := time.Now()
	c := cursor{guard: true, pos: 1_000_000, safe: 1_000_000, floorMark: 1_000_000, fullRescan: 10 * time.Second}
	require.Equal(t, int64(indexStart), c.from(now), "a full rescan is due")
	rows := make([]row, 10)
	for i := range rows {
		rows[i].id = int64(11 + i)
	}
	c.claimed(rows, false)
	require.True(t, c.wantsBound(), "the claim's transaction id is recorded")
	c.record(500)
	require.Equal(t, int64(indexStart), c.from(now.Add(200*time.Millisecond)), "row 10's transaction may still run")
	require.True(t, c.wantsXmin())
	c.settle(499)
	require.Equal(t, int64(indexStart), c.from(now.Add(300*time.Millisecond)))
	c.settle(500)
	require.Equal(t, int64(20), c.from(now.Add(400*time.Millisecond)), "every transaction that could hold a row under 20 has ended")
}
