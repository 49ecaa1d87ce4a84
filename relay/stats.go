package relay

import (
	"context"
	"time"

	"github.com/segmentio/kafka-go"
)

// statsInterval is how often the backlog gauges are refreshed and the
// connections probed for /readyz.
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

func (r *Relay) refreshStats(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	q := r.table.Quoted()
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
	if _, err := tx.Exec(ctx, `SET LOCAL enable_bitmapscan = on`); err != nil {
		return
	}
	rows, err := tx.Query(ctx, `SELECT event_type, count(*) FROM (SELECT event_type FROM `+q+
		` WHERE published_at IS NULL LIMIT $1) s GROUP BY 1`, backlogCap)
	if err != nil {
		if ctx.Err() == nil {
			r.setDBErr(err)
		}
		return
	}
	var backlog, unroutable int64
	var newTypes []string
	for rows.Next() {
		var et string
		var n int64
		if err := rows.Scan(&et, &n); err != nil {
			rows.Close()
			return
		}
		backlog += n
		if _, ok := r.cfg.Topics[et]; !ok {
			unroutable += n
			r.mu.Lock()
			if !r.unroutable[et] {
				r.unroutable[et] = true
				newTypes = append(newTypes, et)
			}
			r.mu.Unlock()
		}
	}
	if rows.Err() != nil {
		return
	}
	for _, et := range newTypes {
		r.log.Warn("rows with an event type missing from the topic map are held until it is mapped", "event_type", et)
	}
	r.m.backlog.Set(float64(backlog))
	r.m.held.WithLabelValues("unroutable").Set(float64(unroutable))

	var age float64
	err = tx.QueryRow(ctx, `SELECT COALESCE((SELECT extract(epoch FROM now() - created_at)::float8 FROM `+q+
		` WHERE published_at IS NULL ORDER BY id LIMIT 1), 0)`).Scan(&age)
	if err == nil {
		r.m.oldestAge.Set(age)
		r.setDBErr(nil)
	}
	if _, err := r.client.Metadata(ctx, &kafka.MetadataRequest{Topics: r.allTopics()}); err != nil {
		if ctx.Err() == nil {
			r.setKafkaErr(err)
		}
	} else {
		r.setKafkaErr(nil)
	}
}
