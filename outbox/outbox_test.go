package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/examples/orderservice/orders"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka))
}

func entry() outbox.Entry {
	return outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order", AggregateID: "o1",
		EventType: "OrderConfirmed", Payload: []byte(`{"a":1}`), PartitionKey: "o1"}
}

func TestStoreCommitsWithTheTransaction(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()

	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	e := entry()
	require.NoError(t, outbox.Store(ctx, tx, e))
	require.NoError(t, outbox.Store(ctx, tx, e), "the same entry again is ignored")
	other := e
	other.Payload = []byte(`{"a":2}`)
	require.ErrorIs(t, outbox.Store(ctx, tx, other), outbox.ErrEventIDConflict, "another event under the same id is an error")
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID))

	tx, err = f.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, outbox.Store(ctx, tx, entry()))
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox`), "a rolled back transaction leaves no event")
}

func TestStoreValidatesTheEntry(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	bad := entry()
	bad.EventID = "not-a-uuid"
	bad.EventType = ""
	err = outbox.Store(ctx, tx, bad)
	require.ErrorContains(t, err, `EventID "not-a-uuid" is not a UUID`)
	require.ErrorContains(t, err, `EventType: event type "" must be 1 to 255 characters`)

	// An event type no topic map can hold would never be claimed: refused
	// as the relay's --topic and the OutboxRelay's topics refuse it.
	// Before, only an empty one was, and such a row waited for ever.
	for _, et := range []string{"a=b", "a,b", "OrderConfirmed ", " x", strings.Repeat("e", 256)} {
		bad := entry()
		bad.EventType = et
		require.ErrorContains(t, outbox.Store(ctx, tx, bad), "without '=' or ','", et)
	}
	require.ErrorContains(t, outbox.Store(ctx, nil, entry()), "tx is nil", "not a panic")

	// What PostgreSQL would refuse with an error naming no field is refused
	// naming it: a NUL byte or invalid UTF-8 in a text column, a NUL in a
	// header, the urn:uuid: form of an id (which uuid.Parse takes).
	for want, edit := range map[string]func(*outbox.Entry){
		`AggregateID "o\x001" holds a NUL byte`:                 func(e *outbox.Entry) { e.AggregateID = "o\x001" },
		`PartitionKey "\xff" holds a NUL byte or invalid UTF-8`: func(e *outbox.Entry) { e.PartitionKey = "\xff" },
		`AggregateType "Or\x00der"`:                             func(e *outbox.Entry) { e.AggregateType = "Or\x00der" },
		`header "tenant" holds a NUL byte`:                      func(e *outbox.Entry) { e.Headers = map[string]string{"tenant": "t\x00"} },
		`is not a UUID`:                                         func(e *outbox.Entry) { e.EventID = "urn:uuid:" + outbox.NewEventID() },
	} {
		bad := entry()
		edit(&bad)
		require.ErrorContains(t, outbox.Store(ctx, tx, bad), want)
	}

	// A CloudEvents attribute a relay with a CloudEvents format would hold
	// the row for is refused whatever the format. Before, Store took it.
	for h, want := range map[string]string{
		"ce_TenantID":        "CloudEvents attribute ce_TenantID: names are 1 to 20 lower-case letters and digits",
		"ce_data":            "the data is the payload",
		"ce_subject":         "ce_subject: must not be empty",
		"ce_dataschema":      `"order.json" is not an absolute URI`,
		"ce_datacontenttype": `"json please" is not a media type`,
	} {
		bad := entry()
		bad.Headers = map[string]string{h: map[string]string{"ce_dataschema": "order.json", "ce_datacontenttype": "json please"}[h]}
		require.ErrorContains(t, outbox.Store(ctx, tx, bad), want, h)
	}
	// Every problem of an entry's headers is reported at once. Before, the
	// first NUL byte hid a reserved name and a bad CloudEvents attribute.
	bad = entry()
	bad.Headers = map[string]string{"event_id": "e\x00", "ce_subject": "", "tenant": "t\x00"}
	err = outbox.Store(ctx, tx, bad)
	for _, want := range []string{`header "event_id" holds a NUL byte`, `header "tenant" holds a NUL byte`,
		"ce_subject: must not be empty", `header names reserved for the relay: "event_id"`} {
		require.ErrorContains(t, err, want)
	}
	good := entry()
	good.Headers = map[string]string{"ce_tenantid": "t1", "ce_subject": "orders/42", "ce_dataschema": "https://schemas.example/order.json", "tenant": "plain"}
	require.NoError(t, outbox.Store(ctx, tx, good))

	// DDL of a Table made by hand with a name ParseTable refuses (a newline
	// would end a comment the name is in and start a statement).
	require.PanicsWithValue(t, `outbox: DDL of an invalid table name "x\n; DROP TABLE orders; --" (make Tables with ParseTable)`, func() {
		outbox.SchemaDDL(outbox.Table{Name: "x\n; DROP TABLE orders; --"})
	})
	require.Panics(t, func() { outbox.HeldDDL(outbox.Table{Schema: "a b", Name: "outbox"}) })
	require.Panics(t, func() { outbox.PartitionedSchemaDDL(outbox.Table{Name: "a.b"}, outbox.PartitionDay, 3) })
}

func TestNewWriterQuotesAndValidatesTable(t *testing.T) {
	t.Parallel()
	_, err := outbox.NewWriter(`outbox; DROP TABLE orders`)
	require.ErrorContains(t, err, "not a plain identifier")

	f := outboxtest.NewFixture(t, 1)
	f.Exec(outbox.SchemaDDL(outbox.Table{Schema: "app", Name: "outbox"}))
	w, err := outbox.NewWriter("app.outbox")
	require.NoError(t, err)
	ctx := context.Background()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, w.Store(ctx, tx, entry()))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM app.outbox`))
}

