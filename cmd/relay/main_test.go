package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka))
}

// 3. A relay killed with SIGKILL mid-drain, then restarted: none lost,
// duplicates at most one batch.
func TestSIGKILLMidDrainLosesNothing(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 4, "E")
	const n, batch = 30000, 100
	f.Insert(n, 500, "E")
	p := outboxtest.StartRelayProcess(t, f.Args("--batch-size", "100"), f.Env()...)
	require.Eventually(t, func() bool { return f.Unpublished() < n-3000 }, 60*time.Second, 5*time.Millisecond)
	p.Signal(t, syscall.SIGKILL)
	p.Wait(t, 10*time.Second)
	require.Greater(t, f.Unpublished(), 0, "killed mid-drain")
	outboxtest.StartRelayProcess(t, f.Args("--batch-size", "100"), f.Env()...)
	f.WaitDrained(0, 2*time.Minute)
	counts, _ := outboxtest.Deliveries(t, n, f.Topics["E"])
	dups := outboxtest.RequireAtLeastOnce(t, f.EventIDs(""), counts)
	require.LessOrEqual(t, dups, relayconfig.DefaultMaxInFlight*batch, "duplicates after a crash are bounded by the batches in flight")
}

// 8. SIGTERM mid-drain: exit 0 quickly, nothing lost, no row left locked.
func TestSIGTERMMidDrainExitsCleanly(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 2, "E")
	const n = 30000
	f.Insert(n, 100, "E")
	p := outboxtest.StartRelayProcess(t, f.Args("--batch-size", "200"), f.Env()...)
	require.Eventually(t, func() bool { return f.Unpublished() < n-2000 }, 60*time.Second, 5*time.Millisecond)
	start := time.Now()
	p.Signal(t, syscall.SIGTERM)
	require.Equal(t, 0, p.Wait(t, 30*time.Second), p.Output())
	require.Less(t, time.Since(start), 10*time.Second, "exits well inside the grace period")
	left := f.Unpublished()
	require.Greater(t, left, 0, "stopped mid-drain")
	// Every unpublished row can be locked at once: the relay left none locked.
	require.Equal(t, left, f.Count(`SELECT count(*) FROM (SELECT 1 FROM outbox WHERE published_at IS NULL FOR UPDATE NOWAIT) s`))
	// What was marked was published exactly once; the rest follows on restart.
	published := f.EventIDs("WHERE published_at IS NOT NULL")
	counts, _ := outboxtest.Deliveries(t, len(published), f.Topics["E"])
	outboxtest.RequireExactlyOnce(t, published, counts)

	outboxtest.StartRelayProcess(t, f.Args("--batch-size", "200"), f.Env()...)
	f.WaitDrained(0, 2*time.Minute)
	counts, _ = outboxtest.Deliveries(t, n, f.Topics["E"])
	outboxtest.RequireExactlyOnce(t, f.EventIDs(""), counts)
}

// 4. The broker stopped for 10 s mid-drain, then started: nothing lost, the
// relay recovers by itself. Not parallel: it stops the shared broker.
func TestBrokerOutageMidDrain(t *testing.T) {
	f := outboxtest.NewFixture(t, 2, "E")
	const n = 20000
	f.Insert(n, 100, "E")
	p := outboxtest.StartRelayProcess(t, f.Args("--batch-size", "100"), f.Env()...)
	p.WaitReady(t, 30*time.Second)
	require.Eventually(t, func() bool { return f.Unpublished() < n-1000 }, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, testenv.Broker().Stop())
	stoppedAt := f.Unpublished()
	outageEnds := time.Now().Add(10 * time.Second) // the outage the scenario asks for
	require.Eventually(t, func() bool { return readyz(p) == http.StatusServiceUnavailable }, 10*time.Second, 50*time.Millisecond,
		"/readyz fails while Kafka is unreachable")
	time.Sleep(time.Until(outageEnds))
	require.Greater(t, f.Unpublished(), 0)
	require.InDelta(t, stoppedAt, f.Unpublished(), 200, "nothing is marked while the broker is down")
	require.NoError(t, testenv.Broker().Start())
	requireRecovered(t, f, p, n)
}

