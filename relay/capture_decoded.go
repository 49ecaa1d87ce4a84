package relay

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// This file is the logical replication capture with writer deletes
// (Settings.WriterDeletes): the writers delete each row in the transaction
// that inserts it, so the table holds nothing to claim or mark, and the
// relay publishes the rows the stream decodes. What it cannot publish now
// (a row it cannot read from the stream, an unmapped type, a topic that is
// down, a row Kafka refused, one too large or malformed) it puts back into
// the table, unpublished, before the slot moves past it: from there the
// sweep and polling publish or hold it as they do any row. So an event is
// either on Kafka or in the table by the time the slot lets its WAL go.

// streamColumns are where the table's columns are in the stream's tuples.
type streamColumns struct {
	relation                                 string // namespace.name, for messages
	names                                    []string
	id, eventID, aggregateType, aggregateID  int
	eventType, payload, partitionKey, create int
	headers, partition                       int // -1 when absent
	payloadBytea                             bool
}

// byteaOID is bytea's type oid: its text form is hex (\x...).
const byteaOID = 17

func newStreamColumns(m *pglogrepl.RelationMessage, partitionColumn string) (*streamColumns, error) {
	c := &streamColumns{relation: m.Namespace + "." + m.RelationName, headers: -1, partition: -1}
	at := map[string]*int{
		"id": &c.id, "event_id": &c.eventID, "aggregate_type": &c.aggregateType, "aggregate_id": &c.aggregateID,
		"event_type": &c.eventType, "payload": &c.payload, "partition_key": &c.partitionKey, "created_at": &c.create,
	}
	for _, p := range at {
		*p = -1
	}
	for i, col := range m.Columns {
		c.names = append(c.names, col.Name)
		if p, ok := at[col.Name]; ok {
			*p = i
		}
		switch {
		case col.Name == "headers":
			c.headers = i
		case partitionColumn != "" && col.Name == partitionColumn:
			c.partition = i
		}
		if col.Name == "payload" {
			c.payloadBytea = col.DataType == byteaOID
		}
	}
	for name, p := range at {
		if *p < 0 {
			return nil, fmt.Errorf("the stream's %s.%s has no %s column", m.Namespace, m.RelationName, name)
		}
	}
	return c, nil
}

// streamedRow is a row as the stream delivered it: the row the publish
// reads, and its columns' text to put it back with.
type streamedRow struct {
	row
	text []*string // each column's text form, nil for NULL, in the order of names
	// names are the columns the stream delivered the row with: the
	// table's when it was written (it may have columns added or dropped
	// since), shared by the rows of one relation message.
	names []string
	// readable: the columns the relay publishes are all there and parse;
	// a row that is not is put back untried, for the claim to name what
	// is wrong with it and hold it.
	readable bool
	// deleted: the transaction that inserted the row deleted it.
	deleted bool
	// rel is the relation the row was inserted into; earlier: an earlier
	// table of the table's name, not the table now (tableReplaced).
	rel     uint32
	earlier bool
	// pendingAt is, for a row to restore (streamState.restore), the place
	// of its id in streamState.pending.
	pendingAt int
}

// column is the text of the row's column name; "" when NULL or absent.
func (x streamedRow) column(name string) string {
	if i := slices.Index(x.names, name); i >= 0 && x.text[i] != nil {
		return *x.text[i]
	}
	return ""
}

// tupleText keeps the text of a tuple's columns (tupleColumns), enough to
// put the row back (record).
func tupleText(id int64, names []string, cols [][]byte) streamedRow {
	x := streamedRow{row: row{id: id}, names: names, text: make([]*string, len(cols))}
	for i, col := range cols {
		if col != nil {
			s := string(col)
			x.text[i] = &s
		}
	}
	return x
}

