// Package outbox is the application side of the transactional outbox: a
// service stores its event in the outbox table inside the same pgx.Tx as its
// business write, and the relay publishes it to Kafka after commit.
//
//	tx, _ := pool.Begin(ctx)
//	defer tx.Rollback(ctx)
//	... business write with tx ...
//	err := outbox.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), ...})
//	err = tx.Commit(ctx)
package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Entry is one event to publish. The relay routes it by EventType through
// its topic map; PartitionKey becomes the Kafka record key, Payload its value.
type Entry struct {
	// EventID identifies the event. Storing the same entry twice stores it
	// once; storing another entry under an existing id is ErrEventIDConflict.
	// Use NewEventID (UUIDv7: time-ordered, index-friendly).
	EventID       string
	AggregateType string
	AggregateID   string
	EventType     string
	// Payload is JSON (the column is jsonb).
	Payload []byte
	// PartitionKey is the Kafka record key; usually the aggregate id, so one
	// aggregate's events land on one partition.
	PartitionKey string
}

// NewEventID returns a new UUIDv7 string.
func NewEventID() string {
	return uuid.Must(uuid.NewV7()).String()
}

// ErrEventIDConflict: an event with the entry's EventID is stored already,
// with other content. A retried handler that stores the same entry again
// does not get it; two different events under one id do.
var ErrEventIDConflict = errors.New("outbox: event id already stored with different content")

// Writer stores entries into one outbox table.
type Writer struct {
	insertSQL, sameSQL string
	notify             string // channel to notify on commit; "" for none
}

// WriterOption configures a Writer.
type WriterOption func(*Writer)

// WithNotify makes the writer notify the table's channel (Table.NotifyChannel)
// in each transaction that stores an event, so a relay run with --notify
// claims it within milliseconds instead of at its next poll. PostgreSQL
// delivers a notification at commit and takes a database-wide lock to do so,
// which serializes the commits of every transaction that notifies: it costs
// writers throughput (docs/benchmarks.md measures how much). Polling still
// runs, so nothing is lost when a notification is.
func WithNotify() WriterOption {
	return func(w *Writer) { w.notify = "on" }
}

// NewWriter returns a Writer for table ("outbox" or "schema.outbox"); the
// name is validated and quoted.
func NewWriter(table string, opts ...WriterOption) (*Writer, error) {
	t, err := ParseTable(table)
	if err != nil {
		return nil, err
	}
	w := &Writer{
		insertSQL: `INSERT INTO ` + t.Quoted() + `
    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (event_id) DO NOTHING`,
		sameSQL: `SELECT EXISTS (SELECT 1 FROM ` + t.Quoted() + `
    WHERE event_id = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_type = $4
      AND payload = $5 AND partition_key = $6)`,
	}
	for _, opt := range opts {
		opt(w)
	}
	if w.notify != "" {
		w.notify = t.NotifyChannel()
	}
	return w, nil
}

var defaultWriter = must(NewWriter(DefaultTable))

func must(w *Writer, err error) *Writer {
	if err != nil {
		panic(err)
	}
	return w
}

// Store inserts e into the "outbox" table within tx.
func Store(ctx context.Context, tx pgx.Tx, e Entry) error {
	return defaultWriter.Store(ctx, tx, e)
}

// Store inserts e within tx. Storing an entry whose EventID is stored
// already is a no-op when the content is the same (a retried handler does
// not store its event twice) and ErrEventIDConflict when it is not.
func (w *Writer) Store(ctx context.Context, tx pgx.Tx, e Entry) error {
	if err := e.validate(); err != nil {
		return err
	}
	args := []any{e.EventID, e.AggregateType, e.AggregateID, e.EventType, e.Payload, e.PartitionKey}
	tag, err := tx.Exec(ctx, w.insertSQL, args...)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "22P02" {
			return fmt.Errorf("outbox store %s: event id or payload malformed: %w", e.EventID, err)
		}
		return fmt.Errorf("outbox store %s: %w", e.EventID, err)
	}
	if tag.RowsAffected() == 1 {
		if w.notify != "" {
			// Repeated notifications of one transaction are delivered once.
			if _, err := tx.Exec(ctx, `SELECT pg_notify($1, '')`, w.notify); err != nil {
				return fmt.Errorf("outbox store %s: notify %s: %w", e.EventID, w.notify, err)
			}
		}
		return nil
	}
	var same bool
	if err := tx.QueryRow(ctx, w.sameSQL, args...).Scan(&same); err != nil {
		return fmt.Errorf("outbox store %s: compare with the stored event: %w", e.EventID, err)
	}
	if !same {
		return fmt.Errorf("outbox store %s: %w", e.EventID, ErrEventIDConflict)
	}
	return nil
}

func (e Entry) validate() error {
	var errs []error
	if _, err := uuid.Parse(e.EventID); err != nil {
		errs = append(errs, fmt.Errorf("EventID %q is not a UUID", e.EventID))
	}
	if e.EventType == "" {
		errs = append(errs, errors.New("EventType is empty"))
	}
	if e.AggregateType == "" {
		errs = append(errs, errors.New("AggregateType is empty"))
	}
	if len(e.Payload) == 0 {
		errs = append(errs, errors.New("Payload is empty"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("outbox entry: %w", err)
	}
	return nil
}
