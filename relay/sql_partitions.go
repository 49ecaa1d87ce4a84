package relay

// Statements of retention on a partitioned outbox (partitions.go). Those
// about one partition take its name as a regclass prints it (quoted and
// qualified where needed), never a value from a row.
// TestPartitionStatementsPrepare prepares every one against the shipped
// partitioned DDL.

// sqlPartitions lists the partitions of the table of oid $1 (name, bound,
// plain table, detach pending, marked by a pruner, range, DEFAULT) and the tables a pruner
// detached from it and has not dropped: those whose comment starts with
// $2, detachedMark and the parent's oid, followed by their bound.
var sqlPartitions = `
		SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid), c.relkind = 'r', i.inhdetachpending,
		       COALESCE(starts_with(obj_description(c.oid, 'pg_class'), $2), false),
		       ` + boundsSQL("pg_get_expr(c.relpartbound, c.oid)") + `, pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT'
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1
		UNION ALL
		SELECT c.oid::regclass::text, substr(d.description, length($2) + 1), true, true, true,
		       ` + boundsSQL("substr(d.description, length($2) + 1)") + `, false
		FROM pg_description d JOIN pg_class c ON c.oid = d.objoid
		WHERE d.classoid = 'pg_class'::regclass AND d.objsubid = 0 AND starts_with(d.description, $2)
		  AND c.relkind = 'r' AND NOT c.relispartition`

// boundsSQL reads a range partition's bounds from its bound expression
// (NULL for MINVALUE and MAXVALUE, and for '-infinity' and 'infinity',
// which no time.Time holds and which bound the range as they do); a
// timestamptz literal reads back in the session that printed it.
func boundsSQL(expr string) string {
	finite := func(re string) string {
		return `(SELECT CASE WHEN isfinite(b) THEN b END FROM (SELECT (regexp_match(` + expr + `, '` + re + `'))[1]::timestamptz AS b) AS x)`
	}
	return finite(`FROM \(''([^'']*)''\)`) + `,
       ` + finite(`TO \(''([^'']*)''\)`)
}

const (
	// sqlPruneCut is the time $1 seconds ago, by the server's clock.
	sqlPruneCut = `SELECT now() - $1::float8 * interval '1 second'`
	// sqlIsAttached: the table named $1 is a partition.
	sqlIsAttached = `SELECT relispartition FROM pg_class WHERE oid = $1::regclass`
	// sqlIsPending: the partition named $1 is detach pending (no row: not a partition).
	sqlIsPending = `SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = $1::regclass`
	// sqlLongStatements lets one transaction's statements run for 10 minutes.
	sqlLongStatements = `SET LOCAL statement_timeout = '10min'`
	// sqlRunningBefore: the transactions of this database, other than this
	// session's, that may have begun before $1: their virtual transaction
	// ids (each transaction holds a lock on its own from its start until it
	// ends, in pg_locks, which every role may read), and the prepared ones
	// ('prepared ' and their id). A session whose pg_stat_activity row the
	// role may not read (another role's, without pg_read_all_stats) shows no
	// xact_start and counts as one that may have.
	sqlRunningBefore = `SELECT COALESCE(array_agg(v), '{}') FROM (
		SELECT l.virtualxid AS v FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted AND l.pid <> pg_backend_pid()
		  AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND (a.xact_start IS NULL OR a.xact_start < $1)
		UNION ALL
		SELECT 'prepared ' || transaction::text FROM pg_prepared_xacts WHERE database = current_database()) t`
	// sqlStillRunning: those of the transactions $1 (sqlRunningBefore) that
	// have not ended.
	sqlStillRunning = `SELECT COALESCE(array_agg(v), '{}') FROM unnest($1::text[]) v
		WHERE v IN (SELECT virtualxid FROM pg_locks WHERE locktype = 'virtualxid' AND mode = 'ExclusiveLock' AND granted
			UNION ALL SELECT 'prepared ' || transaction::text FROM pg_prepared_xacts)`
	// sqlWALInsert: the WAL's insert position.
	sqlWALInsert = `SELECT pg_current_wal_insert_lsn()::text`
	// sqlSlotPast: whether the logical slot $1 of this database has no
	// position left to confirm before $2, or does not exist.
	sqlSlotPast = `SELECT COALESCE((SELECT COALESCE(confirmed_flush_lsn >= $2::pg_lsn, false) FROM pg_replication_slots
		WHERE slot_name = $1 AND database = current_database()), true)`
)

// sqlPartitionWaits: partition p itself holds an unpublished row.
func sqlPartitionWaits(p string) string {
	return `SELECT EXISTS (SELECT 1 FROM ONLY ` + p + ` WHERE published_at IS NULL)`
}

// sqlComment sets table p's comment to the literal lit (quoteLiteral), or removes it for "NULL".
func sqlComment(p, lit string) string { return `COMMENT ON TABLE ` + p + ` IS ` + lit }

// sqlDetach detaches partition p from table t; how is CONCURRENTLY or FINALIZE.
func sqlDetach(t, p, how string) string {
	return `ALTER TABLE ` + t + ` DETACH PARTITION ` + p + ` ` + how
}

// sqlAttach attaches table p to table t with bound, as pg_get_expr printed it.
func sqlAttach(t, p, bound string) string {
	return `ALTER TABLE ` + t + ` ATTACH PARTITION ` + p + ` ` + bound
}

// sqlLockAlone locks table p against every other session until the transaction ends.
func sqlLockAlone(p string) string { return `LOCK TABLE ` + p + ` IN ACCESS EXCLUSIVE MODE` }

// sqlCountRows counts table p's rows, and those unpublished.
func sqlCountRows(p string) string {
	return `SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM ` + p
}

// sqlDrop drops table p.
func sqlDrop(p string) string { return `DROP TABLE ` + p }

// sqlDeleteEventIDs deletes up to $3 event ids of table ids (the outbox's
// event-id table) whose created_at is in [$1, $2); a NULL $1 is unbounded.
func sqlDeleteEventIDs(ids string) string {
	return `DELETE FROM ` + ids + ` WHERE event_id IN (
				SELECT event_id FROM ` + ids + ` WHERE created_at >= COALESCE($1::timestamptz, '-infinity') AND created_at < $2 LIMIT $3)`
}
