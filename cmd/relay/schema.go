package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// runSchema prints the outbox DDL for a table: a plain one, or with
// --partitioned one range-partitioned by created_at.
func runSchema(args []string, stdout, stderr io.Writer) int {
	s, err := relayconfig.ParseSchema(args, stderr)
	if err != nil {
		if errors.Is(err, relayconfig.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "relay schema: %v\n", err)
		return 2
	}
	t, _ := outbox.ParseTable(s.Table) // ParseSchema checked it
	if s.Partitioned {
		fmt.Fprint(stdout, outbox.PartitionedSchemaDDL(t, s.Period, s.Ahead))
		return 0
	}
	fmt.Fprint(stdout, outbox.SchemaDDL(t))
	return 0
}
