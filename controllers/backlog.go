package controllers

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// This file is what the operator asks of the outbox table: one bounded,
// read-only statement per observation, and the pure functions that turn
// its answer into status.backlog.

// backlogQueryTimeout bounds one observation (the session's statement_timeout).
const backlogQueryTimeout = 5 * time.Second

// BacklogSQL is the operator's only statement on the outbox table. It reads
// the $1 oldest unpublished rows by id through the table's partial index on
// (id) WHERE published_at IS NULL (an index scan that stops after $1 rows),
// and returns one row per (event type, has a NULL column, held reason) with
// its count and the age of its oldest row, beside the number of rows read,
// the last id read, the table's max(id) (one primary-key probe), PostgreSQL's
// counts of the table's updated rows and of its deleted rows ($2 is the
// table's quoted name; summed over the leaf partitions of a partitioned
// table, where PostgreSQL counts them: a partitioned parent's own counters
// stay 0), from which the publish rate is derived without scanning
// published_at (a relay that marks updates a row only to mark it
// published; one that deletes deletes a row only once it is published:
// flowTarget.deletes says which counts, since pruning deletes rows
// published long ago and the rate must not take them for publishing), and
// whether the held table exists ($3, its quoted name).
//
// The held reason is the relays' record in the held table (withHeld: it
// exists; outbox.HeldDDL), or, with byKey (PartitionKey ordering),
// "blocked" for a later row of the same partition key and topic as a held
// or invalid row: the relays keep it back to keep the key's order. With
// byKey, $4 and $5 are the topic map as two arrays (event types, topics);
// without, the sample is read in one pass (measured: grouping it by lane
// too made a read at 10,000 waiting rows five times as costly).
func BacklogSQL(t outbox.Table, withHeld, byKey bool) string {
	q := t.Quoted()
	key := ""
	if byKey {
		key = "partition_key, "
	}
	sample := `WITH s AS (
    SELECT id, event_type, ` + key + `CASE WHEN ` + outbox.CreatedAtCheck + ` THEN created_at END AS created_at,
           (` + strings.Join(outbox.RequiredColumns(), " IS NULL OR ") + ` IS NULL
            OR NOT (` + outbox.CreatedAtCheck + `)) AS invalid
    FROM ` + q + `
    WHERE published_at IS NULL
    ORDER BY id
    LIMIT $1),`
	held, reason := `(SELECT NULL::bigint AS id, NULL::text AS reason) h ON false`, `NULL::text`
	if withHeld {
		held, reason = t.HeldTable().Quoted()+` h ON h.id = s.id`, `h.reason`
	}
	var groups string
	if !byKey {
		// One pass over the sample: no lanes, so nothing is read twice.
		groups = `
g AS (
    SELECT s.event_type, s.invalid, ` + reason + ` AS held,
           count(*) AS n, max(s.id) AS last, extract(epoch FROM now() - min(s.created_at))::float8 AS age
    FROM s LEFT JOIN ` + held + `
    GROUP BY 1, 2, 3)`
	} else {
		groups = `
sh AS (
    SELECT s.*, ` + reason + ` AS held, m.topic
    FROM s LEFT JOIN ` + held + `
    LEFT JOIN unnest($4::text[], $5::text[]) AS m(event_type, topic) ON m.event_type = s.event_type),
lanes AS (
    SELECT partition_key, topic, min(id) AS first FROM sh
    WHERE (held IS NOT NULL OR invalid) AND topic IS NOT NULL
    GROUP BY 1, 2),
g AS (
    SELECT sh.event_type, sh.invalid, COALESCE(sh.held, CASE WHEN l.first < sh.id THEN 'blocked' END) AS held,
           count(*) AS n, max(sh.id) AS last, extract(epoch FROM now() - min(sh.created_at))::float8 AS age
    FROM sh LEFT JOIN lanes l ON l.partition_key = sh.partition_key AND l.topic = sh.topic
    GROUP BY 1, 2, 3)`
	}
	return sample + groups + `
SELECT COALESCE((SELECT sum(n) FROM g), 0)::bigint, (SELECT max(last) FROM g)::bigint, (SELECT max(id) FROM ` + q + `)::bigint,
       (SELECT CASE WHEN c.relkind = 'p' THEN
                   (SELECT COALESCE(sum(pg_stat_get_tuples_updated(t.relid)), 0)
                    FROM pg_partition_tree(c.oid) t WHERE t.isleaf)
               ELSE pg_stat_get_tuples_updated(c.oid) END
        FROM pg_class c WHERE c.oid = $2::text::regclass)::bigint,
       (SELECT CASE WHEN c.relkind = 'p' THEN
                   (SELECT COALESCE(sum(pg_stat_get_tuples_deleted(t.relid)), 0)
                    FROM pg_partition_tree(c.oid) t WHERE t.isleaf)
               ELSE pg_stat_get_tuples_deleted(c.oid) END
        FROM pg_class c WHERE c.oid = $2::text::regclass)::bigint,
       current_setting('track_counts')::bool, to_regclass($3) IS NOT NULL,
       g.event_type, g.invalid, g.held, g.n, g.age
FROM (VALUES (1)) one(x) LEFT JOIN g ON true`
}