// requireRecovered checks a relay process drained the table by itself after
// an outage, turned ready again, lost nothing, and published at most the
// batches it had in flight (of 100 rows) twice.
func requireRecovered(t *testing.T, f *outboxtest.Fixture, p *outboxtest.Proc, n int) {
	t.Helper()
	f.WaitDrained(0, 2*time.Minute)
	require.Eventually(t, func() bool { return readyz(p) == http.StatusOK }, 30*time.Second, 50*time.Millisecond)
	counts, _ := outboxtest.Deliveries(t, n, f.Topics["E"])
	dups := outboxtest.RequireAtLeastOnce(t, f.EventIDs(""), counts)
	require.LessOrEqual(t, dups, relayconfig.DefaultMaxInFlight*100, "bounded by the batches in flight")
	require.Nil(t, p.Cmd.ProcessState, "the relay kept running through the outage")
}

// 5. PostgreSQL restarted mid-drain: nothing lost, the relay reconnects by
// itself. Not parallel: it restarts the shared cluster.
func TestPostgresRestartMidDrain(t *testing.T) {
	f := outboxtest.NewFixture(t, 2, "E")
	const n = 20000
	f.Insert(n, 100, "E")
	p := outboxtest.StartRelayProcess(t, f.Args("--batch-size", "100"), f.Env()...)
	require.Eventually(t, func() bool { return f.Unpublished() < n-1000 }, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, testenv.PG().Stop())
	require.Eventually(t, func() bool { return readyz(p) == http.StatusServiceUnavailable }, 15*time.Second, 50*time.Millisecond,
		"/readyz fails while PostgreSQL is unreachable")
	require.NoError(t, testenv.PG().Start())
	f.Pool.Reset()
	requireRecovered(t, f, p, n)
}

// 9. Bad configuration exits non-zero at once, naming the flag and value.
func TestBadConfigurationIsRefused(t *testing.T) {
	t.Parallel()
	bin := outboxtest.RelayBinary(t)
	good := []string{"--brokers", "127.0.0.1:9092", "--topic", "E=t"}
	cases := []struct {
		args []string
		env  []string
		want string
	}{
		{good, nil, "--dsn: required"},
		{append([]string{"--batch-size", "0"}, good...), []string{"RELAY_DSN=postgres://x"}, "--batch-size: 0"},
		{append([]string{"--batch-size", "10001"}, good...), []string{"RELAY_DSN=postgres://x"}, "--batch-size: 10001"},
		{append([]string{"--batch-size", "many"}, good...), []string{"RELAY_DSN=postgres://x"}, `invalid value "many" for flag -batch-size`},
		{append([]string{"--poll-interval", "5ms"}, good...), []string{"RELAY_DSN=postgres://x"}, "--poll-interval: 5ms"},
		{good, []string{"RELAY_DSN=postgres://x", "RELAY_POLL_INTERVAL=soon"}, `RELAY_POLL_INTERVAL (--poll-interval): "soon"`},
		{[]string{"--brokers", "nohost", "--topic", "E=t"}, []string{"RELAY_DSN=postgres://x"}, `--brokers: "nohost"`},
		{[]string{"--brokers", "k:9092"}, []string{"RELAY_DSN=postgres://x"}, "--topic: at least one"},
		{[]string{"--brokers", "k:9092", "--topic", "E"}, []string{"RELAY_DSN=postgres://x"}, `"E" is not EVENT_TYPE=TOPIC`},
		{[]string{"--brokers", "k:9092", "--topic", "E=bad topic"}, []string{"RELAY_DSN=postgres://x"}, `--topic: event type "E": "bad topic"`},
		{append([]string{"--table", "x;drop table y"}, good...), []string{"RELAY_DSN=postgres://x"}, `--table: table "x;drop table y"`},
		{append([]string{"--dead-letter-topic", "t"}, good...), []string{"RELAY_DSN=postgres://x"}, `--dead-letter-topic: "t" is also the topic`},
		{append([]string{"--log-format", "xml"}, good...), []string{"RELAY_DSN=postgres://x"}, `--log-format: "xml"`},
		{append([]string{"--ordering", "sorted"}, good...), []string{"RELAY_DSN=postgres://x"}, `--ordering: "sorted"`},
		{append([]string{"--topics-file", "/nonexistent.yaml"}, good...), []string{"RELAY_DSN=postgres://x"}, "--topics-file: open /nonexistent.yaml"},
		{append([]string{"--kafka-sasl-mechanism", "GSSAPI"}, good...), []string{"RELAY_DSN=postgres://x", "RELAY_KAFKA_SASL_USERNAME=u", "RELAY_KAFKA_SASL_PASSWORD=p"}, `--kafka-sasl-mechanism: "GSSAPI"`},
		{append([]string{"--kafka-tls-ca-file", "/nonexistent.pem"}, good...), []string{"RELAY_DSN=postgres://x"}, "--kafka-tls-ca-file"},
		{append(good, "extra"), []string{"RELAY_DSN=postgres://x"}, `unexpected argument "extra"`},
	}
	for _, c := range cases {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, bin, c.args...)
		cmd.Env = append(os.Environ(), c.env...)
		out, err := cmd.CombinedOutput()
		cancel()
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "%v must fail: %s", c.args, out)
		require.Equal(t, 2, exit.ExitCode(), "%v: %s", c.args, out)
		require.Contains(t, string(out), c.want, "%v", c.args)
		require.Less(t, strings.Count(string(out), "\n"), 4, "one clear message, not a usage dump: %s", out)
	}
}

