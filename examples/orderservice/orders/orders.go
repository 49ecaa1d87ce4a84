// Package orders is an example order service built on the project's outbox
// writer: ConfirmOrder changes an order and stores its OrderConfirmed event
// in the outbox within one transaction, so the event exists if and only if
// the confirmation committed. The relay then publishes it to Kafka.
package orders

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// Schema creates the orders table (the outbox table comes from `relay schema`).
const Schema = `CREATE TABLE IF NOT EXISTS orders (
    id           text        PRIMARY KEY,
    customer_id  text        NOT NULL,
    total_kopecks bigint     NOT NULL,
    status       text        NOT NULL DEFAULT 'new',
    confirmed_at timestamptz
);`

// Order is an order aggregate.
type Order struct {
	ID           string
	CustomerID   string
	TotalKopecks int64 // minor units, never float
	Status       string
}

// ErrAlreadyConfirmed is returned when confirming a confirmed order.
var ErrAlreadyConfirmed = errors.New("order already confirmed")

// Confirm moves the order to confirmed.
func (o *Order) Confirm() error {
	if o.Status == "confirmed" {
		return ErrAlreadyConfirmed
	}
	o.Status = "confirmed"
	return nil
}

// OrderConfirmedEvent is the event's payload; NewOrderConfirmedEvent is the
// only way to make one.
type OrderConfirmedEvent struct {
	EventID    string    `json:"event_id"`
	OccurredAt time.Time `json:"occurred_at"`
	OrderID    string    `json:"order_id"`
	CustomerID string    `json:"customer_id"`
	TotalRUB   int64     `json:"total_rub"` // kopecks
	EventType  string    `json:"event_type"`
}

// EventTypeOrderConfirmed is the event type the relay's topic map routes.
const EventTypeOrderConfirmed = "OrderConfirmed"

// NewOrderConfirmedEvent builds the event for a confirmed order.
func NewOrderConfirmedEvent(o Order) OrderConfirmedEvent {
	return OrderConfirmedEvent{
		EventID:    outbox.NewEventID(),
		OccurredAt: time.Now().UTC(),
		OrderID:    o.ID,
		CustomerID: o.CustomerID,
		TotalRUB:   o.TotalKopecks,
		EventType:  EventTypeOrderConfirmed,
	}
}

// ConfirmOrderHandler confirms orders.
type ConfirmOrderHandler struct {
	DB     *pgxpool.Pool
	Outbox *outbox.Writer
}

// Handle confirms the order and stores its event in the same transaction.
// It returns the stored event.
func (h *ConfirmOrderHandler) Handle(ctx context.Context, orderID string) (OrderConfirmedEvent, error) {
	tx, err := h.DB.Begin(ctx)
	if err != nil {
		return OrderConfirmedEvent{}, fmt.Errorf("begin tx: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit

	var o Order
	err = tx.QueryRow(ctx, `SELECT id, customer_id, total_kopecks, status FROM orders WHERE id = $1 FOR UPDATE`, orderID).
		Scan(&o.ID, &o.CustomerID, &o.TotalKopecks, &o.Status)
	if err != nil {
		return OrderConfirmedEvent{}, fmt.Errorf("load order %s: %w", orderID, err)
	}
	if err := o.Confirm(); err != nil {
		return OrderConfirmedEvent{}, err
	}
	if _, err := tx.Exec(ctx, `UPDATE orders SET status = $2, confirmed_at = now() WHERE id = $1`, o.ID, o.Status); err != nil {
		return OrderConfirmedEvent{}, fmt.Errorf("save order %s: %w", o.ID, err)
	}
	evt := NewOrderConfirmedEvent(o)
	payload, err := json.Marshal(evt)
	if err != nil {
		return OrderConfirmedEvent{}, fmt.Errorf("marshal %T: %w", evt, err)
	}
	if err := h.Outbox.Store(ctx, tx, outbox.Entry{
		EventID:       evt.EventID,
		AggregateType: "Order",
		AggregateID:   o.ID,
		EventType:     EventTypeOrderConfirmed,
		Payload:       payload,
		PartitionKey:  o.ID,
	}); err != nil {
		return OrderConfirmedEvent{}, err
	}
	return evt, tx.Commit(ctx)
}

// CreateOrder inserts a new order.
func CreateOrder(ctx context.Context, db *pgxpool.Pool, o Order) error {
	_, err := db.Exec(ctx, `INSERT INTO orders (id, customer_id, total_kopecks) VALUES ($1, $2, $3)`, o.ID, o.CustomerID, o.TotalKopecks)
	if err != nil {
		return fmt.Errorf("create order %s: %w", o.ID, err)
	}
	return nil
}

// ConfirmOrders creates and confirms random orders, rate a second, until ctx
// ends or, when count > 0, count orders were tried; it hands each outcome to
// report, and stops with the error report returns. A confirmation under way
// when ctx ends runs to its end, so its outcome is a real one.
func ConfirmOrders(ctx context.Context, h *ConfirmOrderHandler, rate float64, count int,
	report func(o Order, evt OrderConfirmedEvent, err error) error) error {
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	for i := 1; count == 0 || i <= count; i++ {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		o := Order{ID: outbox.NewEventID(), CustomerID: fmt.Sprintf("customer-%02d", rand.IntN(100)), TotalKopecks: rand.Int64N(1_000_000)}
		octx := context.WithoutCancel(ctx)
		var evt OrderConfirmedEvent
		err := CreateOrder(octx, h.DB, o)
		if err == nil {
			evt, err = h.Handle(octx, o.ID)
		}
		if err := report(o, evt, err); err != nil {
			return err
		}
	}
	return nil
}
