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
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
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
	// Headers become Kafka headers of the record, besides the relay's own.
	// Optional; they need the table's headers column. Names the relay sets
	// itself (IsReservedHeader) are refused, and CheckHeaders' limits apply.
	// Store adds the trace context of ctx (W3C traceparent and tracestate,
	// through otel.GetTextMapPropagator()) when ctx carries a span.
	Headers map[string]string
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
	insertSQL, sameSQL               string // without the headers column
	insertHeadersSQL, sameHeadersSQL string
	hasHeadersSQL                    string
	table                            string // quoted
	notify                           string // channel to notify on commit; "" for none
	headersCol                       columnCache
}

// columnCache remembers, per database, whether the table has the headers
// column: a table made before the column existed keeps working for entries
// without headers. A found column is remembered for good, a missing one for
// a minute (so adding the column takes effect without a restart).
type columnCache struct {
	mu sync.Mutex
	db map[string]columnState // by host, port and database name
}

type columnState struct {
	present bool
	checked time.Time
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
		insertHeadersSQL: `INSERT INTO ` + t.Quoted() + `
    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, headers)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)
ON CONFLICT (event_id) DO NOTHING`,
		// The trace context differs between two tries of one handler, so
		// it is left out of the comparison ($8: the propagator's fields).
		sameHeadersSQL: `SELECT EXISTS (SELECT 1 FROM ` + t.Quoted() + `
    WHERE event_id = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_type = $4
      AND payload = $5 AND partition_key = $6
      AND COALESCE(headers, '{}'::jsonb) - $8::text[] = COALESCE($7::jsonb, '{}'::jsonb) - $8::text[])`,
		hasHeadersSQL: `SELECT EXISTS (SELECT 1 FROM pg_attribute
    WHERE attrelid = to_regclass($1) AND attname = 'headers' AND NOT attisdropped)`,
		table: t.Quoted(),
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
	prop := otel.GetTextMapPropagator()
	headers := make(propagation.MapCarrier, len(e.Headers)+2)
	prop.Inject(ctx, headers)
	traced := len(headers) > 0
	for k, v := range e.Headers {
		if _, set := headers[k]; !set {
			headers[k] = v
		}
	}
	if traced && CheckHeaders(headers) != nil {
		// The entry's own headers fit (validate checked them) but not with
		// the trace context: the event goes without it, never refused.
		headers = propagation.MapCarrier(e.Headers)
		traced = false
	}
	args := []any{e.EventID, e.AggregateType, e.AggregateID, e.EventType, e.Payload, e.PartitionKey}
	insert, sameStmt := w.insertSQL, w.sameSQL
	var sameArgs []any
	col, err := w.hasHeaders(ctx, tx)
	switch {
	case err != nil:
		return fmt.Errorf("outbox store %s: %w", e.EventID, err)
	case col:
		var stored any // NULL when there are no headers
		if len(headers) > 0 {
			b, err := json.Marshal(headers)
			if err != nil {
				return fmt.Errorf("outbox store %s: headers: %w", e.EventID, err)
			}
			stored = string(b)
		}
		insert, sameStmt = w.insertHeadersSQL, w.sameHeadersSQL
		args = append(args, stored)
		sameArgs = append(args[:len(args):len(args)], prop.Fields())
	case len(e.Headers) > 0:
		return fmt.Errorf("outbox store %s: table %s has no headers column; add it with: ALTER TABLE %s ADD COLUMN headers jsonb",
			e.EventID, w.table, w.table)
	case traced:
		// A table made before the headers column: the event is stored
		// without its trace context rather than not at all.
	}
	tag, err := tx.Exec(ctx, insert, args...)
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
	if sameArgs == nil {
		sameArgs = args
	}
	if err := tx.QueryRow(ctx, sameStmt, sameArgs...).Scan(&same); err != nil {
		return fmt.Errorf("outbox store %s: compare with the stored event: %w", e.EventID, err)
	}
	if !same {
		return fmt.Errorf("outbox store %s: %w", e.EventID, ErrEventIDConflict)
	}
	return nil
}

// hasHeaders reports whether the table has the headers column (see columnCache).
func (w *Writer) hasHeaders(ctx context.Context, tx pgx.Tx) (bool, error) {
	key := ""
	if c := tx.Conn(); c != nil {
		cfg := c.Config()
		key = fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
	}
	w.headersCol.mu.Lock()
	defer w.headersCol.mu.Unlock()
	st := w.headersCol.db[key]
	if st.present || (!st.checked.IsZero() && time.Since(st.checked) < time.Minute) {
		return st.present, nil
	}
	if err := tx.QueryRow(ctx, w.hasHeadersSQL, w.table).Scan(&st.present); err != nil {
		return false, fmt.Errorf("look for the headers column of %s: %w", w.table, err)
	}
	st.checked = time.Now()
	if w.headersCol.db == nil {
		w.headersCol.db = map[string]columnState{}
	}
	w.headersCol.db[key] = st
	return st.present, nil
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
	if err := checkEntryHeaders(e.Headers); err != nil {
		errs = append(errs, fmt.Errorf("Headers: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("outbox entry: %w", err)
	}
	return nil
}
