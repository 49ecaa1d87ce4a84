package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// writerDeletesFixture is captureFixture with --writer-deletes, and a
// writer that deletes each row in the transaction that stores it.
func writerDeletesFixture(t *testing.T, eventTypes ...string) (*outboxtest.Fixture, relay.Config, func(entries ...outbox.Entry)) {
	f, cfg := captureFixture(t, 1, eventTypes...)
	cfg.WriterDeletes = true
	w, err := outbox.NewWriter("outbox", outbox.WithDeleteOnStore())
	require.NoError(t, err)
	store := func(entries ...outbox.Entry) {
		require.NoError(t, pgx.BeginFunc(context.Background(), f.Pool, func(tx pgx.Tx) error {
			for _, e := range entries {
				if err := w.Store(context.Background(), tx, e); err != nil {
					return err
				}
			}
			return nil
		}))
	}
	return f, cfg, store
}

// tableSlot is the name of the slot (and publication) of f's outbox table.
func tableSlot(t *testing.T, f *outboxtest.Fixture) string {
	t.Helper()
	var db string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT current_database()`).Scan(&db))
	return outbox.SlotName(db, outbox.Table{Name: "outbox"})
}

// waitSlotIdle waits until no relay reads f's table's slot (it exists).
func waitSlotIdle(t *testing.T, f *outboxtest.Fixture) {
	t.Helper()
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, tableSlot(t, f)) == 1
	}, 10*time.Second, 20*time.Millisecond, "no relay reads the slot")
}

// waitDeletesOnStore waits until a writer with WithDeleteOnStore would
// delete its rows in f's outbox table: a relay with writer deletes streams.
func waitDeletesOnStore(t *testing.T, f *outboxtest.Fixture, timeout time.Duration) {
	t.Helper()
	require.True(t, deletesOnStoreWithin(f.Pool, timeout), "a relay with writer deletes streams")
}

// deletesOnStoreWithin reports whether a writer with WithDeleteOnStore
// would delete its rows in db's outbox table within timeout.
func deletesOnStoreWithin(db *pgxpool.Pool, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		on, err := outbox.DeletesOnStore(context.Background(), db, outbox.Table{Name: "outbox"})
		if err == nil && on {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// consumedIDs are the event ids of the first n records of topic.
func consumedIDs(t *testing.T, topic string, n int) map[string]bool {
	t.Helper()
	seen := map[string]bool{}
	for _, m := range testenv.Broker().Consume(t, topic, n, 30*time.Second) {
		seen[header(m, relay.HeaderEventID)] = true
	}
	return seen
}

// storeEach stores n events of type E with store, a transaction each, and
// returns their event ids in that order.
func storeEach(store func(entries ...outbox.Entry), n int) []string {
	ids := make([]string, n)
	for i := range n {
		e := entry("E", i)
		store(e)
		ids[i] = e.EventID
	}
	return ids
}

func entry(eventType string, n int) outbox.Entry {
	return outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order", AggregateID: fmt.Sprintf("o%d", n%3),
		EventType: eventType, Payload: fmt.Appendf(nil, `{"n": %d, "note": "a \"quoted\" \\ value"}`, n), PartitionKey: fmt.Sprintf("o%d", n%3)}
}

// With writer deletes the table stays empty and the relay publishes the
// rows it decodes from the stream: every event once, in commit order, with
// its payload and headers as written, and the slot confirmed past them.
func TestWriterDeletesPublishesFromTheStream(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	startStreaming(t, cfg)
	var want []outbox.Entry
	for i := range 20 { // 20 transactions of 5 events
		var tx []outbox.Entry
		for j := range 5 {
			e := entry("E", i*5+j)
			if j == 0 {
				e.Headers = map[string]string{"tenant": fmt.Sprintf("t%d", i)}
			}
			tx = append(tx, e)
		}
		store(tx...)
		want = append(want, tx...)
	}
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writer deleted every row")
	msgs := testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second)
	require.Len(t, msgs, len(want))
	for i, m := range msgs { // one partition: the topic's order is the relay's
		e := want[i]
		require.Equal(t, e.EventID, header(m, relay.HeaderEventID), "event %d in commit order", i)
		require.JSONEq(t, string(e.Payload), string(m.Value))
		require.Equal(t, e.PartitionKey, string(m.Key))
		for k, v := range e.Headers {
			require.Equal(t, v, header(m, k))
		}
	}
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "nothing was put back")
	requireSlotConfirmedPastNow(t, f)
}

// What the relay cannot publish from the stream goes back into the table,
// where polling's rules apply: an unmapped type waits for the map, a row
// with malformed headers is held and recorded, an infinite created_at is
// held; the rows around them flow, and nothing is lost.
func TestWriterDeletesPutsBackWhatItCannotPublish(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, store := writerDeletesFixture(t, "E")
	f.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_created_at_check`) // a table made without the shipped DDL's check
	startStreaming(t, cfg)
	before, unmapped := entry("E", 1), entry("Unmapped", 2)
	store(before, unmapped)
	// Written as a writer that skips the checks would: in one transaction,
	// inserted and deleted.
	var badHeaders, badTime string
	require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
		for _, q := range []struct {
			into    *string
			headers string
			created string
		}{{&badHeaders, `'[1, 2]'`, "now()"}, {&badTime, "NULL", "'infinity'"}} {
			if err := tx.QueryRow(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, headers, created_at)
				VALUES (gen_random_uuid(), 'Order', 'o9', 'E', '{"bad": true}', 'o9', `+q.headers+`, `+q.created+`) RETURNING event_id::text`).Scan(q.into); err != nil {
				return err
			}
		}
		// Its own rows only: the relay may have put the unmapped row back
		// already.
		_, err := tx.Exec(ctx, `DELETE FROM outbox WHERE event_id::text = ANY($1)`, []string{badHeaders, badTime})
		return err
	}))
	after := entry("E", 3)
	store(after)

	msgs := testenv.Broker().Consume(t, f.Topics["E"], 2, 30*time.Second)
	require.Len(t, msgs, 2, "the rows put back are not published (their inserts come back on the stream and are left to the sweep)")
	require.Equal(t, []string{before.EventID, after.EventID}, []string{header(msgs[0], relay.HeaderEventID), header(msgs[1], relay.HeaderEventID)})
	// The three others are back in the table, unpublished, as written.
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_id::text = ANY($1)`,
			[]string{unmapped.EventID, badHeaders, badTime}) == 3
	}, 10*time.Second, 20*time.Millisecond, "put back")
	var payload, headers string
	require.NoError(t, f.Pool.QueryRow(ctx, `SELECT payload::text, headers::text FROM outbox WHERE event_id::text = $1`, badHeaders).Scan(&payload, &headers))
	require.JSONEq(t, `{"bad": true}`, payload)
	require.JSONEq(t, `[1, 2]`, headers)
	var unmappedPayload json.RawMessage
	require.NoError(t, f.Pool.QueryRow(ctx, `SELECT payload FROM outbox WHERE event_id::text = $1`, unmapped.EventID).Scan(&unmappedPayload))
	require.JSONEq(t, string(unmapped.Payload), string(unmappedPayload))
	// Held and recorded with their reasons, by the stream or by the sweep.
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_held h JOIN outbox o USING (id)
			WHERE h.reason = 'invalid_row' AND o.event_id::text = ANY($1)`, []string{badHeaders, badTime}) == 2
	}, 20*time.Second, 50*time.Millisecond, "the malformed rows are held and recorded")
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox_held h JOIN outbox o USING (id) WHERE o.event_id::text = $1`, unmapped.EventID),
		"an unmapped type is not held for itself: it waits for the map")
}

