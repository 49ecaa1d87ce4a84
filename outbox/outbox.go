// Package outbox is the application side of the transactional outbox: a
// service stores its event in the outbox table inside the same pgx.Tx as its
// business write, and the relay publishes it to Kafka after commit.
//
//	tx, err := pool.Begin(ctx)
//	if err != nil { return err }
//	defer tx.Rollback(ctx)
//	... business write with tx ...
//	if err := outbox.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), ...}); err != nil {
//		return err // never commit the business write without its event
//	}
//	return tx.Commit(ctx)
package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

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
	// On a plain table that holds while the row does: once the relay
	// deletes it (retention Delete, or --keep-published-for) the id is free,
	// and a retry stores the event again (consumers de-duplicate by event
	// id). A partitioned table's event id table keeps the id for as long as
	// a partition covers its created_at.
	// Use NewEventID (UUIDv7: time-ordered, index-friendly). Any spelling
	// of a UUID is taken (upper case, braces, no hyphens) and stored, and
	// compared, in its canonical form (lower case, hyphenated): in a text
	// event_id column two spellings of one id are one event.
	EventID       string
	AggregateType string
	AggregateID   string
	EventType     string
	// Payload is JSON, stored as given in a payload column of type jsonb
	// (the DDL's), json, text or bytea. A retried store compares it as
	// JSON (key order and spacing do not matter) with a jsonb or json
	// column, and with a text column of a partitioned table, which then
	// needs JSON; byte for byte with a bytea column and a plain table's
	// text column, which take any bytes.
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
	// The statements of each type of payload column the writer takes
	// (payloadTypes), by the type's name.
	byPayload                      map[string]*storeStatements
	shapeSQL                       string
	table, eventIDs, addPartitions string // quoted
	notify                         string // channel to notify on commit; "" for none
	// The statements deleting the stored entry (WithDeleteOnStore) from a
	// plain and from a partitioned table; "" to keep it.
	deleteStored, deleteStoredParted string
	parsed                           Table
	shapes                           shapeCache
}

// storeStatements are one set of statements per table shape: with or
// without the headers column, plain or partitioned.
type storeStatements struct {
	plain, plainHeaders, parted, partedHeaders statements
}

// payloadSQL is how the statements take the payload ($5) for one type of
// payload column.
type payloadSQL struct {
	// same compares the stored payload with $5 on a plain table.
	same string
	// value is $5 as a partitioned table's row takes it.
	value string
	// digest is $5 as it goes into the digest (digestSQL). A type compared
	// as JSON takes it as jsonb, as the DDL's jsonb column always has, so
	// the digests of the ids stored already stay valid.
	digest string
}

// payloadTypes are the types of payload column the writer stores into,
// those the relay reads (Columns). json and jsonb compare as JSON. text
// compares byte for byte on a plain table, as its = does, and as JSON on a
// partitioned one, as its digest always has. bytea compares byte for byte.
// A value cast from text keeps the payload as given: a json column keeps
// its spelling.
var payloadTypes = map[string]payloadSQL{
	"jsonb": {same: `payload = $5`, value: `$5`, digest: `$5::jsonb`},
	"json":  {same: `payload::jsonb = $5::jsonb`, value: `$5::text::json`, digest: `$5::text::jsonb`},
	"text":  {same: `payload = $5`, value: `$5::text`, digest: `$5::text::jsonb`},
	"bytea": {same: `payload = $5`, value: `$5::bytea`, digest: `encode($5::bytea, 'hex')`},
}

// payloadTypeNames are the names of payloadTypes, for messages.
const payloadTypeNames = "jsonb, json, text or bytea"

// statements store an entry into one shape of table. Their arguments are,
// in this order, the entry's event id, aggregate type, aggregate id, event
// type, payload and partition key, its headers as JSON (or NULL), and the
// propagator's fields (left out of comparisons: the trace context differs
// between two tries of one handler); each statement takes the first n.
type statements struct {
	// insert stores the entry, or nothing when its event id is stored
	// already. With returning, it returns the stored row's id and
	// created_at (the row's key in a partitioned table).
	insert     string
	insertArgs int
	returning  bool
	// same reports whether the event stored under the id is the entry.
	same     string
	sameArgs int
}

// shapeCache remembers, per database and search path, the shape of the table: whether it
// has the headers column (a table made before the column existed keeps
// working for entries without headers), whether it is partitioned,
// whether its event-id table exists, and the type of its payload column
// (payloadTypes). It is read again after a minute, so
// adding the column or replacing the table takes effect without a restart.
type shapeCache struct {
	mu sync.Mutex
	db map[string]tableShape // by host, port, database name, user and the DSN's search_path and options
}

