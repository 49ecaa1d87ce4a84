// Command orderservice is the example order service, runnable: it
// creates its tables (orders, and the outbox from the relay's DDL), then
// creates and confirms orders at a steady rate, each confirmation one
// transaction with its outbox row. Run a relay beside it to see the events
// reach Kafka.
//
//	orderservice --dsn postgres://... --rate 20
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-operator/examples/orderservice/orders"
	"github.com/outbox-relay/outbox-operator/outbox"
)

func main() {
	dsn := flag.String("dsn", os.Getenv("ORDERS_DSN"), "PostgreSQL connection string (or ORDERS_DSN)")
	table := flag.String("table", outbox.DefaultTable, "outbox table")
	rate := flag.Float64("rate", 20, "orders confirmed per second")
	count := flag.Int("count", 0, "stop after this many orders (0: run until interrupted)")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if *dsn == "" || *rate <= 0 {
		fmt.Fprintln(os.Stderr, "orderservice: --dsn is required and --rate must be positive")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dsn, *table, *rate, *count, log); err != nil {
		log.Error("orderservice stopped", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn, table string, rate float64, count int, log *slog.Logger) error {
	db, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	t, err := outbox.ParseTable(table)
	if err != nil {
		return err
	}
	if _, err := db.Exec(ctx, orders.Schema+"\n"+outbox.SchemaDDL(t)); err != nil {
		return fmt.Errorf("create tables: %w", err)
	}
	w, err := outbox.NewWriter(table)
	if err != nil {
		return err
	}
	h := &orders.ConfirmOrderHandler{DB: db, Outbox: w}
	return orders.ConfirmOrders(ctx, h, rate, count, func(o orders.Order, evt orders.OrderConfirmedEvent, err error) error {
		if err != nil {
			return err
		}
		log.Info("order confirmed", "order_id", o.ID, "event_id", evt.EventID)
		return nil
	})
}