// A row the table refuses to take back (a constraint added since it was
// written) stops the stream: its event is in no table and not on Kafka,
// so the slot keeps it until the table takes it. The relay's error quotes
// the server's failing row, its event id included, so whoever fixes the
// table knows which (it named only how many rows before); once the table
// takes it, the stream goes on.
func TestWriterDeletesNamesARowTheTableRefusesBack(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 30*time.Second)
	// A constraint the writer's insert meets and the relay's put-back
	// does not, as one added between the two would be.
	f.Exec(`ALTER TABLE outbox ADD CONSTRAINT no_unmapped
		CHECK (event_type <> 'Unmapped' OR current_setting('application_name') <> 'outbox-relay') NOT VALID`)
	unmapped, after := entry("Unmapped", 1), entry("E", 2)
	store(unmapped)
	store(after)
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), `violates check constraint \"no_unmapped\"`) &&
			strings.Contains(logs.String(), "Failing row contains") && strings.Contains(logs.String(), unmapped.EventID)
	}, 30*time.Second, 50*time.Millisecond, "the relay names the row:\n%s", &logs)
	f.Exec(`ALTER TABLE outbox DROP CONSTRAINT no_unmapped`)
	require.True(t, consumedIDs(t, f.Topics["E"], 1)[after.EventID], "the row behind it goes out")
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1 AND published_at IS NULL`, unmapped.EventID) == 1
	}, 30*time.Second, 50*time.Millisecond, "the refused row is back in the table")
}

// A relay that stops mid-stream and one that starts later lose nothing:
// the slot keeps what was not confirmed, and the rows written while none
// streamed stay in the table (the writer deletes only while one does).
func TestWriterDeletesLosesNothingAcrossRestarts(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	x := startStreaming(t, cfg)
	want := storeEach(store, 50)
	x.Stop(t)
	want = append(want, storeEach(store, 50)...)
	y := outboxtest.Start(t, cfg)
	want = append(want, storeEach(store, 50)...)
	seen := map[string]bool{}
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second) {
		seen[header(m, relay.HeaderEventID)] = true
	}
	for _, id := range want {
		require.True(t, seen[id], "event %s published", id)
	}
	// What was written while no relay streamed stayed in the table, and
	// went out from there.
	require.Positive(t, f.Count(`SELECT count(*) FROM outbox`))
	f.WaitDrained(0, 30*time.Second)
	_ = y
}

// A relay run without writer deletes that takes a slot a relay with them
// streamed keeps it past --max-retained-wal until it has published what
// the slot holds of the events written with writer deletes: their rows are
// in no table, so the slot is their only copy. (Switching an OutboxRelay
// off writer deletes while its slot held back more than maxRetainedWAL
// dropped the slot at the new relay's first check, and lost them.) Once
// past them, the relay removes the publication's mark.
func TestLogicalReplicationKeepsASlotHoldingEventsWrittenWithWriterDeletes(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	slot := tableSlot(t, f)
	mark := func() *string {
		var comment *string
		require.NoError(t, f.Pool.QueryRow(context.Background(),
			`SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1`, slot).Scan(&comment))
		return comment
	}
	x := run(t, cfg, stuckWriter{}) // streams, and publishes nothing
	waitDeletesOnStore(t, f, 30*time.Second)
	require.NotNil(t, mark(), "a relay with writer deletes marks the publication")
	want := storeEach(store, 20)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writers deleted their rows")
	x.Stop(t)
	waitSlotIdle(t, f)
	// The slot holds back more WAL than the least limit.
	f.Exec(`SELECT pg_logical_emit_message(false, 'test-ballast', repeat('x', 1 << 20)) FROM generate_series(1, 80)`)

	cfg.WriterDeletes = false
	cfg.MaxRetainedWAL = relayconfig.MinMaxRetainedWAL
	outboxtest.Start(t, cfg)
	seen := consumedIDs(t, f.Topics["E"], len(want))
	for _, id := range want {
		require.True(t, seen[id], "event %s published", id)
	}
	// Every transaction on the server before the mark's must end first:
	// other tests' stalled claims run up to their deadline, 25 s.
	require.Eventually(t, func() bool { return mark() == nil }, 60*time.Second, 50*time.Millisecond,
		"past those events, the relay removes the mark")
}

// stuckWriter never publishes: each write waits for its context to end,
// as with a broker that stopped answering.
type stuckWriter struct{}

func (stuckWriter) WriteMessages(ctx context.Context, _ ...kafka.Message) error {
	<-ctx.Done()
	return ctx.Err()
}

// A table with a generated column is refused with writer deletes, by name:
// the stream leaves such columns out, so a row could not be put back.
func TestWriterDeletesRefusesGeneratedColumns(t *testing.T) {
	t.Parallel()
	f, cfg, _ := writerDeletesFixture(t, "E")
	f.Exec(`ALTER TABLE outbox ADD COLUMN payload_size int GENERATED ALWAYS AS (octet_length(payload::text)) STORED`)
	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	require.ErrorContains(t, r.Check(context.Background()), "has generated columns (payload_size)")
}

// With writer deletes the relay puts rows back, so its role must insert
// into the table: the start-up check names the GRANT.
func TestWriterDeletesNamesTheMissingInsert(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, _ := writerDeletesFixture(t, "E")
	owner, err := relay.New(cfg) // the table's owner makes the publication
	require.NoError(t, err)
	require.NoError(t, owner.Check(ctx))
	require.NoError(t, owner.Close())
	role := fmt.Sprintf("noinsert_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN REPLICATION; GRANT SELECT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	require.ErrorContains(t, r.Check(ctx), `grant it with: GRANT INSERT ON "outbox" TO "`+role+`"`)
}

// A relay run with writer deletes needs the table's publication to publish
// deletes (a relay run later without them puts back what the writers
// deleted); when it may not alter a publication of inserts alone, it
// refuses to start and names the ALTER PUBLICATION its owner runs. To
// mark it, it must own it: it says so.
func TestWriterDeletesNamesThePublicationAlter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, _ := writerDeletesFixture(t, "E")
	pub := tableSlot(t, f)
	f.Exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`)
	role := fmt.Sprintf("notowner_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN REPLICATION; GRANT SELECT, INSERT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	require.ErrorContains(t, r.Check(ctx), `as its owner, run: ALTER PUBLICATION "`+pub+`" SET (publish = 'insert, delete', publish_via_partition_root = true)`)

	// It marks the publication as streamed with writer deletes, which only
	// its owner may: it starts all the same, and says how to let it.
	f.Exec(`ALTER PUBLICATION ` + pub + ` SET (publish = 'insert, delete', publish_via_partition_root = true)`)
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	unmarked, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unmarked.Close() })
	require.NoError(t, unmarked.Check(ctx))
	require.Contains(t, logs.String(), `fix="ALTER PUBLICATION \"`+pub+`\" OWNER TO \"`+role+`\""`)
	f.Exec(`ALTER PUBLICATION ` + pub + ` SET (publish = 'insert')`)

	// Without writer deletes the same role starts, and the publication is
	// left as it was.
	cfg.WriterDeletes = false
	claiming, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = claiming.Close() })
	require.NoError(t, claiming.Check(ctx))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_publication WHERE pubname = $1 AND NOT pubdelete`, pub))
}

// A relay with writer deletes whose role may not mark the publication (a
// DBA owns it) streams, but takes no writer-deletes lock, so its writers
// keep their rows, even with a mark left there from before: a writer whose
// snapshot predates the mark's removal would read it. Before, it held the
// lock and the writers deleted while nothing could keep the mark there.
// Once its role owns the publication, it marks it, streams again with the
// lock, and the writers delete.
func TestWriterDeletesWaitForARelayThatMayMark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, store := writerDeletesFixture(t, "E")
	pub := tableSlot(t, f)
	f.Exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert, delete', publish_via_partition_root = true)`)
	f.Exec(`COMMENT ON PUBLICATION ` + pub + ` IS ` + outbox.QuoteLiteral(outbox.WriterDeletesMark))
	role := fmt.Sprintf("notowner_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN REPLICATION; GRANT SELECT, INSERT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	startStreaming(t, cfg)
	require.Contains(t, logs.String(), `fix="ALTER PUBLICATION \"`+pub+`\" OWNER TO \"`+role+`\""`)

	on, err := outbox.DeletesOnStore(ctx, f.Pool, outbox.Table{Name: "outbox"})
	require.NoError(t, err)
	require.False(t, on, "no writer-deletes lock: the writers keep their rows")
	kept := entry("E", 1)
	store(kept)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, kept.EventID), "kept")

	f.Exec(`ALTER PUBLICATION ` + pub + ` OWNER TO ` + role)
	waitDeletesOnStore(t, f, 30*time.Second)
	gone := entry("E", 2)
	store(gone)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, gone.EventID), "deleted at commit")
	seen := consumedIDs(t, f.Topics["E"], 2)
	require.True(t, seen[kept.EventID] && seen[gone.EventID], "both published: %v", seen)
}

