package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

var modes = []relay.Ordering{relay.OrderingNone, relay.OrderingPartitionKey}

// eachMode runs test in parallel once per ordering mode, with a fixture of
// partitions partitions per topic and a config in that mode.
func eachMode(t *testing.T, partitions int, types []string, test func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config)) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, partitions, types...)
			cfg := f.Config()
			cfg.Ordering = mode
			test(t, f, cfg)
		})
	}
}

// run starts a relay with an optional injected writer until the test ends.
func run(t *testing.T, cfg relay.Config, w relay.MessageWriter) *outboxtest.Running {
	t.Helper()
	x, err := outboxtest.RunRelay(cfg, w)
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close() })
	return x
}

// readyFailsWith waits until Ready names reason, and checks the stall gauge
// says so too once the stats loop has run.
func readyFailsWith(t *testing.T, x *outboxtest.Running, reason string, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool {
		err := x.R.Ready()
		return err != nil && strings.Contains(err.Error(), "("+reason+")")
	}, within, 50*time.Millisecond, "Ready must fail with %s; it says %v", reason, x.R.Ready())
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_stalled", "reason", reason) == 1
	}, 10*time.Second, 100*time.Millisecond)
}

// A table whose read columns allow NULL is refused at start-up, naming the
// column and the statement that fixes it.
func TestStartupRefusesNullableColumns(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(`ALTER TABLE outbox ALTER COLUMN payload DROP NOT NULL, ALTER COLUMN partition_key DROP NOT NULL`)
	r, err := relay.New(f.Config())
	require.NoError(t, err)
	defer r.Close()
	err = r.Check(context.Background())
	require.ErrorContains(t, err, `column payload allows NULL; fix it with: ALTER TABLE "outbox" ALTER COLUMN "payload" SET NOT NULL`)
	require.ErrorContains(t, err, `ALTER TABLE "outbox" ALTER COLUMN "partition_key" SET NOT NULL`)
}

// A plain table without a unique index on id is refused at start-up: the
// relay marks and prunes by id, and of two rows with one id, the published
// one's mark or prune took the unpublished one too (lost).
func TestStartupRefusesATableWithoutAUniqueID(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_pkey`)
	r, err := relay.New(f.Config())
	require.NoError(t, err)
	defer r.Close()
	require.EqualError(t, r.Check(context.Background()), `table outbox has no unique index on id: the relay claims, marks and prunes rows by id, so of two rows with one id, one published would mark the other published too, and pruning one would delete the other; add it with: ALTER TABLE "outbox" ADD PRIMARY KEY (id)`)
	f.Exec(`CREATE UNIQUE INDEX outbox_id ON outbox (id)`)
	require.NoError(t, r.Check(context.Background()))
}

// A role that lacks a privilege publishing needs on the outbox table is
// refused at start-up, naming it and the GRANT. Before, a relay with
// --on-publish delete on a role that may only update claimed and
// published each batch, failed to delete it and rolled back: the same
// rows went to Kafka again at every retry, without end.
func TestStartupRefusesARoleThatCannotMarkOrDelete(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(5, 5, "E")
	role := fmt.Sprintf("nodelete_%d", time.Now().UnixNano()%1e9)
	f.Exec(`CREATE ROLE ` + role + ` LOGIN; GRANT SELECT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	check := func(edit func(*relay.Config)) error {
		cfg := f.Config()
		cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
		edit(&cfg)
		r, err := relay.New(cfg)
		require.NoError(t, err)
		defer r.Close()
		return r.Check(context.Background())
	}
	require.NoError(t, check(func(*relay.Config) {}), "marking needs SELECT and UPDATE")
	err := check(func(c *relay.Config) { c.OnPublish = relay.OnPublishDelete })
	require.ErrorContains(t, err, "the role "+role+" lacks DELETE on outbox")
	require.ErrorContains(t, err, "--on-publish delete deletes each row it published")
	require.ErrorContains(t, err, `GRANT DELETE ON "outbox" TO "`+role+`"`)
	// Retention's DELETE is logged, not refused: the relay publishes.
	var logs lockedBuffer
	require.NoError(t, check(func(c *relay.Config) {
		c.KeepPublishedFor = time.Hour
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	}))
	require.Contains(t, logs.String(), "the relay's role cannot prune")
	require.Contains(t, logs.String(), `why="--keep-published-for deletes published rows"`)
	require.Contains(t, logs.String(), `GRANT DELETE ON \"outbox\" TO \"`+role+`\"`)

	f.Exec(`REVOKE UPDATE ON outbox FROM ` + role + `; GRANT UPDATE (published_at) ON outbox TO ` + role)
	require.NoError(t, check(func(*relay.Config) {}), "UPDATE of published_at is enough to mark")
	f.Exec(`REVOKE UPDATE ON outbox FROM ` + role + `; REVOKE SELECT ON outbox FROM ` + role + `; GRANT SELECT (id, payload) ON outbox TO ` + role)
	err = check(func(*relay.Config) {})
	require.ErrorContains(t, err, "lacks SELECT (event_id)")
	require.ErrorContains(t, err, "UPDATE (published_at)")
	require.ErrorContains(t, err, `GRANT SELECT, UPDATE ON "outbox" TO "`+role+`"`)
	require.Equal(t, 5, f.Unpublished(), "nothing was claimed")

	// Column grants of every column the relay reads: polling with no
	// ordering reads only those; a partition-key claim locks rows by their
	// ctid, which only a grant on the table allows.
	f.Exec(`GRANT SELECT (id, event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at, published_at, headers), UPDATE (published_at) ON outbox TO ` + role)
	require.NoError(t, check(func(*relay.Config) {}))
	err = check(func(c *relay.Config) { c.Ordering = relay.OrderingPartitionKey })
	require.ErrorContains(t, err, "lacks SELECT (ctid)")
	require.ErrorContains(t, err, `GRANT SELECT ON "outbox"`)
}