// A missing table at start-up is fatal, with a message naming it.
func TestStartupCheckFailureExits(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	p := outboxtest.StartRelayProcess(t, []string{"--brokers", testenv.Broker().Addr(), "--topic", "E=" + f.Topics["E"], "--table", "no_such_table"}, f.Env()...)
	require.Equal(t, 1, p.Wait(t, 30*time.Second))
	require.Contains(t, p.Output(), "table no_such_table does not exist")
}

// A mapped topic missing at start-up is no failed check: the process runs,
// names the topic, and publishes the other topics' rows.
func TestMissingTopicAtStartDoesNotStopTheProcess(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(10, 2, "E")
	p := outboxtest.StartRelayProcess(t, []string{"--brokers", testenv.Broker().Addr(), "--topic", "E=" + f.Topics["E"],
		"--topic", "Missing=no.such.topic", "--poll-interval", "20ms"}, f.Env()...)
	f.WaitDrained(0, 30*time.Second)
	require.Contains(t, p.Output(), `topic \"no.such.topic\" (for event type \"Missing\") does not exist in Kafka`)
}

// Flags come from RELAY_* variables too, and --topics-file takes YAML.
func TestEnvironmentAndTopicsFile(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	other := f.NewTopic("other", 1)
	file := t.TempDir() + "/topics.yaml"
	require.NoError(t, os.WriteFile(file, []byte("Other: "+other+"\n"), 0o644))
	f.Insert(10, 2, "E")
	f.Insert(10, 2, "Other")
	outboxtest.StartRelayProcess(t, nil, append(f.Env(),
		"RELAY_BROKERS="+testenv.Broker().Addr(), "RELAY_TOPIC=E="+f.Topics["E"], "RELAY_TOPICS_FILE="+file,
		"RELAY_POLL_INTERVAL=20ms")...)
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, other, 10, 30*time.Second), 10)
}