type tableShape struct {
	database    string // current_database()
	payload     string // the payload column's type; "" when the table or the column is missing
	headers     bool
	partitioned bool
	eventIDs    bool // Table.EventIDsTable exists
	checked     time.Time
}

// WriterOption configures a Writer.
type WriterOption func(*Writer)

// WithNotify makes the writer notify the table's channel (Table.NotifyChannel)
// in each transaction that stores an event, so a relay run with --notify
// claims it within milliseconds instead of at its next poll. PostgreSQL
// delivers a notification at commit and takes a lock to do so that is one
// for the whole server, every database on it, which serializes the commits
// of every transaction that notifies, whatever its database: it costs
// writers throughput (docs/benchmarks.md measures how much). Polling still
// runs, so nothing is lost when a notification is.
func WithNotify() WriterOption {
	return func(w *Writer) { w.notify = "on" }
}

// WithDeleteOnStore makes the writer delete each entry in the transaction
// that inserts it, as Debezium's outbox pattern does: the insert is in the
// write-ahead log, where a relay run with --capture logical-replication
// --writer-deletes reads it, and the table stays empty, so nothing is
// marked, vacuumed or pruned. A polling relay never sees these events (a
// streaming relay without --writer-deletes puts them back into the table
// and publishes them, as it does while an OutboxRelay is switched away
// from writer deletes), and until a relay publishes them the replication
// slot is their only copy. The row is kept unless such a relay streams from
// the table's slot (SlotName) at that moment (DeleteOnStoreCondition), so
// events written before the relay first ran, while it is down or while an
// OutboxRelay is switched to writer deletes are published from the table.
// Name the table as the relay's --table does: the slot's name (SlotName)
// is made from that spelling, and a writer of "outbox" beside a relay of
// "public.outbox" finds no slot streaming and keeps every row.
// A handler retried after its commit stores its event again, as a new row,
// on a plain table (consumers de-duplicate by event id); on a partitioned
// one the event id table still holds the id, and the retry stores nothing
// (ErrEventIDConflict if its content differs).
func WithDeleteOnStore() WriterOption {
	return func(w *Writer) { w.deleteStored = "on" }
}

// WriterDeletesRelay is the application_name of the replication session
// of a relay run with --writer-deletes, so that it shows in
// pg_stat_activity.
const WriterDeletesRelay = "outbox-relay-writer-deletes"

// writerDeletesLockSeed seeds the hash of a slot's name that keys its
// writer-deletes lock (WriterDeletesLock), so that the key differs from a
// plain hash of the name an application might lock on.
const writerDeletesLockSeed = "6085064421"

// WriterDeletesLock is the SQL of the key (a bigint) of the advisory lock
// that a relay run with --writer-deletes holds, for the life of its
// replication session, while it streams from the slot whose name is the
// text expression slot; the writers test it (DeleteOnStoreCondition).
func WriterDeletesLock(slot string) string {
	return `hashtextextended(` + slot + `, ` + writerDeletesLockSeed + `)`
}

// DeleteOnStoreCondition is the condition under which a writer with
// WithDeleteOnStore deletes its row: a relay run with --writer-deletes
// streams from the table's slot (whose name is the text parameter
// slotParam) now. Otherwise the row stays in the table, unpublished, for a
// relay to claim: before the slot exists, an insert is in no WAL a relay
// reads; while no relay with writer deletes streams, nothing says the slot
// will be read to the row (a relay without them gives its slot up past
// --max-retained-wal, one that polls leaves it unread). It is the part of
// the condition a writer runs (DeleteOnStoreConditionFor) that reads the
// slot and the lock; a relay takes the lock only once it has marked the
// publication (WriterDeletesMark).
//
// Such a relay holds the slot's writer-deletes lock (WriterDeletesLock)
// exclusively on its replication session from just before it starts
// streaming. The writer tries the lock shared and, if it gets it, lets it go
// in the same expression: it holds it for no longer than that, so a relay
// that starts never waits for the writers' transactions. It runs in each
// writer's transaction, so it reads no session's activity: a read of
// pg_stat_activity, even of one session, copies every session's entry.
// A Writer also requires its table to be the one the slot's publication
// publishes (DeletesOnStore says whether both hold).
func DeleteOnStoreCondition(slotParam string) string {
	key := WriterDeletesLock(slotParam + `::text`)
	return `EXISTS (SELECT 1 FROM pg_replication_slots s
        WHERE s.slot_name::text = ` + slotParam + `::text AND s.active_pid IS NOT NULL AND s.confirmed_flush_lsn IS NOT NULL)
      AND CASE WHEN pg_try_advisory_lock_shared(` + key + `) THEN NOT pg_advisory_unlock_shared(` + key + `) ELSE true END`
}