// Retention on a partitioned table detaches and drops partitions, which
// only the table's owner may, and deletes their event ids: a role that
// may publish but not that is told at start-up, naming the owner and each
// grant, and publishes (refused, a relay that published before an upgrade
// would stop for want of pruning; before, nothing said why nothing was
// pruned but a metric).
func TestStartupNamesPartitionedRetentionItCannotDo(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	partitioned(t, f)
	role := fmt.Sprintf("noowner_%d", time.Now().UnixNano()%1e9)
	owner := role + "_owner"
	t.Cleanup(func() {
		_, _ = f.Pool.Exec(context.Background(), `ALTER TABLE outbox OWNER TO postgres`)
		for _, r := range []string{role, owner} {
			_, _ = f.Pool.Exec(context.Background(), `DROP OWNED BY `+r+`; DROP ROLE `+r)
		}
	})
	f.Exec(`CREATE ROLE ` + role + ` LOGIN; GRANT SELECT, UPDATE ON outbox TO ` + role + `; GRANT ALL ON outbox_held TO ` + role)
	check := func(keep time.Duration) string {
		var logs lockedBuffer
		cfg := f.Config()
		cfg.DSN = strings.Replace(f.DSN, "postgres@", role+"@", 1) // the test cluster trusts local connections
		cfg.KeepPublishedFor = keep
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		r, err := relay.New(cfg)
		require.NoError(t, err)
		defer r.Close()
		require.NoError(t, r.Check(context.Background()), "it publishes")
		return logs.String()
	}
	const cannot = "the relay's role cannot prune"
	require.NotContains(t, check(0), cannot, "publishing alone needs no ownership")
	logs := check(time.Hour)
	require.Contains(t, logs, `lacks="the ownership of outbox (owned by postgres) and SELECT (event_id), SELECT (created_at), DELETE on outbox_event_ids"`)
	require.Contains(t, logs, `make the role own the table and its partitions (ALTER TABLE \"outbox\" OWNER TO \"`+role+`\", and each partition); GRANT SELECT, DELETE ON \"outbox_event_ids\" TO \"`+role+`\"`)
	require.NotContains(t, logs, `GRANT \"postgres\"`, "a superuser's membership is never the advice")

	f.Exec(`GRANT SELECT, DELETE ON outbox_event_ids TO ` + role)
	logs = check(time.Hour)
	require.Contains(t, logs, `lacks="the ownership of outbox (owned by postgres)"`)
	require.NotContains(t, logs, "outbox_event_ids TO")

	f.Exec(`CREATE ROLE ` + owner + `; ALTER TABLE outbox OWNER TO ` + owner)
	require.Contains(t, check(time.Hour), `GRANT \"`+owner+`\" TO \"`+role+`\" (the role gets every privilege of `+owner+`), or make the role own`)
	f.Exec(`GRANT ` + owner + ` TO ` + role)
	require.NotContains(t, check(time.Hour), cannot, "a member of the owning role may detach")
}