func TestNewEventIDIsUUIDv7InTimeOrder(t *testing.T) {
	t.Parallel()
	a := outbox.NewEventID()
	time.Sleep(2 * time.Millisecond) // v7 ids order by their millisecond timestamp
	b := outbox.NewEventID()
	ua, err := uuid.Parse(a)
	require.NoError(t, err)
	require.Equal(t, uuid.Version(7), ua.Version())
	require.Less(t, a, b)
}

// A ConfirmOrder handler: the order change and its event commit
// together, and the relay publishes the event with the order id as key.
func TestConfirmOrderEndToEnd(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 3, orders.EventTypeOrderConfirmed)
	f.Exec(orders.Schema)
	ctx := context.Background()
	h := &orders.ConfirmOrderHandler{DB: f.Pool, Outbox: mustWriter(t)}
	o := orders.Order{ID: "order-42", CustomerID: "c-1", TotalKopecks: 12345}
	require.NoError(t, orders.CreateOrder(ctx, f.Pool, o))
	evt, err := h.Handle(ctx, o.ID)
	require.NoError(t, err)

	_, err = h.Handle(ctx, o.ID)
	require.True(t, errors.Is(err, orders.ErrAlreadyConfirmed))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox`), "the failed second confirmation stored nothing")

	_, err = h.Handle(ctx, "missing")
	require.True(t, errors.Is(err, pgx.ErrNoRows))

	outboxtest.Start(t, f.Config())
	msgs := testenv.Broker().Consume(t, f.Topics[orders.EventTypeOrderConfirmed], 1, 30*time.Second)
	require.Len(t, msgs, 1)
	require.Equal(t, "order-42", string(msgs[0].Key))
	require.Equal(t, evt.EventID, testenv.Header(msgs[0], relay.HeaderEventID))
	require.Contains(t, string(msgs[0].Value), `"total_rub": 12345`)
}

func mustWriter(t *testing.T) *outbox.Writer {
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	return w
}

// The writer library is a leaf: a service that writes events compiles no
// Kafka client, no Prometheus client and no relay.
func TestWriterIsALeaf(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/outbox-relay/outbox-operator/outbox").CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, heavy := range []string{"github.com/segmentio/kafka-go", "github.com/prometheus/", "github.com/outbox-relay/outbox-operator/relay"} {
		require.NotContains(t, string(out), heavy)
	}
}

// WithDeleteOnStore keeps the row while no relay with writer deletes
// streams from the table's slot: neither before the slot exists nor while
// it exists with nobody streaming (TestWriterDeletesOnlyWhileSuchARelayStreams,
// in the relay package, covers the relays).
func TestDeleteOnStoreKeepsTheRowUnlessARelayStreams(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	w, err := outbox.NewWriter("outbox", outbox.WithDeleteOnStore())
	require.NoError(t, err)
	store := func() string {
		e := entry()
		require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return w.Store(ctx, tx, e) }))
		return e.EventID
	}
	kept := store()
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, kept), "no slot yet: the row stays")

	var database string
	require.NoError(t, f.Pool.QueryRow(ctx, `SELECT current_database()`).Scan(&database))
	slot := outbox.SlotName(database, outbox.Table{Name: "outbox"})
	f.Exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot) })
	kept = store()
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, kept), "a slot nobody streams from: the row stays")

	// With the slot's publication made and marked as a relay with writer
	// deletes makes it, only the stream itself is missing: the row stays.
	f.Exec(`CREATE PUBLICATION ` + slot + ` FOR TABLE outbox WITH (publish = 'insert, delete')`)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP PUBLICATION IF EXISTS `+slot) })
	f.Exec(`COMMENT ON PUBLICATION ` + slot + ` IS ` + outbox.QuoteLiteral(outbox.WriterDeletesMark))
	kept = store()
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, kept), "a marked publication, a slot nobody streams from: the row stays")
}

