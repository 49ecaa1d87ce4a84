package outbox

import (
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// PartitionPeriod is the span of created_at one partition of a partitioned
// outbox covers (PartitionedSchemaDDL); partitions start on the period's
// boundary in UTC (weeks on Mondays).
type PartitionPeriod string

// The PartitionPeriod values.
const (
	PartitionHour  PartitionPeriod = "hour"
	PartitionDay   PartitionPeriod = "day"
	PartitionWeek  PartitionPeriod = "week"
	PartitionMonth PartitionPeriod = "month"
)

// PartitionPeriods are the valid PartitionPeriod values.
var PartitionPeriods = []PartitionPeriod{PartitionHour, PartitionDay, PartitionWeek, PartitionMonth}

// nameFormat is the to_char format of a partition's start in its name.
func (p PartitionPeriod) nameFormat() string {
	switch p {
	case PartitionHour:
		return "YYYYMMDDHH24"
	case PartitionMonth:
		return "YYYYMM"
	default:
		return "YYYYMMDD"
	}
}

// nameLength is the length of what nameFormat prints.
func (p PartitionPeriod) nameLength() int {
	switch p {
	case PartitionHour:
		return 10
	case PartitionMonth:
		return 6
	default:
		return 8
	}
}

// QueueTableSettings are the storage parameters of a queue table whose
// every row is inserted, updated once and later deleted: vacuum early and
// often so dead index entries do not pile up. The plain table gets them
// (SchemaDDL), and so does every partition of a partitioned one, whether
// the partitions function (PartitionedSchemaDDL) or the relay makes it.
const QueueTableSettings = `autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0,
    fillfactor = 90`

// PartitionedSchemaDDL returns the DDL of an outbox table range-partitioned
// by created_at: the table (primary key (id, created_at), since a
// partitioned table's unique indexes must include the partition key), the
// table that keeps event_id unique across partitions (EventIDsTable), the
// partial index the relay claims through, a function that creates the
// partitions of the current period and of the next ones
// (AddPartitionsFunction), and a call of it for ahead periods. There is no
// DEFAULT partition: the relay detaches old partitions with DETACH
// PARTITION CONCURRENTLY, which a DEFAULT partition rules out.
func PartitionedSchemaDDL(t Table, period PartitionPeriod, ahead int) string {
	t.mustBeValid()
	// period goes into comments and literals of the DDL as written, as
	// the table's name does: a value other than these is a program's
	// error, as a bad table name is (the relay's flags check both).
	if !slices.Contains(PartitionPeriods, period) || ahead < 0 {
		panic(fmt.Sprintf("outbox: partitioned DDL of period %q and %d partitions ahead (want one of %v, ahead ≥ 0)", period, ahead, PartitionPeriods))
	}
	q := t.Quoted()
	ids := t.EventIDsTable()
	fn := t.AddPartitionsFunction()
	var b strings.Builder
	if t.Schema != "" {
		b.WriteString(createSchema(t.Schema))
	}
	idsIndex := cut63("ix_" + ids.Name + "_created_at")
	// Each statement runs only when what it makes is missing: the DDL is
	// safe to run again, as the tables' owner, at every start of a writer.
	fmt.Fprintf(&b, `-- The outbox, range-partitioned by created_at. A partitioned table's
-- primary key must include the partition key, hence (id, created_at); id is
-- unique by itself all the same, drawn from one identity sequence.
%s
-- event_id is unique across partitions through this table: the writer
-- (outbox.Store) inserts the event id here in the same statement as the row,
-- with a digest of the entry that tells a retried store (a no-op) from
-- another event under the same id (an error). An id stays here until no
-- partition covers its created_at: the relay deletes it after dropping the
-- partition.
%s%s
-- The relay claims through this index only (one per partition): it holds
-- just the unpublished rows.
%s
-- The rows relays hold back and why (`+"`relay held`, `relay redrive`"+`).
%s`, ifNoTable(t, fmt.Sprintf(`CREATE TABLE %s (
`+columnDDL+`,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at)`, q)),
		ifNoTable(ids, fmt.Sprintf(`CREATE TABLE %s (
    event_id   uuid        PRIMARY KEY,
    created_at timestamptz NOT NULL,
    digest     bytea       NOT NULL
)`, ids.Quoted())),
		ifNoIndex(ids, idsIndex, fmt.Sprintf(`CREATE INDEX %s ON %s (created_at)`, pgx.Identifier{idsIndex}.Sanitize(), ids.Quoted())),
		ifNoIndex(t, t.IndexName(), fmt.Sprintf(`CREATE INDEX %s
    ON %s (id)
    WHERE published_at IS NULL`, pgx.Identifier{t.IndexName()}.Sanitize(), q)),
		HeldDDL(t))
	unit := string(period)
	fmt.Fprintf(&b, `
-- %[1]s(ahead) creates the partitions of the current %[3]s (UTC)
-- and of the next ahead ones that do not exist yet, and returns how many it
-- created. Each is created on its own and then attached, which takes a SHARE
-- UPDATE EXCLUSIVE lock on the outbox: writers and the relay go on meanwhile.
-- A row no partition covers cannot be inserted, so run it ahead of time,
-- e.g. hourly from pg_cron, in the database pg_cron runs in
-- (cron.database_name), naming this one, in the job's name too (pg_cron
-- keeps one job per name and user):
--   SELECT cron.schedule_in_database('<this database>.%[6]s', '17 * * * *',
--       'SELECT %[1]s(%[4]d)', '<this database>');
-- There is no DEFAULT partition: the relay detaches old partitions with
-- DETACH PARTITION CONCURRENTLY, which a DEFAULT partition rules out.
CREATE OR REPLACE FUNCTION %[9]s(parent regclass, nsp text, part text, lo timestamp, hi timestamp)
RETURNS boolean
LANGUAGE plpgsql
SET datestyle = 'ISO, MDY'
SET timezone = 'UTC'
AS $add$
BEGIN
    EXECUTE format('CREATE TABLE %%I.%%I (LIKE %%s INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE) WITH (%[8]s)',
        nsp, part, parent);
    EXECUTE format('ALTER TABLE %%s ATTACH PARTITION %%I.%%I FOR VALUES FROM (%%L) TO (%%L)',
        parent, nsp, part, lo AT TIME ZONE 'UTC', hi AT TIME ZONE 'UTC');
    RETURN true;
EXCEPTION WHEN duplicate_table OR invalid_object_definition THEN
    -- A table of that name that is no partition (detached by hand), or a
    -- partition attached meanwhile by someone else: the other periods
    -- are still made.
    RAISE WARNING 'partition %% of %% from %% to %% not made: %%', part, parent, lo, hi, SQLERRM;
    RETURN false;
END
$add$;

CREATE OR REPLACE FUNCTION %[1]s(ahead integer DEFAULT %[4]d)
RETURNS integer
LANGUAGE plpgsql
SET lock_timeout = '1min'
-- Partition bounds are read back as text: in ISO, with numeric offsets.
SET datestyle = 'ISO, MDY'
SET timezone = 'UTC'
AS $add$
DECLARE
    parent regclass := %[2]s::regclass;
    nsp    text;
    first  timestamp := date_trunc('%[3]s', now() AT TIME ZONE 'UTC');
    p_lo   timestamp;
    p_hi   timestamp;
    cur    timestamp;
    part   text;
    cover  record;
    made   integer := 0;
BEGIN
    -- One caller at a time: two would try to create the same partitions.
    PERFORM pg_advisory_xact_lock(hashtext('add partitions ' || parent::oid::text));
    SELECT n.nspname INTO nsp FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
    FOR i IN 0..ahead LOOP
        p_lo := first + i * interval '1 %[3]s';
        p_hi := p_lo + interval '1 %[3]s';
        -- Each stretch of [p_lo, p_hi) no partition covers gets one: a
        -- partition of another name or period (made by hand, by a
        -- partition manager, or under another --partition-period) keeps
        -- what it covers, and no stretch is left without one.
        cur := p_lo;
        FOR cover IN SELECT b.blo, b.bhi FROM (
                SELECT COALESCE((regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\)'))[1]::timestamptz AT TIME ZONE 'UTC', '-infinity') AS blo,
                       COALESCE((regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']*)''\)'))[1]::timestamptz AT TIME ZONE 'UTC', 'infinity') AS bhi
                FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                WHERE i.inhparent = parent AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT') b
            WHERE b.bhi > p_lo AND b.blo < p_hi ORDER BY b.blo LOOP
            IF cover.blo > cur AND %[9]s(parent, nsp, left(%[5]s, 47) || to_char(cur, 'YYYYMMDD"t"HH24MISS'), cur, cover.blo) THEN
                made := made + 1;
            END IF;
            cur := greatest(cur, cover.bhi);
        END LOOP;
        IF cur < p_hi THEN
            part := %[5]s || to_char(p_lo, '%[7]s');
            IF cur > p_lo THEN
                part := left(%[5]s, 47) || to_char(cur, 'YYYYMMDD"t"HH24MISS');
            END IF;
            IF %[9]s(parent, nsp, part, cur, p_hi) THEN
                made := made + 1;
            END IF;
        END IF;
    END LOOP;
    RETURN made;
END
$add$;

SELECT %[1]s(%[4]d);

-- With --keep-published-for the relay detaches and drops each partition
-- whose range ended longer ago than that and whose rows are all published,
-- and deletes the event ids of the ranges it dropped.
`, fn.Quoted(), QuoteLiteral(q), unit, ahead, QuoteLiteral(t.Name[:min(len(t.Name), 63-2-period.nameLength())]+"_p"),
		fn.String(), period.nameFormat(), strings.ReplaceAll(QueueTableSettings, "\n    ", " "), t.Suffixed("_add_partition").Quoted())
	return b.String()
}

func cut63(s string) string {
	if len(s) > 63 {
		return s[:63]
	}
	return s
}

// QuoteLiteral quotes s as an SQL string literal, for statements that take
// no parameters (DDL, COMMENT, the replication protocol's commands).
func QuoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
