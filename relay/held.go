package relay

import (
	"log/slog"
	"time"
)

// Reasons a row is held: not published, not marked, counted in
// outbox_relay_rows_held{reason}, logged once and retried on a schedule,
// never blocking the rows of other keys or topics.
const (
	// HeldUnroutable: the row's event type is not in the topic map.
	HeldUnroutable = "unroutable"
	// HeldInvalidRow: a column the relay reads is NULL, created_at is out of
	// range (outbox.CreatedAtCheck), or the headers are malformed.
	HeldInvalidRow = "invalid_row"
	// HeldTopicUnavailable: the row's topic does not exist, or the relay may
	// not write to it.
	HeldTopicUnavailable = "topic_unavailable"
	// HeldTooLarge: the record is larger than its topic takes, and there is
	// no dead-letter topic it fits.
	HeldTooLarge = "too_large"
	// HeldRefused: Kafka refused the record permanently and there is no
	// dead-letter topic.
	HeldRefused = "refused"
)

// heldReasons are every reason, for the gauge's series.
var heldReasons = []string{HeldUnroutable, HeldInvalidRow, HeldTopicUnavailable, HeldTooLarge, HeldRefused}

// heldRows are the rows this replica holds itself (invalid, too large,
// refused); they stay out of claims until their retry time. Rows of an
// unmapped type or an unavailable topic are kept out by the claim's type
// filter (or, in partition-key mode, by blocking their keys) instead.
type heldRows struct {
	rows   map[int64]heldRow
	logged map[int64]bool // rows already logged, so a retried row is logged once
}

type heldRow struct {
	reason string
	until  time.Time
}

func newHeldRows() *heldRows {
	return &heldRows{rows: map[int64]heldRow{}, logged: map[int64]bool{}}
}

// hold keeps x out of claims until until, and logs it the first time.
func (h *heldRows) hold(log *slog.Logger, x row, reason string, until time.Time, err error) {
	h.rows[x.id] = heldRow{reason: reason, until: until}
	if h.logged[x.id] {
		return
	}
	if len(h.logged) > 100000 {
		clear(h.logged) // bounded memory; a row may then be logged again
	}
	h.logged[x.id] = true
	log.Error("row held; it is retried later", "id", x.id, "event_id", x.eventID, "event_type", x.eventType,
		"reason", reason, "err", err)
}

func (h *heldRows) isHeld(id int64) bool { _, ok := h.rows[id]; return ok }

// ids are the held rows' ids, for the claim to leave out.
func (h *heldRows) ids() []int64 {
	ids := make([]int64, 0, len(h.rows))
	for id := range h.rows {
		ids = append(ids, id)
	}
	return ids
}

// release frees the rows whose retry time has come and reports whether any was.
func (h *heldRows) release(now time.Time) bool {
	released := false
	for id, r := range h.rows {
		if !now.Before(r.until) {
			delete(h.rows, id)
			released = true
		}
	}
	return released
}

// count is how many rows are held for reason.
func (h *heldRows) count(reason string) int {
	n := 0
	for _, r := range h.rows {
		if r.reason == reason {
			n++
		}
	}
	return n
}