// A publication changed by hand so that the stream would not carry all of
// the table (no inserts published, a row filter, a column list) is made
// whole again by a relay's start-up check; a relay whose role may not
// alter it refuses to start and names the statement its owner runs.
// Before, the relay started and streamed none of what the publication
// left out, which then waited for the sweep, in id order.
func TestCaptureMakesItsPublicationCarryTheWholeTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	pub := tableSlot(t, f)
	f.Exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'delete')`)
	role := fmt.Sprintf("notowner_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN REPLICATION; GRANT SELECT, INSERT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	notOwner := cfg
	notOwner.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
	check := func(cfg relay.Config) error {
		r, err := relay.New(cfg)
		require.NoError(t, err)
		defer r.Close()
		return r.Check(ctx)
	}
	whole := func() int {
		return f.Count(`SELECT count(*) FROM pg_publication p JOIN pg_publication_rel pr ON pr.prpubid = p.oid
			WHERE p.pubname = $1 AND p.pubinsert AND pr.prqual IS NULL AND pr.prattrs IS NULL`, pub)
	}

	err := check(notOwner)
	require.ErrorContains(t, err, `publishes no inserts`)
	require.ErrorContains(t, err, `as its owner, run: ALTER PUBLICATION "`+pub+`" SET (publish = 'insert, delete', publish_via_partition_root = true)`)
	require.NoError(t, check(cfg))
	require.Equal(t, 1, whole(), "the owner's relay made it publish inserts")

	f.Exec(`ALTER PUBLICATION ` + pub + ` SET TABLE outbox WHERE (id > 100)`)
	err = check(notOwner)
	require.ErrorContains(t, err, `carries only some rows or columns of outbox`)
	require.ErrorContains(t, err, `as its owner, run: ALTER PUBLICATION "`+pub+`" SET TABLE "outbox"`)
	require.NoError(t, check(cfg))
	require.Equal(t, 1, whole(), "the owner's relay dropped the row filter")

	f.Exec(`ALTER PUBLICATION ` + pub + ` SET TABLE outbox (id, event_id)`)
	require.NoError(t, check(cfg))
	require.Equal(t, 1, whole(), "the owner's relay dropped the column list")
	require.NoError(t, check(notOwner), "nothing left to alter")
}

// A writer with outbox.WithDeleteOnStore deletes its row only while a relay
// with writer deletes streams: with no relay, or with one that claims the
// streamed rows from the table (it would find a deleted row gone and move
// on), the row stays and is published from the table; with such a relay
// streaming, the row goes at commit and reaches Kafka from the stream.
func TestWriterDeletesOnlyWhileSuchARelayStreams(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	inTable := func(e outbox.Entry) int {
		return f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID)
	}
	before := entry("E", 1)
	store(before)
	require.Equal(t, 1, inTable(before), "no relay: kept")
	deletesOnStore := func() bool {
		on, err := outbox.DeletesOnStore(context.Background(), f.Pool, outbox.Table{Name: "outbox"})
		require.NoError(t, err)
		return on
	}
	require.False(t, deletesOnStore())

	claiming := cfg
	claiming.WriterDeletes = false
	x := startStreaming(t, claiming)
	during := entry("E", 2)
	store(during)
	require.Equal(t, 1, inTable(during), "a relay that claims from the table streams: kept")
	require.False(t, deletesOnStore())
	f.WaitDrained(0, 30*time.Second) // both published from the table
	x.Stop(t)

	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	after := entry("E", 3)
	store(after)
	require.Zero(t, inTable(after), "a relay with writer deletes streams: deleted at commit")
	seen := consumedIDs(t, f.Topics["E"], 3)
	for _, e := range []outbox.Entry{before, during, after} {
		require.True(t, seen[e.EventID], "event %s published", e.EventID)
	}

	// The publication's writer-deletes mark removed while the relay
	// streams: a relay switched from writer deletes later would not know
	// that the slot holds events in no table, and could give it up, so
	// writers keep their rows (before, they went on deleting). The relay
	// marks it again within a check of the slot, and they delete again.
	// The test holds the relay's edits of the comment back meanwhile, so
	// that it cannot mark it again before the row is stored.
	slot := tableSlot(t, f)
	held, err := f.Pool.Acquire(context.Background())
	require.NoError(t, err)
	defer held.Release()
	_, err = held.Exec(context.Background(), `SELECT pg_advisory_lock(`+relay.NotesLock(slot)+`)`)
	require.NoError(t, err)
	f.Exec(`COMMENT ON PUBLICATION ` + slot + ` IS NULL`)
	require.False(t, deletesOnStore())
	unmarked := entry("E", 5)
	store(unmarked)
	require.Equal(t, 1, inTable(unmarked), "no mark: kept")
	_, err = held.Exec(context.Background(), `SELECT pg_advisory_unlock(`+relay.NotesLock(slot)+`)`)
	require.NoError(t, err)
	waitDeletesOnStore(t, f, 30*time.Second)
	remarked := entry("E", 6)
	store(remarked)
	require.Zero(t, inTable(remarked), "marked again: deleted at commit")
	seen = consumedIDs(t, f.Topics["E"], 5)
	for _, e := range []outbox.Entry{unmarked, remarked} {
		require.True(t, seen[e.EventID], "event %s published", e.EventID)
	}

	// The publication altered by hand to publish no deletes while the
	// relay streams: a relay switched from writer deletes later could not
	// tell the rows writers deleted from those it published, so writers
	// keep their rows. Before, they went on deleting.
	f.Exec(`ALTER PUBLICATION ` + slot + ` SET (publish = 'insert')`)
	require.False(t, deletesOnStore())
	kept := entry("E", 4)
	store(kept)
	require.Equal(t, 1, inTable(kept), "no deletes published: kept")
}

// A relay that claims what it streams (no writer deletes) still publishes
// rows their writers deleted in the transaction that inserted them, as
// writers with outbox.WithDeleteOnStore do while an OutboxRelay is
// switched away from writer deletes: it puts them back into the table and
// claims them with the rest, in commit order. A row deleted later, by
// another transaction, was published already and is not put back. A
// publication made before the relay published deletes is altered to.
func TestLogicalReplicationPublishesRowsTheirWritersDeleted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	slot := tableSlot(t, f)
	f.Exec(`CREATE PUBLICATION ` + slot + ` FOR TABLE outbox WITH (publish = 'insert')`)
	// Sweeps every few milliseconds while the rows arrive: none may publish
	// a kept row before the deleted one the stream puts back before it.
	cfg.FullRescanInterval = 5 * time.Millisecond
	startStreaming(t, cfg)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM pg_publication WHERE pubname = $1 AND pubdelete`, slot), "the relay made its publication publish deletes")

	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	var want []outbox.Entry // in commit order
	for i := range 10 {
		kept, gone := entry("E", 2*i), entry("E", 2*i+1)
		require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
			for _, e := range []outbox.Entry{gone, kept} {
				if err := w.Store(ctx, tx, e); err != nil {
					return err
				}
			}
			_, err := tx.Exec(ctx, `DELETE FROM outbox WHERE event_id = $1`, gone.EventID) // as a writer with writer deletes does
			return err
		}))
		want = append(want, gone, kept)
	}
	msgs := testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second)
	require.Len(t, msgs, len(want))
	for i, m := range msgs { // one partition: the topic's order is the relay's
		require.Equal(t, want[i].EventID, header(m, relay.HeaderEventID), "event %d in commit order", i)
		require.JSONEq(t, string(want[i].Payload), string(m.Value))
	}
	f.WaitDrained(0, 30*time.Second)
	require.Equal(t, len(want), f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`), "the deleted rows are back in the table, published")

	// A row deleted by a later transaction stays deleted and goes out once.
	f.Exec(`DELETE FROM outbox WHERE event_id = $1`, want[1].EventID)
	late := entry("E", 100)
	require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return w.Store(ctx, tx, late) }))
	msgs = testenv.Broker().Consume(t, f.Topics["E"], len(want)+1, 30*time.Second)
	require.Len(t, msgs, len(want)+1)
	require.Equal(t, late.EventID, header(msgs[len(want)], relay.HeaderEventID), "the next event, and no other")
	f.WaitDrained(0, 30*time.Second)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, want[1].EventID), "not put back")
	requireSlotConfirmedPastNow(t, f)
}

// The statements docs/migrating-from-debezium.md gives writers in other
// languages: its delete is the Go writer's (outbox.DeleteOnStoreCondition),
// and with a relay streaming with writer deletes the row is gone at commit
// and its event reaches Kafka with the row's headers (the guide's `id`
// header for consumers that de-duplicated by Debezium's).
func TestDebeziumGuideWriterSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	doc, err := os.ReadFile("../docs/migrating-from-debezium.md")
	require.NoError(t, err)
	_, block, ok := strings.Cut(string(doc), "<!-- writer-sql")
	require.True(t, ok, "the guide marks its writer statements")
	_, block, ok = strings.Cut(block, "```sql\n")
	require.True(t, ok)
	block, _, ok = strings.Cut(block, "```")
	require.True(t, ok)
	var stmts []string
	for _, s := range regexp.MustCompile(`;\s*(\n|$)`).Split(block, -1) { // the mark's literal holds a ';'
		if s = strings.Join(strings.Fields(s), " "); s != "" {
			stmts = append(stmts, s)
		}
	}
	require.Len(t, stmts, 2, "an insert and a delete")
	insert, del := stmts[0], stmts[1]
	require.Equal(t, strings.Join(strings.Fields(`DELETE FROM outbox WHERE event_id = $1 AND `+outbox.DeleteOnStoreConditionFor("$2", outbox.Table{Name: "outbox"})), " "), del,
		"the guide's delete is the Go writer's, whole: before, it left out the publication's conditions")

	f, cfg, _ := writerDeletesFixture(t, "E")
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	slot := tableSlot(t, f)
	id := outbox.NewEventID()
	require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, insert, id, "Order", "o1", "E", `{"total": 42}`, "o1", `{"id": "`+id+`"}`); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, del, id, slot)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("the delete removed %d rows", tag.RowsAffected())
		}
		return err
	}))
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the row is gone at commit")
	msgs := testenv.Broker().Consume(t, f.Topics["E"], 1, 30*time.Second)
	require.Len(t, msgs, 1)
	m := msgs[0]
	require.Equal(t, id, header(m, relay.HeaderEventID))
	require.Equal(t, id, header(m, "id"), "the row's own header")
	require.Equal(t, "o1", string(m.Key))
	require.JSONEq(t, `{"total": 42}`, string(m.Value))
}

