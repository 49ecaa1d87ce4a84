package relay

import (
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// SQL holds every statement the relay runs against the outbox table, built
// once per table. The benchmark runs the same statements.
type SQL struct {
	// Claim locks the next unpublished rows of the mapped event types, in id
	// order, skipping rows other replicas hold. Arguments: $1 the id to
	// start after, $2 the event types, $3 ids to leave out, $4 the most rows,
	// $5 the byte budget, $6 the largest record any topic takes: a row
	// larger comes back without its payload (see budgeted). See
	// claimColumns for the result.
	Claim string
	// ClaimIDs locks the rows of a logical replication stream's ids ($1,
	// in commit order) that are unpublished, of the event types $2 and not
	// among $3, in that order, within the byte budget $4 ($5 the largest
	// record). $6 and $7 say that order fast where they can (see
	// commitOrder; NULL and 0 where not). Result as Claim's. It skips
	// rows another transaction has locked.
	ClaimIDs string
	// ClaimIDsWaiting is ClaimIDs that waits for the rows another
	// transaction has locked, up to the transaction's lock_timeout, and
	// leaves out those it published meanwhile: a row the stream delivered
	// that it skipped would go out after the later rows of its key.
	ClaimIDsWaiting string
	// SweepIDs reads up to $5 ids of unpublished rows after the id $1,
	// in id order, of the event types $3 and not among $4 (as Claim),
	// whose last write was by a transaction before $2 (a transaction id's
	// text form, without its epoch): one that had ended when $2 was the
	// oldest running. With $6 not NULL it also reads those whose last
	// write was by a transaction before $6 not among $7 (the 32-bit forms
	// of a snapshot's xmax and running transactions): one the snapshot
	// sees. The logical replication capture's sweep publishes only those
	// (sweepFence, slotSnapshot).
	SweepIDs string
	// ClaimBuckets is Claim for partition-key ordering: the rows of the
	// replica's key-hash buckets of the event types $9 (those whose topic
	// is available) or none (held as invalid). A row of another type
	// waits with every row of its type, so the later rows of its key and
	// topic (a lane) wait too; leaving out a down topic's lanes key by key
	// instead made claims skip one pair per key, and with tens of thousands
	// of keys the other topics' rows were never claimed. Arguments: $1 the
	// id to start after, $2 ids to leave out, $3 and $4 the (partition key,
	// event type) pairs to leave out, as two arrays, $5 the buckets, $6 the
	// most rows, $7 the byte budget, $8 the largest record any topic takes.
	// It reads its candidates first and then locks them by id, so it also
	// returns the candidates another session holds locked (an open
	// transaction that updated one, an admin's SELECT ... FOR UPDATE, a
	// foreign key's FOR KEY SHARE), which SKIP LOCKED passes over: with
	// only their id, partition key and event type, flagged in a column
	// after locked, so the relay stops their lanes there and the key's
	// later rows do not go out before them; a last column counts the
	// candidates its limit took (claimFenced).
	ClaimBuckets string
	// Mark sets published_at on the rows whose ids are $1; on a
	// partitioned table (Partitioned), the rows whose (id, created_at) are
	// the pairs of $1 and $4, their primary key there, with created_at
	// between $2 and $3, the batch's oldest and newest, so only the
	// partitions holding the batch are touched.
	Mark string
	// Delete deletes the rows Mark would mark (OnPublishDelete), with the
	// same parameters.
	Delete string
	// Partitioned: built WithPartitions; Mark and Delete take the rows'
	// created_at ($4) and the batch's created_at bounds ($2, $3).
	Partitioned bool
	// Prune looks at the $3 rows with the ids above $1 and deletes those
	// published more than $2 seconds ago, skipping rows another
	// transaction holds. It returns the count deleted, the highest id
	// looked at ($1 when none), and how many of them were created or
	// published more than $2 seconds ago: none, and the walk is past the
	// old rows. It never touches an unpublished row: published_at is NULL
	// there. Bounded so: a statement that looked for $3 rows to delete
	// read every row kept after the old ones, the whole table at each
	// pass once they were gone.
	Prune string
	// BacklogByType counts unpublished rows per event type, up to $1 rows
	// in all (NULL event types count under NULL).
	BacklogByType string
	// OldestAge is the age in seconds of the oldest unpublished row, 0 when none.
	OldestAge string
	// OldestWaiting is the age in seconds of the oldest row of event types
	// $1, leaving out ids $2 and the (key, type) pairs $3 and $4, in the
	// key-hash buckets $5 (NULL: any): what a claim could take. 0 when none.
	// With partition-key ordering a replica counts only its own buckets: a
	// row another replica holds is no work this one leaves undone.
	OldestWaiting string

	// The held table (outbox.HeldDDL): the rows the relays hold back.

	// HeldExists is true when the held table exists.
	HeldExists string
	// CreateHeld creates the held table.
	CreateHeld string
	// Hold records holds: $1 ids, $2 event ids, $3 event types, $4 reasons,
	// $5 errors, $6 the seconds until the rows are tried again. A row held
	// before counts one more attempt. With HoldKeepsRedrives, $7 is how
	// many seconds ago the batch began.
	Hold string
	// HoldKeepsRedrives: built WithHeldRedrivenAt; Hold takes the batch's
	// age ($7) and leaves a row's retry time as a redrive written after
	// the batch began set it (the batch may have tried the row before the
	// fix the redrive follows; overwritten, the redrive would be lost).
	HoldKeepsRedrives bool
	// AddHeldRedrivenAt adds redriven_at to a held table made before it
	// existed.
	AddHeldRedrivenAt string
	// Unhold removes the records of the published rows $1.
	Unhold string
	// LoadHeld reads up to $1 held rows, those tried again soonest first:
	// id, reason and the seconds until their retry (0 when due).
	LoadHeld string
	// LoadHeldLanes is LoadHeld with each row's partition key, event type
	// (empty when the row is gone), key bucket (as bucketSQL) and whether
	// it is still unpublished: in partition-key mode a row held by another
	// replica, or before a restart, blocks its lane in the replica that
	// owns its bucket.
	LoadHeldLanes string
	// SweepHeld removes the records whose outbox row is published or gone
	// (published by a replica that did not know it was held, fixed and
	// published, or deleted by hand), or whose id another event has now
	// (the table's ids started over: TRUNCATE … RESTART IDENTITY, or the
	// table made again), which the record would otherwise hold back.
	SweepHeld string
	// ListHeld reads up to $5 records that a HeldFilter ($1 ids, $2
	// reasons, $3 event types, $4 all) selects, in id order.
	ListHeld string
	// Redrive makes the records a HeldFilter selects due at once (and,
	// built WithHeldRedrivenAt, records when in redriven_at).
	Redrive string
}

// heldWhere is the held table's rows that a HeldFilter ($1..$4) selects:
// every row with $4; else, when any selector is given, the rows that match
// each kind given (any of its values), as `--reason refused --type E`
// reads: the refused rows of type E.
const heldWhere = `($4 OR (COALESCE(cardinality($1::bigint[]), 0) + COALESCE(cardinality($2::text[]), 0) + COALESCE(cardinality($3::text[]), 0) > 0
        AND (COALESCE(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1))
        AND (COALESCE(cardinality($2::text[]), 0) = 0 OR reason = ANY($2))
        AND (COALESCE(cardinality($3::text[]), 0) = 0 OR event_type = ANY($3))))`

// bucketSQL is the key-hash bucket of a row, the same in every replica. A
// NULL key hashes as ” so the row is claimed (and held as invalid), not
// stranded in no bucket.
const bucketSQL = `(hashtext(COALESCE(partition_key, '')) & 63)`

// waitingPair is true for a row whose (partition key, event type) is one of
// the pairs in the parallel arrays keys and types.
func waitingPair(keys, types string) string {
	return `EXISTS (SELECT 1 FROM unnest(` + keys + `::text[], ` + types + `::text[]) AS w(k, t)
        WHERE w.k = COALESCE(partition_key, '') AND w.t = COALESCE(event_type, ''))`
}

// SQLOption changes the statements NewSQL builds.
type SQLOption func(*sqlOptions)

type sqlOptions struct {
	headers, partitioned bool
	partitionColumn      string
	byteaPayload         bool
	heldRedrivenAt       bool
}

// WithHeadersColumn makes the claims read the table's optional headers
// column. Without it they return NULL in its place and never name the
// column, so a table made before the column existed keeps working.
func WithHeadersColumn() SQLOption { return func(o *sqlOptions) { o.headers = true } }

// WithByteaPayload says the payload column is bytea: the claims size it
// by its length, which PostgreSQL reads from a compressed value's header
// (its text form, hex, is twice as long as what the relay sends).
func WithByteaPayload() SQLOption { return func(o *sqlOptions) { o.byteaPayload = true } }

// WithPartitionColumn makes the claims read column (an integer column,
// relayconfig.CheckPartitionColumn's name) as each row's Kafka partition.
// Without it they return NULL in its place.
func WithPartitionColumn(column string) SQLOption {
	return func(o *sqlOptions) { o.partitionColumn = column }
}

// WithPartitions builds Mark and Delete for a partitioned table: they take
// each row's created_at and the batch's created_at bounds besides the ids.
func WithPartitions() SQLOption { return func(o *sqlOptions) { o.partitioned = true } }

// WithHeldRedrivenAt says the held table has its redriven_at column (a
// held table made before it existed has not): Redrive records when it ran,
// and a Hold of a batch that began before then keeps the redrive.
func WithHeldRedrivenAt() SQLOption { return func(o *sqlOptions) { o.heldRedrivenAt = true } }

// claimColumns is what a claim returns per row. No column can fail the scan:
// NULLs come back as empty values, a created_at that Go's time cannot carry
// through RFC 3339 (infinity, or outside the years 1 to 9999) comes back as
// the epoch, and invalid names each such value, so one bad row is held on
// its own instead of failing the claim for every replica.
// claimHeaders adds the headers and the size.
var claimColumns = `id,
    COALESCE(event_id::text, '') AS event_id, COALESCE(event_type, '') AS event_type,
    COALESCE(aggregate_type, '') AS aggregate_type, COALESCE(aggregate_id, '') AS aggregate_id,
    COALESCE(partition_key, '') AS partition_key, payload,
    CASE WHEN ` + validCreatedAt + ` THEN created_at ELSE 'epoch' END AS created_at,
    concat_ws(', ', ` + nullColumns() + `,
        CASE WHEN created_at IS NOT NULL AND NOT (` + validCreatedAt + `) THEN 'created_at is out of range: ' || created_at::text END) AS invalid`

// nullColumns names each required column (outbox.RequiredColumns) that is
// NULL in the row: "event_id is NULL", …, one concat_ws argument each.
func nullColumns() string {
	var b strings.Builder
	for i, c := range outbox.RequiredColumns() {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(`CASE WHEN ` + c + ` IS NULL THEN '` + c + ` is NULL' END`)
	}
	return b.String()
}

// validCreatedAt is the created_at range the relay publishes, the same as
// the shipped DDL's CHECK (outbox.CreatedAtCheck).
const validCreatedAt = outbox.CreatedAtCheck

// heldRowIsItsEvent: outbox row o is the one held record h was written
// for, not another event that took its id since (ids that started over);
// a record without an event id (a row without one) goes by its id.
const heldRowIsItsEvent = `(h.event_id = '' OR h.event_id = o.event_id::text)`

// storedSize is what a column costs in a claim's byte budget: its stored
// size when stored uncompressed (free to read), else its text length: a
// compressed value's stored size can be a small fraction of what the relay
// will hold, which would let a claim take far more bytes than the budget.
// (pg_column_compression: PostgreSQL 14+.)
func storedSize(col string) string {
	return `COALESCE(CASE WHEN pg_column_compression(` + col + `) IS NULL THEN pg_column_size(` + col + `)
        ELSE octet_length(` + col + `::text) END, 0)`
}

// claimHeaders is the headers column of a claim's result (the column, or
// NULL for a table without it) and the row's size for the byte budget: the
// payload's, plus the headers' (up to 16 KiB a row, so a batch of 10,000 rows
// could otherwise hold 160 MiB beyond its budget). Malformed headers do not
// fail the scan either: the relay reads them as bytes and holds a row whose
// headers are not an object of strings.
func claimHeaders(o sqlOptions) string {
	payload := storedSize("payload")
	if o.byteaPayload {
		payload = payloadLength(o)
	}
	if o.headers {
		return `, headers, ` + payload + ` + ` + storedSize("headers") + ` AS size`
	}
	return `, NULL::jsonb AS headers, ` + payload + ` AS size`
}

// payloadLength is the length of the payload the relay publishes: its
// text, or a bytea's bytes. It reads the value (and detoasts it), so a
// claim computes it only for a row its stored size says may not fit
// (budgetedBy).
func payloadLength(o sqlOptions) string {
	if o.byteaPayload {
		return `COALESCE(octet_length(payload), 0)`
	}
	return `COALESCE(octet_length(payload::text), 0)`
}

// claimPartition is the record's explicit Kafka partition in a claim's
// result: the partition column, or NULL.
func claimPartition(o sqlOptions) string {
	if o.partitionColumn != "" {
		return `, ` + pgx.Identifier{o.partitionColumn}.Sanitize() + `::bigint AS kafka_partition`
	}
	return `, NULL::bigint AS kafka_partition`
}

// budgeted wraps a locking claim so it returns rows in id order while their
// payloads fit the byte budget (always at least one row), and how many rows
// the claim locked (a batch cut by the budget is a full batch, not a short one).
//
// A row larger than the largest record any topic takes (largestArg) comes
// back with a NULL payload and headers and costs nothing of the budget: the
// relay holds it as too large from its size alone, without reading (or
// holding in memory) a payload it could never publish. The size is the
// stored one (storedSize), which for a jsonb stored uncompressed can be
// several times its text (an array of small numbers); a row over the
// limit by that size is too large only if its payload's text (payload,
// payloadLength) is over it too, so a row that fits is never held.
func budgeted(claim, budgetArg, largestArg, payload string) string {
	return budgetedBy(claim, budgetArg, largestArg, payload, "id")
}

// budgetedBy is budgeted with the rows in the order of column order (id,
// or the stream's commit order).
func budgetedBy(claim, budgetArg, largestArg, payload, order string) string {
	return `WITH c AS (` + claim + `),
` + budgetedRows(budgetArg, largestArg, payload, order, "") + `
ORDER BY ` + order
}

// budgetedRows is budgetedBy after its claim (c, the rows the claim
// locked): the rows within the budget, not yet ordered, with the columns
// extra last.
func budgetedRows(budgetArg, largestArg, payload, order, extra string) string {
	return `o AS (SELECT c.*, CASE WHEN size > ` + largestArg + ` THEN ` + payload + ` > ` + largestArg + ` ELSE false END AS oversize FROM c)
SELECT id, event_id, event_type, aggregate_type, aggregate_id, partition_key,
       CASE WHEN oversize THEN NULL ELSE payload END, created_at, invalid,
       CASE WHEN oversize THEN NULL ELSE headers END, size, kafka_partition, (SELECT count(*) FROM c) AS locked` + extra + `
FROM (SELECT o.*, sum(CASE WHEN oversize THEN 0 ELSE size END) OVER (ORDER BY ` + order + `)
               - CASE WHEN oversize THEN 0 ELSE size END AS before
      FROM o) s
WHERE before < ` + budgetArg
}

// claimFenced is ClaimBuckets: budgeted's claim of the rows of table q
// that where selects, in id order, $6 at most, each with a last column,
// fenced. SKIP LOCKED alone passes over a row another session holds
// locked and goes on to the key's later rows, which would then go out
// before it. So the claim reads its candidates without locking them
// (cand), then locks them (l), and returns those it could not lock
// (fenced true, with only their id, partition key and event type) beside
// those it claimed (c), so that the relay stops their lanes at their place
// in id order (byKey.fence). Only c counts in the byte budget and in
// locked; every row carries, last, how many candidates the limit counted
// (limited), which tells a full claim from a short one.
//
// On a plain table the lock finds each candidate by its ctid, the heap
// address the read returned, with no index probe (a TID scan). On a
// partitioned table a ctid names a row only within its partition, so the
// lock goes by id (one more index probe per candidate, in the partitions
// the candidates' created_at range spans). A candidate that a transaction
// updated and committed between the read and the lock is locked in its
// new version either way: PostgreSQL's TID scan does not check the
// candidate's conditions again when the lock follows the update, so where is
// checked again on the locked version (matches), and one that no longer
// matches (published, of another key, bucket or type now) is left out, as
// a locking claim's recheck leaves it out. Before, on a plain table, such
// a row came back claimed: published by a replica whose bucket it no
// longer was in, or after an operator had marked it published. A
// candidate deleted meanwhile comes back fenced.
//
// On a partitioned table two rows may share an id (the primary key is the
// id with created_at), so a row counts as locked only when one of that id
// and created_at is in l. By id alone, a twin the claim locked (of another
// key, or published) hid its candidate that another session held locked:
// that row was not fenced, and its key's later rows went out before it.
func claimFenced(q, cols, where string, o sqlOptions) string {
	lock, matches := `ctid = ANY(ARRAY(SELECT ctid FROM cand))`, where
	lockedCols, unlocked := "", `id NOT IN (SELECT id FROM l)`
	if o.partitioned {
		// The candidates' created_at range prunes the partitions the lock
		// probes: by id alone it would probe every one.
		lock = `id = ANY(ARRAY(SELECT id FROM cand))
      AND (created_at BETWEEN (SELECT min(created_at) FROM cand) AND (SELECT max(created_at) FROM cand) OR created_at IS NULL)`
		lockedCols = `,
      created_at AS locked_at`
		unlocked = `NOT EXISTS (SELECT 1 FROM l WHERE l.id = cand.id AND l.locked_at IS NOT DISTINCT FROM cand.created_at)`
	}
	return `WITH cand AS (
    SELECT id, ctid, created_at, COALESCE(partition_key, '') AS partition_key, COALESCE(event_type, '') AS event_type
    FROM ` + q + `
    WHERE ` + where + `
    ORDER BY id
    LIMIT $6),
l AS (
    SELECT ` + cols + `,
      ` + matches + ` AS matches` + lockedCols + `
    FROM ` + q + `
    WHERE ` + lock + `
    FOR UPDATE SKIP LOCKED),
c AS (SELECT * FROM l WHERE matches),
` + budgetedRows("$7", "$8", payloadLength(o), "id", ", false AS fenced, (SELECT count(*) FROM cand) AS limited") + `
UNION ALL
SELECT id, '', event_type, '', '', partition_key, NULL, 'epoch', '', NULL, 0, NULL, (SELECT count(*) FROM c), true, (SELECT count(*) FROM cand)
FROM cand WHERE ` + unlocked + `
ORDER BY id`
}

// claimIDs claims the rows of the ids a logical replication stream
// delivered ($1, in commit order), those still unpublished, mapped and not
// held, in that order, locked by lock (ClaimIDs, ClaimIDsWaiting).
// id = ANY walks the partial index of unpublished rows, one probe per id,
// however large the table (a join with unnest could be planned as a scan
// of the table). A row's place in $1 comes from the dense lookup $6 (its
// id less $7 as the index) where the relay could build one: array_position
// scans $1 from its start for every row, n²/2 steps for a claim of n ids.
func claimIDs(cols, q string, o sqlOptions, lock string) string {
	return budgetedBy(`SELECT `+cols+`,
      CASE WHEN id - $7::bigint BETWEEN 0 AND cardinality($6::int[]) - 1 THEN ($6::int[])[(id - $7::bigint + 1)::int]
           ELSE array_position($1::bigint[], id) END AS ord
    FROM `+q+`
    WHERE id = ANY($1::bigint[]) AND published_at IS NULL AND event_type = ANY($2) AND id <> ALL($3)
    `+lock, "$4", "$5", payloadLength(o), "ord")
}

// NewSQL builds the statements for table t. The relay builds them once, after
// its start-up check found out which optional columns the table has.
func NewSQL(t outbox.Table, opts ...SQLOption) SQL {
	var o sqlOptions
	for _, opt := range opts {
		opt(&o)
	}
	q := t.Quoted()
	h := t.HeldTable().Quoted()
	cols := claimColumns + claimHeaders(o) + claimPartition(o)
	// The rows to mark or delete: by id, and on a partitioned table by id
	// and created_at, its primary key there ($4 pairs with $1), within the
	// batch's created_at range, which prunes the partitions. An id alone
	// can name two rows there (explicit ids, a partition attached again
	// after the ids started over): before, the mark reached the other one
	// too, which then counted as published without reaching Kafka.
	marked := `id = ANY($1)`
	if o.partitioned {
		marked = `(id, created_at) IN (SELECT * FROM unnest($1::bigint[], $4::timestamptz[])) AND created_at BETWEEN $2 AND $3`
	}
	retryAt, redrive := `EXCLUDED.retry_at`, `retry_at = now()`
	if o.heldRedrivenAt {
		// The batch began $7 seconds before this statement reached the
		// server: measured by the relay and dated by the server's clock,
		// which the redrive's date comes from too, on every replica.
		retryAt = `CASE WHEN h.event_id = EXCLUDED.event_id AND h.redriven_at > statement_timestamp() - $7::float8 * interval '1 second'
            THEN h.retry_at ELSE EXCLUDED.retry_at END`
		redrive += `, redriven_at = statement_timestamp()`
	}
	return SQL{
		Partitioned:       o.partitioned,
		HoldKeepsRedrives: o.heldRedrivenAt,
		Claim: budgeted(`SELECT `+cols+`
    FROM `+q+`
    WHERE published_at IS NULL AND id > $1::bigint AND event_type = ANY($2) AND id <> ALL($3)
    ORDER BY id
    LIMIT $4
    FOR UPDATE SKIP LOCKED`, "$5", "$6", payloadLength(o)),
		ClaimBuckets: claimFenced(q, cols, `published_at IS NULL AND id > $1::bigint AND id <> ALL($2) AND NOT `+waitingPair("$3", "$4")+`
      AND `+bucketSQL+` = ANY($5) AND (event_type IS NULL OR event_type = ANY($9))`, o),
		ClaimIDs:        claimIDs(cols, q, o, "FOR UPDATE SKIP LOCKED"),
		ClaimIDsWaiting: claimIDs(cols, q, o, "FOR UPDATE"),
		// age(xmin) > age($2): xmin precedes $2 (age counts back from the
		// newest transaction, and a frozen xmin is the oldest of all).
		SweepIDs: `SELECT id FROM ` + q + `
    WHERE published_at IS NULL AND id > $1::bigint AND event_type = ANY($3) AND id <> ALL($4)
      AND (age(xmin) > age($2::text::xid)
           OR (age(xmin) > age($6::text::xid) AND xmin::text::bigint <> ALL($7::bigint[])))
    ORDER BY id
    LIMIT $5`,
		Mark:   `UPDATE ` + q + ` SET published_at = now() WHERE ` + marked,
		Delete: `DELETE FROM ` + q + ` WHERE ` + marked,
		Prune: `WITH chunk AS (
    SELECT id, published_at < now() - $2::float8 * interval '1 second' AS due,
           created_at < now() - $2::float8 * interval '1 second' AS old
    FROM ` + q + `
    WHERE id > $1::bigint
    ORDER BY id LIMIT $3),
doomed AS (
    SELECT id FROM ` + q + `
    WHERE id = ANY(ARRAY(SELECT id FROM chunk WHERE due)) AND published_at < now() - $2::float8 * interval '1 second'
    FOR UPDATE SKIP LOCKED),
gone AS (DELETE FROM ` + q + ` WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING id)
SELECT (SELECT count(*) FROM gone), COALESCE((SELECT max(id) FROM chunk), $1::bigint), (SELECT count(*) FROM chunk WHERE old OR due)`,
		BacklogByType: `SELECT event_type, count(*) FROM (SELECT event_type FROM ` + q + ` WHERE published_at IS NULL LIMIT $1) s GROUP BY 1`,
		// A created_at out of range is left out: its row is held, and
		// before PostgreSQL 17 now() - 'infinity' fails the statement.
		OldestAge: `SELECT COALESCE((SELECT extract(epoch FROM now() - created_at)::float8 FROM ` + q +
			` WHERE published_at IS NULL AND ` + validCreatedAt + ` ORDER BY id LIMIT 1), 0)`,
		OldestWaiting: `SELECT COALESCE((SELECT extract(epoch FROM now() - created_at)::float8 FROM ` + q +
			` WHERE published_at IS NULL AND ` + validCreatedAt + ` AND event_type = ANY($1) AND id <> ALL($2) AND NOT ` + waitingPair("$3", "$4") + `
			  AND ($5::int[] IS NULL OR ` + bucketSQL + ` = ANY($5))
			  ORDER BY id LIMIT 1), 0)`,
		HeldExists:        `SELECT to_regclass(` + outbox.QuoteLiteral(h) + `) IS NOT NULL`,
		CreateHeld:        outbox.HeldDDL(t),
		AddHeldRedrivenAt: outbox.HeldRedrivenAtDDL(t),
		Hold: `INSERT INTO ` + h + ` AS h (id, event_id, event_type, reason, error, retry_at)
    SELECT id, event_id, event_type, reason, error, now() + wait * interval '1 second'
    FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::float8[]) AS n(id, event_id, event_type, reason, error, wait)
    ON CONFLICT (id) DO UPDATE SET event_id = EXCLUDED.event_id, event_type = EXCLUDED.event_type, reason = EXCLUDED.reason, error = EXCLUDED.error,
        attempts = CASE WHEN h.event_id = EXCLUDED.event_id THEN h.attempts + 1 ELSE 1 END,
        first_attempt = CASE WHEN h.event_id = EXCLUDED.event_id THEN h.first_attempt ELSE now() END,
        last_attempt = now(), retry_at = ` + retryAt,
		Unhold:   `DELETE FROM ` + h + ` WHERE id = ANY($1)`,
		LoadHeld: `SELECT id, reason, GREATEST(extract(epoch FROM retry_at - now()), 0)::float8 FROM ` + h + ` ORDER BY retry_at LIMIT $1`,
		LoadHeldLanes: `SELECT h.id, h.reason, GREATEST(extract(epoch FROM h.retry_at - now()), 0)::float8,
       COALESCE(o.partition_key, ''), COALESCE(o.event_type, ''), ` + bucketSQL + `::int4,
       o.id IS NOT NULL AND o.published_at IS NULL
    FROM (SELECT id, event_id, reason, retry_at FROM ` + h + ` ORDER BY retry_at LIMIT $1) h
    LEFT JOIN ` + q + ` o ON o.id = h.id AND ` + heldRowIsItsEvent + `
    ORDER BY h.retry_at`,
		SweepHeld: `DELETE FROM ` + h + ` h WHERE NOT EXISTS (
    SELECT 1 FROM ` + q + ` o WHERE o.id = h.id AND o.published_at IS NULL AND ` + heldRowIsItsEvent + `)`,
		ListHeld: `SELECT id, event_id, event_type, reason, error, attempts, first_attempt, last_attempt, retry_at
    FROM ` + h + ` WHERE ` + heldWhere + ` ORDER BY id LIMIT $5`,
		Redrive: `UPDATE ` + h + ` SET ` + redrive + ` WHERE ` + heldWhere,
	}
}