// A NULL that appears after start-up (a column altered later) holds its
// row alone (invalid_row): never a tombstone, never a failed claim for
// everyone; rows of other keys flow, in both ordering modes.
func TestNullsAfterStartupAreHeldAlone(t *testing.T) {
	eachMode(t, 2, []string{"E"}, func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
		x := run(t, cfg, nil) // checked while every column was NOT NULL
		f.Exec(`ALTER TABLE outbox ALTER COLUMN payload DROP NOT NULL, ALTER COLUMN partition_key DROP NOT NULL,
				ALTER COLUMN created_at DROP NOT NULL, ALTER COLUMN event_type DROP NOT NULL`)
		f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at) VALUES
				(gen_random_uuid(), 'Order', 'a', 'E', NULL, 'bad-1', now()),
				(gen_random_uuid(), 'Order', 'b', 'E', '{}', NULL, now()),
				(gen_random_uuid(), 'Order', 'c', 'E', '{}', 'bad-3', NULL),
				(gen_random_uuid(), 'Order', 'd', NULL, '{}', 'bad-4', now())`)
		f.Insert(300, 10, "E")
		f.WaitDrained(4, 30*time.Second)
		// Without ordering a NULL type is never claimed (no mapping can
		// match it); with partition-key ordering every row of the
		// replica's buckets is claimed, so it is held too.
		want := 3.0
		if cfg.Ordering == relay.OrderingPartitionKey {
			want = 4
		}
		require.Eventually(t, func() bool {
			return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldInvalidRow) == want
		}, 10*time.Second, 50*time.Millisecond)
		require.Equal(t, 4, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id IN ('a','b','c','d')`))
		_, msgs := outboxtest.Deliveries(t, 300, f.Topics["E"])
		for _, m := range msgs {
			require.NotNil(t, m.Value, "no tombstone")
		}
		require.NoError(t, x.R.Ready(), "held rows are not a stall")
	})
}