// A relay with writer deletes streams only once it holds the slot's
// writer-deletes lock, which the writers test before they delete. While a
// session of some other kind holds it, the writers keep their rows and
// the relay polls them; once it is free, the relay streams and the writers
// delete.
func TestWriterDeletesStreamsOnceItHoldsItsLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, store := writerDeletesFixture(t, "E")
	slot := tableSlot(t, f)
	holder, err := f.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(ctx, `SELECT pg_advisory_lock_shared(`+outbox.WriterDeletesLock("$1::text")+`)`, slot)
	require.NoError(t, err)
	x := outboxtest.Start(t, cfg)
	inTable := func(e outbox.Entry) int {
		return f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID)
	}
	kept := entry("E", 1)
	store(kept)
	require.Equal(t, 1, inTable(kept), "no relay holds the lock: kept")
	require.Eventually(t, func() bool { return x.Published() >= 1 }, 20*time.Second, 20*time.Millisecond, "the relay polls what it cannot stream")
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_capture_streaming"), "not streaming without the lock")

	_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock_shared(`+outbox.WriterDeletesLock("$1::text")+`)`, slot)
	require.NoError(t, err)
	waitDeletesOnStore(t, f, 20*time.Second)
	deleted := entry("E", 2)
	store(deleted)
	require.Zero(t, inTable(deleted), "a relay with writer deletes streams: deleted at commit")
	seen := consumedIDs(t, f.Topics["E"], 2)
	require.True(t, seen[kept.EventID] && seen[deleted.EventID], "both events published")
}

// A row its writer kept (a writer without outbox.WithDeleteOnStore, or one
// that stored while no relay with writer deletes streamed) is in the table
// as well as on the stream: the relay claims it from the table, as a relay
// without writer deletes does, so it is published once and marked, and a
// sweep does not publish it again. Rows their writers deleted go out from
// the stream, and the topic keeps the commit order of both.
func TestWriterDeletesPublishesKeptRowsOnce(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	cfg.FullRescanInterval = time.Second // sweeps that would find what the stream left unmarked
	x := startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	plain, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	keep := func(e outbox.Entry) {
		require.NoError(t, pgx.BeginFunc(context.Background(), f.Pool, func(tx pgx.Tx) error { return plain.Store(context.Background(), tx, e) }))
	}
	var want []string
	for i := range 40 {
		e := entry("E", i)
		if i%4 < 2 {
			keep(e)
		} else {
			store(e)
		}
		want = append(want, e.EventID)
	}
	require.Equal(t, 20, f.Count(`SELECT count(*) FROM outbox`), "the plain writer's rows are in the table")
	f.WaitDrained(0, 30*time.Second)
	time.Sleep(2 * cfg.FullRescanInterval) // a sweep or two: they must find nothing unmarked
	requireSlotConfirmedPastNow(t, f)
	var got []string
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second) {
		got = append(got, header(m, relay.HeaderEventID))
	}
	require.Equal(t, want, got, "each event once, in commit order")
	require.Equal(t, 20, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`), "kept rows marked")
	_ = x
}

