package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// partitionedFixture replaces the fixture's outbox with the partitioned DDL
// (day partitions: today's in UTC and ahead more).
func partitionedFixture(t *testing.T, ahead int) *outboxtest.Fixture {
	f := outboxtest.NewFixture(t, 1)
	f.Exec(`DROP TABLE outbox`)
	f.Exec(outbox.PartitionedSchemaDDL(outbox.Table{Name: "outbox"}, outbox.PartitionDay, ahead))
	return f
}

func storeWith(t *testing.T, f *outboxtest.Fixture, w *outbox.Writer, e outbox.Entry) error {
	t.Helper()
	ctx := context.Background()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	if err := w.Store(ctx, tx, e); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// On a partitioned outbox event_id stays unique across partitions: a
// retried store is a no-op and another event under the id is refused,
// whichever partition holds the stored row and whatever created_at each
// store has; the id is remembered after the row is deleted, for as long as
// a partition covers its created_at.
func TestStoreOnPartitionedTable(t *testing.T) {
	t.Parallel()
	f := partitionedFixture(t, 1)
	f.Exec(`CREATE TABLE outbox_yesterday PARTITION OF outbox FOR VALUES
		FROM (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '1 day')
		TO (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')`)
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)

	e := entry()
	e.Headers = map[string]string{"tenant": "t1"}
	require.NoError(t, storeWith(t, f, w, e))
	require.NoError(t, storeWith(t, f, w, e), "a retried store is a no-op")
	same := e
	same.Payload = []byte(`{ "a" : 1 }`) // the same JSON, spelled otherwise
	require.NoError(t, storeWith(t, f, w, same))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_event_ids WHERE event_id = $1`, e.EventID))
	for name, mutate := range map[string]func(*outbox.Entry){
		"payload":       func(x *outbox.Entry) { x.Payload = []byte(`{"a":2}`) },
		"event type":    func(x *outbox.Entry) { x.EventType = "OrderShipped" },
		"partition key": func(x *outbox.Entry) { x.PartitionKey = "o2" },
		"headers":       func(x *outbox.Entry) { x.Headers = map[string]string{"tenant": "t2"} },
	} {
		other := e
		mutate(&other)
		require.ErrorIs(t, storeWith(t, f, w, other), outbox.ErrEventIDConflict, name)
	}

	// The stored row moves to yesterday's partition: a store today still
	// finds its id (a unique index on (event_id, created_at) would not).
	f.Exec(`UPDATE outbox SET created_at = created_at - interval '1 day' WHERE event_id = $1`, e.EventID)
	f.Exec(`UPDATE outbox_event_ids SET created_at = created_at - interval '1 day' WHERE event_id = $1`, e.EventID)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_yesterday WHERE event_id = $1`, e.EventID))
	require.NoError(t, storeWith(t, f, w, e))
	other := e
	other.Payload = []byte(`{"a":3}`)
	require.ErrorIs(t, storeWith(t, f, w, other), outbox.ErrEventIDConflict)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID))

	// Deleted (as --on-publish delete does): the id is still remembered.
	f.Exec(`DELETE FROM outbox WHERE event_id = $1`, e.EventID)
	require.NoError(t, storeWith(t, f, w, e))
	require.ErrorIs(t, storeWith(t, f, w, other), outbox.ErrEventIDConflict)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID))

	// A table without the headers column works too.
	f.Exec(`ALTER TABLE outbox DROP COLUMN headers`)
	w2, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	plain := entry()
	require.NoError(t, storeWith(t, f, w2, plain))
	require.NoError(t, storeWith(t, f, w2, plain))
	plain.AggregateID = "o9"
	require.ErrorIs(t, storeWith(t, f, w2, plain), outbox.ErrEventIDConflict)
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, plain.EventID))
}