// SlotName is unique per database and table, a valid identifier of at most
// 63 bytes, and stable.
func TestSlotName(t *testing.T) {
	t.Parallel()
	require.Equal(t, "outbox_orders_outbox", outbox.SlotName("orders", outbox.Table{Name: "outbox"}))
	require.Equal(t, "outbox_orders_app_outbox", outbox.SlotName("Orders", outbox.Table{Schema: "app", Name: "outbox"}))
	long := outbox.SlotName(strings.Repeat("d", 60), outbox.Table{Name: "outbox"})
	require.Len(t, long, 63)
	require.NotEqual(t, long, outbox.SlotName(strings.Repeat("d", 60), outbox.Table{Name: "outbox2"}), "a hash tells long names apart")
	require.Regexp(t, `^[a-z0-9_]+$`, outbox.SlotName("my-db.1", outbox.Table{Name: "outbox"}))
}

func TestQuoteLiteralRoundTrips(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	for _, s := range []string{"", "plain", "it's", "''", `back\slash`, "new\nline", "ünï"} {
		var got string
		require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT `+outbox.QuoteLiteral(s)).Scan(&got), s)
		require.Equal(t, s, got)
	}
}

// A Writer reads its table's shape in the caller's transaction; while one
// caller's read is slow, the Writer's other callers store meanwhile, in
// their own transactions, instead of waiting for it.
func TestSlowShapeReadHoldsUpNoOtherStore(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	w := mustWriter(t)

	slow, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer slow.Rollback(ctx)
	reading, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	slowTx := &hookTx{Tx: slow, before: func(ctx context.Context, sql string, _ []any) {
		if strings.Contains(sql, "current_database()") {
			once.Do(func() { close(reading) })
			<-release
		}
	}}
	slowDone := make(chan error, 1)
	go func() { slowDone <- w.Store(ctx, slowTx, entry()) }()
	<-reading

	otherCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	otherDone := make(chan error, 1)
	go func() {
		otherDone <- pgx.BeginFunc(otherCtx, f.Pool, func(tx pgx.Tx) error { return w.Store(otherCtx, tx, entry()) })
	}()
	select {
	case err = <-otherDone:
	case <-otherCtx.Done():
		err = otherCtx.Err()
	}
	close(release)
	slowErr := <-slowDone
	require.NoError(t, err, "another store while one reads the shape")
	require.NoError(t, slowErr)
	require.NoError(t, slow.Commit(ctx))
	require.Equal(t, 2, f.Count(`SELECT count(*) FROM outbox`))
}

// A table name of 63 characters ending in _held or _event_ids is its own
// held or event id table once cut to fit, and is refused; one a character
// shorter is not, and SelfDerivedPattern, which the OutboxRelay schema
// carries, matches exactly the refused names.
func TestTableThatIsItsOwnDerivedTableIsRefused(t *testing.T) {
	self := regexp.MustCompile(outbox.SelfDerivedPattern)
	for name, refused := range map[string]bool{
		strings.Repeat("o", 58) + "_held":          true,
		"app." + strings.Repeat("o", 58) + "_held": true,
		strings.Repeat("o", 53) + "_event_ids":     true,
		strings.Repeat("o", 57) + "_held":          false,
		strings.Repeat("o", 52) + "_event_ids":     false,
		strings.Repeat("o", 58) + "_held.outbox":   false,
		strings.Repeat("o", 63):                    false,
		"outbox":                                   false,
		strings.Repeat("o", 56) + "_held_2":        false,
	} {
		_, err := outbox.ParseTable(name)
		if refused {
			require.ErrorContains(t, err, "is the name of its own held or event id table", name)
		} else {
			require.NoError(t, err, name)
		}
		require.Equal(t, refused, self.MatchString(name), name)
	}
}

// The DDL runs again, at every start of a writer as the example service
// runs it, as the tables' owner without the schema's CREATE privilege,
// and while a writer's transaction is open: it makes only what is
// missing. Before, CREATE TABLE IF NOT EXISTS asked for the schema's
// CREATE even when the table existed, CREATE INDEX IF NOT EXISTS locked
// the table against writes (SHARE) before finding the index: it waited
// for every open writer, and every write queued behind it; and ALTER TABLE
// … SET of the storage parameters waited for autovacuum.
func TestSchemaDDLRunsAgainAsTheTablesOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1)
	plain, err := outbox.ParseTable("app.outbox")
	require.NoError(t, err)
	parted, err := outbox.ParseTable("app.parted")
	require.NoError(t, err)
	ddl := map[outbox.Table]string{plain: outbox.SchemaDDL(plain), parted: outbox.PartitionedSchemaDDL(parted, outbox.PartitionDay, 1)}
	role := fmt.Sprintf("owner_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN`)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	for _, d := range ddl {
		f.Exec(d)
	}
	// The role owns every table (partitions too) and the function, and
	// may use the schema, not create in it.
	f.Exec(`DO $$ DECLARE r regclass; BEGIN
		FOR r IN SELECT oid::regclass FROM pg_class WHERE relnamespace = 'app'::regnamespace AND relkind IN ('r', 'p') LOOP
			EXECUTE format('ALTER TABLE %s OWNER TO ` + role + `', r); END LOOP; END $$`)
	f.Exec(`GRANT USAGE ON SCHEMA app TO ` + role + `; ALTER FUNCTION ` + parted.AddPartitionsFunction().Quoted() + `(integer) OWNER TO ` + role)
	conn, err := pgx.Connect(ctx, strings.Replace(f.DSN, "postgres@", role+"@", 1)) // the test cluster trusts local connections
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `SET statement_timeout = '5s'`) // a wait for the writer's lock ends the DDL
	require.NoError(t, err)
	admin, err := f.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer admin.Release()
	_, err = admin.Exec(ctx, `SET statement_timeout = '5s'`)
	require.NoError(t, err)
	// CREATE OR REPLACE FUNCTION asks for the schema's CREATE privilege:
	// the partitioned DDL runs again as a role that may create there.
	for _, c := range []struct {
		table outbox.Table
		db    interface {
			Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
		}
	}{{plain, conn}, {parted, admin}} {
		writer, err := f.Pool.Begin(ctx)
		require.NoError(t, err)
		defer writer.Rollback(ctx) //nolint:errcheck // a failed test leaves it open
		w, err := outbox.NewWriter(c.table.String())
		require.NoError(t, err)
		require.NoError(t, w.Store(ctx, writer, entry()))
		if c.table == plain {
			// The lock a running autovacuum holds, which ALTER TABLE …
			// SET waits for (on the plain table: autovacuum locks a
			// partitioned table's leaves, and a new day's ATTACH would
			// wait for it on the parent).
			_, err = writer.Exec(ctx, `LOCK TABLE `+c.table.Quoted()+` IN SHARE UPDATE EXCLUSIVE MODE`)
			require.NoError(t, err)
		}
		_, err = c.db.Exec(ctx, ddl[c.table])
		require.NoError(t, err, "%s: the DDL again, a writer's transaction open", c.table)
		require.NoError(t, writer.Commit(ctx))
	}
	_, err = conn.Exec(ctx, `CREATE TABLE app.other (id int)`)
	require.ErrorContains(t, err, "permission denied for schema app", "the role may create nothing there")
	_, err = conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS app`)
	require.ErrorContains(t, err, "permission denied for database", "what the DDL ran before")
}

// An event id is stored in its canonical form: in a text event_id column,
// its upper-case or braced spelling is the same event (a retry is a no-op,
// another entry a conflict), and the row carries the canonical id. Before,
// each spelling was stored as another event.
func TestEventIDSpellingsAreOneEvent(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	f.Exec(`ALTER TABLE outbox ALTER COLUMN event_id TYPE text`)
	e := entry()
	for _, id := range []string{strings.ToUpper(e.EventID), "{" + e.EventID + "}", strings.ReplaceAll(e.EventID, "-", "")} {
		e.EventID = id
		require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return outbox.Store(ctx, tx, e) }), id)
	}
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox`))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, canonical(e.EventID)), "the row carries the canonical id")
	other := e
	other.Payload = []byte(`{"a":2}`)
	other.EventID = strings.ToUpper(canonical(e.EventID))
	err := pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return outbox.Store(ctx, tx, other) })
	require.ErrorIs(t, err, outbox.ErrEventIDConflict)
}

// canonical is id as uuid.UUID prints it.
func canonical(id string) string { return uuid.MustParse(id).String() }