// heldBlocked is BacklogSQL's held reason of a row kept back behind a held
// or invalid row of its partition key and topic.
const heldBlocked = "blocked"

// backlogQuery is what one observation reads: the table, whether its held
// table exists (as the last observation found), and the topic map and
// ordering, to tell the rows held back from those pending.
type backlogQuery struct {
	table    outbox.Table
	withHeld bool
	topics   map[string]string
	byKey    bool   // PartitionKey ordering
	slot     string // the replication slot to read; "" for none
	// slotRequired: the relay streams, so a failure to read its slot fails
	// the reading; a polling relay's reading goes on without the slot.
	slotRequired bool
}

// key identifies the question q asks with bound: readers asking the same
// share a reading.
func (q backlogQuery) key(bound int64) string {
	pairs := make([]string, 0, len(q.topics))
	for et, t := range q.topics {
		pairs = append(pairs, et+"="+t)
	}
	slices.Sort(pairs)
	return fmt.Sprintf("%s|%v|%v|%d|%s|%s|%v", q.table, q.withHeld, q.byKey, bound, strings.Join(pairs, ","), q.slot, q.slotRequired)
}

// args are BacklogSQL's arguments after the bound.
func (q backlogQuery) args(bound int64) []any {
	types := make([]string, 0, len(q.topics))
	topics := make([]string, 0, len(q.topics))
	for et, t := range q.topics {
		types, topics = append(types, et), append(topics, t)
	}
	args := []any{bound, q.table.Quoted(), q.table.HeldTable().Quoted()}
	if q.byKey {
		args = append(args, types, topics)
	}
	return args
}

// typeCount is one group of the sampled rows.
type typeCount struct {
	eventType *string // nil: a NULL event type
	invalid   bool    // a NULL in a column the relay reads, or created_at out of range
	held      string  // the held table's reason, heldBlocked, or "" (BacklogSQL)
	n         int64
	age       float64 // seconds since the group's oldest created_at; NaN when unknown
}

// backlogSample is one observation of an outbox table.
type backlogSample struct {
	at     time.Time
	groups []typeCount
	// read is the number of unpublished rows read (at most the bound);
	// beyond is how many ids were issued after the last of them when the
	// bound was reached (0 otherwise).
	read, beyond int64
	// updated and deleted are the table's counts of updated and of deleted
	// rows; tracked is false when the server does not count (track_counts
	// off).
	updated, deleted int64
	tracked          bool
	// heldTable: the held table exists (read it with the next observation).
	heldTable bool
	// perMinute is the publish rate over the last minute, nil when unknown;
	// the observer fills it in from earlier samples.
	perMinute *int64
	// slot is the replication slot's state, nil when none was asked for.
	slot *outboxv1alpha1.SlotStatus
}

// SlotSQL reads the replication slot $1: whether it exists, is active, the
// WAL it retains and the WAL not yet confirmed, in bytes.
const SlotSQL = `SELECT count(*) > 0, COALESCE(bool_or(active), false),
       COALESCE(max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), 0)::bigint,
       COALESCE(max(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)), 0)::bigint
FROM pg_replication_slots WHERE slot_name = $1`

