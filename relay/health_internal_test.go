package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// An idle relay sleeping its poll interval (up to an hour) is not wedged:
// the liveness probe must not restart it while it waits.
func TestIdleSleepIsNotWedged(t *testing.T) {
	t0 := time.Now()
	h := newHealth(10*time.Second, 45*time.Second, t0)
	h.iteration(t0)
	h.idleUntil(t0.Add(5 * time.Minute)) // --poll-interval 5m, empty table
	if _, wedged := h.stalls(t0.Add(4 * time.Minute))[StallLoopWedged]; wedged {
		t.Fatal("a relay sleeping its poll interval was called wedged")
	}
	// After the sleep ended, a loop that does not move is wedged.
	if _, wedged := h.stalls(t0.Add(5*time.Minute + 46*time.Second))[StallLoopWedged]; !wedged {
		t.Fatal("a loop that did not move after its sleep ended was not called wedged")
	}
}

// The relay's record size accounting is kafka-go's, so the batches the
// writer cuts at a topic's budget are the ones the broker measures.
func TestRecordSizeMatchesVarintLengths(t *testing.T) {
	for _, c := range []struct{ n, want int }{{0, 1}, {63, 1}, {64, 2}, {8191, 2}, {8192, 3}} {
		if got := varintSize(c.n); got != c.want {
			t.Errorf("varintSize(%d) = %d, want %d", c.n, got, c.want)
		}
	}
	ts := newTopicState(false, 0)
	if b := ts.budget("t"); b >= defaultMaxRecordBytes-recordBatchOverhead || b <= 0 {
		t.Errorf("budget %d does not keep the batch header out of the limit %d", b, defaultMaxRecordBytes)
	}
	if newTopicState(true, 0).budget("t") >= ts.budget("t") {
		t.Error("a compressing writer must keep a margin for the codec's framing")
	}
}

// The wedged limit outlasts one statement of the relay's sessions (30 s,
// which a stream's own queries may take) by the stall timeout, at the
// least settings too. Before, it was a batch's deadline plus the stall
// timeout: 30 s at the least stall timeout and a 10 s publish timeout, and
// the kubelet restarted a relay one statement kept waiting.
func TestWedgedLimitOutlastsAStatement(t *testing.T) {
	t.Parallel()
	for _, publish := range []time.Duration{relayconfig.MinPublishTimeout, 10 * time.Second, time.Minute} {
		cfg := Config{Settings: Settings{PublishTimeout: publish, StallTimeout: relayconfig.MinStallTimeout}}
		require.GreaterOrEqual(t, wedgedAfter(cfg), statementTimeout+relayconfig.MinStallTimeout, "publish timeout %s", publish)
		require.GreaterOrEqual(t, wedgedAfter(cfg), batchDeadline(cfg)+relayconfig.MinStallTimeout, "publish timeout %s", publish)
	}
}

// The start-up check waits out what a later try may not meet, and stops
// on what stands until someone fixes it. Before, only a failed connect was
// waited out: a failover between the connect and the next query, or a
// lock wait past the check's deadline, ended the process, which the
// kubelet restarted with a growing delay.
func TestStartupCheckWaitsOutTransientFailures(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return fmt.Errorf("read the server version: %w", &pgconn.PgError{Code: code}) }
	for _, err := range []error{
		pg("57P01"), // admin shutdown: a failover
		pg("57P03"), // cannot connect now: starting up
		pg("57014"), // canceled: statement_timeout
		pg("08006"), // connection failure
		pg("40P01"), // deadlock
		pg("53300"), // too many connections
		pg("55P03"), // lock not available
		fmt.Errorf("create the publication: %w", context.DeadlineExceeded),
		fmt.Errorf("read columns: %w", io.ErrUnexpectedEOF),
		&net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")},
	} {
		require.True(t, checkTransient(err), "%v", err)
	}
	for _, err := range []error{
		pg("42P01"), // undefined table
		pg("42501"), // insufficient privilege
		pg("55000"), // object not in prerequisite state: wal_level
		errors.New("table outbox does not exist; create it with the DDL from `relay schema --table outbox`"),
	} {
		require.False(t, checkTransient(err), "%v", err)
	}
}

// A statement on the publication that another replica's start-up check
// raced is tried again; a refusal is not.
func TestPublicationRacesAreTriedAgain(t *testing.T) {
	t.Parallel()
	pg := func(code, msg string) error { return &pgconn.PgError{Code: code, Message: msg} }
	require.True(t, publicationRetriable(pg("42710", `publication "p" already exists`)))
	require.True(t, publicationRetriable(pg("23505", `duplicate key value violates unique constraint "pg_publication_pubname_index"`)))
	require.True(t, publicationRetriable(pg("XX000", "tuple concurrently updated")))
	require.True(t, publicationRetriable(pg("55P03", "lock not available")), "checkTransient's too")
	require.False(t, publicationRetriable(pg("XX000", "cache lookup failed for relation 1")))
	require.False(t, publicationRetriable(pg("42501", "must be owner of table outbox")))
}

// A relay whose start-up check waits for the database is not stalled, also
// past the stall timeout: /readyz names the database. Before, it said
// "stalled (no_progress): claimed rows but published none".
func TestWaitingForTheDatabaseIsNoStall(t *testing.T) {
	r, err := New(Config{Settings: Settings{DSN: "postgres://u@127.0.0.1:1/db?connect_timeout=1", Brokers: []string{"127.0.0.1:1"},
		Topics: map[string]string{"E": "t"}}})
	require.NoError(t, err)
	defer r.Close()
	r.health.timeout = time.Second
	r.health.lastProgress = time.Now().Add(-time.Minute) // made a minute ago, waiting since
	var unreachable *UnreachableError
	require.ErrorAs(t, r.Check(context.Background()), &unreachable)
	require.EqualError(t, r.Ready(), "database: unreachable")
}