// Two transactions storing one event id at once, each with its own
// created_at: the second waits for the first and then stores nothing (the
// same entry) or is refused (another one). One row in the end.
func TestConcurrentStoresOnPartitionedTable(t *testing.T) {
	t.Parallel()
	f := partitionedFixture(t, 1)
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	ctx := context.Background()
	for _, sameEntry := range []bool{true, false} {
		e := entry()
		second := e
		if !sameEntry {
			second.Payload = []byte(`{"other":true}`)
		}
		first, err := f.Pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, w.Store(ctx, first, e))
		time.Sleep(5 * time.Millisecond) // the second transaction's now() is later
		done := make(chan error, 1)
		go func() { done <- storeWith(t, f, w, second) }()
		select {
		case err := <-done:
			t.Fatalf("the second store did not wait for the first transaction: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		require.NoError(t, first.Commit(ctx))
		err = <-done
		if sameEntry {
			require.NoError(t, err)
		} else {
			require.ErrorIs(t, err, outbox.ErrEventIDConflict)
		}
		require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE event_id = $1`, e.EventID))
	}
}

// The writer says what is missing: the event-id table, or a partition for now().
func TestStoreOnPartitionedTableSaysWhatIsMissing(t *testing.T) {
	t.Parallel()
	f := partitionedFixture(t, 1)
	f.Exec(`DROP TABLE outbox_event_ids`)
	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	err = storeWith(t, f, w, entry())
	require.ErrorContains(t, err, `"outbox_event_ids"`)
	require.ErrorContains(t, err, "relay schema --partitioned")

	f.Exec(`DROP TABLE outbox`)
	f.Exec(outbox.PartitionedSchemaDDL(outbox.Table{Name: "outbox"}, outbox.PartitionDay, 1))
	rows, err := f.Pool.Query(context.Background(), `SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'outbox'::regclass`)
	require.NoError(t, err)
	parts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, parts, 2)
	for _, p := range parts {
		f.Exec(`DROP TABLE ` + p)
	}
	w, err = outbox.NewWriter("outbox")
	require.NoError(t, err)
	err = storeWith(t, f, w, entry())
	require.ErrorContains(t, err, "no partition of")
	require.ErrorContains(t, err, `SELECT "outbox_add_partitions"()`)
	require.Zero(t, f.Count(`SELECT count(*) FROM outbox_event_ids`), "the failed store left no event id")
}

// The DDL's partition function lays out contiguous partitions from the
// current period on, for every period, with the queue table's vacuum
// settings, and adds partitions while writers and a claim hold their locks.
func TestAddPartitionsFunction(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	for _, period := range outbox.PartitionPeriods {
		table := outbox.Table{Schema: "p_" + string(period), Name: "outbox"}
		f.Exec(outbox.PartitionedSchemaDDL(table, period, 3))
		rows, err := f.Pool.Query(ctx, `
			SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\)'))[1]::timestamptz,
			       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']*)''\)'))[1]::timestamptz,
			       array_to_string(c.reloptions, ',')
			FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
			WHERE i.inhparent = $1::regclass ORDER BY 1`, table.Quoted())
		require.NoError(t, err)
		type part struct {
			Lo, Hi time.Time
			Opts   string
		}
		parts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[part])
		require.NoError(t, err)
		require.Len(t, parts, 4, period)
		now := time.Now()
		require.False(t, parts[0].Lo.After(now), "%s: the first partition covers now", period)
		require.True(t, parts[0].Hi.After(now), period)
		for i, p := range parts {
			require.Contains(t, p.Opts, "autovacuum_vacuum_scale_factor=0.01", period)
			require.Contains(t, p.Opts, "fillfactor=90", period)
			if i > 0 {
				require.Equal(t, parts[i-1].Hi, p.Lo, "%s: contiguous", period)
			}
			lo := p.Lo.UTC()
			switch period {
			case outbox.PartitionHour:
				require.Equal(t, time.Hour, p.Hi.Sub(p.Lo))
				require.Zero(t, lo.Minute())
			case outbox.PartitionWeek:
				require.Equal(t, time.Monday, lo.Weekday())
				require.Equal(t, 7*24*time.Hour, p.Hi.Sub(p.Lo))
			case outbox.PartitionMonth:
				require.Equal(t, 1, lo.Day())
				require.Equal(t, lo.AddDate(0, 1, 0), p.Hi.UTC())
			default:
				require.Equal(t, 24*time.Hour, p.Hi.Sub(p.Lo))
			}
			if period != outbox.PartitionHour {
				require.Zero(t, lo.Hour(), "%s: starts at midnight UTC", period)
			}
		}
	}

	// Adding partitions waits for no writer and no claim.
	day := outbox.Table{Schema: "p_day", Name: "outbox"}
	writer, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	w, err := outbox.NewWriter(day.String())
	require.NoError(t, err)
	require.NoError(t, w.Store(ctx, writer, entry()))
	claim, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer claim.Rollback(ctx)
	_, err = claim.Exec(ctx, `SELECT id FROM p_day.outbox WHERE published_at IS NULL ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED`)
	require.NoError(t, err)
	conn, err := f.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	// A wait for the writer's or the claim's locks would end the call.
	_, err = conn.Exec(ctx, `SET statement_timeout = '5s'`)
	require.NoError(t, err)
	var made int
	require.NoError(t, conn.QueryRow(ctx, fmt.Sprintf(`SELECT %s(5)`, day.AddPartitionsFunction().Quoted())).Scan(&made))
	require.Equal(t, 2, made)
	require.NoError(t, conn.QueryRow(ctx, fmt.Sprintf(`SELECT %s(5)`, day.AddPartitionsFunction().Quoted())).Scan(&made))
	require.Zero(t, made, "partitions that exist are left alone")
	require.NoError(t, writer.Commit(ctx))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM p_day.outbox`))

	// Partitions of another name or period (here the DDL's own under
	// --partition-period day, then hour) keep what they cover, and every
	// stretch they leave gets a partition. Before, the first overlap failed
	// the whole call, every time, and no partition ahead was made: writers
	// failed once the last one ended.
	f.Exec(outbox.PartitionedSchemaDDL(day, outbox.PartitionHour, 0))
	// In one statement, so that the hour the function starts at is the
	// hour the count starts at: the hours to the end of the day partitions,
	// and two more.
	require.NoError(t, f.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT %s((SELECT extract(epoch FROM max(upper) - date_trunc('hour', now() AT TIME ZONE 'UTC'))::int / 3600 + 2 FROM (
		SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']*)''\)'))[1]::timestamptz AT TIME ZONE 'UTC' AS upper
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'p_day.outbox'::regclass) b))`, day.AddPartitionsFunction().Quoted())).Scan(&made))
	require.Equal(t, 3, made, "the hours after the day partitions")
	require.Equal(t, 3, f.Count(`SELECT count(*) FROM pg_inherits WHERE inhparent = 'p_day.outbox'::regclass AND inhrelid::regclass::text ~ '^p_day\.outbox_p[0-9]{10}$'`), "hour partitions")

	// The other way round: hour partitions cover part of today, and the day
	// DDL fills today's stretches before and after them, then tomorrow.
	// Every half hour of both days takes a row.
	mix := outbox.Table{Schema: "p_mix", Name: "outbox"}
	f.Exec(outbox.PartitionedSchemaDDL(mix, outbox.PartitionHour, 2))
	// Run where bounds print otherwise: the function reads them in ISO and UTC.
	styled, err := f.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer styled.Release()
	_, err = styled.Exec(ctx, `SET datestyle = 'German'; SET timezone = 'Asia/Kolkata'`)
	require.NoError(t, err)
	_, err = styled.Exec(ctx, outbox.PartitionedSchemaDDL(mix, outbox.PartitionDay, 1))
	require.NoError(t, err)
	_, err = styled.Exec(ctx, `RESET datestyle; RESET timezone`)
	require.NoError(t, err)
	require.Zero(t, f.Count(`SELECT count(*) FROM generate_series(date_trunc('day', now() AT TIME ZONE 'UTC'),
			date_trunc('day', now() AT TIME ZONE 'UTC') + interval '47 hours 30 minutes', interval '30 minutes') t
		WHERE NOT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'p_mix.outbox'::regclass
			AND t >= (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\)'))[1]::timestamptz AT TIME ZONE 'UTC'
			AND t < (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']*)''\)'))[1]::timestamptz AT TIME ZONE 'UTC')`),
		"no stretch of today or tomorrow without a partition")
	f.Exec(`INSERT INTO p_mix.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
		SELECT gen_random_uuid(), 'Order', 'o', 'E', '{}', 'o', t AT TIME ZONE 'UTC'
		FROM generate_series(date_trunc('day', now() AT TIME ZONE 'UTC'),
			date_trunc('day', now() AT TIME ZONE 'UTC') + interval '47 hours 30 minutes', interval '30 minutes') t`)
	require.Equal(t, 96, f.Count(`SELECT count(*) FROM p_mix.outbox`))
}

// scannedRelations are the outbox's relations (its partitions) a JSON plan
// (EXPLAIN (FORMAT JSON)) reads, each with the node type that reads it; the
// catalogs the delete condition reads are left out.
func scannedRelations(t *testing.T, plan string) map[string]string {
	t.Helper()
	var doc []struct{ Plan map[string]any }
	require.NoError(t, json.Unmarshal([]byte(plan), &doc), plan)
	require.Len(t, doc, 1)
	got := map[string]string{}
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		if rel, ok := n["Relation Name"].(string); ok && n["Node Type"] != "ModifyTable" && strings.HasPrefix(rel, "outbox") {
			got[rel] = n["Node Type"].(string)
		}
		children, _ := n["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any))
		}
	}
	walk(doc[0].Plan)
	return got
}

// A writer with WithDeleteOnStore deletes its row through an index: on a
// partitioned outbox (which has no index on event_id) by the primary key in
// the one partition that holds the row, which is also the only partition it
// locks, so it waits for no lock on another one; on a plain outbox by the
// unique index on event_id. The statement is the one Store sends, with its
// arguments, on tables of 1,000 analyzed rows a partition.
func TestDeleteOnStoreDeletesByIndexInOnePartition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 1)
			today := "outbox"
			if partitioned {
				f.Exec(`DROP TABLE outbox`)
				f.Exec(outbox.PartitionedSchemaDDL(outbox.Table{Name: "outbox"}, outbox.PartitionDay, 1))
				f.Exec(`CREATE TABLE outbox_yesterday PARTITION OF outbox FOR VALUES
					FROM (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '1 day')
					TO (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')`)
				require.NoError(t, f.Pool.QueryRow(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
					WHERE i.inhparent = 'outbox'::regclass AND c.relname <> 'outbox_yesterday' ORDER BY 1 LIMIT 1`).Scan(&today))
				for _, day := range []string{"-1", "0", "1"} {
					f.Exec(`WITH r AS (
						INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at)
						SELECT gen_random_uuid(), 'Order', 'o', 'E', '{}', 'o', now() + $1::int * interval '1 day'
						FROM generate_series(1, 1000)
						RETURNING event_id, created_at)
						INSERT INTO outbox_event_ids SELECT event_id, created_at, '\x00' FROM r`, day)
				}
			} else {
				f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
					SELECT gen_random_uuid(), 'Order', 'o', 'E', '{}', 'o' FROM generate_series(1, 3000)`)
			}
			f.Exec(`ANALYZE`)
			w, err := outbox.NewWriter("outbox", outbox.WithDeleteOnStore())
			require.NoError(t, err)

			var plans []string
			require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
				return w.Store(ctx, &hookTx{Tx: tx, before: func(ctx context.Context, sql string, args []any) {
					if isDelete(sql) {
						var plan string
						require.NoError(t, tx.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+sql, args...).Scan(&plan))
						plans = append(plans, plan)
					}
				}}, entry())
			}))
			require.Len(t, plans, 1, "one delete")
			scanned := scannedRelations(t, plans[0])
			require.Len(t, scanned, 1, "one relation read: %s", plans[0])
			require.Contains(t, []string{"Index Scan", "Index Only Scan"}, scanned[today], "read by index: %s", plans[0])

			if !partitioned {
				return
			}
			// Another partition locked: stores go on, on one connection
			// past the statement cache's first plans.
			other, err := f.Pool.Begin(ctx)
			require.NoError(t, err)
			defer other.Rollback(ctx)
			_, err = other.Exec(ctx, `LOCK TABLE outbox_yesterday IN ACCESS EXCLUSIVE MODE`)
			require.NoError(t, err)
			conn, err := f.Pool.Acquire(ctx)
			require.NoError(t, err)
			defer conn.Release()
			for i := range 10 {
				require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '2s'`); err != nil {
						return err
					}
					return w.Store(ctx, tx, entry())
				}), "store %d", i)
			}
		})
	}
}

// The writer takes every payload column type the relay reads (jsonb, json,
// text, bytea), on a plain and on a partitioned table: it stores the
// payload as given (jsonb as JSON), a retried store is a no-op and
// another payload under the id is ErrEventIDConflict. json compares as
// JSON, as jsonb does, and so does text on a partitioned table (as its
// digest always has); bytea, and text on a plain table, byte for byte.
// Another type is refused, named.
func TestStoreWithEachPayloadColumnType(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	using := map[string]string{"jsonb": "payload", "json": "payload::json", "text": "payload::text", "bytea": "convert_to(payload::text, 'UTF8')"}
	// The DSN's default_query_exec_mode (exec and simple_protocol are
	// usual behind PgBouncer) leaves pgx to type a parameter by its Go
	// value: a payload passed as []byte went as bytea, so a text column
	// stored its hex form and json and jsonb refused it.
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		cfg := f.Pool.Config()
		cfg.ConnConfig.DefaultQueryExecMode = mode
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()
		store := func(w *outbox.Writer, e outbox.Entry) error {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			if err := w.Store(ctx, tx, e); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
		for _, partitioned := range []bool{false, true} {
			for _, typ := range []string{"jsonb", "json", "text", "bytea"} {
				table := outbox.Table{Schema: fmt.Sprintf("%s_%v_%d", typ, partitioned, mode), Name: "outbox"}
				if partitioned {
					f.Exec(outbox.PartitionedSchemaDDL(table, outbox.PartitionDay, 1))
				} else {
					f.Exec(outbox.SchemaDDL(table))
				}
				f.Exec(fmt.Sprintf(`ALTER TABLE %s ALTER COLUMN payload TYPE %s USING %s`, table.Quoted(), typ, using[typ]))
				w, err := outbox.NewWriter(table.String())
				require.NoError(t, err)
				e := entry()
				e.Payload = []byte(`{"a": 1,  "b": [2]}`)
				e.Headers = map[string]string{"tenant": "t1"}
				require.NoError(t, store(w, e), "%s, %v", table, mode)
				require.NoError(t, store(w, e), "%s, %v: a retried store is a no-op", table, mode)
				respelled := e
				respelled.Payload = []byte(`{"b":[2],"a":1}`)
				if typ == "json" || typ == "jsonb" || typ == "text" && partitioned {
					require.NoError(t, store(w, respelled), "%s, %v: the same JSON", table, mode)
				} else {
					require.ErrorIs(t, store(w, respelled), outbox.ErrEventIDConflict, "%s, %v: other bytes", table, mode)
				}
				other := e
				other.Payload = []byte(`{"a": 2}`)
				require.ErrorIs(t, store(w, other), outbox.ErrEventIDConflict, "%s, %v", table, mode)
				require.Equal(t, 1, f.Count(`SELECT count(*) FROM `+table.Quoted()), table)
				var stored []byte
				var headers string
				require.NoError(t, f.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT %s, headers::text FROM %s`,
					map[bool]string{true: "payload", false: "convert_to(payload::text, 'UTF8')"}[typ == "bytea"], table.Quoted())).Scan(&stored, &headers))
				want := string(e.Payload)
				if typ == "jsonb" {
					want = `{"a": 1, "b": [2]}` // jsonb's own spelling
				}
				require.Equal(t, want, string(stored), "%s, %v: stored as given", table, mode)
				require.Equal(t, `{"tenant": "t1"}`, headers, "%s, %v", table, mode)
			}
		}
	}
	f.Exec(outbox.SchemaDDL(outbox.Table{Schema: "text_false", Name: "outbox"}))
	f.Exec(`ALTER TABLE "text_false".outbox ALTER COLUMN payload TYPE varchar`)
	w, err := outbox.NewWriter("text_false.outbox")
	require.NoError(t, err)
	require.ErrorContains(t, storeWith(t, f, w, entry()),
		`column payload of "text_false"."outbox" has type character varying; the writer stores into jsonb, json, text or bytea`)
}

