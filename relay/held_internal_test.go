package relay

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// A reload of the held table read after a row was held but before the
// batch recording the hold committed does not hold its record yet: it must
// not release the row (which would be claimed and held again, one attempt
// more). Once the batch commits, a reload read before the commit still
// leaves it; one read after the commit decides.
func TestReloadDoesNotReleaseAHoldItCannotSeeYet(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := newHeldRows()
	h.recorded = true
	h.hold(log, row{id: 7, eventType: "E"}, HeldTooLarge, time.Now().Add(time.Hour), errors.New("too large"))
	holds := h.take()

	empty := func(at time.Time) heldSnapshot {
		return heldSnapshot{at: at, rows: map[int64]heldRow{}, complete: true}
	}
	h.merge(empty(time.Now())) // read while the batch commits
	require.True(t, h.isHeld(7), "a reload cannot release a hold whose record is not committed")

	readBefore := time.Now()
	h.committed(holds, readBefore.Add(time.Millisecond)) // the commit comes after that read
	h.merge(empty(readBefore))
	require.True(t, h.isHeld(7), "a reload read before the commit does not show the record")

	h.merge(empty(time.Now().Add(time.Second))) // read after the commit, without the record: redriven or swept
	require.False(t, h.isHeld(7))
}

// A reload cut short at heldCacheRows holds the records tried again
// soonest: a hold of this replica due later than the last of them is not
// in it, and is not released by it (before, such rows were claimed, sent
// again and held again at every reload, about every 5 s). One due before
// the last is released: its record is gone.
func TestReloadCutShortReleasesOnlyWhatItReached(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := newHeldRows()
	h.recorded = true
	now := time.Now()
	h.hold(log, row{id: 7, eventType: "E"}, HeldRefused, now.Add(time.Hour), errors.New("refused"))
	h.hold(log, row{id: 8, eventType: "E"}, HeldRefused, now.Add(time.Minute), errors.New("refused"))
	h.committed(h.take(), now)
	cut := heldSnapshot{at: now.Add(time.Second), rows: map[int64]heldRow{9: {reason: HeldRefused, until: now.Add(30 * time.Minute), waiting: true}},
		last: now.Add(30 * time.Minute)}
	early, learned := h.merge(cut)
	require.True(t, h.isHeld(7), "a hold past the reload's last is not in it and stays")
	require.False(t, h.isHeld(8), "a hold before the reload's last, not in it, was redriven or swept")
	require.Len(t, early, 1)
	require.True(t, h.isHeld(9))
	require.Len(t, learned, 1, "a row held elsewhere is learned, to block its lane")
}

// In partition-key mode a row another replica holds blocks its lane here
// until its retry time, each time that time moves on: once released here
// and held again there, or held longer, it is learned again (else a
// replica taking its bucket over would try it at once). A record of a row
// already published blocks nothing.
func TestReloadLearnsEveryLaterWaitOfAnUnpublishedRow(t *testing.T) {
	t.Parallel()
	now := time.Now()
	h := newHeldRows()
	h.recorded = true
	held := func(until time.Time, waiting bool) heldRow {
		return heldRow{reason: HeldRefused, until: until, key: "k", eventType: "E", bucket: 3, waiting: waiting}
	}
	snap := func(at time.Time, r heldRow) heldSnapshot {
		return heldSnapshot{at: at, rows: map[int64]heldRow{7: r}, complete: true}
	}
	_, learned := h.merge(snap(now, held(now.Add(time.Minute), true)))
	require.Len(t, learned, 1, "new")
	h.releaseIDs(now.Add(61 * time.Second))
	_, learned = h.merge(snap(now.Add(62*time.Second), held(now.Add(time.Hour), true)))
	require.Len(t, learned, 1, "released here, held again elsewhere")
	_, learned = h.merge(snap(now.Add(63*time.Second), held(now.Add(2*time.Hour), true)))
	require.Len(t, learned, 1, "held longer")
	_, learned = h.merge(snap(now.Add(64*time.Second), held(now.Add(2*time.Hour), true)))
	require.Empty(t, learned, "the same wait again")
	_, learned = h.merge(snap(now.Add(65*time.Second), held(now.Add(3*time.Hour), false)))
	require.Empty(t, learned, "a record of a row published since blocks nothing")
}

// A long error is cut to heldErrorBytes at a character's edge: half a
// character is no text PostgreSQL takes, and the batch recording the hold
// would fail at every retry, with the healthy rows it published.
func TestHeldErrorIsCutAtACharacter(t *testing.T) {
	t.Parallel()
	h := newHeldRows()
	h.recorded = true
	msg := "x" + strings.Repeat("é", heldErrorBytes) // two bytes each, the limit falls inside one
	h.hold(slog.New(slog.NewTextHandler(io.Discard, nil)), row{id: 1, eventType: "E"}, HeldRefused, time.Now().Add(time.Hour), errors.New(msg))
	got := h.take()[0].err
	require.True(t, utf8.ValidString(got))
	require.Equal(t, heldErrorBytes-1, len(got))
}

// A table of the held table's name that a relay did not make (or that lost
// a column, or its key) is not taken as the held table: holds stay in
// memory, and the log names what it lacks. Before, every batch that held a
// row tried to record it there and failed.
func TestAnUnrelatedHeldTableIsNotTaken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, ddl := range map[string]string{
		"unrelated":       `DROP TABLE outbox_held; CREATE TABLE outbox_held (id bigint PRIMARY KEY, note text)`,
		"without a key":   `ALTER TABLE outbox_held DROP CONSTRAINT outbox_held_pkey`,
		"a deferred key":  `ALTER TABLE outbox_held DROP CONSTRAINT outbox_held_pkey, ADD PRIMARY KEY (id) DEFERRABLE INITIALLY DEFERRED`,
		"made by a relay": `SELECT 1`, // the schema's DDL made it
	} {
		dsn, pool := outboxDB(t)
		_, err := pool.Exec(ctx, ddl)
		require.NoError(t, err, name)
		r, err := New(Config{Settings: Settings{DSN: dsn, Brokers: []string{testenv.Broker().Addr()}, Topics: map[string]string{"E": "t"}}})
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })
		logs := &syncBuffer{}
		r.log = slog.New(slog.NewTextHandler(logs, nil))
		recorded, _, err := r.ensureHeldTable(ctx)
		require.NoError(t, err, name)
		switch name {
		case "unrelated":
			require.False(t, recorded, name)
			require.Contains(t, logs.String(), `missing="event_id, event_type, reason, error, attempts, first_attempt, last_attempt, retry_at"`, name)
		case "without a key", "a deferred key":
			require.False(t, recorded, name)
			require.Contains(t, logs.String(), `missing="unique index on id"`, name)
		default:
			require.True(t, recorded, name)
			require.NotContains(t, logs.String(), "not one a relay made", name)
		}
	}
}
