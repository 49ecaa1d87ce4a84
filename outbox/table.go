package outbox

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// DefaultTable is the outbox table's name when none is configured.
const DefaultTable = "outbox"

// EventTypePattern is what an event type may be: no '=' or ',' (the
// relay's --topic syntax, EVENT_TYPE=TOPIC, comma-separated) and no
// surrounding space, in at most MaxEventTypeLength characters. A type
// outside it can be in no topic map, so no relay would ever claim its row:
// Store refuses it, and the relay's settings and the OutboxRelay schema
// carry the same rule.
const EventTypePattern = `^[^=,\s]([^=,]*[^=,\s])?$`

// MaxEventTypeLength is the longest event type, in characters.
const MaxEventTypeLength = 255

var eventTypeRE = regexp.MustCompile(EventTypePattern)

// CheckEventType applies EventTypePattern and MaxEventTypeLength.
func CheckEventType(et string) error {
	if !eventTypeRE.MatchString(et) || utf8.RuneCountInString(et) > MaxEventTypeLength {
		return fmt.Errorf("event type %q must be 1 to %d characters without '=' or ',' and without surrounding space", et, MaxEventTypeLength)
	}
	return nil
}

// IdentifierPattern is one part of a table name: a plain, unquoted PostgreSQL
// identifier. Anything needing quotes (upper case, spaces, quotes, dots
// inside a part) is refused, so a configured name can never change the SQL
// it is spliced into, and PostgreSQL's case folding never surprises anyone.
const IdentifierPattern = `[a-z_][a-z0-9_]{0,62}`

// TablePattern is a whole table name, NAME or SCHEMA.NAME. The OutboxRelay
// schema carries the same pattern (a test compares them).
const TablePattern = `^` + IdentifierPattern + `(\.` + IdentifierPattern + `)?$`

var identRE = regexp.MustCompile(`^` + IdentifierPattern + `$`)

// Table is a validated, optionally schema-qualified outbox table name.
type Table struct {
	Schema string // "" means the search_path
	Name   string
}

// createSchema is the DDL that makes schema when it is missing. CREATE
// SCHEMA IF NOT EXISTS asks for the database's CREATE privilege even when
// the schema exists, so a table owner without it could not run the DDL
// again (the example service runs it at every start); the check comes
// first instead.
func createSchema(schema string) string {
	return fmt.Sprintf("DO $$ BEGIN\n    IF to_regnamespace(%s) IS NULL THEN CREATE SCHEMA %s; END IF;\nEND $$;\n\n",
		QuoteLiteral(pgx.Identifier{schema}.Sanitize()), pgx.Identifier{schema}.Sanitize())
}

// mustBeValid panics unless t is a name ParseTable takes: the DDL
// functions splice it into comments too, where a quoted name cannot keep a
// newline from ending the comment and starting a statement. A Table made
// by hand with such a name is a program's error, as a bad regexp is.
func (t Table) mustBeValid() {
	if _, err := ParseTable(t.String()); err != nil || (t.Schema == "" && strings.Contains(t.Name, ".")) {
		panic(fmt.Sprintf("outbox: DDL of an invalid table name %q (make Tables with ParseTable)", t.String()))
	}
}

// ParseTable validates "name" or "schema.name": each part a lower-case
// identifier of at most 63 bytes.
func ParseTable(s string) (Table, error) {
	parts := strings.Split(s, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("table %q: want NAME or SCHEMA.NAME", s)
	}
	for _, p := range parts {
		if !identRE.MatchString(p) {
			return Table{}, fmt.Errorf("table %q: %q is not a plain identifier (lower-case letters, digits and _, starting with a letter or _, at most 63 characters)", s, p)
		}
	}
	t := Table{Name: parts[0]}
	if len(parts) == 2 {
		t = Table{Schema: parts[0], Name: parts[1]}
	}
	// A name of 63 bytes ending in a derived table's suffix is its own
	// derived table once cut to fit (suffixed): the relay would add the
	// held table's columns to the outbox and write its records there.
	if t.HeldTable() == t || t.EventIDsTable() == t {
		return Table{}, fmt.Errorf("table %q: a name of 63 characters ending in _held or _event_ids is the name of its own held or event id table; shorten it", s)
	}
	return t, nil
}

