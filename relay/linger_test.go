package relay_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// With rows arriving steadily, a longer --linger claims less often and
// fills each batch fuller; every row still goes out. Two relays with
// different lingers take the same stream of rows side by side.
func TestLingerMakesFullerBatches(t *testing.T) {
	t.Parallel()
	claims := map[time.Duration]float64{}
	var mu sync.Mutex
	t.Run("side by side", func(t *testing.T) { // returns when both relays are done
		for _, linger := range []time.Duration{time.Millisecond, 100 * time.Millisecond} {
			t.Run(linger.String(), func(t *testing.T) {
				t.Parallel()
				f := outboxtest.NewFixture(t, 1, "E")
				cfg := f.Config()
				cfg.BatchSize, cfg.PollInterval, cfg.Linger = 500, 200*time.Millisecond, linger
				x := outboxtest.Start(t, cfg)
				ctx := context.Background()
				end := time.Now().Add(3 * time.Second)
				n := 0
				tick := time.NewTicker(2 * time.Millisecond) // a row every 2 ms or so
				defer tick.Stop()
				for now := range tick.C {
					if now.After(end) {
						break
					}
					require.NoError(t, outboxtest.InsertRows(ctx, f.Pool, 1, 10, "E"))
					n++
				}
				f.WaitDrained(0, 30*time.Second)
				require.Eventually(t, func() bool { return x.Published() == float64(n) }, 5*time.Second, 10*time.Millisecond, "every row is published")
				c, _, err := outboxtest.ReadMetric(x.Reg, "outbox_relay_claim_duration_seconds")
				require.NoError(t, err)
				mu.Lock()
				claims[linger] = c
				mu.Unlock()
			})
		}
	})
	t.Logf("claims over 3 s of rows: %v with --linger 1ms, %v with --linger 100ms", claims[time.Millisecond], claims[100*time.Millisecond])
	require.Less(t, claims[100*time.Millisecond]*2, claims[time.Millisecond], "a 100 ms linger claims far less often than a 1 ms one")
	require.LessOrEqual(t, claims[100*time.Millisecond], 3/0.1+20, "about one claim per linger while rows arrive, and a few once they stop")
}
