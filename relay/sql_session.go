package relay

import "github.com/jackc/pgx/v5"

// Statements about the catalog, the session and advisory locks: the same
// for every table (a table comes in as its quoted name, a lock as its
// class and key). TestSessionStatementsPrepare prepares every one.
const (
	// sqlOldestRunning: the oldest transaction still running (a snapshot's
	// xmin) as a full 64-bit id (cursor.settle).
	sqlOldestRunning = `SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint`
	// sqlClaimXid: the claim transaction's id, taken when it locked its
	// first row, or now if it locked none (cursor.record).
	sqlClaimXid = `SELECT COALESCE(pg_current_xact_id_if_assigned(), pg_current_xact_id())::text::bigint`
	// sqlTableOID is the oid of the table whose quoted name is $1, NULL
	// when it does not exist; lock classes derive from it.
	sqlTableOID = `SELECT to_regclass($1)::oid`
	// sqlPrivilegesMissing: the current role, and the ordinals (from 1) of
	// the privileges it lacks of those listed as table $1[i] (a quoted
	// name), privilege $2[i] and column $3[i]: "" for the table, "*" for any
	// one column (FOR UPDATE needs UPDATE on one), privilege OWNER for the
	// table's ownership (as a member of the owning role). A table that does
	// not exist lacks nothing here. has_table_privilege with a list is true
	// when any one is held, so each is asked alone.
	sqlPrivilegesMissing = `SELECT current_user::text, COALESCE(array_agg(o ORDER BY o), '{}')
		FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS x(t, p, c, o)
		WHERE NOT CASE WHEN p = 'OWNER' THEN (SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass(t))
			WHEN c = '' THEN has_table_privilege(to_regclass(t), p)
			WHEN c = '*' THEN has_any_column_privilege(to_regclass(t), p)
			ELSE has_column_privilege(to_regclass(t), c, p) END`
	// sqlTableOwner: the owner of the table whose quoted name is $1, and
	// whether it is a superuser.
	sqlTableOwner = `SELECT r.rolname::text, r.rolsuper FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner WHERE c.oid = to_regclass($1)`
	// sqlHeldShapeMissing lists what table $1 lacks of the held table's
	// shape: each of columns $2, and a unique index on id alone, valid and
	// not deferred (recording a hold's ON CONFLICT (id) needs one).
	sqlHeldShapeMissing = `SELECT COALESCE(array_agg(c ORDER BY o), '{}') || CASE WHEN EXISTS (
			SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
			WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indimmediate AND i.indisvalid
				AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL AND a.attname = 'id')
			THEN '{}'::text[] ELSE '{unique index on id}' END
		FROM unnest($2::text[]) WITH ORDINALITY AS x(c, o)
		WHERE NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = c AND attnum > 0 AND NOT attisdropped)`
	// sqlTableSchema is the schema of the table whose oid is $1.
	sqlTableSchema = `SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1`
	// sqlHasColumn: table $1 has a live column named $2.
	sqlHasColumn = `SELECT EXISTS (SELECT 1 FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND attnum > 0 AND NOT attisdropped)`
	// sqlColumnType: the type of table $1's live column $2 (no row when none).
	sqlColumnType = `SELECT format_type(atttypid, NULL) FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND attnum > 0 AND NOT attisdropped`
	// sqlTableShape: whether table $1 is partitioned, by RANGE (created_at)
	// alone, with a DEFAULT partition, and whether table $2 (its event-id
	// table) exists.
	sqlTableShape = `SELECT c.relkind = 'p',
		    COALESCE(p.partstrat = 'r' AND p.partnatts = 1 AND a.attname = 'created_at', false),
		    COALESCE(p.partdefid <> 0, false),
		    to_regclass($2) IS NOT NULL
		FROM pg_class c
		LEFT JOIN pg_partitioned_table p ON p.partrelid = c.oid
		LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = p.partattrs[0]
		WHERE c.oid = to_regclass($1)`
	// sqlColumns: name, type and NOT NULL of each live column of the table of oid $1.
	sqlColumns = `SELECT a.attname, format_type(a.atttypid, NULL), a.attnotnull
		FROM pg_attribute a
		WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped`
	// sqlHasUnpublishedIndex: the table of oid $1 has a valid index on
	// (id) WHERE published_at IS NULL, the one every claim walks.
	sqlHasUnpublishedIndex = `SELECT EXISTS (
			SELECT 1 FROM pg_index i
			WHERE i.indrelid = $1 AND i.indisvalid
			  AND i.indkey[0] = (SELECT attnum FROM pg_attribute WHERE attrelid = $1 AND attname = 'id')
			  AND regexp_replace(pg_get_expr(i.indpred, i.indrelid), '[()]', '', 'g') = 'published_at IS NULL')`
	// sqlHasUniqueID: the table of oid $1 has a valid unique index on id
	// alone, with no predicate (a primary key, say).
	sqlHasUniqueID = `SELECT EXISTS (
			SELECT 1 FROM pg_index i
			WHERE i.indrelid = $1 AND i.indisunique AND i.indisvalid AND i.indnkeyatts = 1
			  AND i.indpred IS NULL AND i.indexprs IS NULL
			  AND i.indkey[0] = (SELECT attnum FROM pg_attribute WHERE attrelid = $1 AND attname = 'id'))`
	// sqlIsPartitioned: the table of oid $1 is partitioned.
	sqlIsPartitioned = `SELECT relkind = 'p' FROM pg_class WHERE oid = $1`
	// sqlServerVersion is server_version_num.
	sqlServerVersion = `SELECT current_setting('server_version_num')::int`
	// sqlSetSession sets setting $1 to $2 for the rest of the session.
	sqlSetSession = `SELECT set_config($1, $2, false)`
	// sqlBoundWaits bounds, for the rest of the transaction, each
	// statement's lock waits and the statement itself to $1 milliseconds.
	sqlBoundWaits = `SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $1, true)`
	// sqlUnboundWaits sets them back to the session's values, as it began,
	// for the rest of the transaction.
	sqlUnboundWaits = `SELECT set_config(name, reset_val, true) FROM pg_settings WHERE name IN ('lock_timeout', 'statement_timeout')`
	// sqlBitmapScansOn turns bitmap scans back on for one transaction (the
	// relay's sessions run with them off, for the claim).
	sqlBitmapScansOn = `SET LOCAL enable_bitmapscan = on`

	// sqlLockShared takes advisory lock ($1 class, $2 key) shared, for the session.
	sqlLockShared = `SELECT pg_advisory_lock_shared($1::int4, $2::int4)`
	// sqlTryLock takes advisory lock ($1, $2) for the session if it is free.
	sqlTryLock = `SELECT pg_try_advisory_lock($1::int4, $2::int4)`
	// sqlUnlock releases advisory lock ($1, $2).
	sqlUnlock = `SELECT pg_advisory_unlock($1::int4, $2::int4)`
	// sqlLockHolders counts the sessions of this database holding advisory
	// lock (class $1, key $2), its arguments as the unsigned values pg_locks shows.
	sqlLockHolders = `SELECT count(DISTINCT pid) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND objsubid = 2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = $1 AND objid::bigint = $2`
	// sqlFreeLocks lists the keys 0..$2-1 of class $1 (unsigned) that no
	// session of this database holds.
	sqlFreeLocks = `SELECT b FROM generate_series(0, $2::int4 - 1) b
		WHERE NOT EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND granted AND objsubid = 2
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND classid::bigint = $1 AND objid::bigint = b)`
)