// Rows written while no relay streams, after the slot's position, are the
// stream's: the sweep when streaming starts leaves them, and the stream
// publishes them in commit order. (That sweep once claimed every row it
// found, so each kept row below went out before the deleted one committed
// before it, which only the stream has.)
func TestLogicalReplicationPublishesRowsWrittenWhileNoRelayStreamedInCommitOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg := captureFixture(t, 1, "E")
	x := startStreaming(t, cfg)
	x.Stop(t)
	waitSlotIdle(t, f)
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	var want []string // in commit order
	for i := range 10 {
		gone, kept := entry("E", 2*i), entry("E", 2*i+1)
		require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
			if err := w.Store(ctx, tx, gone); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `DELETE FROM outbox WHERE event_id = $1`, gone.EventID) // as a writer with writer deletes does
			return err
		}))
		require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return w.Store(ctx, tx, kept) }))
		want = append(want, gone.EventID, kept.EventID)
	}
	startStreaming(t, cfg)
	var got []string
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second) {
		got = append(got, header(m, relay.HeaderEventID))
	}
	require.Equal(t, want, got, "each event once, in commit order")
}

// A sweep never publishes a row ahead of an earlier one the stream has not
// read yet. Rows a writer kept are in the table, rows a writer deleted are
// in the stream only: a sweep that claimed every unpublished row it found
// would send a kept row out before a deleted one committed before it (a
// sweep runs between two transactions of the stream, and the writers go
// on meanwhile). Here sweeps run every few milliseconds while kept and
// deleted rows of three keys alternate, and each key's events must arrive
// in commit order.
func TestWriterDeletesSweepsNeverOvertakeTheStream(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	cfg.FullRescanInterval = 5 * time.Millisecond
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	plain, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	want := map[string][]string{} // each key's event ids in commit order
	const n = 300
	for i := range n {
		e := entry("E", i)
		if i%2 == 0 {
			require.NoError(t, pgx.BeginFunc(context.Background(), f.Pool, func(tx pgx.Tx) error { return plain.Store(context.Background(), tx, e) }))
		} else {
			store(e)
		}
		want[e.PartitionKey] = append(want[e.PartitionKey], e.EventID)
	}
	got := map[string][]string{}
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], n, 60*time.Second) {
		got[string(m.Key)] = append(got[string(m.Key)], header(m, relay.HeaderEventID))
	}
	require.Equal(t, want, got, "each key's events once, in commit order")
}

// With writer deletes a partitioned outbox's rows go out from the stream
// too (its publication publishes them as the table's own), in commit
// order, and the table stays empty.
func TestWriterDeletesStreamsAPartitionedTable(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	partitioned(t, f)
	cfg.FullRescanInterval = time.Hour // no sweep delivers what the stream skipped
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	want := storeEach(store, 20)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writer deleted every row")
	var got []string
	for _, m := range testenv.Broker().Consume(t, f.Topics["E"], len(want), 20*time.Second) {
		got = append(got, header(m, relay.HeaderEventID))
	}
	require.Equal(t, want, got, "each event once, in commit order")
	requireSlotConfirmedPastNow(t, f)
}

