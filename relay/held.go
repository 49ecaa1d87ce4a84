package relay

import (
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// Reasons a row is held: not published, not marked, counted in
// outbox_relay_rows_held{reason}, logged once and retried on a schedule,
// never blocking the rows of other keys or topics.
const (
	// HeldUnroutable: the row's event type is not in the topic map.
	HeldUnroutable = "unroutable"
	// HeldInvalidRow: a column the relay reads is NULL, created_at is out of
	// range (outbox.CreatedAtCheck), or the headers are malformed.
	HeldInvalidRow = outbox.HeldInvalidRow
	// HeldTopicUnavailable: the row's topic does not exist, or the relay may
	// not write to it.
	HeldTopicUnavailable = "topic_unavailable"
	// HeldTooLarge: the record is larger than its topic takes, and there is
	// no dead-letter topic it fits.
	HeldTooLarge = outbox.HeldTooLarge
	// HeldRefused: Kafka refused the record permanently, and there is no
	// dead-letter topic, or the dead-letter topic refused its copy or is
	// unavailable (held for Config.MaxBackoff only when the copy failed in
	// a way a retry may fix).
	HeldRefused = outbox.HeldRefused
)

// heldReasons are every reason, for the gauge's series.
var heldReasons = []string{HeldUnroutable, HeldInvalidRow, HeldTopicUnavailable, HeldTooLarge, HeldRefused}

// heldErrorBytes bounds the error text recorded with a held row.
const heldErrorBytes = 2000

// heldCacheRows bounds how many held rows a replica loads from the held
// table to leave out of its claims; a row beyond is claimed on its turn and
// held again (one more attempt), so the bound costs work, never a row.
const heldCacheRows = 10000

// heldRows are the rows held back from claims (invalid, too large,
// refused) until their retry time. They are recorded in the held table
// (outbox.HeldDDL) in the transaction of the batch that held them, so they
// survive restarts and every replica, the operator and a DBA see them; each
// replica keeps its own copy here, reloaded from the table every
// statsInterval, so a claim leaves them out without reading the table. Rows
// of an unmapped type or an unavailable topic are kept out by the claim's
// type filter (or, in partition-key mode, by blocking their keys) instead.
type heldRows struct {
	rows   map[int64]heldRow
	logged map[int64]bool // rows already logged, so a retried row is logged once
	// recorded: the held table exists; holds are written there.
	recorded bool
	// pending are the holds of the batch being published, for its
	// transaction to record (take).
	pending []heldRecord
}

type heldRow struct {
	reason string
	until  time.Time
	// key and eventType of the row (loaded from the table only in
	// partition-key mode), so its hold blocks its lane, and an early
	// release frees it.
	key, eventType string
	bucket         int32 // the key's bucket (partition-key mode, loaded from the table)
	// waiting: the row is unpublished (partition-key mode, loaded from the
	// table): a record of a row published or gone, which the sweep has not
	// removed yet, blocks no lane.
	waiting bool
	// at is when this replica's hold became durable (its batch committed
	// the record): a reload read before then may not see it yet and leaves
	// it as it is.
	at time.Time
	// uncommitted: held in a batch that has not committed yet, so no
	// reload can hold its record; a reload leaves it as it is.
	uncommitted bool
	// released: its retry time came; it may be claimed, and its record
	// goes once it is published (forget).
	released bool
}

// heldRecord is one hold to write to the held table.
type heldRecord struct {
	id                         int64
	eventID, eventType, reason string
	err                        string
	// wait is how long from its recording the row is held: the table's
	// retry_at, which a reload of the table (merge) takes as its end.
	wait time.Duration
}

// heldSnapshot is the held table as one replica read it.
type heldSnapshot struct {
	at   time.Time
	rows map[int64]heldRow
	// complete: the reload read every record; else only those tried again
	// soonest, up to last (heldCacheRows), and says nothing of the others.
	complete bool
	last     time.Time
}

func newHeldRows() *heldRows {
	return &heldRows{rows: map[int64]heldRow{}, logged: map[int64]bool{}}
}

// hold keeps x out of claims until until, queues its record, and logs it
// the first time.
func (h *heldRows) hold(log *slog.Logger, x row, reason string, until time.Time, err error) {
	now := time.Now()
	h.rows[x.id] = heldRow{reason: reason, until: until, at: now, key: x.partitionKey, eventType: x.eventType, uncommitted: h.recorded}
	if h.recorded {
		msg := err.Error()
		if len(msg) > heldErrorBytes {
			// Cut whole characters: half of one is no text PostgreSQL takes,
			// and the batch recording the hold would fail at every retry.
			msg = strings.ToValidUTF8(msg[:heldErrorBytes], "")
		}
		h.pending = append(h.pending, heldRecord{id: x.id, eventID: x.eventID, eventType: x.eventType, reason: reason, err: msg, wait: max(until.Sub(now), 0)})
	}
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

// committed says that the batch recording holds is over (committed, or
// failed: then the rows are claimed and held again): from now, a reload
// read after at shows the holds as they are.
func (h *heldRows) committed(holds []heldRecord, at time.Time) {
	for _, rec := range holds {
		if r, ok := h.rows[rec.id]; ok && r.uncommitted {
			r.uncommitted, r.at = false, at
			h.rows[rec.id] = r
		}
	}
}

// take returns the holds queued since the last take.
func (h *heldRows) take() []heldRecord {
	p := h.pending
	h.pending = nil
	return p
}

// move keys the row held as from by to: it was put back under a new id.
func (h *heldRows) move(from, to int64) {
	if r, ok := h.rows[from]; ok {
		delete(h.rows, from)
		h.rows[to] = r
	}
	if h.logged[from] {
		delete(h.logged, from)
		h.logged[to] = true
	}
}

func (h *heldRows) isHeld(id int64) bool { r, ok := h.rows[id]; return ok && !r.released }

// ids are the held rows' ids, for the claim to leave out.
func (h *heldRows) ids() []int64 {
	ids := make([]int64, 0, len(h.rows))
	for id, r := range h.rows {
		if !r.released {
			ids = append(ids, id)
		}
	}
	return ids
}

// release frees the rows whose retry time has come and reports whether any was.
func (h *heldRows) release(now time.Time) bool { return len(h.releaseIDs(now)) > 0 }

// releaseIDs frees the rows whose retry time has come and returns their
// ids in id order.
func (h *heldRows) releaseIDs(now time.Time) []int64 {
	var ids []int64
	for id, r := range h.rows {
		if !r.released && !now.Before(r.until) {
			r.released = true
			h.rows[id] = r
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// forget drops the published rows among ids and returns those whose record
// in the held table goes with them.
func (h *heldRows) forget(ids []int64) []int64 {
	if len(h.rows) == 0 {
		return nil
	}
	var gone []int64
	for _, id := range ids {
		if _, ok := h.rows[id]; ok {
			delete(h.rows, id)
			gone = append(gone, id)
		}
	}
	if !h.recorded {
		return nil
	}
	return gone
}

// merge takes in a reload of the held table: what other replicas held, and
// what `relay redrive` released or the sweep removed. A row this replica
// held after the reload was read stays as it is, and so does one a reload
// cut short (heldCacheRows) did not reach. It returns the rows this
// replica held that the reload releases early, and the rows it learns of
// that wait (held elsewhere, or before a restart).
func (h *heldRows) merge(s heldSnapshot) (early, learned []heldRow) {
	for id, r := range h.rows {
		if _, ok := s.rows[id]; !ok && !r.uncommitted && !r.at.After(s.at) && (s.complete || r.until.Before(s.last)) {
			delete(h.rows, id)
			if !r.released {
				early = append(early, r)
			}
		}
	}
	for id, n := range s.rows {
		r, ok := h.rows[id]
		switch {
		case ok && (r.uncommitted || r.at.After(s.at)):
			// held here since the reload was read
		case ok && r.released && !n.until.After(s.at):
			// released here already; its record goes once it is published
		default:
			if ok && !r.released && !n.until.After(s.at) && r.until.After(s.at) {
				early = append(early, r) // redriven
			}
			if ok && (r.key != "" || r.eventType != "") {
				n.key, n.eventType = r.key, r.eventType
			}
			// Learned: a wait this replica did not know of, or knew with an
			// earlier end (released here, held again elsewhere), of a row
			// still unpublished: its lane waits until then.
			if n.waiting && n.until.After(s.at) && (!ok || r.released || n.until.After(r.until)) {
				learned = append(learned, n)
			}
			h.rows[id] = n // release marks it when its time has come
		}
	}
	return early, learned
}

// count is how many rows are held for reason.
func (h *heldRows) count(reason string) int {
	n := 0
	for _, r := range h.rows {
		if r.reason == reason && !r.released {
			n++
		}
	}
	return n
}