// sqlListen subscribes the session to channel's notifications.
func sqlListen(channel string) string { return "LISTEN " + pgx.Identifier{channel}.Sanitize() }

// sessionStatements are the statements above by name, for the test that
// prepares each.
var sessionStatements = map[string]string{
	"sqlTableOID": sqlTableOID, "sqlTableSchema": sqlTableSchema, "sqlPrivilegesMissing": sqlPrivilegesMissing, "sqlTableOwner": sqlTableOwner, "sqlHasColumn": sqlHasColumn, "sqlColumnType": sqlColumnType, "sqlTableShape": sqlTableShape,
	"sqlColumns": sqlColumns, "sqlHasUnpublishedIndex": sqlHasUnpublishedIndex, "sqlHasUniqueID": sqlHasUniqueID, "sqlIsPartitioned": sqlIsPartitioned,
	"sqlServerVersion": sqlServerVersion, "sqlSetSession": sqlSetSession, "sqlBoundWaits": sqlBoundWaits, "sqlUnboundWaits": sqlUnboundWaits, "sqlBitmapScansOn": sqlBitmapScansOn,
	"sqlLockShared": sqlLockShared, "sqlTryLock": sqlTryLock, "sqlUnlock": sqlUnlock,
	"sqlLockHolders": sqlLockHolders, "sqlFreeLocks": sqlFreeLocks, "sqlOldestRunning": sqlOldestRunning, "sqlClaimXid": sqlClaimXid,
}