// A row put back after the table's columns changed goes in by column
// name: the stream decodes it with the columns it was written with, the
// table has another column now (with its default), and a record of the old
// shape would never cast to the new one: the relay would replay the same
// transaction for good, every later row stuck behind it.
func TestWriterDeletesPutsBackAcrossAColumnAdded(t *testing.T) {
	t.Parallel()
	f, cfg, _ := writerDeletesFixture(t, "E")
	x := startStreaming(t, cfg)
	x.Stop(t)
	waitSlotIdle(t, f)
	// Stored and deleted in one transaction, as a writer with writer
	// deletes does, with an event type the relay maps to no topic: it is
	// put back when the relay reads it.
	f.Exec(`BEGIN;
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT gen_random_uuid(), 'Order', 'o1', 'Unmapped', '{"n": 1}', 'o1' FROM generate_series(1, 5);
		DELETE FROM outbox WHERE event_type = 'Unmapped';
		COMMIT`)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`))
	f.Exec(`ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'none'`)
	outboxtest.Start(t, cfg)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE event_type = 'Unmapped' AND tenant = 'none' AND published_at IS NULL`) == 5
	}, 20*time.Second, 50*time.Millisecond, "the rows are back in the table, the new column at its default")
	requireSlotConfirmedPastNow(t, f)
}

// A table swapped in by a rename while a relay with writer deletes streams
// is in no publication, so its rows are in no stream: the writers keep
// them in the table for the relays to claim. Before, the writers' test
// looked only at the slot and its lock, and deleted every row stored in
// the new table: events in no table and no stream.
func TestWriterDeletesKeepRowsOfATableSwappedIn(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	storeEach(store, 2)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "deleted on store while the relay streams")

	f.Exec(`CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL)`)
	f.Exec(`ALTER TABLE outbox RENAME TO outbox_old; ALTER TABLE outbox_new RENAME TO outbox`)
	on, err := outbox.DeletesOnStore(context.Background(), f.Pool, outbox.Table{Name: "outbox"})
	require.NoError(t, err)
	require.False(t, on, "the new table is in no publication")
	storeEach(store, 5)
	require.Equal(t, 5, f.Count(`SELECT count(*) FROM outbox`), "kept: the stream does not carry them")
}

