package relay

import (
	"context"
	"errors"
	"time"

	"github.com/segmentio/kafka-go"
)

// statsInterval is how often the backlog gauges, the topics' state and the
// stall check are refreshed and the connections probed for /readyz.
const statsInterval = 5 * time.Second

// backlogCap bounds the backlog count so it stays cheap on a huge table.
const backlogCap = 100000

func (r *Relay) statsLoop(ctx context.Context) {
	t := time.NewTicker(statsInterval)
	defer t.Stop()
	for {
		r.refreshStats(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// statsTimeout bounds each of the stats' refreshes (the brokers, the
// backlog, the held table), and the held table's first read at start-up: a
// database or broker that does not answer (a network that drops packets)
// does not hold the loop up past it. Each has its own: before, brokers
// that did not answer used up the one budget of all three, and the held
// table went unread (a redrive unseen, other replicas' holds unknown, its
// sweep skipped) for as long as they did not.
const statsTimeout = 4 * time.Second

func (r *Relay) refreshStats(ctx context.Context) {
	for _, refresh := range []func(context.Context){r.refreshKafka, r.refreshBacklog, r.refreshHeld, r.sweepHeld} {
		rctx, cancel := context.WithTimeout(ctx, statsTimeout)
		refresh(rctx)
		cancel()
	}
	stalls := r.health.stalls(time.Now())
	for _, reason := range stallReasons {
		_, stalled := stalls[reason]
		r.m.stalled.WithLabelValues(reason).Set(boolGauge(stalled))
	}
}

// refreshKafka probes the brokers and re-reads the topics' record limits.
// kafka-go's transport answers a metadata request from its cache, and
// keeps a layout it knew through every failure to refresh it, so the
// probe is a round trip to a broker besides: before, brokers that had
// answered once never read as unreachable (readiness, brokersDown).
func (r *Relay) refreshKafka(ctx context.Context) {
	read := r.topics.readStarted()
	md, err := r.client.Metadata(ctx, &kafka.MetadataRequest{Topics: r.allTopics()})
	if err == nil {
		_, err = r.client.ApiVersions(ctx, &kafka.ApiVersionsRequest{})
		if err != nil && ctx.Err() == nil {
			// Once more: the pooled connection may be to a broker that
			// restarted, and a new one says whether the brokers answer.
			_, err = r.client.ApiVersions(ctx, &kafka.ApiVersionsRequest{})
		}
	}
	if err != nil {
		// A probe that ran out of time counts (a network that drops
		// packets answers nothing); one cut short by shutdown does not.
		if !errors.Is(ctx.Err(), context.Canceled) {
			r.setKafkaErr(err)
			r.brokersDownSince.CompareAndSwap(0, time.Now().UnixNano())
		}
		return
	}
	r.topics.setPartitions(read, md)
	r.setKafkaErr(nil)
	r.brokersDownSince.Store(0)
	if err := r.topics.refreshLimits(ctx, r.client, r.allTopics(), r.cfg.HeldRetryInterval); err != nil {
		r.log.Debug("could not refresh the topics' record size limits", "err", err)
	}
}

// refreshBacklog counts the unpublished rows, those held by type, the age
// of the oldest one and of the oldest one this replica could claim.
func (r *Relay) refreshBacklog(ctx context.Context) {
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		if ctx.Err() == nil {
			r.setDBErr(err)
		}
		return
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only
	// Relay sessions run with bitmap scans off, for the claim; a count over
	// the backlog is better served with them (else, on stale statistics,
	// perhaps a sequential scan of the whole table every few seconds).
	if _, err := tx.Exec(ctx, sqlBitmapScansOn); err != nil {
		return
	}
	rows, err := tx.Query(ctx, r.sql.BacklogByType, backlogCap)
	if err != nil {
		if ctx.Err() == nil {
			r.setDBErr(err)
		}
		return
	}
	down := r.topics.downTopics()
	var backlog, unroutable, unavailable int64
	var newTypes []string
	for rows.Next() {
		var et *string
		var n int64
		if err := rows.Scan(&et, &n); err != nil {
			rows.Close()
			return
		}
		backlog += n
		if et == nil {
			continue // NULL event types are claimed (and held as invalid) in partition-key mode only
		}
		topic, mapped := r.cfg.Topics[*et]
		if _, isDown := down[topic]; mapped && isDown {
			unavailable += n
		}
		if mapped {
			continue
		}
		unroutable += n
		r.mu.Lock()
		if !r.unroutable[*et] {
			r.unroutable[*et] = true
			newTypes = append(newTypes, *et)
		}
		r.mu.Unlock()
	}
	if rows.Err() != nil {
		return
	}
	for _, et := range newTypes {
		r.log.Warn("rows with an event type missing from the topic map are held until it is mapped",
			"event_type", et, "reason", HeldUnroutable)
	}
	r.m.backlog.Set(float64(backlog))
	r.m.held.WithLabelValues(HeldUnroutable).Set(float64(unroutable))
	r.m.held.WithLabelValues(HeldTopicUnavailable).Set(float64(unavailable))

	var age float64
	if err := tx.QueryRow(ctx, r.sql.OldestAge).Scan(&age); err == nil {
		r.m.oldestAge.Set(age)
		r.setDBErr(nil)
	}
	if f := r.filter.Load(); f != nil {
		if err := tx.QueryRow(ctx, r.sql.OldestWaiting, f.types, f.held, f.keys, f.keyTypes, f.buckets).Scan(&age); err == nil {
			r.health.setOldestWaiting(time.Duration(age * float64(time.Second)))
		}
	}
}

// heldSweepEvery is how many stats refreshes pass between sweeps of the
// held table's records of rows published meanwhile.
const heldSweepEvery = 12

// sweepHeld removes, every heldSweepEvery stats refreshes (the first at
// the stats loop's start), the held table's records of rows published or
// gone. A refresh of its own, with its own time: before, it ran with the
// held table's load, before it, and a slow sweep made a restarted relay's
// first load run out its time, so it tried its holds again at once.
func (r *Relay) sweepHeld(ctx context.Context) {
	if !r.held.recorded {
		return
	}
	sweep := r.heldSweeps%heldSweepEvery == 0
	r.heldSweeps++
	if !sweep {
		return
	}
	if _, err := r.pool.Exec(ctx, r.sql.SweepHeld); err != nil && !errors.Is(err, context.Canceled) {
		r.log.Warn("could not sweep the held table", "table", r.table.HeldTable().String(), "err", err)
	}
}

// refreshHeld reloads the held table for the loop to merge (what other
// replicas held, what `relay redrive` released).
func (r *Relay) refreshHeld(ctx context.Context) {
	if !r.held.recorded { // set by Check, before Run starts this loop
		return
	}
	at := time.Now()
	lanes := r.lanes != nil
	load := r.sql.LoadHeld
	if lanes {
		load = r.sql.LoadHeldLanes
	}
	rows, err := r.pool.Query(ctx, load, heldCacheRows)
	if err != nil {
		if !errors.Is(err, context.Canceled) { // a timeout is worth a line: the holds are not known meanwhile
			r.log.Warn("could not read the held table", "table", r.table.HeldTable().String(), "err", err)
		}
		return
	}
	snap := heldSnapshot{at: at, rows: map[int64]heldRow{}}
	for rows.Next() {
		var id int64
		var h heldRow
		var wait float64
		dest := []any{&id, &h.reason, &wait}
		if lanes {
			dest = append(dest, &h.key, &h.eventType, &h.bucket, &h.waiting)
		}
		if err := rows.Scan(dest...); err != nil {
			rows.Close()
			r.log.Warn("could not read the held table", "table", r.table.HeldTable().String(), "err", err)
			return
		}
		h.until = at.Add(time.Duration(wait * float64(time.Second)))
		snap.rows[id] = h
		snap.last = h.until
	}
	if err := rows.Err(); err != nil {
		if !errors.Is(err, context.Canceled) {
			r.log.Warn("could not read the held table", "table", r.table.HeldTable().String(), "err", err)
		}
		return
	}
	snap.complete = len(snap.rows) < heldCacheRows
	r.heldSnap.Store(&snap)
}
