package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A row another session holds locked stops its lane at its place in id
// order: the lane's claimed rows before it go, those after it wait, and
// the lane waits the transient-failure backoff; other lanes are not
// touched. A lane with two such rows backs off once per claim.
func TestFenceStopsItsLaneAtItsPlace(t *testing.T) {
	k := newByKey(byKeyDeps{topics: map[string]string{"E": "t"}, maxBackoff: time.Second})
	r := func(id int64, key string) row { return row{id: id, partitionKey: key, eventType: "E"} }
	rows := []row{r(1, "K"), r(2, "J"), r(3, "K"), r(6, "K"), r(7, "J")}
	fenced := []row{r(4, "K"), r(5, "K")}
	now := time.Now()
	afresh := k.fence(rows, fenced, now)
	require.Equal(t, []row{r(4, "K")}, afresh, "the lane's oldest locked row, once")
	for i, want := range []bool{false, false, false, true, false} {
		require.Equal(t, want, k.stopped(rows[i], i), "row %d", rows[i].id)
	}
	l := lane{"K", "t"}
	require.Equal(t, 100*time.Millisecond, k.laneBackoff[l])
	require.WithinRange(t, k.blocked[l], now.Add(80*time.Millisecond), now.Add(120*time.Millisecond))
	require.NotContains(t, k.blocked, lane{"J", "t"})

	clear(k.firstStop)
	require.Empty(t, k.fence(rows[:1], []row{r(4, "K")}, now), "still waiting: no new log line")
	require.Equal(t, 200*time.Millisecond, k.laneBackoff[l], "locked again: the backoff doubles")

	clear(k.firstStop)
	k.fence(rows, []row{r(0, "K")}, now)
	require.True(t, k.stopped(rows[0], 0), "locked before every claimed row: all of its lane waits")
}
