package localcluster

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-operator/examples/orderservice/orders"
	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// The sample (config/samples) names these; the stack provides them.
const (
	// OrdersDatabase is the database in the sample Secret's DSN.
	OrdersDatabase = "orders"
	// RelayRole is the role in the sample Secret's DSN.
	RelayRole = "relay"
	// SampleBrokers and SamplePostgres are the addresses the samples carry;
	// RenderSamples replaces them with the stack's.
	SampleBrokers  = "127.0.0.1:9092"
	SamplePostgres = "127.0.0.1:5432"
)

// SampleTopics are the topics config/samples maps, with their partitions.
var SampleTopics = map[string]int{"orders.confirmed": 3, "orders.cancelled": 1, "orders.dead-letter": 1}

// OrdersDSN is the DSN of the orders database as role.
func (s *Stack) OrdersDSN(role string) string {
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", role, s.Postgres.Port, OrdersDatabase)
}

// PrepareOrders creates what the sample OutboxRelay expects: the orders
// database with the order service's tables (orders, and the outbox from the
// relay's DDL), the relay role with its grants, and the sample's topics.
func (s *Stack) PrepareOrders(ctx context.Context) error {
	if _, err := s.Postgres.CreateDatabase(ctx, OrdersDatabase); err != nil {
		return err
	}
	if err := s.Postgres.Exec(ctx, OrdersDatabase, orders.Schema+"\n"+outbox.SchemaDDL(outbox.Table{Name: outbox.DefaultTable})); err != nil {
		return fmt.Errorf("create the order service's tables: %w", err)
	}
	if err := s.CreateRelayRole(ctx, RelayRole); err != nil {
		return err
	}
	for topic, parts := range SampleTopics {
		if err := s.Kafka.CreateTopicErr(topic, parts); err != nil {
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	return nil
}

// CreateRelayRole creates a login role with the grants a relay needs: on
// the outbox table SELECT, and UPDATE for FOR UPDATE and the mark; on its
// held table (outbox.HeldDDL) SELECT, INSERT, UPDATE and DELETE. Its
// password is its name: the relay pods log in with it.
func (s *Stack) CreateRelayRole(ctx context.Context, role string) error {
	id := pgx.Identifier{role}.Sanitize()
	t := outbox.Table{Name: outbox.DefaultTable}
	sql := fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD %s; GRANT SELECT, UPDATE ON %s TO %s;
		GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;`,
		id, outbox.QuoteLiteral(role), t.Quoted(), id, t.HeldTable().Quoted(), id)
	if err := s.Postgres.Exec(ctx, OrdersDatabase, sql); err != nil {
		return fmt.Errorf("create role %s: %w", role, err)
	}
	return nil
}

// RenderSamples copies config/samples into dst with the stack's broker and
// PostgreSQL addresses as pods reach them (at HostIP) in place of the samples' 127.0.0.1:9092 and
// 127.0.0.1:5432; edit, when set, may change each file further.
func (s *Stack) RenderSamples(dst string, edit func(name string, b []byte) []byte) error {
	src := filepath.Join(testenv.RepoRoot(), "config", "samples")
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".yaml") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			return err
		}
		b = bytes.ReplaceAll(b, []byte(SampleBrokers), []byte(s.Kafka.Addr()))
		b = bytes.ReplaceAll(b, []byte(SamplePostgres), []byte(net.JoinHostPort(s.Postgres.Host, strconv.Itoa(s.Postgres.Port))))
		if edit != nil {
			b = edit(e.Name(), b)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}
