package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// querier is what CheckSchema needs of a pool or connection.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// hasColumn reports whether table t has a column named name.
func hasColumn(ctx context.Context, conn querier, t outbox.Table, name string) (bool, error) {
	var ok bool
	err := conn.QueryRow(ctx, sqlHasColumn, t.Quoted(), name).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("read columns of %s: %w", t, err)
	}
	return ok, nil
}

// partitionColumnTypes are the types a partition column may have.
var partitionColumnTypes = []string{"smallint", "integer", "bigint"}

// checkPartitionColumn verifies that t has column c of an integer type.
func checkPartitionColumn(ctx context.Context, conn querier, t outbox.Table, c string) error {
	var typ string
	err := conn.QueryRow(ctx, sqlColumnType, t.Quoted(), c).Scan(&typ)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("--%s: table %s has no column %s; add it with: ALTER TABLE %s ADD COLUMN %s integer",
			relayconfig.FlagPartitionColumn, t, c, t.Quoted(), pgx.Identifier{c}.Sanitize())
	case err != nil:
		return fmt.Errorf("read columns of %s: %w", t, err)
	case !slices.Contains(partitionColumnTypes, typ):
		return fmt.Errorf("--%s: column %s of %s has type %s; want one of %s",
			relayconfig.FlagPartitionColumn, c, t, typ, strings.Join(partitionColumnTypes, ", "))
	}
	return nil
}

// tableShape is what the relay needs to know of a table beyond its columns:
// whether it is partitioned, and how.
type tableShape struct {
	partitioned bool
	// byCreatedAt: partitioned by RANGE (created_at) alone, so retention can
	// drop whole partitions by their range.
	byCreatedAt bool
	// hasDefault: the table has a DEFAULT partition.
	hasDefault bool
	// eventIDs: the event-id table of a partitioned outbox
	// (outbox.Table.EventIDsTable) exists.
	eventIDs bool
}

// readShape reads whether t is partitioned (relkind 'p'), by what, and
// whether its event-id table exists.
func readShape(ctx context.Context, conn querier, t outbox.Table) (tableShape, error) {
	var s tableShape
	err := conn.QueryRow(ctx, sqlTableShape, t.Quoted(), t.EventIDsTable().Quoted()).Scan(&s.partitioned, &s.byCreatedAt, &s.hasDefault, &s.eventIDs)
	if err != nil {
		return s, fmt.Errorf("read the partitioning of %s: %w", t, err)
	}
	return s, nil
}

// errNoTable: no table has the name, or the role may not see its schema.
var errNoTable = errors.New("does not exist")

// tableOID is the oid of table t; lock classes derive from it. A missing
// table is errNoTable, naming it (to_regclass answers NULL, which scanned
// into a number read "cannot scan NULL").
func tableOID(ctx context.Context, q querier, t outbox.Table) (uint32, error) {
	var oid *uint32
	if err := q.QueryRow(ctx, sqlTableOID, t.Quoted()).Scan(&oid); err != nil {
		return 0, fmt.Errorf("read the oid of table %s: %w", t, err)
	}
	if oid == nil {
		return 0, fmt.Errorf("table %s %w", t, errNoTable)
	}
	return *oid, nil
}

// CheckSchema verifies that the table exists with the columns and types the
// relay needs, that the columns it reads are NOT NULL, and that a partial
// index on published_at IS NULL exists. The error names each problem and
// the DDL that fixes it.
func CheckSchema(ctx context.Context, conn querier, t outbox.Table) error {
	oid, err := tableOID(ctx, conn, t)
	if errors.Is(err, errNoTable) {
		return fmt.Errorf("%w; create it with the DDL from `relay schema --table %s`", err, t)
	}
	if err != nil {
		return err
	}
	rows, err := conn.Query(ctx, sqlColumns, oid)
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	type col struct {
		typ     string
		notNull bool
	}
	have := map[string]col{}
	for rows.Next() {
		var name string
		var c col
		if err := rows.Scan(&name, &c.typ, &c.notNull); err != nil {
			return fmt.Errorf("read columns of %s: %w", t, err)
		}
		have[name] = c
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	var problems []string
	for _, want := range outbox.Columns {
		c, ok := have[want.Name]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("column %s is missing (want %s)", want.Name, want.Types[0]))
		case !slices.Contains(want.Types, c.typ):
			problems = append(problems, fmt.Sprintf("column %s has type %s (want one of %s)", want.Name, c.typ, strings.Join(want.Types, ", ")))
		case want.NotNull && !c.notNull:
			problems = append(problems, fmt.Sprintf("column %s allows NULL; fix it with: ALTER TABLE %s ALTER COLUMN %s SET NOT NULL",
				want.Name, t.Quoted(), pgx.Identifier{want.Name}.Sanitize()))
		}
	}
	for _, opt := range outbox.OptionalColumns {
		if c, ok := have[opt.Name]; ok && !slices.Contains(opt.Types, c.typ) {
			problems = append(problems, fmt.Sprintf("column %s has type %s (want one of %s)", opt.Name, c.typ, strings.Join(opt.Types, ", ")))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("table %s: %s", t, strings.Join(problems, "; "))
	}
	var partitioned, hasIndex, uniqueID bool
	if err := conn.QueryRow(ctx, sqlIsPartitioned, oid).Scan(&partitioned); err != nil {
		return fmt.Errorf("read the kind of %s: %w", t, err)
	}
	if !partitioned { // a partitioned table's unique indexes hold its partition key too
		if err := conn.QueryRow(ctx, sqlHasUniqueID, oid).Scan(&uniqueID); err != nil {
			return fmt.Errorf("read indexes of %s: %w", t, err)
		}
		if !uniqueID {
			return fmt.Errorf("table %s has no unique index on id: the relay claims, marks and prunes rows by id, so of two rows with one id, one published would mark the other published too, and pruning one would delete the other; add it with: ALTER TABLE %s ADD PRIMARY KEY (id)",
				t, t.Quoted())
		}
	}
	err = conn.QueryRow(ctx, sqlHasUnpublishedIndex, oid).Scan(&hasIndex)
	if err != nil {
		return fmt.Errorf("read indexes of %s: %w", t, err)
	}
	if !hasIndex {
		if partitioned {
			// CREATE INDEX CONCURRENTLY does not exist for a partitioned table.
			return fmt.Errorf("table %s has no valid partial index on (id) WHERE published_at IS NULL; without it every claim scans every partition. Create it with: CREATE INDEX %s ON %s (id) WHERE published_at IS NULL (it blocks writes while it builds; to avoid that, create it ON ONLY the table, then CONCURRENTLY on each partition, and ALTER INDEX … ATTACH PARTITION each)",
				t, pgx.Identifier{t.IndexName()}.Sanitize(), t.Quoted())
		}
		return fmt.Errorf("table %s has no partial index on (id) WHERE published_at IS NULL; without it every claim scans the table. Create it with: CREATE INDEX CONCURRENTLY %s ON %s (id) WHERE published_at IS NULL",
			t, pgx.Identifier{t.IndexName()}.Sanitize(), t.Quoted())
	}
	return nil
}