// SelfDerivedPattern matches the table names ParseTable refuses for being
// their own held or event id table; the OutboxRelay schema refuses them
// with the same expression (a test compares them).
const SelfDerivedPattern = `(^|[.])([a-z_][a-z0-9_]{57}_held|[a-z_][a-z0-9_]{52}_event_ids)$`

// String is the name as configured.
func (t Table) String() string {
	if t.Schema == "" {
		return t.Name
	}
	return t.Schema + "." + t.Name
}

// Quoted is the name quoted for SQL.
func (t Table) Quoted() string {
	if t.Schema == "" {
		return pgx.Identifier{t.Name}.Sanitize()
	}
	return pgx.Identifier{t.Schema, t.Name}.Sanitize()
}

// IndexName is the conventional name of the table's partial index on unpublished rows.
func (t Table) IndexName() string {
	n := "ix_" + t.Name + "_unpublished"
	if len(n) > 63 {
		n = n[:63]
	}
	return n
}

// suffixed is the table's name with suffix, the name cut so the whole fits
// PostgreSQL's 63 bytes.
func (t Table) suffixed(suffix string) string {
	n := t.Name
	if len(n)+len(suffix) > 63 {
		n = n[:63-len(suffix)]
	}
	return n + suffix
}

// Suffixed is the table of the same schema named as the table with
// suffix, the name cut so the whole fits PostgreSQL's 63 bytes.
func (t Table) Suffixed(suffix string) Table {
	return Table{Schema: t.Schema, Name: t.suffixed(suffix)}
}

// EventIDsTable is the table that keeps event_id unique across the
// partitions of a partitioned outbox (PartitionedSchemaDDL): "<name>_event_ids",
// in the outbox's schema.
func (t Table) EventIDsTable() Table {
	return t.Suffixed("_event_ids")
}

// HeldTable is the table where relays record the rows they hold back (too
// large, refused by Kafka, invalid): "<name>_held", in the outbox's schema
// (HeldDDL).
func (t Table) HeldTable() Table {
	return t.Suffixed("_held")
}

// The reasons a relay records a row in the held table under (HeldDDL's
// CHECK); the relay's reasons of the same names are these.
const (
	// HeldInvalidRow: a column the relay reads is NULL, created_at is out
	// of range (CreatedAtCheck), or the headers are malformed.
	HeldInvalidRow = "invalid_row"
	// HeldTooLarge: the record is larger than its topic takes, and there
	// is no dead-letter topic it fits.
	HeldTooLarge = "too_large"
	// HeldRefused: Kafka refused the record permanently and there is no
	// dead-letter topic.
	HeldRefused = "refused"
)

// HeldReasons are the reasons in the held table.
var HeldReasons = []string{HeldInvalidRow, HeldTooLarge, HeldRefused}

// HeldDDL is the DDL of t's held table: one row per outbox row a relay
// holds back, with the reason, the last error, when it was first and last
// tried, how often, when it is tried next, and when it was last redriven.
// Relays create it themselves when it is missing and their role may;
// `relay held` lists it and `relay redrive` sets retry_at and redriven_at
// to now. A row leaves it once its outbox row is published (or
// dead-lettered).
func HeldDDL(t Table) string {
	t.mustBeValid()
	reasons := make([]string, len(HeldReasons))
	for i, r := range HeldReasons {
		reasons[i] = QuoteLiteral(r)
	}
	return ifNoTable(t.HeldTable(), fmt.Sprintf(`CREATE TABLE %s (
    id            bigint      PRIMARY KEY,
    event_id      text        NOT NULL,
    event_type    text        NOT NULL,
    reason        text        NOT NULL CHECK (reason IN (%s)),
    error         text        NOT NULL,
    attempts      integer     NOT NULL DEFAULT 1,
    first_attempt timestamptz NOT NULL DEFAULT now(),
    last_attempt  timestamptz NOT NULL DEFAULT now(),
    retry_at      timestamptz NOT NULL,
    %s
)`, t.HeldTable().Quoted(), strings.Join(reasons, ", "), heldRedrivenAt))
}