func readyz(p *outboxtest.Proc) int {
	resp, err := http.Get("http://" + p.MetricsAddr + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// The binary serves its metrics, health and readiness.
func TestMetricsEndpoint(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(120, 4, "E")
	p := outboxtest.StartRelayProcess(t, f.Args(), f.Env()...)
	p.WaitReady(t, 30*time.Second)
	f.WaitDrained(0, 30*time.Second)
	var body string
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + p.MetricsAddr + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return strings.Contains(body, `outbox_relay_events_published_total{topic="`+f.Topics["E"]+`"} 120`)
	}, 15*time.Second, 100*time.Millisecond)
	for _, name := range []string{"outbox_relay_batches_total", "outbox_relay_claim_duration_seconds_bucket",
		"outbox_relay_backlog_rows", "outbox_relay_oldest_unpublished_age_seconds", "outbox_relay_rows_held{reason=\"unroutable\"}",
		"outbox_relay_commit_to_publish_seconds_count 120", "process_resident_memory_bytes"} {
		require.Contains(t, body, name)
	}
	resp, err := http.Get("http://" + p.MetricsAddr + "/healthz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

func TestSchemaSubcommand(t *testing.T) {
	t.Parallel()
	out, err := exec.Command(outboxtest.RelayBinary(t), "schema", "--table", "app.outbox").Output()
	require.NoError(t, err)
	require.Contains(t, string(out), `CREATE TABLE "app"."outbox" (`)
	require.Contains(t, string(out), `WHERE published_at IS NULL`)
	require.Contains(t, string(out), `autovacuum_vacuum_scale_factor`)
	// The DDL it prints is what the relay's start-up check accepts.
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(string(out))
	f.Exec(`INSERT INTO app.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key) VALUES (gen_random_uuid(), 'a', 'b', 'E', '{}', 'k')`)
	outboxtest.StartRelayProcess(t, f.Args("--table", "app.outbox"), f.Env()...)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM app.outbox WHERE published_at IS NULL`) == 0
	}, 30*time.Second, 50*time.Millisecond)

	bad, err := exec.Command(outboxtest.RelayBinary(t), "schema", "--table", `x"; drop`).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(bad), "--table")
}

// `relay schema --partitioned` prints DDL that applies, lays out the current
// partition and the ones ahead, and that a relay with retention starts on;
// the writer stores into it and the relay publishes.
func TestSchemaSubcommandPartitioned(t *testing.T) {
	t.Parallel()
	out, err := exec.Command(outboxtest.RelayBinary(t), "schema", "--table", "app.outbox", "--partitioned", "--partitions-ahead", "3").Output()
	require.NoError(t, err)
	require.Contains(t, string(out), `PARTITION BY RANGE (created_at)`)
	require.Contains(t, string(out), `CREATE TABLE "app"."outbox_event_ids" (`)
	f := outboxtest.NewFixture(t, 1, "E")
	f.Exec(string(out))
	require.Equal(t, 4, f.Count(`SELECT count(*) FROM pg_inherits WHERE inhparent = 'app.outbox'::regclass`))
	require.Zero(t, f.Count(`SELECT partdefid::int FROM pg_partitioned_table WHERE partrelid = 'app.outbox'::regclass`), "no DEFAULT partition")
	w, err := outbox.NewWriter("app.outbox")
	require.NoError(t, err)
	ctx := context.Background()
	tx, err := f.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, w.Store(ctx, tx, outbox.Entry{EventID: outbox.NewEventID(), AggregateType: "Order", AggregateID: "o1",
		EventType: "E", Payload: []byte(`{}`), PartitionKey: "o1"}))
	require.NoError(t, tx.Commit(ctx))
	p := outboxtest.StartRelayProcess(t, f.Args("--table", "app.outbox", "--keep-published-for", "1h"), f.Env()...)
	require.Eventually(t, func() bool {
		return f.Count(`SELECT count(*) FROM app.outbox WHERE published_at IS NULL`) == 0
	}, 30*time.Second, 50*time.Millisecond)
	require.Contains(t, p.Output(), "the table is partitioned")
}

// `relay held` lists the held rows (DSN and table from the environment, as
// in a relay pod), `relay redrive` releases them by reason, and bad
// selections are refused naming the flag and the value.
func TestHeldAndRedriveSubcommands(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(3, 3, "E")
	f.Exec(`INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		SELECT id, event_id::text, event_type, CASE WHEN id = 1 THEN 'too_large' ELSE 'refused' END,
		       'MESSAGE_TOO_LARGE', now() + interval '1 hour' FROM outbox WHERE id IN (1, 2)`)
	env := append(os.Environ(), relayconfig.EnvDSN+"="+f.DSN)
	cmd := func(args ...string) (string, error) {
		c := exec.Command(outboxtest.RelayBinary(t), args...)
		c.Env = env
		out, err := c.CombinedOutput()
		return string(out), err
	}

	out, err := cmd("held")
	require.NoError(t, err, out)
	require.Contains(t, out, "ID  EVENT ID")
	require.Regexp(t, `(?m)^1\s+\S+\s+E\s+too_large\s+1\s`, out)
	require.Regexp(t, `(?m)^2\s+\S+\s+E\s+refused\s+1\s`, out)

	out, err = cmd("held", "--reason", "refused", "--output", "json")
	require.NoError(t, err, out)
	require.Contains(t, out, `"reason": "refused"`)
	require.NotContains(t, out, `"too_large"`)

	// Cut off at --limit, the JSON on stdout stays an array and stderr
	// says so, as in the text output.
	c := exec.Command(outboxtest.RelayBinary(t), "held", "--output", "json", "--limit", "1")
	c.Env = env
	var stderr strings.Builder
	c.Stderr = &stderr
	stdout, err := c.Output()
	require.NoError(t, err, stderr.String())
	var listed []map[string]any
	require.NoError(t, json.Unmarshal(stdout, &listed), "stdout is a JSON array: %s", stdout)
	require.Len(t, listed, 1)
	require.Contains(t, stderr.String(), "(the first 1; --limit lists more)")
	// Exactly --limit rows: none is cut off, and nothing says so.
	c = exec.Command(outboxtest.RelayBinary(t), "held", "--limit", "2")
	c.Env = env
	stderr.Reset()
	c.Stderr = &stderr
	listing, err := c.Output()
	require.NoError(t, err, stderr.String())
	require.Regexp(t, `(?m)^2\s`, string(listing))
	require.Empty(t, stderr.String())

	// Kinds of selector narrow each other: the too-large rows of type
	// Other are none, not the too-large row and every row of Other.
	out, err = cmd("held", "--reason", "too_large", "--type", "Other")
	require.NoError(t, err, out)
	require.NotRegexp(t, `(?m)^[12]\s`, out)

	out, err = cmd("redrive", "--reason", "too_large")
	require.NoError(t, err, out)
	require.Contains(t, out, "released 1 held rows of outbox")
	require.Equal(t, 1, f.Count(`SELECT count(*) FROM outbox_held WHERE retry_at <= now()`))

	for _, bad := range [][]string{{"redrive"}, {"redrive", "--reason", "lost"}, {"held", "--id", "x"}, {"redrive", "--all", "--id", "1"}} {
		out, err = cmd(bad...)
		require.Error(t, err, "%v: %s", bad, out)
		require.Equal(t, 2, err.(*exec.ExitError).ExitCode(), out)
	}
	out, _ = cmd("redrive", "--reason", "lost")
	require.Contains(t, out, `flag -reason: "lost" is not one of invalid_row, too_large, refused`)
	out, _ = cmd("redrive")
	require.Contains(t, out, "select the rows to release with --id, --reason or --type, or --all")
}

// `relay held` and `relay redrive` connect as the relay does: with the
// relay's --database-tls-* flags they reach a PostgreSQL that admits the
// role only over TLS, verifying its certificate although the DSN says
// sslmode=disable; without them, or with another CA, they are refused.
func TestHeldAndRedriveTakeTheDatabaseFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, ca, err := testenv.StartPostgresTLS(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Close() })
	_, err = pg.CreateDatabase(ctx, "held")
	require.NoError(t, err)
	require.NoError(t, pg.Exec(ctx, "held", outbox.SchemaDDL(outbox.Table{Name: "outbox"})+`
		CREATE ROLE relay_tls LOGIN PASSWORD 'secret';
		GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO relay_tls;
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES (gen_random_uuid(), 'Order', '1', 'E', '{}', '1');
		INSERT INTO outbox_held (id, event_id, event_type, reason, error, retry_at)
		SELECT id, event_id::text, event_type, 'refused', 'INVALID_RECORD', now() + interval '1 hour' FROM outbox;`))
	require.NoError(t, pg.RequirePassword("relay_tls"))
	dir := t.TempDir()
	caFile, otherFile := dir+"/ca.crt", dir+"/other.crt"
	require.NoError(t, os.WriteFile(caFile, ca.PEM, 0o600))
	other, err := testenv.NewCA("someone-else")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(otherFile, other.PEM, 0o600))
	env := append(os.Environ(), fmt.Sprintf("%s=postgres://relay_tls:secret@127.0.0.1:%d/held?sslmode=disable", relayconfig.EnvDSN, pg.Port))
	cmd := func(args ...string) (string, error) {
		c := exec.Command(outboxtest.RelayBinary(t), args...)
		c.Env = env
		out, err := c.CombinedOutput()
		return string(out), err
	}
	tlsFlag := "--" + relayconfig.FlagDatabaseCAFile

	var out string
	require.Eventually(t, func() bool { // the reload that turns TLS on completes asynchronously
		out, err = cmd("held", tlsFlag, caFile)
		return err == nil
	}, 10*time.Second, 100*time.Millisecond, "over TLS: %s", out)
	require.Regexp(t, `(?m)^1\s+\S+\s+E\s+refused\s+1\s`, out)

	out, err = cmd("held")
	require.Error(t, err, "plain text is rejected for the role: %s", out)
	require.Contains(t, out, "connect to PostgreSQL")
	out, err = cmd("held", tlsFlag, otherFile)
	require.Error(t, err, out)
	require.True(t, strings.Contains(out, "certificate signed by unknown authority") || strings.Contains(out, "certificate is not trusted"), out)
	out, err = cmd("redrive", "--all", "--"+relayconfig.FlagDatabaseCertFile, caFile, tlsFlag, caFile)
	require.Error(t, err, out)
	require.Equal(t, 2, err.(*exec.ExitError).ExitCode(), out)
	require.Contains(t, out, "--"+relayconfig.FlagDatabaseCertFile+": goes together with --"+relayconfig.FlagDatabaseKeyFile)

	out, err = cmd("redrive", "--all", tlsFlag, caFile)
	require.NoError(t, err, out)
	require.Contains(t, out, "released 1 held rows of outbox")
}

