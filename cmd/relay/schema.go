package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// runSchema prints the outbox DDL for a table.
func runSchema(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("relay schema", flag.ContinueOnError)
	fs.SetOutput(stderr)
	table := fs.String("table", outbox.DefaultTable, "outbox table, NAME or SCHEMA.NAME")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	t, err := outbox.ParseTable(*table)
	if err != nil {
		fmt.Fprintf(stderr, "relay schema: --table: %v\n", err)
		return 2
	}
	fmt.Fprint(stdout, outbox.SchemaDDL(t))
	return 0
}