// decodeRow reads an insert's columns (tupleColumns).
func (c *streamColumns) decodeRow(cols [][]byte) (streamedRow, error) {
	x := streamedRow{names: c.names, text: make([]*string, len(c.names)), readable: true}
	for i, col := range cols {
		if i < len(x.text) && col != nil {
			s := string(col)
			x.text[i] = &s
		}
	}
	switch {
	case len(cols) != len(c.names):
		return x, fmt.Errorf("the stream's insert into %s has %d columns, its relation message %d", c.relation, len(cols), len(c.names))
	case x.text[c.id] == nil:
		return x, fmt.Errorf("the stream's insert into %s has a NULL id", c.relation)
	}
	id, err := strconv.ParseInt(*x.text[c.id], 10, 64)
	if err != nil {
		return x, fmt.Errorf("the stream's id %q: %w", *x.text[c.id], err)
	}
	x.id = id
	text := func(i int) string {
		if x.text[i] == nil {
			x.readable = false
			return ""
		}
		return *x.text[i]
	}
	x.eventID, x.aggregateType, x.aggregateID = text(c.eventID), text(c.aggregateType), text(c.aggregateID)
	x.eventType, x.partitionKey = text(c.eventType), text(c.partitionKey)
	x.payload = []byte(text(c.payload))
	if c.payloadBytea && x.readable {
		b, err := hex.DecodeString(strings.TrimPrefix(string(x.payload), `\x`))
		x.payload, x.readable = b, x.readable && err == nil
	}
	created, ok := parseTimestamptz(text(c.create))
	x.createdAt, x.readable = created, x.readable && ok
	if c.headers >= 0 && x.text[c.headers] != nil {
		x.headers = []byte(*x.text[c.headers])
	}
	if c.partition >= 0 && x.text[c.partition] != nil {
		p, err := strconv.ParseInt(*x.text[c.partition], 10, 64)
		x.partition, x.readable = &p, x.readable && err == nil
	}
	x.size = int64(len(x.payload) + len(x.headers))
	return x, nil
}

// parseTimestamptz reads timestamptz's text form (DateStyle ISO, as the
// replication session sets it); false for what the relay does not
// publish: infinity, years before 1 (BC) or after 9999.
func parseTimestamptz(s string) (time.Time, bool) {
	for _, layout := range []string{"2006-01-02 15:04:05.999999999-07", "2006-01-02 15:04:05.999999999-07:00", "2006-01-02 15:04:05.999999999-07:00:00"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, true
		}
	}
	return time.Time{}, false
}

// publishDecoded publishes streamed rows in commit order, a batch at a
// time. A row its writer deleted is published from the stream; one its
// writer kept (a writer without outbox.WithDeleteOnStore, or one that
// stored while no relay with writer deletes streamed) is in the table too,
// so it is claimed, published and marked from there, as a relay without
// writer deletes does: published from the stream, it would go out again
// when a sweep or polling claimed it. Rows that fail transiently are put
// back and published again from the table before any later row
// (retryIDs). Without an error the slot may move past them: each is on
// Kafka, or in the table. The error is the database's: a failure to put
// rows back, or to publish rows from the table. Nothing is confirmed then, so
// the stream delivers the rows again, in commit order, before any later
// row: rows it put back would otherwise go out with a sweep, after later
// rows of their keys (the table's copies of rows put back go out again
// then, duplicates).
func (s *streamState) publishDecoded(ctx context.Context, rows []streamedRow) error {
	for len(rows) > 0 {
		if err := s.keepAlive(ctx); err != nil { // a large transaction's rows can take longer than wal_sender_timeout
			return err
		}
		// Each batch is a turn of the loop, bounded by its deadline: a
		// large transaction is a loop that moves, not a wedged one (before,
		// /healthz failed past the wedge limit, and the kubelet restarted the
		// relay mid-transaction, which it then streamed again from the start).
		s.r.health.iteration(time.Now())
		if !rows[0].deleted {
			n := 1
			for n < len(rows) && !rows[n].deleted {
				n++
			}
			ids, left := make([]int64, 0, n), []int64(nil)
			for _, x := range rows[:n] {
				if x.earlier { // in that table: the table's row of its id is another
					left = append(left, x.id)
				} else {
					ids = append(ids, x.id)
				}
			}
			if len(left) > 0 {
				s.r.log.Warn(keptInEarlierLog, "ids", left)
			}
			if err := s.r.publishStreamed(ctx, ids, s.pendXids, s.keepAlive); err != nil {
				return err
			}
			rows = rows[n:]
			continue
		}
		// A batch's rows are of one table, each id once (ids that started
		// over, TRUNCATE … RESTART IDENTITY, give two rows one): its
		// publish, put-back and retries know a row by its id.
		n, bytes, ids := 0, int64(0), map[int64]bool{}
		for n < len(rows) && rows[n].deleted && rows[n].earlier == rows[0].earlier && !ids[rows[n].id] && n < s.r.cfg.BatchSize &&
			(n == 0 || bytes+rows[n].size <= int64(s.r.cfg.MaxBatchBytes)) {
			bytes, ids[rows[n].id] = bytes+rows[n].size, true
			n++
		}
		retry, perr, err := s.publishDecodedBatch(ctx, rows[:n])
		if err != nil {
			return err
		}
		if len(retry) > 0 {
			if _, err := s.r.retryIDs(ctx, retry, perr, s.keepAlive); err != nil {
				return err
			}
		}
		rows = rows[n:]
	}
	return nil
}