// A publication changed by hand so that it no longer carries the table's
// inserts as the stream reads them (inserts not published, a row filter,
// or a partitioned table's published under its partitions' names) makes the
// writers keep their rows, for the relays to claim: the stream would leave
// them out, and they would be in no table and no stream it reads. Before,
// the writers deleted them.
func TestWriterDeletesKeepRowsThePublicationNoLongerCarries(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	partitioned(t, f)
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	var db string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT current_database()`).Scan(&db))
	pub := pgx.Identifier{outbox.SlotName(db, outbox.Table{Name: "outbox"})}.Sanitize()
	deletes := func() bool {
		on, err := outbox.DeletesOnStore(context.Background(), f.Pool, outbox.Table{Name: "outbox"})
		require.NoError(t, err)
		return on
	}

	f.Exec(`ALTER PUBLICATION ` + pub + ` SET (publish_via_partition_root = false)`)
	require.False(t, deletes(), "its partitions' names are not the stream's")
	storeEach(store, 2)
	require.Equal(t, 2, f.Count(`SELECT count(*) FROM outbox`), "kept for the relays to claim")

	f.Exec(`ALTER PUBLICATION ` + pub + ` SET (publish_via_partition_root = true, publish = 'update, delete')`)
	require.False(t, deletes(), "no inserts published")

	f.Exec(`ALTER PUBLICATION ` + pub + ` SET (publish = 'insert, delete')`)
	require.True(t, deletes(), "as the relay made it")

	f.Exec(`ALTER PUBLICATION ` + pub + ` SET TABLE outbox WHERE (id > 100)`)
	require.False(t, deletes(), "only some rows published")
	f.Exec(`ALTER PUBLICATION ` + pub + ` SET TABLE outbox`)
	require.True(t, deletes())
}

// A table dropped and made again under a streaming relay with writer
// deletes, then published again (here by a replica starting, whose
// start-up check adds it to the publication; a DBA's ALTER PUBLICATION
// does the same): the writers delete again on store, and the stream takes
// the new table's inserts. Before, it took only the relation it read at
// its own start, so their events were in no table and no slot: 2 of 7
// reached Kafka, with nothing logged.
func TestWriterDeletesTableMadeAgainAndPublishedIsStreamed(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	storeEach(store, 2)
	testenv.Broker().Consume(t, f.Topics["E"], 2, 30*time.Second)

	f.Exec(`CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL)`)
	f.Exec(`DROP TABLE outbox`)
	f.Exec(`ALTER TABLE outbox_new RENAME TO outbox`)
	standby := cfg
	standby.Logger = slog.New(slog.DiscardHandler)
	outboxtest.Start(t, standby) // its start-up check publishes the new table
	waitDeletesOnStore(t, f, 10*time.Second)
	storeEach(store, 5)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writers deleted them")
	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], 7, 30*time.Second, time.Second)
	require.NoError(t, err)
	require.Len(t, msgs, 7, "the 5 events stored in the new table reach Kafka")
	require.Contains(t, logs.String(), "the table was replaced by another of its name")
}

// A table renamed away and made again under a streaming relay with writer
// deletes, whose earlier table then changes (a cleanup after the
// migration): the stream goes on taking the new table's inserts. pgoutput
// describes the earlier table again before its change, and not the new
// one after it. Before, the stream kept only the last table described and
// left the new table's inserts out: their events were in no table, and 7
// of 10 reached Kafka.
func TestWriterDeletesNewTableIsStreamedAfterTheEarlierOneChanges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, store := writerDeletesFixture(t, "E")
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	storeEach(store, 2)
	testenv.Broker().Consume(t, f.Topics["E"], 2, 30*time.Second)

	f.Exec(`CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL)`)
	f.Exec(`ALTER TABLE outbox RENAME TO outbox_old`)
	f.Exec(`ALTER TABLE outbox_new RENAME TO outbox`)
	f.Exec(`ALTER PUBLICATION ` + tableSlot(t, f) + ` ADD TABLE outbox`) // as a DBA would
	waitDeletesOnStore(t, f, 10*time.Second)
	storeEach(store, 5)
	testenv.Broker().Consume(t, f.Topics["E"], 7, 30*time.Second)

	old, err := outbox.NewWriter("outbox_old") // a change to the earlier table, kept there
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return old.Store(ctx, tx, entry("E", 9)) }))
	f.Exec(`DELETE FROM outbox_old`)
	later := storeEach(store, 3)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writers deleted them")
	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], 10, 30*time.Second, time.Second)
	require.NoError(t, err)
	require.Len(t, msgs, 10, "the 3 events stored after the earlier table's change reach Kafka, and the one kept there does not")
	for i, id := range later {
		require.Equal(t, id, header(msgs[7+i], relay.HeaderEventID))
	}
}

// A relay that starts (a restart, a standby taking over) after the table
// was replaced, while the slot still holds inserts of the earlier table
// that no relay confirmed, publishes the rows their writers deleted: they
// are in no table. Here the earlier relay stops as one killed would, after
// the writers deleted their rows and before it confirmed them; the new
// table's ids start over. One such row the relay cannot publish (its type
// has no topic) goes back into the new table, whose row of its id is
// another event's: under a new id. Before, the stream left the earlier
// table's inserts out (0 of the 3 events reached Kafka), and a put-back
// whose id was taken was left out of the table (the event was lost).
func TestWriterDeletesPublishesAnEarlierTablesRowsAfterARestart(t *testing.T) {
	t.Parallel()
	earlierTableAfterRestart(t, true)
}

// The same with writer deletes switched off for the relay that starts (the
// OutboxRelay changed to writerDeletes: false right after the table was
// replaced): it puts the rows the writers deleted back into the table now,
// as it does the table's own, and publishes them. Before, a relay without
// writer deletes took only the table it found, and those events were lost
// (0 of the 3 reached Kafka).
func TestEarlierTablesDeletedRowsArePublishedAfterWriterDeletesAreSwitchedOff(t *testing.T) {
	t.Parallel()
	earlierTableAfterRestart(t, false)
}

// earlierTableAfterRestart stores events with writer deletes while no
// relay confirms them, replaces the table, and starts a relay, with
// writer deletes when writerDeletes, that must publish them.
func earlierTableAfterRestart(t *testing.T, writerDeletes bool) {
	t.Helper()
	ctx := context.Background()
	f, cfg, store := writerDeletesFixture(t, "E")
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	x := startStreaming(t, cfg) // makes the slot and the publication
	x.Stop(t)
	waitSlotIdle(t, f)

	// A relay that streams and never confirms: it holds the writer-deletes
	// lock on its replication session, as a relay does.
	slot := tableSlot(t, f)
	conf, err := pgconn.ParseConfig(f.DSN)
	require.NoError(t, err)
	conf.RuntimeParams["replication"] = "database"
	stream, err := pgconn.ConnectConfig(ctx, conf)
	require.NoError(t, err)
	_, err = stream.Exec(ctx, `SELECT pg_advisory_lock(`+outbox.WriterDeletesLock(outbox.QuoteLiteral(slot))+`)`).ReadAll()
	require.NoError(t, err)
	require.NoError(t, pglogrepl.StartReplication(ctx, stream, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + slot + "'"}}))
	waitDeletesOnStore(t, f, 10*time.Second)
	earlier := []outbox.Entry{entry("E", 1), entry("Unmapped", 2), entry("E", 3), entry("E", 4)}
	for _, e := range earlier {
		store(e)
	}
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writers deleted them")
	keeps, err := outbox.NewWriter("outbox") // a writer without writer deletes
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return keeps.Store(ctx, tx, entry("E", 5)) }))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox`), "kept, in the earlier table")
	require.NoError(t, stream.Close(ctx))
	waitSlotIdle(t, f)

	f.Exec(`CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL)`) // its ids start at 1 again
	f.Exec(`DROP TABLE outbox`)
	f.Exec(`ALTER TABLE outbox_new RENAME TO outbox`)
	later := storeEach(store, 5) // kept: no relay streams; the last has the id of the row kept in the earlier table
	require.Equal(t, 5, f.Count(`SELECT count(*) FROM outbox WHERE id <= 5`))

	cfg.WriterDeletes = writerDeletes
	outboxtest.Start(t, cfg)
	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], 8, 30*time.Second, 3*time.Second) // and nothing more for 3 s
	require.NoError(t, err)
	require.Len(t, msgs, 8, "each event once; the row kept in the earlier table went with it")
	seen, order := map[string]bool{}, []string(nil)
	for _, m := range msgs {
		id := header(m, relay.HeaderEventID)
		seen[id] = true
		if slices.Contains(later, id) {
			order = append(order, id)
		}
	}
	// A claim of the kept row's id would find the new table's row of that
	// id, which must go out in its own place, after the rows of its key
	// stored before it.
	require.Equal(t, later, order, "the new table's rows in the order they were stored")
	for _, id := range append([]string{earlier[0].EventID, earlier[2].EventID, earlier[3].EventID}, later...) {
		require.True(t, seen[id], "event %s published", id)
	}
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1 AND published_at IS NULL AND id > 5`, earlier[1].EventID) == 1
	}, 30*time.Second, 50*time.Millisecond, "the row without a topic is back in the table, under a new id")
	require.Equal(t, 5, f.Count(`SELECT count(*) FROM outbox WHERE id <= 5 AND event_id = ANY($1)`, later), "the new table's rows keep their ids")
	require.Contains(t, logs.String(), "the stream reads inserts of an earlier table of the table's name")
	require.Contains(t, logs.String(), "rows their writers kept in an earlier table of the table's name stay there")
}

// Two rows of one id in what the stream publishes at once (the table's ids
// started over between them: ALTER … RESTART, TRUNCATE … RESTART
// IDENTITY) go out in batches of their own: each is published, or put
// back, for itself. Before, one batch took both, the one published stood
// for the other, and the other, which had no topic, was neither published
// nor put back: in no table.
func TestWriterDeletesRowsOfOneIdAreEachPublishedOrPutBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, cfg, _ := writerDeletesFixture(t, "E")
	startStreaming(t, cfg)
	waitDeletesOnStore(t, f, 10*time.Second)
	published, unmapped := entry("E", 1), entry("Unmapped", 2)
	w, err := outbox.NewWriter("outbox", outbox.WithDeleteOnStore())
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { // one transaction: one flush
		if err := w.Store(ctx, tx, published); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `ALTER TABLE outbox ALTER COLUMN id RESTART WITH 1`); err != nil {
			return err
		}
		return w.Store(ctx, tx, unmapped)
	}))
	require.True(t, consumedIDs(t, f.Topics["E"], 1)[published.EventID])
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1 AND published_at IS NULL`, unmapped.EventID) == 1
	}, 30*time.Second, 50*time.Millisecond, "the row without a topic is back in the table")
}