// ifNoTable is ddl, run only when table t does not exist. CREATE TABLE IF
// NOT EXISTS asks for the schema's CREATE privilege even when the table
// exists, so a table's owner without it could not run the DDL again (the
// example service runs it at every start).
func ifNoTable(t Table, ddl string) string {
	return fmt.Sprintf("DO $$ BEGIN\n    IF to_regclass(%s) IS NULL THEN\n%s;\n    END IF;\nEND $$;\n",
		QuoteLiteral(t.Quoted()), indent(ddl))
}

// ifNoIndex is ddl, run only when table t has no index named index. CREATE
// INDEX IF NOT EXISTS locks the table against writes (SHARE) before it
// finds the index: run again at every start, it waited for every open
// writer transaction, and every write queued behind it.
func ifNoIndex(t Table, index, ddl string) string {
	return fmt.Sprintf(`DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
                   WHERE x.indrelid = to_regclass(%s) AND i.relname = %s) THEN
%s;
    END IF;
END $$;
`, QuoteLiteral(t.Quoted()), QuoteLiteral(index), indent(ddl))
}

// ifSettingsDiffer is ALTER TABLE t SET (settings), run only when t's
// storage parameters lack one of settings ("name = value", comma-separated):
// run again, it would rewrite the catalog and lock out autovacuum.
func ifSettingsDiffer(t Table, settings string) string {
	var want []string
	for _, kv := range strings.Split(settings, ",") {
		k, v, _ := strings.Cut(kv, "=")
		want = append(want, QuoteLiteral(strings.TrimSpace(k)+"="+strings.TrimSpace(v)))
	}
	return fmt.Sprintf(`DO $$ BEGIN
    IF NOT (SELECT COALESCE(reloptions, '{}') @> ARRAY[%s]::text[] FROM pg_class WHERE oid = to_regclass(%s)) THEN
        ALTER TABLE %s SET (
            %s
        );
    END IF;
END $$;
`, strings.Join(want, ", "), QuoteLiteral(t.Quoted()), t.Quoted(), strings.ReplaceAll(settings, "\n    ", "\n            "))
}

// indent indents each line of ddl by eight spaces.
func indent(ddl string) string {
	return "        " + strings.ReplaceAll(ddl, "\n", "\n        ")
}

// heldRedrivenAt is the held table's redriven_at column: when `relay
// redrive` last released the row. A batch that began before then and holds
// the row again leaves its retry_at as the redrive set it: the batch's
// attempt may predate the fix the redrive follows.
const heldRedrivenAt = `redriven_at   timestamptz`

// HeldRedrivenAtDDL adds redriven_at to t's held table made before the
// column existed; relays run it at start-up when their role may.
func HeldRedrivenAtDDL(t Table) string {
	return `ALTER TABLE ` + t.HeldTable().Quoted() + ` ADD COLUMN IF NOT EXISTS ` + heldRedrivenAt
}

// AddPartitionsFunction is the function PartitionedSchemaDDL defines to
// create a partitioned outbox's next partitions: "<name>_add_partitions".
func (t Table) AddPartitionsFunction() Table {
	return t.Suffixed("_add_partitions")
}

// NotifyChannel is the channel a writer with WithNotify notifies and a
// relay with --notify listens on: the table's name (at most 63 bytes, the
// longest channel name PostgreSQL takes).
func (t Table) NotifyChannel() string {
	c := t.String()
	if len(c) > 63 {
		c = c[:63]
	}
	return c
}

// Column is one column of the outbox table as the relay reads it.
type Column struct {
	Name string
	// Types are the column types the relay accepts, the DDL's first.
	Types []string
	// NotNull: the relay refuses a table where this column allows NULL.
	NotNull bool
}

// Columns are the columns the relay reads or writes.
var Columns = []Column{
	{"id", []string{"bigint", "integer"}, true},
	{"event_id", []string{"uuid", "text", "character varying"}, true},
	{"aggregate_type", []string{"text", "character varying"}, true},
	{"aggregate_id", []string{"text", "character varying"}, true},
	{"event_type", []string{"text", "character varying"}, true},
	{"payload", []string{"jsonb", "json", "bytea", "text"}, true},
	{"partition_key", []string{"text", "character varying"}, true},
	{"created_at", []string{"timestamp with time zone"}, true},
	{"published_at", []string{"timestamp with time zone"}, false},
}