// The binary authenticates with OAUTHBEARER from its flags: TLS to the
// broker's SASL_SSL listener with the CA from a file (as a Secret mounts
// it) and the token from a file.
func TestOAuthBearerFromFlags(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	dir := t.TempDir()
	ca, token := dir+"/ca.crt", dir+"/token"
	require.NoError(t, os.WriteFile(ca, testenv.Broker().CA.PEM, 0o644))
	require.NoError(t, os.WriteFile(token, []byte(testenv.UnsecuredJWT("relay", time.Hour)), 0o600))
	f.Insert(10, 2, "E")
	outboxtest.StartRelayProcess(t, nil, append(f.Env(),
		"RELAY_BROKERS="+testenv.Broker().OAuthAddr(), "RELAY_TOPIC=E="+f.Topics["E"], "RELAY_POLL_INTERVAL=20ms",
		"RELAY_KAFKA_TLS=true", "RELAY_KAFKA_TLS_CA_FILE="+ca,
		"RELAY_KAFKA_SASL_MECHANISM=OAUTHBEARER", "RELAY_KAFKA_SASL_OAUTH_TOKEN_FILE="+token)...)
	f.WaitDrained(0, 30*time.Second)
	require.Len(t, testenv.Broker().Consume(t, f.Topics["E"], 10, 30*time.Second), 10)
}