// WriterDeletesMark is the line a relay with writer deletes adds to the
// comment of its slot's publication before it streams, and adds again
// while it streams if the line is gone. A relay without writer deletes that
// takes the slot later reads it: the slot may then hold events that are in
// no table, so it keeps the slot past --max-retained-wal until it has
// streamed past them, and then removes the line. Writers delete only while
// the publication carries it (DeleteOnStoreConditionFor): a row deleted
// while it does not, as when the relay's role may not comment on the
// publication, would be in the slot alone with nothing saying so, and a
// relay switched away from writer deletes would give the slot up past
// the limit and lose it.
const WriterDeletesMark = "outbox-relay: streamed with writer deletes; the slot may hold events that are in no table"

// DeleteOnStoreConditionFor is the condition under which a writer with
// WithDeleteOnStore deletes its row of table t: DeleteOnStoreCondition,
// the slot's publication (named as the slot) carries WriterDeletesMark,
// and t is the table that publication publishes, as the relay reads it:
// its inserts and deletes (without the deletes a relay switched from
// writer deletes later cannot tell the rows writers deleted from those it
// published; the relay checks it at start, and this holds while it
// streams), every row and every column (no row filter or column list,
// PostgreSQL 15's; read through to_jsonb, so the
// condition also runs on 14, which has neither), and a partitioned table's
// under the table's own name (publish_via_partition_root). A table dropped
// and made again, or swapped in by a rename, while a relay streams is in
// no publication, and a publication changed by hand may carry no inserts,
// only some rows or columns, or a partitioned table's under its
// partitions' names, which the stream does not read: such rows are in no
// stream the relay reads, so the writer keeps them for the relays to
// claim. The slot's name is in slotParam. It is the whole condition, which
// a writer in another language must run too
// (docs/migrating-from-debezium.md). The mark is read from pg_description
// itself: obj_description is an SQL-language function, which the server
// plans again at each statement that calls it, in every writer's
// transaction; the join is planned once, with the statement.
func DeleteOnStoreConditionFor(slotParam string, t Table) string {
	rel := `to_regclass(` + QuoteLiteral(t.Quoted()) + `)`
	return DeleteOnStoreCondition(slotParam) + `
      AND EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
        WHERE p.pubname = ` + slotParam + `::text AND pr.prrelid = ` + rel + ` AND p.pubinsert AND p.pubdelete
          AND EXISTS (SELECT 1 FROM pg_description d WHERE d.objoid = p.oid AND d.classoid = 'pg_catalog.pg_publication'::regclass AND d.objsubid = 0
            AND ` + QuoteLiteral(WriterDeletesMark) + ` = ANY(string_to_array(d.description, E'\n')))
          AND to_jsonb(pr) ->> 'prqual' IS NULL AND to_jsonb(pr) ->> 'prattrs' IS NULL
          AND (p.pubviaroot OR NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = ` + rel + ` AND c.relkind = 'p')))`
}

// DeletesOnStore reports whether a writer with WithDeleteOnStore, connected
// as db is, would delete the rows it stores in table now
// (DeleteOnStoreConditionFor on the table's slot in the connected database:
// a relay with writer deletes streams, its publication carries
// WriterDeletesMark, and table is the one it publishes). A
// relay's replication session connects before it takes the slot, so a test
// or a readiness check that waits for writer deletes waits on this, not on
// the session.
func DeletesOnStore(ctx context.Context, db interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, table Table) (bool, error) {
	var database string
	if err := db.QueryRow(ctx, `SELECT current_database()`).Scan(&database); err != nil {
		return false, err
	}
	var on bool
	err := db.QueryRow(ctx, `SELECT `+DeleteOnStoreConditionFor("$1", table), SlotName(database, table)).Scan(&on)
	return on, err
}