// A row larger than the batch's byte budget is claimed and sent alone; no
// claim commits an empty batch.
func TestRowLargerThanByteBudgetIsSentAlone(t *testing.T) {
	eachMode(t, 1, []string{"E"}, func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
		f.Insert(20, 3, "E")
		f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
				SELECT gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 200000)), 'order-1'
				FROM generate_series(1, 3)`)
		f.Insert(20, 3, "E")
		cfg.MaxBatchBytes = 64 << 10
		x := run(t, cfg, nil)
		f.WaitDrained(0, 30*time.Second)
		_, msgs := outboxtest.Deliveries(t, 43, f.Topics["E"])
		big := 0
		for _, m := range msgs {
			if len(m.Value) > 200000 {
				big++
			}
		}
		require.Equal(t, 3, big)
		require.NoError(t, x.R.Ready())
	})
}

// A mapped topic deleted mid-drain holds only its rows (topic_unavailable);
// the other topic drains completely; recreated, its rows follow.
func TestDeletedTopicHoldsOnlyItsRows(t *testing.T) {
	eachMode(t, 2, []string{"A", "B"}, func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
		const n = 6000
		f.Insert(n, 100, "A", "B") // every key has one type
		cfg.BatchSize = 100
		cfg.HeldRetryInterval = 2 * time.Second
		x := run(t, cfg, nil)
		require.Eventually(t, func() bool { return f.Unpublished() < n-500 }, 30*time.Second, 5*time.Millisecond)
		client := &kafka.Client{Addr: kafka.TCP(testenv.Broker().Addr()), Timeout: 10 * time.Second}
		resp, err := client.DeleteTopics(context.Background(), &kafka.DeleteTopicsRequest{Topics: []string{f.Topics["B"]}})
		require.NoError(t, err)
		require.NoError(t, resp.Errors[f.Topics["B"]])

		require.Eventually(t, func() bool {
			return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_type = 'A'`) == 0
		}, 60*time.Second, 50*time.Millisecond, "the other topic drains")
		require.Positive(t, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_type = 'B'`))
		require.Eventually(t, func() bool {
			return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTopicUnavailable) > 0
		}, 15*time.Second, 100*time.Millisecond)

		require.Eventually(t, func() bool {
			return testenv.Broker().CreateTopicErr(f.Topics["B"], 2) == nil
		}, 30*time.Second, 500*time.Millisecond)
		f.WaitDrained(0, 90*time.Second)
		counts, _ := outboxtest.Deliveries(t, n/2, f.Topics["A"])
		require.Len(t, counts, n/2, "every A row reached its topic")
	})
}

// A mapped topic that is missing when the relay starts (deleted, or its ACL
// revoked, before a pod restarted) holds only its own rows, as when it goes
// while the relay runs, and a missing dead-letter topic holds nothing back:
// the relay starts, the other topic's rows flow, and the missing topic's
// rows go out once it exists. Before, the start-up check refused to start,
// and the pod's crash loop stopped every topic's rows.
func TestMissingTopicAtStartHoldsOnlyItsRows(t *testing.T) {
	eachMode(t, 2, []string{"A"}, func(t *testing.T, f *outboxtest.Fixture, cfg relay.Config) {
		const n = 2000
		missing := testenv.Broker().TopicName(t, "b")
		cfg.Topics = map[string]string{"A": f.Topics["A"], "B": missing}
		cfg.DeadLetterTopic = testenv.Broker().TopicName(t, "dlt")
		cfg.HeldRetryInterval = 2 * time.Second
		f.Insert(n, 100, "A", "B")
		x := run(t, cfg, nil)
		require.Eventually(t, func() bool {
			return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_type = 'A'`) == 0
		}, 60*time.Second, 50*time.Millisecond, "the other topic drains")
		require.Equal(t, n/2, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_type = 'B'`))
		require.Eventually(t, func() bool {
			return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTopicUnavailable) > 0
		}, 15*time.Second, 100*time.Millisecond)

		require.NoError(t, testenv.Broker().CreateTopicErr(missing, 2))
		f.WaitDrained(0, 90*time.Second)
		counts, _ := outboxtest.Deliveries(t, n/2, missing)
		require.Len(t, counts, n/2, "every B row reached its topic once it existed")
	})
}

// A record larger than its topic takes that does not fit the dead-letter
// topic either is held (too_large), not sent without its payload.
func TestTooLargeForDeadLetterTopicIsHeld(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1)
	f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
	dlt := f.NewTopic("dlt", 1, "max.message.bytes", "3000")
	f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
	f.Insert(50, 5, "E")
	cfg := f.Config()
	cfg.DeadLetterTopic = dlt
	x := run(t, cfg, nil)
	f.WaitDrained(1, 30*time.Second)
	require.Eventually(t, func() bool {
		return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTooLarge) == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id = 'big'`))
}

