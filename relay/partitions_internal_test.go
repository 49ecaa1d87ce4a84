package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// uncovered finds the stretches below the cut that no partition covers:
// below the first partition, holes between partitions, and above the last
// one up to the cut; MINVALUE and MAXVALUE bounds cover to infinity.
func TestUncoveredStretches(t *testing.T) {
	t.Parallel()
	day := func(d int) *time.Time { x := time.Date(2025, 1, d, 0, 0, 0, 0, time.UTC); return &x }
	p := func(lo, hi *time.Time) partition { return partition{lo: lo, hi: hi} }
	cases := []struct {
		name  string
		parts []partition
		cut   *time.Time
		want  []span
	}{
		{"no partitions", nil, day(9), []span{{nil, day(9)}}},
		{"below, a hole, above", []partition{p(day(2), day(3)), p(day(4), day(5))}, day(9),
			[]span{{nil, day(2)}, {day(3), day(4)}, {day(5), day(9)}}},
		{"the cut inside a hole", []partition{p(day(2), day(3)), p(day(6), day(7))}, day(4),
			[]span{{nil, day(2)}, {day(3), day(4)}}},
		{"the cut inside a partition", []partition{p(day(2), day(5))}, day(4), []span{{nil, day(2)}}},
		{"MINVALUE", []partition{p(nil, day(3)), p(day(3), day(4))}, day(9), []span{{day(4), day(9)}}},
		{"MAXVALUE", []partition{p(day(2), day(3)), p(day(5), nil)}, day(9), []span{{nil, day(2)}, {day(3), day(5)}}},
		{"contiguous", []partition{p(day(1), day(2)), p(day(2), day(3))}, day(3), []span{{nil, day(1)}}},
	}
	for _, c := range cases {
		require.Equal(t, c.want, uncovered(c.parts, *c.cut), c.name)
	}
}

// gapAround finds the stretch no partition covers around a time: between
// the partitions before and after it, unbounded where there is none, and
// nothing where a partition (or a DEFAULT one) covers it.
func TestGapAround(t *testing.T) {
	t.Parallel()
	day := func(d int) *time.Time { x := time.Date(2025, 1, d, 0, 0, 0, 0, time.UTC); return &x }
	p := func(lo, hi *time.Time) partition { return partition{lo: lo, hi: hi} }
	parts := []partition{p(day(1), day(2)), p(day(2), day(3)), p(day(5), day(6)), p(day(8), nil)}
	for _, c := range []struct {
		name   string
		parts  []partition
		at     *time.Time
		lo, hi *time.Time
		ok     bool
	}{
		{"a hole", parts, day(4), day(3), day(5), true},
		{"below every partition", parts, day(0), nil, day(1), true},
		{"covered", parts, day(2), nil, nil, false},
		{"covered up to MAXVALUE", parts, day(9), nil, nil, false},
		{"above every partition", parts[:3], day(7), day(6), nil, true},
		{"a DEFAULT partition", append(parts[:3:3], partition{isDef: true}), day(4), nil, nil, false},
	} {
		lo, hi, ok := gapAround(c.parts, *c.at)
		require.Equal(t, []any{c.lo, c.hi, c.ok}, []any{lo, hi, ok}, c.name)
	}
}