// A metrics address already taken (a sidecar's, or the node's with host
// networking) stops the relay before it claims a row: it exits 1 naming the
// flag and the address, and leaves every row to the next start. Before, the
// address was tried beside the start-up check, so the relay started, and
// exited with its first batch in flight and Run still going.
func TestMetricsAddressTakenStopsBeforeAnyClaim(t *testing.T) {
	t.Parallel()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { taken.Close() })
	f := outboxtest.NewFixture(t, 1, "E")
	f.Insert(50, 2, "E")
	p, err := devproc.Start(devproc.Options{
		Binary: outboxtest.RelayBinary(t),
		Args:   f.Args("--"+relayconfig.FlagMetricsAddr, taken.Addr().String(), "--"+relayconfig.FlagLogFormat, "text"),
		Env:    append(os.Environ(), f.Env()...),
	})
	require.NoError(t, err)
	t.Cleanup(p.Kill)
	code, err := p.Wait(30 * time.Second)
	require.NoError(t, err)
	require.Equal(t, 1, code, p.Output())
	require.Contains(t, p.Output(), "--"+relayconfig.FlagMetricsAddr+" "+taken.Addr().String())
	require.NotContains(t, p.Output(), "relay started", "it stops before the relay runs")
	require.Equal(t, 50, f.Unpublished())
	size, err := testenv.Broker().TopicBytes(f.Topics["E"])
	require.NoError(t, err)
	require.Zero(t, size, "nothing reached Kafka")
}
