package main

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-operator/examples/orderservice/orders"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// orderService is examples/orderservice running in the demo's process: it
// creates an order and confirms it with the seeds' ConfirmOrder handler (the
// order update and its outbox row in one transaction), rate times a second.
type orderService struct {
	db        *pgxpool.Pool
	confirmed atomic.Int64
	failures  atomic.Int64
	lastErr   atomic.Pointer[string]
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

func startOrderService(ctx context.Context, dsn string, rate float64, log *slog.Logger) (*orderService, error) {
	db, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, err
	}
	w, err := outbox.NewWriter(outbox.DefaultTable)
	if err != nil {
		db.Close()
		return nil, err
	}
	h := &orders.ConfirmOrderHandler{DB: db, Outbox: w}
	ctx, cancel := context.WithCancel(ctx)
	s := &orderService{db: db, cancel: cancel}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			o := orders.Order{ID: outbox.NewEventID(), CustomerID: jitterID(), TotalKopecks: rand.Int64N(1_000_000)}
			err := orders.CreateOrder(ctx, db, o)
			if err == nil {
				_, err = h.Handle(ctx, o.ID)
			}
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				s.failures.Add(1)
				msg := err.Error()
				s.lastErr.Store(&msg)
				log.Warn("confirm order", "err", err)
				continue
			}
			s.confirmed.Add(1)
		}
	}()
	return s, nil
}

// Close stops the service and closes its pool.
func (s *orderService) Close() {
	s.cancel()
	s.wg.Wait()
	s.db.Close()
}

// counts reads the outbox: rows written, published and waiting.
func (s *orderService) counts(ctx context.Context) (written, published, backlog int64, err error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err = s.db.QueryRow(ctx, `SELECT count(*), count(published_at), count(*) - count(published_at) FROM outbox`).
		Scan(&written, &published, &backlog)
	if err != nil {
		err = fmt.Errorf("count outbox rows: %w", err)
	}
	return
}