// publishDecodedBatch publishes one batch of streamed rows and puts back
// what did not go out, with its holds, in one transaction. retry
// are the rows put back to publish again first (publish).
func (s *streamState) publishDecodedBatch(ctx context.Context, rows []streamedRow) (retry []int64, perr, err error) {
	r := s.r
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchDeadline(r.cfg))
	defer cancel()
	start := time.Now()
	types, largest := r.availableTypes(start), r.largestRecord()
	send := make([]row, 0, len(rows))
	for _, x := range rows {
		if x.readable && slices.Contains(types, x.eventType) {
			// Too large without a look at its record only when its payload
			// alone is, as a claim judges (budgetedRows): the headers
			// column's JSON spells each header with more bytes than the
			// record carries, so a row over by its headers may still fit,
			// and admit judges its record.
			x.oversize = len(x.payload) > largest
			send = append(send, x.row)
		}
	}
	var published []int64
	if len(send) > 0 {
		pctx, pcancel := publishing(bctx)
		published, retry, perr = r.publish(pctx, send)
		pcancel()
		if len(retry) == 0 {
			r.retryAgain()
		}
	}
	b := &inFlight{ctx: bctx, cancel: cancel, start: start, rows: send, published: published}
	b.holds, b.unhold = r.held.take(), r.held.forget(published)
	out := make(map[int64]bool, len(published))
	for _, id := range published {
		out[id] = true
	}
	back, backIDs := []streamedRow{}, []int64{}
	for _, x := range rows {
		if !out[x.id] {
			back, backIDs = append(back, x), append(backIDs, x.id)
		}
	}
	var moved movedRows
	if len(back) > 0 || len(b.holds) > 0 || len(b.unhold) > 0 {
		moved, err = r.putBack(b, back)
	}
	r.held.committed(b.holds, time.Now())
	if err != nil {
		return nil, nil, r.dbFailed(err)
	}
	r.noteHeldLost(b)
	retry = moved.apply(retry) // a batch's rows are of one table: their ids are their own
	if len(back) > 0 {
		s.remember(moved.apply(backIDs))
		if len(back) > len(retry) {
			r.log.Info("put rows the relay could not publish back into the table; the sweep publishes or holds them", "ids", backIDs)
			s.nextSweep = time.Now()
		}
	}
	r.setDBErr(nil)
	r.batchMetrics(start, len(rows))
	if perr == nil {
		r.health.batchDone(start, len(rows), len(published))
	}
	return retry, perr, nil
}

