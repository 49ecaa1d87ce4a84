package relay

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A slot's snapshot read back from its note is the snapshot noted.
func TestSlotSnapshotNoteRoundTrips(t *testing.T) {
	for _, s := range []*slotSnapshot{
		{xmax: "4294967295", xip: []int64{}},
		{xmax: "1300", xip: []int64{1201, 1299}},
	} {
		got, err := parseSlotSnapshot(s.note())
		require.NoError(t, err)
		require.Equal(t, s, got)
	}
	for _, bad := range []string{"", beforeSlotNote, beforeSlotNote + " xmax=12", beforeSlotNote + " xmax=x xip=", beforeSlotNote + " xmax=12 xip=1,y"} {
		_, err := parseSlotSnapshot(bad)
		require.ErrorContains(t, err, "not a slot's snapshot", bad)
	}
}
