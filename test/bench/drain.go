package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// ceilingSQL is the relay's own claim and mark (relay/sql.go): the ceiling
// measures what PostgreSQL allows for exactly the statements the relay runs,
// with no Kafka in between. Like the relay it reads past a cursor, so it
// does not wade through the dead index entries marked rows leave.
var ceilingSQL = relay.NewSQL(outbox.Table{Name: "outbox"})

// ceilingLoops runs loops claim+mark loops, each on its own connection,
// until the table has no unpublished row left.
func ceilingLoops(ctx context.Context, dsn string, batch, loops int) error {
	var wg sync.WaitGroup
	errs := make([]error, loops)
	for l := range loops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[l] = ceilingLoop(ctx, dsn, batch)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func ceilingLoop(ctx context.Context, dsn string, batch int) error {
	conn, err := pgConnect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var cursor int64
	ids := make([]int64, 0, batch)
	for ctx.Err() == nil {
		ids = ids[:0]
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, ceilingSQL.Claim, cursor, []string{eventType}, []int64{}, batch, relayconfig.DefaultMaxBatchBytes, math.MaxInt32)
			if err != nil {
				return err
			}
			// Every column is decoded, as the relay does; the id comes first.
			for rows.Next() {
				v, err := rows.Values()
				if err != nil {
					rows.Close()
					return err
				}
				ids = append(ids, v[0].(int64))
			}
			if err := rows.Err(); err != nil {
				return err
			}
			if len(ids) == 0 {
				return nil
			}
			cursor = ids[len(ids)-1]
			_, err = tx.Exec(ctx, ceilingSQL.Mark, ids)
			return err
		})
		if err != nil {
			return fmt.Errorf("ceiling loop: %w", err)
		}
		if len(ids) == 0 {
			return nil
		}
	}
	return ctx.Err()
}

// orderingAvailable starts `relay --ordering mode` once and reports whether it
// comes up; a mode the relay refuses is "not available" with its message.
func orderingAvailable(ctx context.Context, o *options, e *benchEnv, mode string) (bool, string, error) {
	if v, ok := e.orderingProbe[mode]; ok {
		return v == "", v, nil
	}
	if err := e.freshTable(ctx, 0); err != nil {
		return false, "", err
	}
	topic, err := e.newTopic(o, "probe")
	if err != nil {
		return false, "", err
	}
	defer e.deleteTopic(topic)
	p, err := e.startRelay(e.relayArgs(topic, 50, mode))
	if err != nil {
		return false, "", err
	}
	rerr := p.WaitReady(ctx, 30*time.Second)
	stopRelay(p)
	msg := ""
	if rerr != nil {
		msg = rerr.Error()
		logf("ordering %s: not available: %s", mode, msg)
	}
	if e.orderingProbe == nil {
		e.orderingProbe = map[string]string{}
	}
	e.orderingProbe[mode] = msg
	return msg == "", msg, nil
}

// stallAfter ends a drain that stopped making progress (rows stranded).
const stallAfter = 45 * time.Second

// relayDrain runs replicas relay processes over a fresh table of o.rows rows
// until every row is published, and returns events/s, CPU seconds per 10k
// events (all processes, start to stop) and the largest peak RSS in MiB.
func relayDrain(ctx context.Context, o *options, e *benchEnv, batch, replicas int, ordering string, extra ...string) (map[string]float64, error) {
	return relayDrainWith(ctx, o, e, drainSetup{}, batch, replicas, ordering, extra...)
}

// drainSetup is what a drain changes from relayDrain's: the table (o.rows
// unpublished rows are always there) and the relays' environment.
type drainSetup struct {
	// published and headers are the tableFill fields of the same names.
	published int
	headers   bool
	// env is added to each relay's environment.
	env []string
	// fromSlot: the rows wait in the WAL of the table's replication slot,
	// made by a streaming relay that then stopped, as after an outage
	// (the relays stream, extra says how); with writerDeletes they are in
	// no table, each deleted in the transaction that inserted it.
	fromSlot, writerDeletes bool
}