// An authorization error, or a topic format too old for the relay's
// records, is not permanent: the topic's rows are held and retried, never
// dead-lettered, and flow once the ACL is fixed or the format raised.
func TestAuthorizationErrorIsHeldNotDeadLettered(t *testing.T) {
	t.Parallel()
	// A topic whose message.format.version is older than 0.11 refuses every
	// record with headers, which is every record the relay sends.
	for _, refusal := range []kafka.Error{kafka.TopicAuthorizationFailed, kafka.UnsupportedForMessageFormat} {
		t.Run(refusal.Title(), func(t *testing.T) {
			t.Parallel()
			f := outboxtest.NewFixture(t, 2, "A", "B")
			dlt := f.NewTopic("dlt", 1)
			f.Insert(400, 10, "A", "B")
			var denied atomic.Bool
			denied.Store(true)
			w := &faultyWriter{MessageWriter: newKafkaWriter(t), fail: func(_ int, m kafka.Message) error {
				if denied.Load() && m.Topic == f.Topics["B"] {
					return refusal
				}
				return nil
			}}
			cfg := f.Config()
			cfg.DeadLetterTopic = dlt
			cfg.HeldRetryInterval = 2 * time.Second
			x := run(t, cfg, w)
			require.Eventually(t, func() bool {
				return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND event_type = 'A'`) == 0
			}, 30*time.Second, 20*time.Millisecond)
			require.Eventually(t, func() bool {
				return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", relay.HeldTopicUnavailable) == 200
			}, 15*time.Second, 100*time.Millisecond)
			require.Equal(t, 200, f.Unpublished())
			require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
			denied.Store(false) // the ACL is fixed, the topic's format raised
			f.WaitDrained(0, 30*time.Second)
			require.Zero(t, outboxtest.MetricValue(t, x.Reg, "outbox_relay_dead_lettered_total"))
		})
	}
}

// Each stall fails Ready within the stall timeout, with the gauge set.
func TestStallsFailReadiness(t *testing.T) {
	t.Parallel()
	const stall = 5 * time.Second
	within := stall + 5*time.Second

	t.Run("batch_failing", func(t *testing.T) {
		t.Parallel()
		f := outboxtest.NewFixture(t, 1, "E")
		f.Insert(100, 5, "E")
		cfg := f.Config()
		cfg.StallTimeout = stall
		x := run(t, cfg, writerFunc(func(context.Context, ...kafka.Message) error { return errors.New("broker on fire") }))
		readyFailsWith(t, x, relay.StallBatchFailing, within)
		require.Equal(t, 100, f.Unpublished())
	})
	t.Run("batch_failing_database", func(t *testing.T) {
		t.Parallel()
		f := outboxtest.NewFixture(t, 1, "E")
		cfg := f.Config()
		cfg.StallTimeout = stall
		x := run(t, cfg, nil)
		f.Exec(`ALTER TABLE outbox RENAME TO outbox_gone`) // every claim fails now
		readyFailsWith(t, x, relay.StallBatchFailing, within)
	})
	t.Run("rows_waiting_partition_hung", func(t *testing.T) {
		t.Parallel()
		// Every write hangs past the publish timeout: the partition is set
		// aside and its rows are left out of the claims, so the claims come
		// back empty. The stall check still counts those rows: they wait,
		// and nothing goes out. Before, it left them out with the claims,
		// and /readyz passed.
		f := outboxtest.NewFixture(t, 1, "E")
		f.Insert(20, 5, "E")
		cfg := f.Config()
		cfg.StallTimeout, cfg.PublishTimeout = stall, time.Second
		x := run(t, cfg, writerFunc(func(ctx context.Context, _ ...kafka.Message) error { <-ctx.Done(); return ctx.Err() }))
		readyFailsWith(t, x, relay.StallRowsWaiting, within)
		require.Equal(t, 20, f.Unpublished())
	})
	t.Run("no_progress", func(t *testing.T) {
		t.Parallel()
		// Holding disabled (rows released at once): claims keep returning a
		// row that never goes out.
		f := outboxtest.NewFixture(t, 1)
		f.Topics["E"] = f.NewTopic("small", 1, "max.message.bytes", "2000")
		f.Exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
			VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('pad', repeat('y', 5000)), 'big')`)
		cfg := f.Config()
		cfg.StallTimeout = stall
		cfg.HeldRetryInterval = time.Millisecond
		x := run(t, cfg, nil)
		readyFailsWith(t, x, relay.StallNoProgress, within)
	})
	t.Run("rows_waiting", func(t *testing.T) {
		t.Parallel()
		// Rows locked by another transaction: every claim comes back empty.
		f := outboxtest.NewFixture(t, 1, "E")
		f.Insert(20, 5, "E")
		tx, err := f.Pool.Begin(context.Background())
		require.NoError(t, err)
		defer tx.Rollback(context.Background()) //nolint:errcheck
		_, err = tx.Exec(context.Background(), `SELECT id FROM outbox FOR UPDATE`)
		require.NoError(t, err)
		cfg := f.Config()
		cfg.StallTimeout = stall
		x := run(t, cfg, nil)
		readyFailsWith(t, x, relay.StallRowsWaiting, within+stall)
		require.NoError(t, tx.Rollback(context.Background()))
		f.WaitDrained(0, 30*time.Second)
		require.Eventually(t, func() bool { return x.R.Ready() == nil }, 15*time.Second, 100*time.Millisecond)
	})
	t.Run("loop_wedged", func(t *testing.T) {
		t.Parallel()
		f := outboxtest.NewFixture(t, 1, "E")
		f.Insert(10, 5, "E")
		cfg := f.Config()
		cfg.StallTimeout = stall
		cfg.PublishTimeout = time.Second
		release := make(chan struct{})
		x := run(t, cfg, writerFunc(func(context.Context, ...kafka.Message) error { <-release; return nil }))
		t.Cleanup(func() { close(release) }) // runs before the relay's Close
		// A batch may take PublishTimeout+15s, a statement 30 s; wedged is
		// the longer plus the stall timeout.
		require.Eventually(t, func() bool { return x.R.Live() != nil }, 30*time.Second+stall+10*time.Second, 100*time.Millisecond)
		require.ErrorContains(t, x.R.Live(), relay.StallLoopWedged)
	})
}

// Replicas of the two ordering modes never claim from one table at once: a
// mode switch mid-drain stops the newcomer (mode_conflict) until the old
// replica is gone, and every key stays in order.
func TestModeSwitchMidDrainKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 4, "E")
	const n = 20000
	f.Insert(n, 50, "E")
	cfg := f.Config()
	cfg.BatchSize = 100
	old := run(t, cfg, nil)
	require.Eventually(t, func() bool { return f.Unpublished() < n-2000 }, 30*time.Second, 5*time.Millisecond)

	cfg.Ordering = relay.OrderingPartitionKey
	next := run(t, cfg, nil)
	readyFailsWith(t, next, relay.StallModeConflict, 10*time.Second)
	readyFailsWith(t, old, relay.StallModeConflict, 10*time.Second)
	// A batch claimed before the conflict was seen may still be committing
	// (pipelined): let it settle, then no claim may follow.
	var left int
	require.Eventually(t, func() bool {
		before := f.Unpublished()
		time.Sleep(300 * time.Millisecond)
		left = f.Unpublished()
		return left == before
	}, 10*time.Second, time.Millisecond)
	time.Sleep(2 * time.Second)
	require.Equal(t, left, f.Unpublished(), "neither mode claims while both are live")
	require.NoError(t, old.Close())

	f.WaitDrained(0, 60*time.Second)
	require.Eventually(t, func() bool { return next.R.Ready() == nil }, 10*time.Second, 100*time.Millisecond)
	_, msgs := outboxtest.Deliveries(t, n, f.Topics["E"])
	violations, keys := orderViolations(t, msgs, idsByEvent(t, f))
	require.Equal(t, 50, keys)
	require.Zero(t, violations)
}

