package relay

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Every catalog, session, lock and capture statement prepares (parsed, every
// relation, column and parameter type resolved) on the server the tests run.
func TestSessionStatementsPrepare(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.PG().NewDatabase(t))
	require.NoError(t, err)
	defer conn.Close(ctx)
	stmts := map[string]string{"sqlListen": sqlListen(outbox.Table{Name: "outbox"}.NotifyChannel())}
	for name, stmt := range sessionStatements {
		stmts[name] = stmt
	}
	for name, stmt := range captureStatements {
		stmts[name] = stmt
	}
	for name, stmt := range stmts {
		_, err := conn.Prepare(ctx, name, stmt)
		require.NoError(t, err, "%s does not prepare:\n%s", name, stmt)
	}
}

// Every statement of retention on a partitioned outbox prepares against the
// shipped partitioned DDL, those about one partition with a real partition's
// name and bound.
func TestPartitionStatementsPrepare(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.PG().NewDatabase(t))
	require.NoError(t, err)
	defer conn.Close(ctx)
	table := outbox.Table{Schema: "app", Name: "outbox"}
	_, err = conn.Exec(ctx, outbox.PartitionedSchemaDDL(table, outbox.PartitionDay, 1))
	require.NoError(t, err)
	var part, bound string
	require.NoError(t, conn.QueryRow(ctx, `SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid)
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1::regclass AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT' LIMIT 1`, table.Quoted()).Scan(&part, &bound))
	q := table.Quoted()
	stmts := map[string]string{
		"sqlPartitions": sqlPartitions, "sqlPruneCut": sqlPruneCut, "sqlIsAttached": sqlIsAttached, "sqlIsPending": sqlIsPending,
		"sqlLongStatements": sqlLongStatements, "sqlPartitionWaits": sqlPartitionWaits(part),
		"sqlComment": sqlComment(part, outbox.QuoteLiteral(detachedMark+"1: "+bound)), "sqlUncomment": sqlComment(part, "NULL"),
		"sqlDetach": sqlDetach(q, part, "CONCURRENTLY"), "sqlDetachFinalize": sqlDetach(q, part, "FINALIZE"),
		"sqlAttach": sqlAttach(q, part, bound), "sqlLockAlone": sqlLockAlone(part), "sqlCountRows": sqlCountRows(part),
		"sqlDrop": sqlDrop(part), "sqlDeleteEventIDs": sqlDeleteEventIDs(table.EventIDsTable().Quoted()),
		"sqlRunningBefore": sqlRunningBefore, "sqlStillRunning": sqlStillRunning, "sqlWALInsert": sqlWALInsert, "sqlSlotPast": sqlSlotPast,
	}
	for name, stmt := range stmts {
		_, err := conn.Prepare(ctx, name, stmt)
		require.NoError(t, err, "%s does not prepare:\n%s", name, stmt)
	}
	// The statements that read rows also run: the plan is valid, not only the text.
	for _, stmt := range []string{sqlPartitionWaits(part), sqlCountRows(part)} {
		_, err := conn.Exec(ctx, fmt.Sprintf("EXPLAIN %s", stmt))
		require.NoError(t, err, stmt)
	}
}