// A row the stream must put back whose partition was dropped (by hand, or
// by a partition manager) gets a partition again: the relay attaches one
// over the stretch between the partitions around its created_at, with the
// storage settings of every partition the DDL's partitions function makes,
// puts the row back there, and the rows behind it go out. (Before, the
// put-back failed at every retry, and nothing behind it was published; and
// the partition came without the autovacuum settings of a queue table.)
func TestWriterDeletesPutsARowBackWhosePartitionWasDropped(t *testing.T) {
	t.Parallel()
	f, cfg, _ := writerDeletesFixture(t, "E")
	today := partitioned(t, f)
	addDay(f, "outbox_d2", today.Add(-48*time.Hour))
	addDay(f, "outbox_d3", today.Add(-72*time.Hour))
	startStreaming(t, cfg).Stop(t) // makes the slot
	waitSlotIdle(t, f)
	write := func(key, eventType, createdAt string) {
		f.Exec(`BEGIN;
			INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
			VALUES (gen_random_uuid(), 'Order', '` + key + `', '` + eventType + `', '{}', '` + key + `', ` + createdAt + `);
			DELETE FROM outbox WHERE partition_key = '` + key + `';
			COMMIT`)
	}
	write("o1", "E", "now()")
	write("o2", "Unmapped", today.Add(-36*time.Hour).UTC().Format("'2006-01-02 15:04:05+00'"))
	write("o3", "E", "now()")
	f.Exec(`DROP TABLE outbox_d2`)
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	run(t, cfg, nil)
	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], 2, 30*time.Second, time.Second)
	require.NoError(t, err)
	require.Len(t, msgs, 2, "the rows around the one put back go out:\n%s", &logs)
	require.Equal(t, []string{"o1", "o3"}, []string{string(msgs[0].Key), string(msgs[1].Key)})
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE partition_key = 'o2' AND published_at IS NULL`), "the row is back")
	var bound string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'outbox'::regclass AND c.oid = (SELECT tableoid FROM outbox WHERE partition_key = 'o2')`).Scan(&bound))
	lit := func(t time.Time) string { return t.UTC().Format("'2006-01-02 15:04:05+00'") }
	require.Equal(t, "FOR VALUES FROM ("+lit(today.Add(-48*time.Hour))+") TO ("+lit(today)+")", bound, "the partition spans the stretch no partition covered")
	var restored, made []string
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT reloptions FROM pg_class
		WHERE oid = (SELECT tableoid FROM outbox WHERE partition_key = 'o2')`).Scan(&restored))
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT reloptions FROM pg_class WHERE oid = $1::regclass`,
		"outbox_p"+today.UTC().Format("20060102")).Scan(&made))
	require.NotEmpty(t, made)
	require.Equal(t, made, restored, "the partition has the autovacuum settings of those the partitions function makes")
	requireSlotConfirmedPastNow(t, f)
}

// Rows a failed streamed batch put back are published again from the table
// before anything the stream delivers later, all of them, also when the
// claim's byte budget takes only some at a time: the table measures a row
// by its stored size, which for a jsonb array of small numbers is several
// times its text, the size the stream's batch is cut by. Before, the rows
// past the first claim were left to the sweep, seconds later, and the
// key's next event went out before them.
func TestWriterDeletesRetriesEveryRowPutBackBeforeLaterOnes(t *testing.T) {
	t.Parallel()
	f, cfg, store := writerDeletesFixture(t, "E")
	w := &keyFailWriter{w: newKafkaWriter(t), key: "k"}
	w.failing.Store(true)
	cfg.BatchSize, cfg.MaxBatchBytes = 100, relayconfig.MinMaxBatchBytes
	x := run(t, cfg, w)
	waitDeletesOnStore(t, f, 30*time.Second)
	// 100 events of key k in one transaction: 36 KB of text, some 150 KB
	// stored.
	array := "[" + strings.TrimSuffix(strings.Repeat("1, ", 120), ", ") + "]"
	var entries []outbox.Entry
	var want []string
	for range 100 {
		e := outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order", AggregateID: "k", EventType: "E", Payload: []byte(array), PartitionKey: "k"}
		entries = append(entries, e)
		want = append(want, e.EventID)
	}
	store(entries...)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_publish_errors_total", "reason", "transient") > 0
	},
		30*time.Second, 10*time.Millisecond, "the batch failed")
	require.Eventually(t, func() bool { return f.Count(`SELECT count(*) FROM outbox`) == len(entries) }, 30*time.Second, 10*time.Millisecond, "put back")
	require.Greater(t, f.Count(`SELECT min(pg_column_size(payload)) FROM outbox`), 3*len(array), "stored larger than its text")
	w.failing.Store(false)
	later := outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order", AggregateID: "k", EventType: "E", Payload: []byte(`{}`), PartitionKey: "k"}
	store(later)
	want = append(want, later.EventID)

	order := keyOrder(testenv.Broker().Consume(t, f.Topics["E"], len(want), 30*time.Second), "k")
	require.Equal(t, len(want)-1, slices.Index(order, later.EventID), "the later event goes out last")
	require.Equal(t, want, order, "the key's events in commit order")
}

// A streamed row whose payload and headers column together exceed the
// largest record its topic takes, though its record fits (the column's
// JSON spells each header with more bytes than the record carries), is
// published, as a claim would publish it: it is judged too large by its
// payload alone, as a claim judges it, and then by its record. Before,
// it was held as too large "without reading" its payload, and published
// only once the hold ended and the table's sweep claimed it.
func TestWriterDeletesJudgesARowBySizeAsAClaimDoes(t *testing.T) {
	t.Parallel()
	const limit = 4000
	f, cfg, store := writerDeletesFixture(t, "E")
	c := faultCluster(t, 1, limit, "small")
	cfg.Brokers, cfg.Topics, cfg.HeldRetryInterval = c.ListenAddrs(), map[string]string{"E": "small"}, time.Hour
	x := startStreaming(t, cfg)
	e := entry("E", 1)
	e.Payload = fmt.Appendf(nil, `{"pad": "%s"}`, strings.Repeat("x", 3300))
	e.Headers = map[string]string{}
	for i := range outbox.MaxHeaders - 4 {
		e.Headers[fmt.Sprintf("h%02d", i)] = "v"
	}
	headers, err := json.Marshal(e.Headers)
	require.NoError(t, err)
	var columns int
	require.NoError(t, f.Pool.QueryRow(context.Background(), `SELECT octet_length($1::jsonb::text) + octet_length($2::jsonb::text)`,
		string(e.Payload), string(headers)).Scan(&columns))
	require.Greater(t, columns, limit, "the columns' text together is over the topic's limit")
	store(e)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox`), "the writer deleted the row")
	got := readTopics(t, c.ListenAddrs(), 1, "small")
	require.Len(t, got, 1)
	require.Equal(t, e.EventID, got[0].eventID)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge))

	// The relay judged by the topic's limit, not a guess: a payload over it
	// alone is held.
	over := entry("E", 2)
	over.Payload = fmt.Appendf(nil, `{"pad": "%s"}`, strings.Repeat("x", limit))
	store(over)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge) == 1
	}, 20*time.Second, 50*time.Millisecond, "a payload over the topic's limit alone is held")
	held, err := relay.ListHeld(context.Background(), f.Pool, outbox.Table{Name: "outbox"}, relay.HeldFilter{All: true}, 10)
	require.NoError(t, err)
	require.Len(t, held, 1)
	require.Contains(t, held[0].Error, fmt.Sprintf("a payload of %d bytes", len(`{"pad": ""}`)+limit), "it says what was measured")
}