// recordQuoter escapes a field of a row type's text form inside its quotes.
var recordQuoter = strings.NewReplacer(`\`, `\\`, `"`, `\"`)

// putBackMemory is how long the stream remembers a row it put back, to
// leave its insert, when it comes back on the stream, to the sweep: the
// insert comes within the stream's lag, and one that never comes (the row
// was in the table already) must not stay in memory.
const putBackMemory = 10 * time.Minute

// remember notes rows put back (see streamState.putBack).
func (s *streamState) remember(ids []int64) {
	now := time.Now()
	if s.putBack == nil {
		s.putBack = map[int64]time.Time{}
	}
	for id, at := range s.putBack {
		if now.Sub(at) > putBackMemory {
			delete(s.putBack, id)
		}
	}
	for _, id := range ids {
		s.putBack[id] = now
	}
}

// record is the row in the text form of a row type whose columns are
// layout, "(v1,,v3)" (an empty field is NULL): cast to the type, each field
// goes through its column type's input, as the writer's insert did. A
// column of layout the row does not have is left empty.
func (x streamedRow) record(layout []string) string {
	var b strings.Builder
	b.WriteByte('(')
	for i, name := range layout {
		if i > 0 {
			b.WriteByte(',')
		}
		if j := slices.Index(x.names, name); j >= 0 && x.text[j] != nil {
			b.WriteByte('"')
			b.WriteString(recordQuoter.Replace(*x.text[j]))
			b.WriteByte('"')
		}
	}
	b.WriteByte(')')
	return b.String()
}

// putBack inserts rows into the table as they were written (their ids
// too, but for those moved to new ids: insertStreamed), unpublished, and
// records the batch's holds, in one transaction.
func (r *Relay) putBack(b *inFlight, rows []streamedRow) (moved movedRows, err error) {
	tx, err := r.pool.Begin(b.ctx)
	if err != nil {
		return nil, fmt.Errorf("begin putting rows back into %s: %w", r.table, err)
	}
	defer tx.Rollback(b.ctx) //nolint:errcheck // no-op after commit
	b.tx = tx
	if moved, err = r.insertStreamed(b.ctx, tx, rows); err != nil {
		return nil, fmt.Errorf("put %d rows back into %s: %w%s", len(rows), r.table, err, failingRow(err))
	}
	for i, h := range b.holds {
		for _, m := range moved {
			if m.from == h.id && m.eventID == h.eventID {
				b.holds[i].id = m.to
				r.held.move(m.from, m.to)
			}
		}
	}
	if err := r.recordHolds(b); err != nil {
		return nil, err
	}
	if err := tx.Commit(b.ctx); err != nil {
		return nil, fmt.Errorf("commit rows put back into %s: %w", r.table, err)
	}
	return moved, nil
}

// movedRow is a row put back under another id than the one it was
// written with (insertStreamed).
type movedRow struct {
	from, to int64
	eventID  string
}

type movedRows []movedRow

// apply replaces in ids the ids of moved rows with their new ones: the
// ids of one batch's rows, which are of one table, each its own.
func (m movedRows) apply(ids []int64) []int64 {
	if len(m) == 0 {
		return ids
	}
	to := make(map[int64]int64, len(m))
	for _, x := range m {
		to[x.from] = x.to
	}
	for i, id := range ids {
		if n, ok := to[id]; ok {
			ids[i] = n
		}
	}
	return ids
}

// restoreDeleted puts back into the table rows a writer deleted in the
// transaction that inserted them (a writer with writer deletes, while the
// table's relay did not run with them: during a switch away from writer
// deletes, say), unpublished, for the claim that follows to publish them.
// Those moved to new ids (insertStreamed) are in moved.
func (r *Relay) restoreDeleted(ctx context.Context, rows []streamedRow) (moved movedRows, err error) {
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchDeadline(r.cfg))
	defer cancel()
	if err := pgx.BeginFunc(bctx, r.pool, func(tx pgx.Tx) (err error) { moved, err = r.insertStreamed(bctx, tx, rows); return err }); err != nil {
		return nil, r.dbFailed(fmt.Errorf("put %d rows the writers deleted back into %s (the relay's role needs INSERT on it: GRANT INSERT ON %s TO the role): %w%s",
			len(rows), r.table, r.table.Quoted(), err, failingRow(err)))
	}
	r.log.Info("put rows their writers deleted back into the table, to publish them", "rows", len(rows))
	return moved, nil
}