// NewWriter returns a Writer for table ("outbox" or "schema.outbox"); the
// name is validated and quoted.
func NewWriter(table string, opts ...WriterOption) (*Writer, error) {
	t, err := ParseTable(table)
	if err != nil {
		return nil, err
	}
	q, ids := t.Quoted(), t.EventIDsTable().Quoted()
	w := &Writer{
		byPayload: map[string]*storeStatements{},
		shapeSQL: `SELECT current_database(), COALESCE((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false),
    EXISTS (SELECT 1 FROM pg_attribute
        WHERE attrelid = to_regclass($1) AND attname = 'headers' AND attnum > 0 AND NOT attisdropped),
    to_regclass($2) IS NOT NULL,
    COALESCE((SELECT format_type(atttypid, NULL) FROM pg_attribute
        WHERE attrelid = to_regclass($1) AND attname = 'payload' AND attnum > 0 AND NOT attisdropped), '')`,
		table:         q,
		parsed:        t,
		eventIDs:      ids,
		addPartitions: t.AddPartitionsFunction().Quoted(),
	}
	for typ, p := range payloadTypes {
		w.byPayload[typ] = newStoreStatements(q, ids, p)
	}
	for _, opt := range opts {
		opt(w)
	}
	if w.notify != "" {
		w.notify = t.NotifyChannel()
	}
	if w.deleteStored != "" {
		cond := DeleteOnStoreConditionFor("$2", t)
		// A plain table's event_id is unique (the insert's ON CONFLICT
		// needs the index), so the row is found by it. A partitioned
		// table has no index on event_id: the row is found by its primary
		// key (id, created_at), which the insert returns, so that only the
		// partition holding it is scanned (by index) and locked.
		w.deleteStored = `DELETE FROM ` + q + ` WHERE event_id = $1 AND ` + cond
		w.deleteStoredParted = `DELETE FROM ` + q + ` WHERE id = $3 AND created_at = $4 AND event_id = $1 AND ` + cond
		for _, sts := range w.byPayload {
			for _, st := range []*statements{&sts.parted, &sts.partedHeaders} {
				st.insert += `
RETURNING id, created_at`
				st.returning = true
			}
		}
	}
	return w, nil
}

