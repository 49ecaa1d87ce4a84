// Command consumer is an example consumer of the relay's records: it reads
// a topic in a consumer group, processes each event once by its event_id
// (events.Processor), continues the writer's trace when tracing is set up,
// and commits each offset after its event was processed.
//
//	consumer --dsn postgres://... --brokers localhost:9092 --topic orders.confirmed
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"

	"github.com/outbox-relay/outbox-operator/examples/consumer/events"
)

func main() {
	dsn := flag.String("dsn", os.Getenv("CONSUMER_DSN"), "PostgreSQL connection string of the consumer's own database (or CONSUMER_DSN)")
	brokers := flag.String("brokers", "localhost:9092", "Kafka bootstrap brokers, comma-separated")
	topic := flag.String("topic", "", "topic to read")
	group := flag.String("group", "example-consumer", "consumer group")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if *dsn == "" || *topic == "" {
		fmt.Fprintln(os.Stderr, "consumer: --dsn and --topic are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dsn, strings.Split(*brokers, ","), *topic, *group, log); err != nil {
		log.Error("consumer stopped", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn string, brokers []string, topic, group string, log *slog.Logger) error {
	db, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := db.Exec(ctx, events.Schema); err != nil {
		return fmt.Errorf("create processed_events: %w", err)
	}
	p := &events.Processor{
		DB:     db,
		Tracer: otel.Tracer("example-consumer"), // a no-op until the program installs a tracer provider
		Handle: func(ctx context.Context, _ pgx.Tx, e events.Event) error {
			log.Info("event", "event_id", e.ID, "event_type", e.Type, "aggregate_id", e.AggregateID, "payload", string(e.Payload))
			return nil
		},
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, GroupID: group})
	defer r.Close()
	for {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if _, err := p.Process(ctx, m); err != nil {
			return err // the offset stays uncommitted: the event is read again after a restart
		}
		if err := r.CommitMessages(ctx, m); err != nil {
			return err
		}
	}
}
