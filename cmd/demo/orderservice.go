package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-operator/examples/orderservice/orders"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// orderService is examples/orderservice running in the demo's process: it
// creates an order and confirms it with the example's ConfirmOrder handler
// (the order update and its outbox row in one transaction), rate times a
// second.
type orderService struct {
	db        *pgxpool.Pool
	writer    *outbox.Writer
	bursts    atomic.Int64
	confirmed atomic.Int64
	failures  atomic.Int64
	lastErr   atomic.Pointer[string]
	cancel    context.CancelFunc
	done      chan struct{}
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
	s := &orderService{db: db, writer: w, cancel: cancel, done: make(chan struct{})}
	if rate <= 0 {
		close(s.done)
		return s, nil
	}
	go func() {
		defer close(s.done)
		_ = orders.ConfirmOrders(ctx, h, rate, 0, func(_ orders.Order, _ orders.OrderConfirmedEvent, err error) error {
			if err != nil {
				s.failures.Add(1)
				msg := err.Error()
				s.lastErr.Store(&msg)
				log.Warn("confirm order", "err", err)
				return nil // the demo goes on; the screen shows the failures
			}
			s.confirmed.Add(1)
			return nil
		})
	}()
	return s, nil
}

// burst writes n OrderConfirmed events in one transaction, as a batch job
// or a backfill would.
func (s *orderService) burst(ctx context.Context, n int) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	seq := s.bursts.Add(1)
	for i := range n {
		evt := orders.NewOrderConfirmedEvent(orders.Order{ID: fmt.Sprintf("burst-%d-%d", seq, i),
			CustomerID: fmt.Sprintf("customer-%02d", i%100), TotalKopecks: int64(1000 + i%500000)})
		payload, err := json.Marshal(evt)
		if err != nil {
			return err
		}
		if err := s.writer.Store(ctx, tx, outbox.Entry{EventID: evt.EventID, AggregateType: "Order", AggregateID: evt.OrderID,
			EventType: evt.EventType, Payload: payload, PartitionKey: evt.OrderID}); err != nil {
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	s.confirmed.Add(int64(n))
	return nil
}

// Close stops the service and closes its pool.
func (s *orderService) Close() {
	s.cancel()
	<-s.done
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
