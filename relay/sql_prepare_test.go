package relay_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Every statement of relay.SQL prepares (parsed, and every table, column
// and parameter type resolved) against the shipped DDL, plain and
// partitioned, with and without the optional headers column, and with a
// held table made before its redriven_at column: a schema change that
// breaks one fails here, not in a relay pod.
func TestEveryStatementPreparesOnTheShippedDDL(t *testing.T) {
	t.Parallel()
	table := outbox.Table{Schema: "app", Name: "outbox"}
	for _, c := range []struct {
		name string
		ddl  string
		opts []relay.SQLOption
	}{
		{"plain", outbox.SchemaDDL(table), []relay.SQLOption{relay.WithHeadersColumn(), relay.WithHeldRedrivenAt()}},
		{"plain without headers", outbox.SchemaDDL(table) + `ALTER TABLE app.outbox DROP COLUMN headers;`, []relay.SQLOption{relay.WithHeldRedrivenAt()}},
		{"plain with a partition column", outbox.SchemaDDL(table) + `ALTER TABLE app.outbox ADD COLUMN kafka_partition smallint;`,
			[]relay.SQLOption{relay.WithHeadersColumn(), relay.WithPartitionColumn("kafka_partition"), relay.WithHeldRedrivenAt()}},
		{"partitioned", outbox.PartitionedSchemaDDL(table, outbox.PartitionDay, 1),
			[]relay.SQLOption{relay.WithHeadersColumn(), relay.WithPartitions(), relay.WithHeldRedrivenAt()}},
		{"bytea payload", outbox.SchemaDDL(table) + `ALTER TABLE app.outbox ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8');`,
			[]relay.SQLOption{relay.WithHeadersColumn(), relay.WithByteaPayload(), relay.WithHeldRedrivenAt()}},
		{"held table from before redriven_at", outbox.SchemaDDL(table) + `ALTER TABLE app.outbox_held DROP COLUMN redriven_at;`,
			[]relay.SQLOption{relay.WithHeadersColumn()}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			conn, err := pgx.Connect(ctx, testenv.PG().NewDatabase(t))
			require.NoError(t, err)
			defer conn.Close(ctx)
			_, err = conn.Exec(ctx, c.ddl)
			require.NoError(t, err)
			sql := relay.NewSQL(table, c.opts...)
			v := reflect.ValueOf(sql)
			n := 0
			for i := range v.NumField() {
				f := v.Type().Field(i)
				if f.Type.Kind() != reflect.String || f.Name == "CreateHeld" { // CreateHeld is the DDL itself
					continue
				}
				stmt := v.Field(i).String()
				require.NotEmpty(t, stmt, f.Name)
				_, err := conn.Prepare(ctx, fmt.Sprintf("s%d", i), stmt)
				require.NoError(t, err, "relay.SQL.%s does not prepare on the %s table:\n%s", f.Name, c.name, stmt)
				n++
			}
			require.GreaterOrEqual(t, n, 12, "every statement was tried")
		})
	}
}