// relayDrainWith is relayDrain on the table and with the environment d
// says; with published rows it also returns the rows pruned ("pruned").
func relayDrainWith(ctx context.Context, o *options, e *benchEnv, d drainSetup, batch, replicas int, ordering string, extra ...string) (map[string]float64, error) {
	fill := tableFill{rows: o.rows, published: d.published, headers: d.headers}
	if d.fromSlot {
		fill.rows = 0
	}
	if err := e.fillTable(ctx, fill); err != nil {
		return nil, err
	}
	topic, err := e.newTopic(o, fmt.Sprintf("drain-b%d-r%d", batch, replicas))
	if err != nil {
		return nil, err
	}
	defer e.deleteTopic(topic)
	var walEnd string // the WAL position after the rows, with fromSlot
	if d.fromSlot {
		if walEnd, err = e.slotBacklog(ctx, o, topic, d.writerDeletes, extra...); err != nil {
			return nil, err
		}
	}
	dbCPU0, err := e.serverCPUSeconds(ctx)
	if err != nil {
		return nil, err
	}
	var procs []*devproc.Proc
	defer func() {
		for _, p := range procs {
			stopRelay(p)
		}
	}()
	for range replicas {
		p, err := e.startRelay(e.relayArgs(topic, batch, ordering, extra...), d.env...)
		if err != nil {
			return nil, err
		}
		procs = append(procs, p)
	}
	deadline := time.Now().Add(o.drainTimeout)
	var last float64
	lastMove := time.Now()
	// The counter's view of the drain, for deleted rows (no published_at):
	// from the first sample that saw a row published to the one that saw all.
	// A drain the first such sample saw whole (a small one, from the slot)
	// is timed from the last sample that saw none, which gives a rate no
	// higher than the drain's.
	var firstSeen, lastNone time.Time
	var firstCount float64
	lastNone = time.Now()
	for {
		var sum float64
		for _, p := range procs {
			if p.HasExited() {
				return nil, fmt.Errorf("relay exited during the drain: %s", p.Tail(5))
			}
			n, _ := published(p)
			sum += n
		}
		if sum == 0 {
			lastNone = time.Now()
		}
		if sum > 0 && firstSeen.IsZero() {
			firstSeen, firstCount = time.Now(), sum
			if sum >= float64(o.rows) {
				firstSeen, firstCount = lastNone, 0
			}
		}
		if sum >= float64(o.rows) {
			break
		}
		if sum > last {
			last, lastMove = sum, time.Now()
		}
		if time.Since(lastMove) > stallAfter {
			unpub, _ := e.unpublished(ctx)
			return nil, fmt.Errorf("drain stalled: no progress for %s with %d of %d rows unpublished; last relay log: %s",
				stallAfter, unpub, o.rows, procs[0].Tail(3))
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("drain not done after %s: %.0f of %d published", o.drainTimeout, sum, o.rows)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	counterRate := (float64(o.rows) - firstCount) / time.Since(firstSeen).Seconds()
	// The counter moves before the commit: wait for the marks to land.
	for i := 0; ; i++ {
		n, err := e.unpublished(ctx)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			break
		}
		if i > 200 {
			return nil, fmt.Errorf("%d rows still unpublished after the relays reported all published", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	dbCPU, err := e.serverCPUSeconds(ctx)
	if err != nil {
		return nil, err
	}
	walsender, err := e.walsenderCPUSeconds(ctx) // the relays' walsenders started after dbCPU0, and still run
	if err != nil {
		return nil, err
	}
	var cpu, hwm, pruned float64
	for _, p := range procs {
		n, err := scrape(p, metricPruned)
		if err != nil {
			return nil, err
		}
		pruned += n
		c, err := cpuSeconds(p.Pid())
		if err != nil {
			return nil, err
		}
		_, h, err := memKiB(p.Pid())
		if err != nil {
			return nil, err
		}
		cpu += c
		hwm = max(hwm, h)
	}
	topicBytes, err := e.kafka.TopicBytes(topic)
	if err != nil {
		return nil, err
	}
	m := map[string]float64{
		"topic_mib":            float64(topicBytes) / (1 << 20),
		"counter_events_per_s": counterRate,
		"cpu_s_per_10k":        cpu / float64(o.rows) * 10_000,
		"db_cpu_s_per_10k":     (dbCPU - dbCPU0) / float64(o.rows) * 10_000,
		"peak_rss_mib":         hwm / 1024,
	}
	if d.published > 0 {
		m["pruned"] = pruned
	}
	if d.fromSlot {
		m["walsender_cpu_s_per_10k"] = walsender / float64(o.rows) * 10_000
		// Every row is out; the slot may not be confirmed past them yet:
		// until it is, new rows wait behind.
		for {
			var caughtUp bool
			if err := e.pool.QueryRow(ctx, `SELECT COALESCE(bool_and(confirmed_flush_lsn >= $1::pg_lsn), false) FROM pg_replication_slots`, walEnd).Scan(&caughtUp); err != nil {
				return nil, err
			}
			if caughtUp {
				break
			}
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("the slot was not confirmed past the rows after %s", o.drainTimeout)
			}
			time.Sleep(50 * time.Millisecond)
		}
		m["caught_up_s"] = time.Since(firstSeen).Seconds()
	}
	if d.writerDeletes || slices.Contains(extra, flagArg(relayconfig.FlagOnPublish, relayconfig.OnPublishDelete)) {
		if left, err := e.unpublished(ctx); err != nil || left != 0 {
			return nil, fmt.Errorf("%d rows left after a delete drain: %v", left, err)
		}
		m["events_per_s"] = counterRate
		return m, nil
	}
	// The published rows were inserted first: ids 1 to d.published.
	done, rate, err := e.drainSpanAfter(ctx, int64(d.published))
	if err != nil {
		return nil, err
	}
	if done != o.rows {
		return nil, fmt.Errorf("%d of %d rows marked published", done, o.rows)
	}
	m["events_per_s"] = rate
	return m, nil
}

// naiveRow is a row as the naive shape claims it.
type naiveRow struct {
	ID                                                  int64
	EventID, EventType, AggregateType, AggregateID, Key string
	Payload                                             []byte
}

// naiveShape drains the table for d the way a hand-written relay commonly
// does, to measure what the relay's design buys (scenario naive-per-row): claim a
// batch with FOR UPDATE SKIP LOCKED through the pool, whose implicit
// transaction ends (and drops the locks) with the SELECT, then publish and
// mark one row at a time, with the relay's Writer settings.
func naiveShape(ctx context.Context, e *benchEnv, topic string, batch int, d time.Duration) error {
	w := relayLikeWriter(e.kafka.Addr(), batch)
	defer w.Close()
	end := time.Now().Add(d)
	for time.Now().Before(end) && ctx.Err() == nil {
		rows, err := e.pool.Query(ctx, `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, partition_key, payload
FROM outbox WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`, batch)
		if err != nil {
			return err
		}
		claimed, err := pgx.CollectRows(rows, pgx.RowToStructByPos[naiveRow])
		if err != nil || len(claimed) == 0 {
			return err
		}
		for _, c := range claimed {
			if time.Now().After(end) {
				return nil
			}
			err := w.WriteMessages(ctx, kafka.Message{Topic: topic, Key: []byte(c.Key), Value: c.Payload, Headers: []kafka.Header{
				{Key: "event_id", Value: []byte(c.EventID)}, {Key: "event_type", Value: []byte(c.EventType)},
				{Key: "aggregate_type", Value: []byte(c.AggregateType)}, {Key: "aggregate_id", Value: []byte(c.AggregateID)},
			}})
			if err != nil {
				return fmt.Errorf("naive shape publish: %w", err)
			}
			if _, err := e.pool.Exec(ctx, `UPDATE outbox SET published_at = now() WHERE id = $1`, c.ID); err != nil {
				return err
			}
		}
	}
	return ctx.Err()
}

// warmUp runs one unmeasured claim+mark loop and, when Kafka is up, one
// relay drain, so the first measured repetition does not pay for cold
// caches and the broker's JIT compilation.
func warmUp(ctx context.Context, o *options, e *benchEnv) error {
	n := min(o.rows, 20_000)
	logf("== warm-up (%d rows, not measured)", n)
	if err := e.freshTable(ctx, n); err != nil {
		return err
	}
	if err := ceilingLoops(ctx, e.dsn, 50, 1); err != nil {
		return err
	}
	if e.kafka == nil || e.relayBin == "" {
		return nil
	}
	wo := *o
	wo.rows = n
	_, err := relayDrain(ctx, &wo, e, 50, 1, "")
	return err
}

// slotBacklog makes the table's replication slot with a relay that streams
// (extra), stops it, and writes o.rows rows, a thousand a transaction,
// into the WAL behind the slot (with writerDeletes each transaction
// deletes its rows, as writers with writer deletes do). It returns the
// WAL position after them.
func (e *benchEnv) slotBacklog(ctx context.Context, o *options, topic string, writerDeletes bool, extra ...string) (string, error) {
	p, err := e.readyRelay(ctx, topic, false, extra...)
	if err != nil {
		return "", err
	}
	stopRelay(p)
	const perTx = 1000
	for done := 0; done < o.rows; done += perTx {
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, outboxtest.InsertRowsSQL, min(perTx, o.rows-done), 1000, []string{eventType}); err != nil {
				return err
			}
			if writerDeletes {
				_, err := tx.Exec(ctx, `DELETE FROM outbox`)
				return err
			}
			return nil
		})
		if err != nil {
			return "", fmt.Errorf("write the slot's backlog: %w", err)
		}
	}
	var end string
	err = e.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end)
	return end, err
}
