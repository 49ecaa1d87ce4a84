package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// heldTimeout bounds `relay held` and `relay redrive`.
const heldTimeout = 30 * time.Second

// runHeld lists the held rows (`relay held`), or releases them (`relay
// redrive`). Both take --dsn and --table from RELAY_DSN and RELAY_TABLE when
// not given, so `kubectl exec deploy/<name>-relay -- /relay held` works.
func runHeld(args []string, redrive bool, stdout, stderr io.Writer) int {
	cmd := "relay held"
	if redrive {
		cmd = "relay redrive"
	}
	s, err := relayconfig.ParseHeld(args, redrive, os.LookupEnv, stderr)
	if err != nil {
		if errors.Is(err, relayconfig.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
		return 2
	}
	table, _ := outbox.ParseTable(s.Table) // ParseHeld checked it
	ctx, cancel := context.WithTimeout(context.Background(), heldTimeout)
	defer cancel()
	t, tokens, err := databaseLogin(s.DatabaseLogin)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
		return 2
	}
	conn, err := relay.Connect(ctx, s.DSN, t, tokens)
	if err != nil {
		fmt.Fprintf(stderr, "%s: connect to PostgreSQL: %v\n", cmd, err)
		return 1
	}
	defer conn.Close(context.Background())
	f := relay.HeldFilter{IDs: s.IDs, Reasons: s.Reasons, Types: s.Types, All: s.All}
	if redrive {
		n, err := relay.Redrive(ctx, conn, table, f)
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
			return 1
		}
		fmt.Fprintf(stdout, "released %d held rows of %s; the relays try them again within seconds\n", n, table)
		return 0
	}
	if f.Empty() {
		f.All = true
	}
	// One row more than --limit tells whether there are more: exactly
	// --limit rows are not cut off.
	rows, err := relay.ListHeld(ctx, conn, table, f, s.Limit+1)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
		return 1
	}
	more := len(rows) > s.Limit
	rows = rows[:min(len(rows), s.Limit)]
	// Cut off at --limit: said on stderr in both outputs, so that the JSON
	// on stdout stays the array it was.
	cut := func() {
		if more {
			fmt.Fprintf(stderr, "(the first %d; --%s lists more)\n", s.Limit, relayconfig.FlagLimit)
		}
	}
	if s.Output == "json" {
		if rows == nil {
			rows = []relay.HeldRow{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rows); err != nil {
			return 1
		}
		cut()
		return 0
	}
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tEVENT ID\tTYPE\tREASON\tATTEMPTS\tFIRST\tLAST\tRETRY\tERROR")
	for _, r := range rows {
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.ID, r.EventID, r.EventType, r.Reason, r.Attempts,
			r.FirstAttempt.UTC().Format(time.RFC3339), r.LastAttempt.UTC().Format(time.RFC3339), r.RetryAt.UTC().Format(time.RFC3339), r.Error)
	}
	w.Flush()
	cut()
	return 0
}
