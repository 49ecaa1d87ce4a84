package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// With the guard, claims start at the safe floor: the cursor of the newest
// claim whose snapshot's xmax the oldest running transaction has passed.
func TestGuardedCursorStartsAtTheSafeFloor(t *testing.T) {
	t.Parallel()
	now := time.Now()
	c := cursor{guard: true, fullRescan: time.Hour, nextFull: now.Add(time.Hour), nextFloor: now.Add(time.Hour)}
	claim := func(last int64, xmin, xmax int64) {
		c.claimed([]row{{id: last}}, true)
		require.True(t, c.wantsSnapshot())
		c.snapshot(xmin, xmax)
	}
	claim(10, 100, 105) // transactions 100..104 may hold rows at or below 10
	require.Equal(t, int64(0), c.from(now), "not safe yet")
	claim(20, 103, 110)
	require.Equal(t, int64(0), c.from(now), "103 and 104 may still run")
	claim(30, 105, 112)
	require.Equal(t, int64(10), c.from(now), "all before 105 ended: rows up to 10 are committed or gone")
	claim(40, 112, 115)
	require.Equal(t, int64(30), c.from(now))
	require.Equal(t, []claimMark{{40, 115}}, c.marks)
	c.snapshot(115, 116) // an empty claim: nothing new to record
	require.Equal(t, int64(40), c.from(now))
	require.False(t, c.wantsSnapshot(), "nothing to settle, no snapshot")

	// A transaction that stays open: the marks merge past the bound and
	// the floor stays.
	for i := range 3 * maxClaimMarks {
		claim(int64(41+i), 116, int64(200+i))
		require.LessOrEqual(t, len(c.marks), maxClaimMarks)
	}
	require.Equal(t, int64(40), c.from(now))
	c.snapshot(int64(200+3*maxClaimMarks), int64(201+3*maxClaimMarks))
	require.Equal(t, c.pos, c.from(now), "once it ends, the floor is the cursor")

	// Without the guard the cursor alone decides.
	u := cursor{fullRescan: time.Hour, nextFull: now.Add(time.Hour), nextFloor: now.Add(time.Hour)}
	u.claimed([]row{{id: 50}}, true)
	require.False(t, u.wantsSnapshot())
	require.Equal(t, int64(50), u.from(now))
}