// failingRowMax bounds the failing row failingRow quotes: its payload can
// be megabytes.
const failingRowMax = 500

// failingRow is the server's detail of a put-back the table refused: for
// a constraint added since the row was written, "Failing row contains
// (…)", its id and event id first; for a partition that retention dropped,
// the row's created_at. The stream waits for that row until the table
// takes it, so the error names it; "" when err has no detail.
func failingRow(err error) string {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Detail == "" {
		return ""
	}
	d := pgErr.Detail
	if len(d) > failingRowMax {
		d = strings.ToValidUTF8(d[:failingRowMax], "") + "…"
	}
	return " (" + d + ")"
}

// insertStreamed inserts streamed rows into the table, unpublished, with
// their ids, leaving out those it has already (by id and event id, or by
// event id under another id). The stream delivers a row with the columns
// the table had when it was written; a column added since takes its
// default, one dropped since is left out, so a row written before a
// migration goes back after it. It goes into the table that has the name
// now, as that table's columns stand.
//
// Two kinds of row go back under a new id, which moved maps them to: a
// row of an earlier table of the name (streamedRow.earlier), always, since
// its id is of that table's sequence, which this table's may yet reach (a
// writer's insert would then fail); and a row whose id another event of
// the table has taken (a table made again, whose ids start over). Left out
// by ON CONFLICT, it would have been in no table and no stream.
func (r *Relay) insertStreamed(ctx context.Context, tx pgx.Tx, rows []streamedRow) (moved movedRows, err error) {
	if len(rows) == 0 {
		return nil, nil
	}
	var oid *uint32 // NULL when no table has the name
	if err := tx.QueryRow(ctx, sqlTableOID, r.table.Quoted()).Scan(&oid); err != nil {
		return nil, fmt.Errorf("read the oid of %s: %w", r.table, err)
	}
	if oid == nil {
		return nil, fmt.Errorf("no table %s to put rows back into", r.table)
	}
	var layout []string
	if err := tx.QueryRow(ctx, sqlRowTypeColumns, *oid).Scan(&layout); err != nil {
		return nil, fmt.Errorf("read the columns of %s: %w", r.table, err)
	}
	var eventIDType string
	if err := tx.QueryRow(ctx, sqlColumnTypeOf, *oid, "event_id").Scan(&eventIDType); err != nil {
		return nil, fmt.Errorf("read the type of %s.event_id: %w", r.table, err)
	}
	// Rows of one relation message share their names: one statement each.
	for len(rows) > 0 {
		n := 1
		for n < len(rows) && slices.Equal(rows[n].names, rows[0].names) && rows[n].earlier == rows[0].earlier {
			n++
		}
		var cols []string
		for _, name := range layout {
			if slices.Contains(rows[0].names, name) {
				cols = append(cols, name)
			}
		}
		p := putBackGroup{r: r, tx: tx, layout: layout, cols: cols, oid: *oid, eventIDType: eventIDType}
		if moved, err = p.insert(ctx, rows[:n], moved); err != nil {
			return nil, err
		}
		rows = rows[n:]
	}
	return moved, nil
}

// putBackGroup puts back rows of one relation message: their columns cols
// of the table's layout.
type putBackGroup struct {
	r      *Relay
	tx     pgx.Tx
	layout []string
	cols   []string
	oid    uint32
	// eventIDType is the table's event_id type, as format_type names it.
	eventIDType string
}