// The DDL takes the period and the count ahead as written, into comments
// and literals: a period other than the four, or a count below zero, is a
// program's error, as a bad table name is. The pg_cron job it suggests is
// named with the database and the table's schema (pg_cron keeps one job
// per name and user) and runs in the outbox's database.
func TestPartitionedDDLTakesOnlyItsPeriods(t *testing.T) {
	t.Parallel()
	table := outbox.Table{Schema: "billing", Name: "outbox"}
	require.Panics(t, func() { outbox.PartitionedSchemaDDL(table, "day\n; DROP TABLE x; --", 1) })
	require.Panics(t, func() { outbox.PartitionedSchemaDDL(table, "year", 1) })
	require.Panics(t, func() { outbox.PartitionedSchemaDDL(table, outbox.PartitionDay, -1) })
	for _, p := range outbox.PartitionPeriods {
		require.NotPanics(t, func() { outbox.PartitionedSchemaDDL(table, p, 0) })
	}
	require.Contains(t, outbox.PartitionedSchemaDDL(table, outbox.PartitionDay, 7),
		`cron.schedule_in_database('<this database>.billing.outbox_add_partitions', '17 * * * *',`)
}

// A writer of a table named without a schema caches the shape of the table
// each search_path finds. Before, the cache was keyed by the database
// alone, so a session whose search_path found a table made before the
// headers column stored with the first table's statements, which name the
// column, and failed.
func TestTheShapeCacheFollowsTheSearchPath(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	ctx := context.Background()
	other := outbox.Table{Schema: "other", Name: "outbox"}
	f.Exec(outbox.SchemaDDL(other))
	f.Exec(`ALTER TABLE other.outbox DROP COLUMN headers`)
	cfg := f.Pool.Config()
	cfg.ConnConfig.RuntimeParams["search_path"] = "other"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()

	cfg = f.Pool.Config()
	cfg.ConnConfig.RuntimeParams["options"] = "-c search_path=other"
	viaOptions, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer viaOptions.Close()

	w, err := outbox.NewWriter("outbox")
	require.NoError(t, err)
	for _, p := range []*pgxpool.Pool{f.Pool, pool, f.Pool, viaOptions} {
		tx, err := p.Begin(ctx)
		require.NoError(t, err)
		err = w.Store(ctx, tx, entry())
		if err != nil {
			require.NoError(t, tx.Rollback(ctx))
		}
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
	}
	require.Equal(t, 2, f.Count(`SELECT count(*) FROM public.outbox`))
	require.Equal(t, 2, f.Count(`SELECT count(*) FROM other.outbox`))
}
