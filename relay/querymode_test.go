package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// A DSN copied from an application behind a transaction-mode pooler carries
// pgx's default_query_exec_mode exec or simple_protocol. A relay given one
// (connected to PostgreSQL itself) publishes, holds, records and marks as in pgx's
// default mode, in both captures, and relay held reads its held table.
func TestRelayInEachQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"exec", "simple_protocol"} {
		for _, capture := range []relay.Capture{relay.CapturePoll, relay.CaptureLogicalReplication} {
			t.Run(mode+"/"+string(capture), func(t *testing.T) {
				t.Parallel()
				f := outboxtest.NewFixture(t, 2, "Known")
				sep := "?"
				if strings.Contains(f.DSN, "?") {
					sep = "&"
				}
				dsn := f.DSN + sep + "default_query_exec_mode=" + mode
				f.Insert(50, 10, "Unknown")
				f.Insert(20, 10, "Known")
				f.Exec(`UPDATE outbox SET headers = '[1, 2]'`) // the Unknown rows and 20 Known: invalid rows
				f.Insert(300, 10, "Known")
				cfg := f.Config()
				cfg.DSN = dsn
				cfg.Capture = capture
				x := outboxtest.Start(t, cfg)
				known := func() bool {
					return f.Count(`SELECT count(*) FROM outbox WHERE published_at IS NULL AND headers IS NULL`) == 0
				}
				require.Eventually(t, known, 30*time.Second, 50*time.Millisecond)
				f.Insert(300, 10, "Known") // streamed, with logical replication
				require.Eventually(t, known, 30*time.Second, 50*time.Millisecond)
				require.Eventually(t, func() bool {
					return outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "unroutable") == 50 &&
						outboxtest.MetricValue(t, x.Reg, "outbox_relay_rows_held", "reason", "invalid_row") == 20
				}, 15*time.Second, 100*time.Millisecond)
				require.Len(t, testenv.Broker().Consume(t, f.Topics["Known"], 600, 30*time.Second), 600)

				ctx := context.Background()
				conn, err := relay.Connect(ctx, dsn, nil, nil)
				require.NoError(t, err)
				defer conn.Close(ctx)
				table, err := outbox.ParseTable(f.Table)
				require.NoError(t, err)
				require.Eventually(t, func() bool {
					held, err := relay.ListHeld(ctx, conn, table, relay.HeldFilter{Reasons: []string{"invalid_row"}}, 100)
					require.NoError(t, err)
					return len(held) == 20
				}, 15*time.Second, 100*time.Millisecond, "relay held lists the held rows")
			})
		}
	}
}