// newStoreStatements are the statements that store into table q (with
// event-id table ids when partitioned) whose payload column takes the
// payload as p says.
func newStoreStatements(q, ids string, p payloadSQL) *storeStatements {
	return &storeStatements{
		plain: statements{
			insert: `INSERT INTO ` + q + `
    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (event_id) DO NOTHING`, insertArgs: 6,
			same: `SELECT EXISTS (SELECT 1 FROM ` + q + `
    WHERE event_id = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_type = $4
      AND ` + p.same + ` AND partition_key = $6)`, sameArgs: 6,
		},
		plainHeaders: statements{
			insert: `INSERT INTO ` + q + `
    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, headers)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)
ON CONFLICT (event_id) DO NOTHING`, insertArgs: 7,
			same: `SELECT EXISTS (SELECT 1 FROM ` + q + `
    WHERE event_id = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_type = $4
      AND ` + p.same + ` AND partition_key = $6
      AND COALESCE(headers, '{}'::jsonb) - $8::text[] = COALESCE($7::jsonb, '{}'::jsonb) - $8::text[])`, sameArgs: 8,
		},
		// A partitioned table cannot have a unique index on event_id
		// alone (it must include the partition key), so the event id goes
		// into the event-id table first, in the same statement: its primary
		// key makes a second store of the id wait for the first and then do
		// nothing, whatever created_at each has. The row is inserted only
		// when the id was new.
		parted: statements{
			insert: `WITH id AS (
    INSERT INTO ` + ids + ` (event_id, created_at, digest) VALUES ($1, now(), ` + digestSQL(p.digest, false) + `)
    ON CONFLICT (event_id) DO NOTHING
    RETURNING event_id)
INSERT INTO ` + q + `
    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
SELECT event_id, $2, $3, $4, ` + p.value + `, $6 FROM id`, insertArgs: 6,
			same: `SELECT COALESCE((SELECT digest = ` + digestSQL(p.digest, false) + ` FROM ` + ids + ` WHERE event_id = $1), false)`, sameArgs: 6,
		},
		partedHeaders: statements{
			insert: `WITH id AS (
    INSERT INTO ` + ids + ` (event_id, created_at, digest) VALUES ($1, now(), ` + digestSQL(p.digest, true) + `)
    ON CONFLICT (event_id) DO NOTHING
    RETURNING event_id)
INSERT INTO ` + q + `
    (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, headers)
SELECT event_id, $2, $3, $4, ` + p.value + `, $6, $7::jsonb FROM id`, insertArgs: 8,
			same: `SELECT COALESCE((SELECT digest = ` + digestSQL(p.digest, true) + ` FROM ` + ids + ` WHERE event_id = $1), false)`, sameArgs: 8,
		},
	}
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
	if tx == nil {
		return errors.New("outbox: Store needs the business write's transaction, and tx is nil")
	}
	if err := e.validate(); err != nil {
		return err
	}
	e.EventID = uuid.MustParse(e.EventID).String() // validate parsed it
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
	shape, err := w.shape(ctx, tx)
	if err != nil {
		return fmt.Errorf("outbox store %s: %w", e.EventID, err)
	}
	sts := w.byPayload[shape.payload]
	switch {
	case sts == nil && shape.payload != "":
		return fmt.Errorf("outbox store %s: column payload of %s has type %s; the writer stores into %s",
			e.EventID, w.table, shape.payload, payloadTypeNames)
	case sts == nil: // no table or no column: the insert says so
		sts = w.byPayload["jsonb"]
	}
	if shape.partitioned && !shape.eventIDs {
		return fmt.Errorf("outbox store %s: table %s is partitioned and %s, which keeps event_id unique across its partitions, does not exist; create it with the DDL that `relay schema --partitioned` prints",
			e.EventID, w.table, w.eventIDs)
	}
	var stored any // NULL when there are no headers
	switch {
	case shape.headers:
		if len(headers) > 0 {
			b, err := json.Marshal(headers)
			if err != nil {
				return fmt.Errorf("outbox store %s: headers: %w", e.EventID, err)
			}
			stored = string(b)
		}
	case len(e.Headers) > 0:
		return fmt.Errorf("outbox store %s: table %s has no headers column; add it with: ALTER TABLE %s ADD COLUMN headers jsonb",
			e.EventID, w.table, w.table)
	case traced:
		// A table made before the headers column: the event is stored
		// without its trace context rather than not at all.
	}
	st := sts.plain
	switch {
	case shape.partitioned && shape.headers:
		st = sts.partedHeaders
	case shape.partitioned:
		st = sts.parted
	case shape.headers:
		st = sts.plainHeaders
	}
	// The payload goes as text to every type but bytea: a connection whose
	// default_query_exec_mode is exec or simple_protocol (usual behind
	// PgBouncer) types a parameter by its Go value, and a []byte as bytea,
	// whose text form a text column kept and json refused.
	var payload any = string(e.Payload)
	if shape.payload == "bytea" {
		payload = e.Payload
	}
	// The propagator's fields are left out of a retry's comparison; nil
	// would go as NULL, and jsonb minus NULL is NULL: every retry would
	// conflict on a plain table, and any headers match on a partitioned one.
	fields := prop.Fields()
	if fields == nil {
		fields = []string{}
	}
	args := []any{e.EventID, e.AggregateType, e.AggregateID, e.EventType, payload, e.PartitionKey, stored, fields}
	var (
		inserted  bool
		id        int64     // with st.returning
		createdAt time.Time // with st.returning
	)
	if st.returning {
		err = tx.QueryRow(ctx, st.insert, args[:st.insertArgs]...).Scan(&id, &createdAt)
		inserted = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	} else {
		var tag pgconn.CommandTag
		tag, err = tx.Exec(ctx, st.insert, args[:st.insertArgs]...)
		inserted = err == nil && tag.RowsAffected() == 1
	}
	if err != nil {
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == "22P02":
			return fmt.Errorf("outbox store %s: event id or payload malformed: %w", e.EventID, err)
		case errors.As(err, &pgErr) && pgErr.Code == "23514" && strings.Contains(pgErr.Message, "no partition"):
			return fmt.Errorf("outbox store %s: no partition of %s covers now(); create partitions ahead of time with SELECT %s(): %w",
				e.EventID, w.table, w.addPartitions, err)
		}
		return fmt.Errorf("outbox store %s: %w", e.EventID, err)
	}
	if inserted {
		if w.deleteStored != "" {
			slot := SlotName(shape.database, w.parsed)
			var err error
			if st.returning {
				// Sent with its values in the text, so it is planned with
				// them each time: a prepared statement's generic plan,
				// which the statement cache uses from the sixth run on,
				// locks every partition.
				_, err = tx.Exec(ctx, w.deleteStoredParted, pgx.QueryExecModeSimpleProtocol, e.EventID, slot, id, createdAt)
			} else {
				_, err = tx.Exec(ctx, w.deleteStored, e.EventID, slot)
			}
			if err != nil {
				return fmt.Errorf("outbox store %s: delete after insert: %w", e.EventID, err)
			}
		}
		if w.notify != "" {
			// Repeated notifications of one transaction are delivered once.
			if _, err := tx.Exec(ctx, `SELECT pg_notify($1, '')`, w.notify); err != nil {
				return fmt.Errorf("outbox store %s: notify %s: %w", e.EventID, w.notify, err)
			}
		}
		return nil
	}
	var same bool
	if err := tx.QueryRow(ctx, st.same, args[:st.sameArgs]...).Scan(&same); err != nil {
		return fmt.Errorf("outbox store %s: compare with the stored event: %w", e.EventID, err)
	}
	if !same {
		return fmt.Errorf("outbox store %s: %w", e.EventID, ErrEventIDConflict)
	}
	return nil
}