// insert puts rows back (insertStreamed), adding those under new ids to
// moved.
func (p putBackGroup) insert(ctx context.Context, rows []streamedRow, moved movedRows) (movedRows, error) {
	anew := rows
	if !rows[0].earlier {
		// Under its own id unless the table gave it to another event, or
		// another row of the group has it (ids that started over between
		// two of the stream's transactions).
		taken, err := p.eventsByID(ctx, rows)
		if err != nil {
			return moved, err
		}
		var own []streamedRow
		anew = nil
		mine := map[int64]bool{}
		for _, x := range rows {
			switch e, ok := taken[x.id]; {
			case ok && e == x.column("event_id"): // there already
			case ok || mine[x.id]:
				anew = append(anew, x)
			default:
				own, mine[x.id] = append(own, x), true
			}
		}
		if len(own) > 0 {
			ids, err := p.insertRecords(ctx, own, p.cols)
			if err != nil {
				return moved, err
			}
			in := make(map[int64]bool, len(ids))
			for _, id := range ids {
				in[id] = true
			}
			for _, x := range own {
				if !in[x.id] { // left out by a conflict: its event under another id
					anew = append(anew, x)
				}
			}
		}
	}
	// Under a new id, unless the table has its event already (a stream
	// that reads a row again it put back before).
	cols := slices.DeleteFunc(slices.Clone(p.cols), func(c string) bool { return c == "id" })
	n := len(moved)
	for _, x := range anew {
		id, there, err := p.eventRow(ctx, x)
		if err != nil {
			return moved, err
		}
		if there {
			if id != x.id {
				moved = append(moved, movedRow{from: x.id, to: id, eventID: x.column("event_id")})
			}
			continue
		}
		ids, err := p.insertRecords(ctx, []streamedRow{x}, cols) // one at a time: RETURNING does not say which row a new id is
		if err != nil {
			return moved, fmt.Errorf("put row %d (event %s) back under a new id: %w", x.id, x.column("event_id"), err)
		}
		if len(ids) == 1 {
			moved = append(moved, movedRow{from: x.id, to: ids[0], eventID: x.column("event_id")})
		}
	}
	if len(moved) > n {
		p.r.log.Warn("put rows back into the table under new ids: rows of an earlier table of its name, or rows whose ids the table gave other events (it was made again, with ids that start over); the sweep publishes them, after the rows of their keys already in the table",
			"moved", moved[n:])
	}
	return moved, nil
}

// insertRecords inserts rows' columns cols, returning the ids of those
// inserted.
func (p putBackGroup) insertRecords(ctx context.Context, rows []streamedRow, cols []string) ([]int64, error) {
	records := make([]string, len(rows))
	for i, x := range rows {
		records[i] = x.record(p.layout)
	}
	return p.r.insertRecords(ctx, p.tx, sqlInsertRecords(p.r.table, cols), records, rows, p.oid)
}

// eventsByID reads the event ids, as text, of the table's rows that have
// the ids of rows.
func (p putBackGroup) eventsByID(ctx context.Context, rows []streamedRow) (map[int64]string, error) {
	ids := make([]int64, len(rows))
	for i, x := range rows {
		ids[i] = x.id
	}
	res, err := p.tx.Query(ctx, sqlEventsByID(p.r.table), ids)
	if err != nil {
		return nil, fmt.Errorf("read the rows of %s by the ids of rows put back: %w", p.r.table, err)
	}
	found := map[int64]string{}
	var id int64
	var e string
	if _, err := pgx.ForEachRow(res, []any{&id, &e}, func() error { found[id] = e; return nil }); err != nil {
		return nil, fmt.Errorf("read the rows of %s by the ids of rows put back: %w", p.r.table, err)
	}
	return found, nil
}

// eventRow reads the id of the table's row of x's event, if there is one:
// by its event id and created_at, so that on a partitioned table one
// partition is read.
func (p putBackGroup) eventRow(ctx context.Context, x streamedRow) (id int64, there bool, err error) {
	e, created := x.column("event_id"), x.column("created_at")
	if e == "" {
		return 0, false, nil // a row without one: the insert names what is wrong
	}
	q, args := sqlRowOfEvent(p.r.table, p.eventIDType, created != ""), []any{e}
	if created != "" {
		args = append(args, created)
	}
	err = p.tx.QueryRow(ctx, q, args...).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read the row of event %s in %s: %w", e, p.r.table, err)
	}
	return id, true, nil
}
