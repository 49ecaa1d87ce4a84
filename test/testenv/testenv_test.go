package testenv_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka|testenv.NeedKube))
}

func TestPostgresFreshDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testenv.PG().NewDatabase(t)
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer conn.Close(ctx)

	var db string
	var tables int
	require.NoError(t, conn.QueryRow(ctx,
		`SELECT current_database(), (SELECT count(*) FROM pg_tables WHERE schemaname = 'public')`).Scan(&db, &tables))
	require.Equal(t, conn.Config().Database, db)
	require.Zero(t, tables, "a fresh database has no tables")

	var sum int
	require.NoError(t, conn.QueryRow(ctx, `SELECT sum(g) FROM generate_series(1, 100) g`).Scan(&sum))
	require.Equal(t, 5050, sum)
}

func TestKafkaRoundTripWithHeaders(t *testing.T) {
	t.Parallel()
	b := testenv.Broker()
	topic := b.TopicName(t, "smoke")
	b.CreateTopic(t, topic, 3)

	w := &kafka.Writer{
		Addr:         kafka.TCP(b.Addr()),
		Topic:        topic,
		RequiredAcks: kafka.RequireAll,
		Balancer:     &kafka.Murmur2Balancer{},
		BatchTimeout: time.Millisecond,
	}
	defer w.Close()
	var msgs []kafka.Message
	for i := range 20 {
		msgs = append(msgs, kafka.Message{
			Key:   []byte(fmt.Sprintf("key-%d", i%5)),
			Value: []byte(fmt.Sprintf(`{"n":%d}`, i)),
			Headers: []kafka.Header{
				{Key: "event_id", Value: []byte(fmt.Sprintf("id-%d", i))},
				{Key: "event_type", Value: []byte("smoke")},
			},
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, w.WriteMessages(ctx, msgs...))

	got := b.Consume(t, topic, len(msgs), 30*time.Second)
	require.Len(t, got, len(msgs))
	byID := map[string]kafka.Message{}
	for _, m := range got {
		byID[testenv.Header(m, "event_id")] = m
	}
	for i := range 20 {
		m, ok := byID[fmt.Sprintf("id-%d", i)]
		require.True(t, ok, "event id-%d read back", i)
		require.Equal(t, fmt.Sprintf("key-%d", i%5), string(m.Key))
		require.Equal(t, fmt.Sprintf(`{"n":%d}`, i), string(m.Value))
		require.Equal(t, "smoke", testenv.Header(m, "event_type"))
	}
}

func TestKubeNamespaceRoundTrip(t *testing.T) {
	t.Parallel()
	c, err := client.New(testenv.Kube().Config, client.Options{})
	require.NoError(t, err)
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "smoke-test"}}
	require.NoError(t, c.Create(ctx, ns))
	var got corev1.Namespace
	require.NoError(t, c.Get(ctx, client.ObjectKey{Name: "smoke-test"}, &got))
	require.Equal(t, "smoke-test", got.Name)
	require.NotEmpty(t, got.UID)
}
