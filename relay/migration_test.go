package relay_test

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// migrationSeeds are the scenarios make test runs of
// TestLogicalReplicationLosesNothingThroughMigrations, with writer deletes
// and without: with them, 3 restarts a relay after the table was renamed
// away, which refused to start beside the earlier table, and 25 changes
// the earlier table under a streaming relay, which then left the new
// table's inserts out (8 of its 34 events lost in one run).
var migrationSeeds = []uint64{3, 25}

// migrationRandom is how many random seeds the test runs beside
// migrationSeeds (make chaos-migrations).
var migrationRandom = flag.Int("migration.random", 0, "run this many random migration histories of each mode too (make chaos-migrations)")

// No migration that moves the table's unpublished rows loses an event:
// whatever the order of the writers' events, migrations that replace the
// table (renamed away and kept, or dropped, the new table's ids starting
// over, the earlier table's unpublished rows copied into it in the same
// transaction), changes to an earlier table after it (a cleanup), relays
// restarting and PostgreSQL ending the relay's sessions, every event a
// writer stored reaches Kafka. With writer deletes the stream is the only
// copy of most of them. Each seed draws one such history.
func TestLogicalReplicationLosesNothingThroughMigrations(t *testing.T) {
	t.Parallel()
	seeds := slices.Clone(migrationSeeds)
	for range *migrationRandom {
		seeds = append(seeds, rand.Uint64()%1_000_000)
	}
	for _, writerDeletes := range []bool{true, false} {
		for _, seed := range seeds {
			t.Run(fmt.Sprintf("writer deletes %v seed %d", writerDeletes, seed), func(t *testing.T) {
				t.Parallel()
				migrationScenario(t, seed, writerDeletes)
			})
		}
	}
}

// migrationSteps are what a migration scenario draws from.
var migrationSteps = []string{"store", "store", "store", "replace_rename", "replace_drop", "cleanup", "restart", "terminate"}

func migrationScenario(t *testing.T, seed uint64, writerDeletes bool) {
	ctx := context.Background()
	rnd := rand.New(rand.NewPCG(seed, 0x6d6967726174696f))
	f, cfg, _ := writerDeletesFixture(t, "E")
	cfg.WriterDeletes = writerDeletes
	pub := tableSlot(t, f)
	opts := []outbox.WriterOption{}
	if writerDeletes {
		opts = append(opts, outbox.WithDeleteOnStore())
	}
	w, err := outbox.NewWriter("outbox", opts...)
	require.NoError(t, err)

	current := outboxtest.Start(t, cfg)
	waitStreaming(t, current)
	stored := map[string]bool{}
	var history []string
	earlier := 0 // earlier tables kept, outbox_old_1 …
	n := 0
	for range 14 {
		step := migrationSteps[rnd.IntN(len(migrationSteps))]
		history = append(history, step)
		switch step {
		case "store":
			for range 1 + rnd.IntN(8) {
				e := entry("E", rnd.IntN(3))
				n++
				require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return w.Store(ctx, tx, e) }))
				stored[e.EventID] = true
			}
		case "replace_rename", "replace_drop":
			// One transaction, as a migration runs: the new table takes
			// the unpublished rows (writers kept them while no relay
			// streamed), under its own ids, which start over.
			away := `DROP TABLE outbox`
			if step == "replace_rename" {
				earlier++
				away = fmt.Sprintf(`ALTER TABLE outbox RENAME TO outbox_old_%d`, earlier)
			}
			cols := "event_id, aggregate_type, aggregate_id, event_type, payload, partition_key, created_at, headers"
			require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
				for _, q := range []string{
					`LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`,
					`CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL)`,
					`INSERT INTO outbox_new (` + cols + `) SELECT ` + cols + ` FROM outbox WHERE published_at IS NULL ORDER BY id`,
					away,
					`ALTER TABLE outbox_new RENAME TO outbox`,
					`ALTER PUBLICATION ` + pub + ` ADD TABLE outbox`,
				} {
					if _, err := tx.Exec(ctx, q); err != nil {
						return fmt.Errorf("%s: %w", q, err)
					}
				}
				return nil
			}))
		case "cleanup":
			// A change to an earlier table, which pgoutput describes again
			// before it: a row stored there (no relay takes it, as a row
			// kept in an earlier table), then the table emptied.
			if earlier > 0 {
				old := fmt.Sprintf("outbox_old_%d", 1+rnd.IntN(earlier))
				keeps, err := outbox.NewWriter(old)
				require.NoError(t, err)
				require.NoError(t, pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error { return keeps.Store(ctx, tx, entry("E", 0)) }))
				f.Exec(`DELETE FROM ` + old)
			}
		case "restart":
			require.NoError(t, current.Close())
			current = outboxtest.Start(t, cfg)
		case "terminate":
			f.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name LIKE 'outbox-relay%' AND datname = current_database() AND pid <> pg_backend_pid()`)
		}
	}
	t.Logf("seed %d: %s; %d events", seed, strings.Join(history, ", "), n)

	msgs, err := testenv.Broker().ConsumeErr(f.Topics["E"], n, 60*time.Second, time.Second)
	require.NoError(t, err)
	seen := map[string]bool{}
	for _, m := range msgs {
		seen[header(m, relay.HeaderEventID)] = true
	}
	var lost []string
	for id := range stored {
		if !seen[id] {
			lost = append(lost, id)
		}
	}
	require.Empty(t, lost, "seed %d (%s): events stored and never published", seed, strings.Join(history, ", "))
}
