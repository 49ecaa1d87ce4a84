package main

import (
	"context"
	"fmt"
	"sort"
	"time"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// runBacklogCost measures what the operator's backlog sampling costs the
// database: the read each OutboxRelay's observer makes every
// spec.backlog.interval (the operator's own connection settings, statement
// and bound, through controllers.BacklogProbe), timed on this machine at
// each of o.backlogRows waiting rows, and turned into database time per
// second per OutboxRelay at the default interval.
func runBacklogCost(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	interval := controllers.DefaultBacklogInterval
	for _, n := range o.backlogRows {
		if err := e.freshTable(ctx, n); err != nil {
			return err
		}
		m, err := func() (map[string]float64, error) {
			probe, err := controllers.NewBacklogProbe(ctx, e.dsn, outbox.Table{Name: "outbox"})
			if err != nil {
				return nil, err
			}
			defer probe.Close()
			var ms []float64
			var read int64
			// Two reads first, not timed: the connection, the plan, the cache.
			for i := range o.backlogReads + 2 {
				start := time.Now()
				if read, err = probe.Read(ctx); err != nil {
					return nil, err
				}
				if i >= 2 {
					ms = append(ms, float64(time.Since(start).Microseconds())/1000)
				}
			}
			sort.Float64s(ms)
			med := median(ms)
			// Milliseconds of database time per second, per OutboxRelay.
			perS := med / interval.Seconds()
			return map[string]float64{"read_ms": med, "read_ms_p95": pct(ms, 0.95), "rows_read": float64(read),
				"reads_per_s": 1 / interval.Seconds(), "db_ms_per_s": perS, "relays_per_core": 1000 / perS}, nil
		}()
		if err != nil {
			return err
		}
		logf("backlog read at %d waiting rows: %.1f ms (p95 %.1f), %.0f rows read; %.2f ms of database time per second per OutboxRelay at %s",
			n, m["read_ms"], m["read_ms_p95"], m["rows_read"], m["db_ms_per_s"], interval)
		rep.add(scBacklog, fmt.Sprintf("pending=%d", n), map[string]any{"pending": n, "interval": interval.String(),
			"bound": outboxv1alpha1.BacklogBound, "reads": o.backlogReads}, []map[string]float64{m})
	}
	return nil
}