// RequiredColumns are the columns a row must fill to be published: the
// NOT NULL columns of Columns but id (a primary key is never NULL). The
// relay holds a row with one of them NULL as invalid; the operator counts it so.
func RequiredColumns() []string {
	var names []string
	for _, c := range Columns {
		if c.NotNull && c.Name != "id" {
			names = append(names, c.Name)
		}
	}
	return names
}

// OptionalColumns are columns the relay reads when the table has them; a
// table made before they existed keeps working without them.
var OptionalColumns = []Column{
	// headers: an object of string to string, each entry a Kafka header
	// (Entry.Headers, and the writer's trace context). NULL means none.
	{"headers", []string{"jsonb"}, false},
}

// SchemaDDL returns the DDL of an outbox table: its columns, the partial
// index the relay claims through, and per-table autovacuum settings for a
// queue table whose every row is updated once and pruned later.
func SchemaDDL(t Table) string {
	t.mustBeValid()
	q := t.Quoted()
	idx := pgx.Identifier{t.IndexName()}.Sanitize()
	var b strings.Builder
	if t.Schema != "" {
		b.WriteString(createSchema(t.Schema))
	}
	// Each statement runs only when what it makes is missing: the DDL is
	// safe to run again, as the table's owner, at every start of a writer.
	b.WriteString(ifNoTable(t, fmt.Sprintf(`CREATE TABLE %s (
`+columnDDL+`,
    PRIMARY KEY (id),
    UNIQUE (event_id)
)`, q)))
	fmt.Fprintf(&b, `
-- The relay claims through this index only: it holds just the unpublished rows.
%s
-- Every row is inserted, updated once (published_at, never a HOT update
-- because the column is in the index predicate) and later deleted:
-- vacuum early and often so dead index entries do not pile up.
%s
-- Prune published rows periodically (e.g. from pg_cron), in small batches:
-- DELETE FROM %[3]s WHERE id IN (
--     SELECT id FROM %[3]s WHERE published_at < now() - interval '1 day' LIMIT 10000);

-- The rows relays hold back and why (`+"`relay held`, `relay redrive`"+`).
%[4]s`, ifNoIndex(t, t.IndexName(), fmt.Sprintf(`CREATE INDEX %s
    ON %s (id)
    WHERE published_at IS NULL`, idx, q)), ifSettingsDiffer(t, QueueTableSettings), q, HeldDDL(t))
	return b.String()
}

// CreatedAtCheck is the range of created_at the relay publishes: finite, and
// within the years 1 to 9999, which RFC 3339 timestamps (the CloudEvents
// time header) and Go's JSON encoding of time can carry. The DDL checks it;
// on a table without the check, the relay holds a row outside it as invalid.
const CreatedAtCheck = `created_at >= '0001-01-01 00:00:00+00' AND created_at < '10000-01-01 00:00:00+00'`

// columnDDL is the outbox's columns, the same in the plain and the
// partitioned table; each DDL adds its own keys after them.
const columnDDL = `    id             bigint      GENERATED ALWAYS AS IDENTITY,
    event_id       uuid        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    partition_key  text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now() CHECK (` + CreatedAtCheck + `),
    published_at   timestamptz,
    headers        jsonb`

// SlotName is the replication slot (and publication) of database's table t
// in logical-replication capture: slot names are unique in the whole
// cluster, so the database is part of it; a name longer than PostgreSQL's
// 63 bytes ends in a hash of the whole.
func SlotName(database string, t Table) string {
	b := []byte(strings.ToLower("outbox_" + database + "_" + strings.ReplaceAll(t.String(), ".", "_")))
	for i, c := range b {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			b[i] = '_'
		}
	}
	name := string(b)
	if len(name) > 63 {
		sum := sha256.Sum256([]byte(name))
		name = name[:50] + "_" + hex.EncodeToString(sum[:])[:12]
	}
	return name
}