// A relay that waits at start-up for a database that does not answer, as
// `relay` does before it runs, is not wedged: /healthz passes, so the
// kubelet does not restart it for a wait that is not its own. Before, it
// failed once the loop's wedged limit had passed since the relay was made.
func TestWaitingForDependenciesIsNotWedged(t *testing.T) {
	t.Parallel()
	cfg := relay.Config{
		Settings: relay.Settings{
			DSN: "postgres://relay@127.0.0.1:1/outbox?connect_timeout=1", Table: "outbox",
			Brokers: []string{"127.0.0.1:1"}, Topics: map[string]string{"E": "e"},
			PublishTimeout: time.Second, StallTimeout: 5 * time.Second,
		},
	}
	r, err := relay.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	wedged := 30*time.Second + cfg.StallTimeout // the loop's limit: a statement's 30 s (more than this batch's deadline) and the stall timeout
	for end := time.Now().Add(wedged + 5*time.Second); time.Now().Before(end); {
		var unreachable *relay.UnreachableError
		require.ErrorAs(t, r.Check(context.Background()), &unreachable)
		require.NoError(t, r.Live(), "waiting for the database is not a wedged loop")
		<-time.After(time.Second) // the start-up loop's backoff
	}
}

// A start-up check that a lock wait outlasts (a migration holding the
// table) says the database is not there yet, and the relay checks again:
// the error is an UnreachableError, which the process waits out. Before,
// only a failed connect was one, and this ended the process. /readyz
// names the database meanwhile; it named Kafka, not checked yet.
func TestStartupCheckBehindALockIsUnreachable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := outboxtest.NewFixture(t, 1, "E")
	migration, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	defer migration.Rollback(ctx) //nolint:errcheck // only holds the lock
	_, err = migration.Exec(ctx, `LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	r, err := relay.New(f.Config())
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	err = r.Check(cctx)
	var unreachable *relay.UnreachableError
	require.ErrorAs(t, err, &unreachable, "%v", err)
	require.EqualError(t, r.Ready(), "database: unreachable", "/readyz names what the check waits for")
}