// digestSQL is what the event-id table of a partitioned outbox keeps of an
// entry to compare a later store with: a SHA-256 of the statements'
// arguments $2 to $6 and, with headers, of the headers without the
// propagator's fields ($7, $8), laid out as a JSON array (so no two
// different entries read alike). The payload goes in as payload says
// (payloadSQL.digest): as jsonb, it compares as the plain table's jsonb
// column does (key order and spacing do not matter).
func digestSQL(payload string, headers bool) string {
	h := `'{}'::jsonb`
	if headers {
		h = `COALESCE($7::jsonb, '{}'::jsonb) - $8::text[]`
	}
	return `sha256(convert_to(jsonb_build_array($2::text, $3::text, $4::text, ` + payload + `, $6::text, ` + h + `)::text, 'UTF8'))`
}

// shape reads the table's shape, or remembers it (see shapeCache).
func (w *Writer) shape(ctx context.Context, tx pgx.Tx) (tableShape, error) {
	key := ""
	if c := tx.Conn(); c != nil {
		// A table name without a schema resolves through the session's
		// search_path, which the role (ALTER ROLE ... SET) or the DSN sets
		// (search_path, or options=-c search_path=...); a session that
		// sets it itself after connecting is not told apart: give such a
		// writer a schema-qualified table.
		cfg := c.Config()
		key = fmt.Sprintf("%s:%d/%s user=%q search_path=%q options=%q", cfg.Host, cfg.Port, cfg.Database, cfg.User,
			cfg.RuntimeParams["search_path"], cfg.RuntimeParams["options"])
	}
	w.shapes.mu.Lock()
	st := w.shapes.db[key]
	w.shapes.mu.Unlock()
	if !st.checked.IsZero() && time.Since(st.checked) < time.Minute {
		return st, nil
	}
	// Read without the lock: the read runs in the caller's transaction,
	// and a slow one must hold up no other caller. Callers that find the
	// shape stale at once each read it.
	if err := tx.QueryRow(ctx, w.shapeSQL, w.table, w.eventIDs).Scan(&st.database, &st.partitioned, &st.headers, &st.eventIDs, &st.payload); err != nil {
		return tableShape{}, fmt.Errorf("read the shape of %s: %w", w.table, err)
	}
	st.checked = time.Now()
	w.shapes.mu.Lock()
	defer w.shapes.mu.Unlock()
	if w.shapes.db == nil {
		w.shapes.db = map[string]tableShape{}
	}
	if w.shapes.db[key].checked.Before(st.checked) {
		w.shapes.db[key] = st
	}
	return st, nil
}

func (e Entry) validate() error {
	var errs []error
	if _, err := uuid.Parse(e.EventID); err != nil || strings.HasPrefix(strings.ToLower(e.EventID), "urn:") {
		// uuid.Parse takes the urn:uuid: form, which PostgreSQL's uuid refuses.
		errs = append(errs, fmt.Errorf("EventID %q is not a UUID", e.EventID))
	}
	if err := CheckEventType(e.EventType); err != nil {
		errs = append(errs, fmt.Errorf("EventType: %w", err))
	}
	if e.AggregateType == "" {
		errs = append(errs, errors.New("AggregateType is empty"))
	}
	// PostgreSQL's text holds neither a NUL byte nor invalid UTF-8: the
	// insert would fail with an error that names no field.
	for _, f := range []struct{ name, v string }{
		{"EventType", e.EventType}, {"AggregateType", e.AggregateType}, {"AggregateID", e.AggregateID}, {"PartitionKey", e.PartitionKey},
	} {
		if strings.IndexByte(f.v, 0) >= 0 || !utf8.ValidString(f.v) {
			errs = append(errs, fmt.Errorf("%s %q holds a NUL byte or invalid UTF-8, which PostgreSQL's text refuses", f.name, f.v))
		}
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