// observeSlot reads the slot named name.
func observeSlot(ctx context.Context, db queryRower, name string) (*outboxv1alpha1.SlotStatus, error) {
	rows, err := db.Query(ctx, SlotSQL, name)
	if err != nil {
		return nil, fmt.Errorf("read replication slot %s: %w", name, err)
	}
	defer rows.Close()
	st := &outboxv1alpha1.SlotStatus{Name: name}
	var retained, lag int64
	for rows.Next() {
		if err := rows.Scan(&st.Exists, &st.Active, &retained, &lag); err != nil {
			return nil, fmt.Errorf("read replication slot %s: %w", name, err)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read replication slot %s: %w", name, err)
	}
	if st.Exists {
		st.RetainedWAL, st.ConfirmedLag = resource.NewQuantity(retained, resource.BinarySI), resource.NewQuantity(lag, resource.BinarySI)
	}
	return st, nil
}

// queryRower is what observeBacklog needs of a connection or pool.
type queryRower interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// observeBacklog runs BacklogSQL once, reading at most bound rows.
func observeBacklog(ctx context.Context, db queryRower, q backlogQuery, bound int64) (backlogSample, error) {
	s := backlogSample{at: time.Now()}
	table := q.table
	rows, err := db.Query(ctx, BacklogSQL(table, q.withHeld, q.byKey), q.args(bound)...)
	if err != nil {
		return s, fmt.Errorf("read the backlog of %s: %w", table, err)
	}
	defer rows.Close()
	var lastRead, maxID *int64
	for rows.Next() {
		var et, held *string
		var invalid *bool
		var n *int64
		var age *float64
		if err := rows.Scan(&s.read, &lastRead, &maxID, &s.updated, &s.deleted, &s.tracked, &s.heldTable, &et, &invalid, &held, &n, &age); err != nil {
			return s, fmt.Errorf("read the backlog of %s: %w", table, err)
		}
		if n == nil { // no unpublished row: the LEFT JOIN's empty side
			continue
		}
		g := typeCount{eventType: et, invalid: invalid != nil && *invalid, held: deref(held), n: *n, age: math.NaN()}
		if age != nil {
			g.age = *age
		}
		s.groups = append(s.groups, g)
	}
	if err := rows.Err(); err != nil {
		return s, fmt.Errorf("read the backlog of %s: %w", table, err)
	}
	if s.read >= bound && lastRead != nil && maxID != nil && *maxID > *lastRead {
		s.beyond = *maxID - *lastRead
	}
	if q.slot != "" {
		rows.Close()
		if s.slot, err = observeSlot(ctx, db, q.slot); err != nil {
			if q.slotRequired || ctx.Err() != nil {
				return s, err
			}
			s.slot = nil // a polling relay's backlog does not hang on a slot it does not use
		}
	}
	return s, nil
}

// backlogStatus classifies a sample by the relay's topic map and the held
// table: rows of a mapped type with no NULL column that no relay holds back
// are pending, the others held. Held rows are neither work more replicas
// could do nor a sign that publishing stopped, so they count in neither
// Pending nor OldestAge.
func backlogStatus(relay *outboxv1alpha1.OutboxRelay, s *backlogSample) *outboxv1alpha1.BacklogStatus {
	st := &outboxv1alpha1.BacklogStatus{ObservedAt: metav1.NewTime(s.at.Truncate(time.Second))}
	oldest := 0.0
	for _, g := range s.groups {
		_, mapped := relay.Spec.Topics[deref(g.eventType)]
		switch {
		case g.invalid || g.held == outbox.HeldInvalidRow:
			st.Held.Invalid += g.n
		case g.held == outbox.HeldTooLarge:
			st.Held.TooLarge += g.n
		case g.held == outbox.HeldRefused:
			st.Held.Refused += g.n
		case g.held == heldBlocked:
			st.Held.Blocked += g.n
		case g.eventType == nil || !mapped:
			st.Held.Unroutable += g.n
		default:
			st.Pending += g.n
			if !math.IsNaN(g.age) && g.age > oldest {
				oldest = g.age
			}
		}
	}
	if s.beyond > 0 {
		st.Estimated = true
		st.Pending += s.beyond
	}
	st.OldestAge = metav1.Duration{Duration: time.Duration(oldest) * time.Second}
	st.PublishedPerMinute = s.perMinute
	st.Slot = s.slot
	if !streams(relay) && (st.Slot == nil || !st.Slot.Exists || st.Slot.Active) {
		st.Slot = nil // a polling relay shows only a slot left behind, which nothing reads
	}
	return st
}

// streams reports whether the relay captures with logical replication.
func streams(relay *outboxv1alpha1.OutboxRelay) bool {
	return relay.Spec.Capture != nil && relay.Spec.Capture.Mode == outboxv1alpha1.CaptureLogicalReplication
}

// deletesPublished reports whether relay deletes the rows it published
// (spec.retention.onPublish Delete) rather than marks them. With writer
// deletes the rows the writers delete never wait in the table: those that
// do (kept while no such relay streamed) the relay marks, or deletes.
func deletesPublished(relay *outboxv1alpha1.OutboxRelay) bool {
	return relay.Spec.Retention != nil && relay.Spec.Retention.OnPublish == outboxv1alpha1.OnPublishDelete
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// backlogError says why an observation failed in words fit for the status,
// which anyone who may read the OutboxRelay can see: PostgreSQL's own
// refusals (a missing table, a permission) are named; connection errors,
// which can name hosts, users and databases, are not (the operator's log has them).
func backlogError(err error, dsnSecret string) string {
	var pgErr *pgconn.PgError
	var connErr *pgconn.ConnectError
	var unknownCA x509.UnknownAuthorityError
	var hostErr x509.HostnameError
	switch {
	case errors.As(err, &unknownCA):
		return "PostgreSQL's certificate is not signed by spec.database.tls.ca"
	case errors.As(err, &hostErr):
		return "PostgreSQL's certificate is not for the host in the DSN (spec.database.tls verifies the host name)"
	case errors.Is(err, dbauth.ErrPlainText):
		return "spec.database.auth sends a token as the password, so the connection must use TLS without a plain-text fallback: set spec.database.tls, or sslmode=require or stricter in the DSN"
	case errors.Is(err, dbauth.ErrNoToken):
		return "the operator's own cloud identity gave no token for spec.database.auth (the operator's log has the error)"
	case errors.Is(err, errDatabaseCAInvalid), errors.Is(err, errDatabaseClientCertInvalid):
		return err.Error()
	case err != nil && strings.Contains(err.Error(), "server refused TLS connection"):
		return "PostgreSQL does not accept TLS connections, which spec.database.tls asks for"
	case errors.As(err, &connErr):
		return fmt.Sprintf("cannot reach PostgreSQL with the DSN in Secret %s (the operator's log has the error)", dsnSecret)
	case errors.As(err, &pgErr) && pgErr.Code == "57014":
		return fmt.Sprintf("the backlog query took longer than %s", backlogQueryTimeout)
	case errors.As(err, &pgErr):
		return fmt.Sprintf("PostgreSQL refused the backlog query: %s (SQLSTATE %s)", pgErr.Message, pgErr.Code)
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("the backlog query took longer than %s", backlogQueryTimeout)
	case errors.Is(err, errNoTurn):
		return "the operator's connections to this database were busy with other OutboxRelays' reads for the whole interval (raise --backlog-connections-per-database, or spec.backlog.interval)"
	case errors.Is(err, errDSNUnparsable):
		return fmt.Sprintf("the DSN in Secret %s cannot be parsed", dsnSecret)
	default:
		return fmt.Sprintf("cannot reach PostgreSQL with the DSN in Secret %s (the operator's log has the error)", dsnSecret)
	}
}

// errDSNUnparsable: the DSN cannot be parsed (its text is never repeated).
var errDSNUnparsable = errors.New("the DSN cannot be parsed")
