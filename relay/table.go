package relay

import (
	"context"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// identPattern is a plain, unquoted PostgreSQL identifier. Anything needing
// quotes (upper case, spaces, quotes, dots inside a part) is refused, so a
// table name from configuration can never change the SQL it is spliced into.
var identPattern = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Table is a validated, optionally schema-qualified outbox table name.
type Table struct {
	Schema string // "" means the search_path
	Name   string
}

// ParseTable validates "name" or "schema.name": each part a lower-case
// identifier of at most 63 bytes.
func ParseTable(s string) (Table, error) {
	parts := strings.Split(s, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("table %q: want NAME or SCHEMA.NAME", s)
	}
	for _, p := range parts {
		if !identPattern.MatchString(p) {
			return Table{}, fmt.Errorf("table %q: %q is not a plain identifier (lower-case letters, digits and _, starting with a letter or _, at most 63 characters)", s, p)
		}
	}
	if len(parts) == 2 {
		return Table{Schema: parts[0], Name: parts[1]}, nil
	}
	return Table{Name: parts[0]}, nil
}

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

// indexName is the conventional name of the partial index for the table.
func (t Table) indexName() string {
	n := "ix_" + t.Name + "_unpublished"
	if len(n) > 63 {
		n = n[:63]
	}
	return n
}

// SchemaDDL returns the DDL of an outbox table: the seeds' schema, the
// partial index the relay claims through, and per-table autovacuum settings
// for a queue table whose every row is updated once and pruned later.
func SchemaDDL(t Table) string {
	q := t.Quoted()
	idx := pgx.Identifier{t.indexName()}.Sanitize()
	var b strings.Builder
	if t.Schema != "" {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n\n", pgx.Identifier{t.Schema}.Sanitize())
	}
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %[1]s (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       uuid        NOT NULL UNIQUE,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    partition_key  text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
);

-- The relay claims through this index only: it holds just the unpublished rows.
CREATE INDEX IF NOT EXISTS %[2]s
    ON %[1]s (id)
    WHERE published_at IS NULL;

-- Every row is inserted, updated once (published_at, never a HOT update
-- because the column is in the index predicate) and later deleted:
-- vacuum early and often so dead index entries do not pile up.
ALTER TABLE %[1]s SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0,
    fillfactor = 90
);

-- Prune published rows periodically (e.g. from pg_cron), in small batches:
-- DELETE FROM %[1]s WHERE id IN (
--     SELECT id FROM %[1]s WHERE published_at < now() - interval '1 day' LIMIT 10000);
`, q, idx)
	return b.String()
}

// requiredColumns are the columns the relay reads or writes, with the types it accepts.
var requiredColumns = []struct {
	name  string
	types []string
}{
	{"id", []string{"bigint", "integer"}},
	{"event_id", []string{"uuid", "text", "character varying"}},
	{"aggregate_type", []string{"text", "character varying"}},
	{"aggregate_id", []string{"text", "character varying"}},
	{"event_type", []string{"text", "character varying"}},
	{"payload", []string{"jsonb", "json", "bytea", "text"}},
	{"partition_key", []string{"text", "character varying"}},
	{"created_at", []string{"timestamp with time zone"}},
	{"published_at", []string{"timestamp with time zone"}},
}

// CheckSchema verifies that the table exists with the columns and types the
// relay needs and that a partial index on published_at IS NULL exists. The
// error names what is missing and, for the index, the DDL that creates it.
func CheckSchema(ctx context.Context, conn interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, t Table) error {
	var oid uint32
	err := conn.QueryRow(ctx, `SELECT to_regclass($1)::oid`, t.Quoted()).Scan(&oid)
	if err != nil || oid == 0 {
		return fmt.Errorf("table %s does not exist; create it with the DDL from `relay schema --table %s`", t, t)
	}
	rows, err := conn.Query(ctx, `
		SELECT a.attname, format_type(a.atttypid, NULL)
		FROM pg_attribute a
		WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped`, oid)
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	have := map[string]string{}
	for rows.Next() {
		var name, typ string
		if err := rows.Scan(&name, &typ); err != nil {
			return err
		}
		have[name] = typ
	}
	if err := rows.Err(); err != nil {
		return err
	}
	var problems []string
	for _, c := range requiredColumns {
		typ, ok := have[c.name]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("column %s is missing (want %s)", c.name, c.types[0]))
		case !contains(c.types, typ):
			problems = append(problems, fmt.Sprintf("column %s has type %s (want one of %s)", c.name, typ, strings.Join(c.types, ", ")))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("table %s: %s", t, strings.Join(problems, "; "))
	}
	var hasIndex bool
	err = conn.QueryRow(ctx, `
		SELECT EXISTS (
			SELECT 1 FROM pg_index i
			WHERE i.indrelid = $1 AND i.indisvalid
			  AND i.indkey[0] = (SELECT attnum FROM pg_attribute WHERE attrelid = $1 AND attname = 'id')
			  AND regexp_replace(pg_get_expr(i.indpred, i.indrelid), '[()]', '', 'g') = 'published_at IS NULL')`, oid).Scan(&hasIndex)
	if err != nil {
		return fmt.Errorf("read indexes of %s: %w", t, err)
	}
	if !hasIndex {
		return fmt.Errorf("table %s has no partial index on (id) WHERE published_at IS NULL; without it every claim scans the table. Create it with: CREATE INDEX CONCURRENTLY %s ON %s (id) WHERE published_at IS NULL",
			t, pgx.Identifier{t.indexName()}.Sanitize(), t.Quoted())
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
