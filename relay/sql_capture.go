package relay

import (
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// Statements of the logical replication capture (capture.go).
// TestSessionStatementsPrepare prepares every one.
const (
	// sqlCaptureSettings: wal_level, the database and the role.
	sqlCaptureSettings = `SELECT current_setting('wal_level'), current_database(), current_user`
	// sqlCanReplicate: the role may stream from a replication slot
	// (REPLICATION, superuser, or a managed service's replication role).
	sqlCanReplicate = `SELECT r.rolreplication OR r.rolsuper OR EXISTS (
		SELECT 1 FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid
		WHERE m.member = r.oid AND g.rolname IN ('rds_replication', 'rds_superuser', 'cloudsqlsuperuser', 'azure_pg_admin'))
		FROM pg_roles r WHERE r.rolname = current_user`
	// sqlPublishes: whether the publication $1 exists, whether it
	// includes the table whose quoted name is $2, whose oid it returns too,
	// whether it publishes deletes, whether it publishes a partitioned
	// table's changes as the table's own, whether it publishes inserts, and
	// whether a row filter or a column list (PostgreSQL 15's; read through
	// to_jsonb, so the query also runs on 14) narrows what it carries of
	// the table.
	sqlPublishes = `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
		EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
		WHERE p.pubname = $1 AND pr.prrelid = to_regclass($2)), to_regclass($2)::oid,
		COALESCE((SELECT pubdelete FROM pg_publication WHERE pubname = $1), false),
		COALESCE((SELECT pubviaroot FROM pg_publication WHERE pubname = $1), false),
		COALESCE((SELECT pubinsert FROM pg_publication WHERE pubname = $1), false),
		EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
		WHERE p.pubname = $1 AND pr.prrelid = to_regclass($2)
		  AND (to_jsonb(pr) ->> 'prqual' IS NOT NULL OR to_jsonb(pr) ->> 'prattrs' IS NOT NULL))`
	// sqlReplicaIdentityWithoutID: the first of the table $1 or, when it is
	// partitioned, its leaf partitions (their own identity keys a delete on
	// them; pg_partition_tree lists none of a plain table) whose replica
	// identity gives a deleted row's old key without its id, and that
	// identity (relreplident: n nothing, d the primary key, i an index),
	// and whether it has no key at all (nothing, or the primary key of a
	// table without one: PostgreSQL then refuses its deletes once they
	// are published); no row when every one carries the id. A delete's key
	// is what the stream sees of a row its writer deleted.
	sqlReplicaIdentityWithoutID = `SELECT c.oid::regclass::text, c.relreplident::text,
		c.relreplident = 'n' OR (c.relreplident = 'd' AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))
		FROM pg_class c
		WHERE (c.oid = $1 OR c.oid IN (SELECT relid FROM pg_partition_tree($1::oid::regclass) WHERE isleaf))
		  AND c.relkind <> 'p' AND c.relreplident <> 'f' AND NOT EXISTS (
			SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
			WHERE i.indrelid = c.oid AND a.attname = 'id'
			  AND CASE c.relreplident WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END)
		ORDER BY c.oid LIMIT 1`
	// sqlBackendLive: whether the server still runs backend $1 (a
	// replication session, whose session locks end with it).
	sqlBackendLive = `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`
	// sqlOwnSession names the session it runs on: its pid, and when it
	// began, in microseconds since 1970 (0 when pg_stat_activity lacks it).
	sqlOwnSession = `SELECT pg_backend_pid(), coalesce((SELECT (extract(epoch FROM backend_start) * 1000000)::int8
        FROM pg_stat_activity WHERE pid = pg_backend_pid()), 0)`
	// sqlStreamSession reads the wait event of the session streaming from
	// slot $1 when it is backend $2 that began at $3 (sqlOwnSession); no
	// row when another session streams, or none.
	sqlStreamSession = `SELECT coalesce(a.wait_event, '') FROM pg_replication_slots s
        JOIN pg_stat_activity a ON a.pid = s.active_pid
        WHERE s.slot_name = $1 AND s.active_pid = $2::int4 AND (extract(epoch FROM a.backend_start) * 1000000)::int8 = $3::int8`
	// sqlEndStreamSession ends the session sqlStreamSession reads
	// (pg_terminate_backend: the role's own sessions, or with
	// pg_signal_backend), and says whether it did.
	sqlEndStreamSession = `SELECT coalesce(bool_or(pg_terminate_backend(a.pid)), false) FROM pg_replication_slots s
        JOIN pg_stat_activity a ON a.pid = s.active_pid
        WHERE s.slot_name = $1 AND s.active_pid = $2::int4 AND (extract(epoch FROM a.backend_start) * 1000000)::int8 = $3::int8`
	// sqlNameTaken: the other tables the publication $1 publishes (their
	// quoted names, their schemas, their names), and the database of
	// another database's slot named $1 (NULL when none): slot names are
	// the cluster's, and two tables whose names differ only in what
	// SlotName folds (case, '.' and '_') get the same.
	sqlNameTaken = `SELECT COALESCE(array_agg(format('%I.%I', n.nspname, c.relname) ORDER BY c.oid), '{}'), COALESCE(array_agg(n.nspname::text ORDER BY c.oid), '{}'),
			COALESCE(array_agg(c.relname::text ORDER BY c.oid), '{}'),
		(SELECT database::text FROM pg_replication_slots WHERE slot_name = $1 AND database <> current_database() LIMIT 1)
		FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid JOIN pg_class c ON c.oid = pr.prrelid
			JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE p.pubname = $1 AND pr.prrelid IS DISTINCT FROM to_regclass($2)`
	// sqlWriterDeletesTable: the generated columns of the table whose oid
	// is $1, and whether the role may insert into it.
	sqlWriterDeletesTable = `SELECT COALESCE(array_agg(attname::text ORDER BY attnum), '{}'), has_table_privilege($1::oid, 'INSERT')
		FROM pg_attribute WHERE attrelid = $1 AND attgenerated <> '' AND attnum > 0 AND NOT attisdropped`
	// sqlWALSenderTimeout: wal_sender_timeout in seconds (0: none).
	sqlWALSenderTimeout = `SELECT extract(epoch FROM current_setting('wal_sender_timeout')::interval)::float8`
	// sqlSlotState: the WAL the slot $1 holds back, in bytes, its
	// wal_status, whether the publication $2's comment has the line $3
	// (outbox.WriterDeletesMark, sqlSetNote), and whether the role may
	// comment it (has its owner's privileges; a superuser has every
	// role's).
	sqlSlotState = `SELECT COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint, COALESCE(wal_status, ''),
		COALESCE((SELECT $3 = ANY(string_to_array(obj_description(p.oid, 'pg_publication'), E'\n')) FROM pg_publication p WHERE p.pubname = $2), false),
		COALESCE((SELECT pg_has_role(p.pubowner, 'USAGE') FROM pg_publication p WHERE p.pubname = $2), false)
		FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`
	// sqlSweepFence (sweepFence): the oldest running transaction, every
	// one before it ended (a transaction id's text form, without its
	// epoch), then the WAL's insert position, read after this statement's
	// snapshot, and the size of a WAL page.
	sqlSweepFence = `SELECT (pg_snapshot_xmin(pg_current_snapshot())::text::numeric % 4294967296)::text,
		pg_current_wal_insert_lsn()::text, current_setting('wal_block_size')::int`
	// sqlSlotHorizon: the catalog horizon of the slot $1 (catalog_xmin, a
	// transaction id's text form), NULL when it has none.
	sqlSlotHorizon = `SELECT catalog_xmin::text FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`
	// sqlInvisible: how many of the transactions $1 (32-bit ids, of the
	// current epoch or the one before) this statement's snapshot does not
	// see as ended.
	sqlInvisible = `SELECT count(*) FROM pg_current_snapshot() s,
		LATERAL (SELECT pg_snapshot_xmax(s)::text::numeric AS xmax) m, unnest($1::bigint[]) x
		WHERE NOT pg_visible_in_snapshot(((floor(m.xmax / 4294967296) - CASE WHEN x <= m.xmax % 4294967296 THEN 0 ELSE 1 END)
			* 4294967296 + x)::text::xid8, s)`
	// sqlSlotSnapshot: the 32-bit forms of the transaction snapshot's xmax
	// and running transactions (slotSnapshot), in a transaction that
	// imported the snapshot a slot's creation exported.
	sqlSlotSnapshot = `SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::numeric % 4294967296)::text,
		ARRAY(SELECT (x::text::numeric % 4294967296)::bigint FROM pg_snapshot_xip(pg_current_snapshot()) x)`
	// sqlDeletedRowsMark: whether the publication $1's comment has the line
	// $2 (outbox.WriterDeletesMark, sqlSetNote), and the first transaction id not
	// yet begun.
	sqlDeletedRowsMark = `SELECT COALESCE((SELECT $2 = ANY(string_to_array(obj_description(oid, 'pg_publication'), E'\n')) FROM pg_publication WHERE pubname = $1), false),
		pg_snapshot_xmax(pg_current_snapshot())::text`
	// sqlDeletedRowsEnd: whether every transaction before $1 (a full
	// transaction id's text form) has ended, then the WAL's insert position.
	sqlDeletedRowsEnd = `SELECT pg_snapshot_xmin(pg_current_snapshot()) >= $1::xid8, pg_current_wal_insert_lsn()::text`
	// sqlNote: the first line of the publication $1's comment that starts
	// with $2 (sqlSetNote), if any.
	sqlNote = `SELECT l FROM pg_publication p, unnest(string_to_array(obj_description(p.oid, 'pg_publication'), E'\n')) AS l
		WHERE p.pubname = $1 AND starts_with(l, $2) LIMIT 1`
	// sqlSlotConfirmed: how far the slot's consumer has confirmed.
	sqlSlotConfirmed = `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`
	// sqlDropSlot drops the slot $1 when no connection uses it; true when it
	// did. Slot names are the cluster's: only this database's slot is its.
	sqlDropSlot = `WITH s AS (SELECT slot_name FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database() AND NOT active),
		d AS (SELECT pg_drop_replication_slot(slot_name) FROM s)
		SELECT count(*) > 0 FROM d`
)

// sqlRowTypeColumns: the names of the columns of the table whose oid is $1, in
// its row type's order.
const sqlRowTypeColumns = `SELECT COALESCE(array_agg(attname::text ORDER BY attnum), '{}')
	FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped`

// sqlInsertRecords inserts into t the columns cols of records ($1, each the
// text form of t's row type, ids included), leaving out rows t has already
// (by any unique key: its id or its event id), and returns the ids of
// those it inserted; t's other columns take their defaults (without "id"
// in cols, a new id).
func sqlInsertRecords(t outbox.Table, cols []string) string {
	list := make([]string, len(cols))
	sel := make([]string, len(cols))
	for i, c := range cols {
		list[i] = pgx.Identifier{c}.Sanitize()
		sel[i] = "x." + list[i]
	}
	return `INSERT INTO ` + t.Quoted() + ` (` + strings.Join(list, ", ") + `) OVERRIDING SYSTEM VALUE
    SELECT ` + strings.Join(sel, ", ") + ` FROM unnest($1::text[]) AS r, LATERAL (SELECT (r::` + t.Quoted() + `).*) AS x
    ON CONFLICT DO NOTHING RETURNING id`
}

// sqlEventsByID reads the ids and event ids (as text) of the rows of t
// whose ids are $1.
func sqlEventsByID(t outbox.Table) string {
	return `SELECT id, event_id::text FROM ` + t.Quoted() + ` WHERE id = ANY($1::bigint[])`
}

// sqlRowOfEvent reads the id of t's row whose event_id, of type typ (as
// format_type names it, a catalog value), is $1 (as text) and, withCreated,
// whose created_at is $2: on a partitioned table, one partition is read.
func sqlRowOfEvent(t outbox.Table, typ string, withCreated bool) string {
	q := `SELECT id FROM ` + t.Quoted() + ` WHERE event_id = $1::text::` + typ
	if withCreated {
		q += ` AND created_at = $2::timestamptz`
	}
	return q + ` LIMIT 1`
}

// sqlColumnTypeOf is the type of column $2 of the table whose oid is $1,
// as format_type names it.
const sqlColumnTypeOf = `SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = $1 AND attname = $2 AND NOT attisdropped`

// captureLockSeed seeds the hash of a slot's name that keys its capture
// lock (sqlTryCaptureLock), unlike the writer-deletes lock's and a plain
// hash an application might lock on.
const captureLockSeed = "7310248513"

// sqlTryCaptureLock takes the capture lock of the slot whose name is the
// literal slot, without waiting: true when this session holds it now. The
// replica that streams from the slot holds it on its replication session,
// and one that polls in the stream's stead (runCapture) holds it while it
// polls, so that one replica at a time publishes what the slot carries:
// two, one in commit order and one in id order, could put a key's rows
// out of order between them.
func sqlTryCaptureLock(slot string) string {
	return `SELECT pg_try_advisory_lock(hashtextextended(` + slot + `, ` + captureLockSeed + `))`
}

// publishes is what the table's publication publishes: inserts, and
// deletes for the rows a writer deletes in the transaction that inserted
// them (streamState.restore); a partitioned table's as the table's own
// (without publish_via_partition_root they carry their partition's
// relation, which the stream does not read).
const publishes = `publish = 'insert, delete', publish_via_partition_root = true`

// sqlCreatePublication publishes the inserts and deletes of table t as pub.
func sqlCreatePublication(pub string, t outbox.Table) string {
	return `CREATE PUBLICATION ` + pgx.Identifier{pub}.Sanitize() + ` FOR TABLE ` + t.Quoted() + ` WITH (` + publishes + `)`
}

// sqlAlterPublication makes the publication pub publish what publishes
// says (one made by a relay before it published deletes, or a partitioned
// table's changes through the table).
func sqlAlterPublication(pub string) string {
	return `ALTER PUBLICATION ` + pgx.Identifier{pub}.Sanitize() + ` SET (` + publishes + `)`
}

// sqlMarkPublication sets the publication pub's comment to the literal lit
// (outbox.QuoteLiteral), or removes it for "NULL".
func sqlMarkPublication(pub, lit string) string {
	return `COMMENT ON PUBLICATION ` + pgx.Identifier{pub}.Sanitize() + ` IS ` + lit
}

// sqlSetNote replaces, in one statement, the lines of the publication
// pub's comment that start with prefix by line, or removes them when line
// is "": the comment holds one line per note (outbox.WriterDeletesMark,
// beforeSlotNote), and each note is set or removed without the others.
func sqlSetNote(pub, prefix, line string) string {
	return sqlEditNotes(pub, `starts_with(l, `+outbox.QuoteLiteral(prefix)+`)`, line)
}

// sqlRemoveNote removes the lines of the publication pub's comment that
// are line.
func sqlRemoveNote(pub, line string) string {
	return sqlEditNotes(pub, `l = `+outbox.QuoteLiteral(line), "")
}

// sqlUnmarkWhileStreaming removes outbox.WriterDeletesMark from the
// publication pub's comment, but only while the session pid streams from
// slot.
func sqlUnmarkWhileStreaming(pub, slot string, pid int32) string {
	return sqlEditNotesIf(pub, `l = `+outbox.QuoteLiteral(outbox.WriterDeletesMark), "",
		`EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name::text = `+outbox.QuoteLiteral(slot)+` AND active_pid = `+strconv.Itoa(int(pid))+`)`)
}

// notesLock is the SQL of the two keys of the advisory lock that
// serializes the edits of the publication pub's comment.
func notesLock(pub string) string {
	return `hashtext('outbox-relay publication notes'), hashtext(` + outbox.QuoteLiteral(pub) + `)`
}

// sqlEditNotes drops the lines l of the publication pub's comment for
// which the SQL condition drop holds, and adds line unless it is "". An
// advisory lock of the publication's name serializes the edits, which
// read the comment before they write it.
func sqlEditNotes(pub, drop, line string) string {
	return sqlEditNotesIf(pub, drop, line, "true")
}

// sqlEditNotesIf is sqlEditNotes when the SQL condition guard holds once
// the edit holds the lock, and does nothing otherwise.
func sqlEditNotesIf(pub, drop, line, guard string) string {
	lit := "NULL"
	if line != "" {
		lit = outbox.QuoteLiteral(line)
	}
	p := outbox.QuoteLiteral(pub)
	// The notes are the relay's, so none holds the block's quote.
	return `DO $outbox$ BEGIN
PERFORM pg_advisory_xact_lock(` + notesLock(pub) + `);
IF ` + guard + ` THEN EXECUTE format('COMMENT ON PUBLICATION %I IS %L', ` + p + `,
	NULLIF(concat_ws(E'\n', (SELECT string_agg(l, E'\n' ORDER BY n)
		FROM unnest(string_to_array(obj_description((SELECT oid FROM pg_publication WHERE pubname = ` + p + `), 'pg_publication'), E'\n'))
			WITH ORDINALITY AS x(l, n)
		WHERE NOT (` + drop + `)), ` + lit + `), ''));
END IF;
END $outbox$`
}

// sqlAddToPublication adds table t to the publication pub.
func sqlAddToPublication(pub string, t outbox.Table) string {
	return `ALTER PUBLICATION ` + pgx.Identifier{pub}.Sanitize() + ` ADD TABLE ` + t.Quoted()
}

// sqlPublishWhole makes the publication pub publish every row and column of
// table t, its only table: no row filter or column list (PostgreSQL 15's).
func sqlPublishWhole(pub string, t outbox.Table) string {
	return `ALTER PUBLICATION ` + pgx.Identifier{pub}.Sanitize() + ` SET TABLE ` + t.Quoted()
}

// captureStatements are the statements above by name, for the test that
// prepares each.
var captureStatements = map[string]string{
	"sqlCaptureSettings": sqlCaptureSettings, "sqlCanReplicate": sqlCanReplicate, "sqlPublishes": sqlPublishes,
	"sqlSlotState": sqlSlotState, "sqlDropSlot": sqlDropSlot, "sqlWriterDeletesTable": sqlWriterDeletesTable,
	"sqlRowTypeColumns": sqlRowTypeColumns, "sqlWALSenderTimeout": sqlWALSenderTimeout,
	"sqlSweepFence": sqlSweepFence, "sqlSlotHorizon": sqlSlotHorizon, "sqlSlotConfirmed": sqlSlotConfirmed,
	"sqlDeletedRowsMark": sqlDeletedRowsMark, "sqlDeletedRowsEnd": sqlDeletedRowsEnd, "sqlInvisible": sqlInvisible,
	"sqlSlotSnapshot": sqlSlotSnapshot, "sqlNameTaken": sqlNameTaken, "sqlNote": sqlNote,
}
