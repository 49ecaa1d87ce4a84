package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/internal/testenv"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// eventType is the one event type the benchmark tables hold.
const eventType = "OrderConfirmed"

// benchEnv is the PostgreSQL cluster, the Kafka broker and the relay binary
// every scenario shares.
type benchEnv struct {
	work     string
	pg       *testenv.PostgresCluster
	kafka    *testenv.KafkaBroker
	relayBin string
	dsn      string // the benchmark database
	pool     *pgxpool.Pool
	seq      int
	pgVer    string

	orderingProbe map[string]string // mode -> "" when available, else why not
}

func startEnv(ctx context.Context, o *options, work string) (*benchEnv, error) {
	e := &benchEnv{work: work}
	var err error
	needKafka := false
	for _, s := range o.scenarios {
		if s != "ceiling" && s != "footprint" {
			needKafka = true
		}
	}
	logf("starting PostgreSQL (fsync %v)", o.fsync)
	if e.pg, err = testenv.StartPostgres(filepath.Join(work, "postgres")); err != nil {
		return nil, err
	}
	if needKafka {
		logf("starting Kafka")
		if e.kafka, err = testenv.StartKafka(filepath.Join(work, "kafka")); err != nil {
			// A start-up on a busy machine can time out; try once more.
			logf("Kafka did not start (%v); trying again", err)
			if e.kafka, err = testenv.StartKafka(filepath.Join(work, "kafka2")); err != nil {
				e.close()
				return nil, err
			}
		}
	}
	if err := e.pg.Exec(ctx, "postgres", "CREATE DATABASE bench"); err != nil {
		e.close()
		return nil, fmt.Errorf("create database: %w", err)
	}
	e.dsn = e.pg.DSN("bench")
	if e.pool, err = pgxpool.New(ctx, e.dsn); err != nil {
		e.close()
		return nil, err
	}
	_ = e.pool.QueryRow(ctx, "SHOW server_version").Scan(&e.pgVer)
	e.relayBin = o.relayBin
	if e.relayBin == "" && needKafka {
		e.relayBin = filepath.Join(work, "relay")
		logf("building the relay binary (go build ./cmd/relay)")
		out, err := exec.CommandContext(ctx, "go", "build", "-o", e.relayBin, "./cmd/relay").CombinedOutput()
		if err != nil {
			e.close()
			return nil, fmt.Errorf("go build ./cmd/relay: %w\n%s", err, out)
		}
	}
	return e, nil
}

func (e *benchEnv) close() {
	if e.pool != nil {
		e.pool.Close()
	}
	if e.kafka != nil {
		_ = e.kafka.Close()
	}
	if e.pg != nil {
		_ = e.pg.Close()
	}
}

// freshTable drops and recreates the outbox table with the shipped DDL,
// inserts n rows of ~300-byte JSON over 1,000 partition keys, then vacuums,
// analyzes and checkpoints, so every drain starts from the same state.
func (e *benchEnv) freshTable(ctx context.Context, n int) error {
	if _, err := e.pool.Exec(ctx, "DROP TABLE IF EXISTS outbox"); err != nil {
		return err
	}
	if _, err := e.pool.Exec(ctx, outbox.SchemaDDL(outbox.Table{Name: "outbox"})); err != nil {
		return fmt.Errorf("create outbox table: %w", err)
	}
	if n > 0 {
		if _, err := e.pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, partition_key)
SELECT gen_random_uuid(), 'Order', 'order-' || (g % 1000), $2,
       jsonb_build_object('seq', g, 'order_id', 'order-' || (g % 1000), 'pad', repeat('x', 240)),
       'order-' || (g % 1000)
FROM generate_series(1, $1) g`, n, eventType); err != nil {
			return fmt.Errorf("insert %d rows: %w", n, err)
		}
	}
	for _, q := range []string{"VACUUM ANALYZE outbox", "CHECKPOINT"} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	return nil
}

// newTopic creates a fresh topic for one run.
func (e *benchEnv) newTopic(o *options, name string) (string, error) {
	e.seq++
	topic := fmt.Sprintf("bench.%d.%s", e.seq, name)
	return topic, e.kafka.CreateTopicErr(topic, o.partitions)
}

// deleteTopic frees the broker's disk after a run.
func (e *benchEnv) deleteTopic(topic string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := &kafka.Client{Addr: kafka.TCP(e.kafka.Addr()), Timeout: 20 * time.Second}
	_, _ = c.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}})
}

// drainSpan reads the drain's rate from the database's own timestamps:
// published_at is now(), the start of each claim transaction, so between the
// first and the last batch's start every row but the last batch's was done.
func (e *benchEnv) drainSpan(ctx context.Context) (done int, rate float64, err error) {
	var first, last time.Time
	var lastBatch int
	err = e.pool.QueryRow(ctx, `
SELECT count(*), min(published_at), max(published_at),
       count(*) FILTER (WHERE published_at = (SELECT max(published_at) FROM outbox))
FROM outbox WHERE published_at IS NOT NULL`).Scan(&done, &first, &last, &lastBatch)
	if err != nil {
		return 0, 0, fmt.Errorf("read drain timestamps: %w", err)
	}
	span := last.Sub(first).Seconds()
	if span <= 0 {
		return done, 0, fmt.Errorf("drain of %d rows took no measurable time", done)
	}
	return done, float64(done-lastBatch) / span, nil
}

func (e *benchEnv) unpublished(ctx context.Context) (int, error) {
	var n int
	err := e.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n)
	return n, err
}

// relayProc is one relay binary process.
type relayProc struct {
	cmd         *exec.Cmd
	metricsAddr string
	out         *syncBuffer
	exited      chan struct{}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() > 1<<20 {
		return len(p), nil // enough to diagnose; do not grow without bound
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// relayArgs are the flags of a benchmark relay; poll interval and the
// rest stay at their defaults unless extra says otherwise.
func (e *benchEnv) relayArgs(topic string, batch int, ordering string, extra ...string) []string {
	args := []string{"--brokers", e.kafka.Addr(), "--table", "outbox", "--topic", eventType + "=" + topic,
		"--batch-size", strconv.Itoa(batch)}
	if ordering != "" {
		args = append(args, "--ordering", ordering)
	}
	return append(args, extra...)
}

func (e *benchEnv) startRelay(args []string) (*relayProc, error) {
	port, err := testenv.FreePort()
	if err != nil {
		return nil, err
	}
	p := &relayProc{metricsAddr: fmt.Sprintf("127.0.0.1:%d", port), out: &syncBuffer{}, exited: make(chan struct{})}
	p.cmd = exec.Command(e.relayBin, append(args, "--metrics-addr", p.metricsAddr, "--log-format", "text")...)
	p.cmd.Env = append(os.Environ(), "RELAY_DSN="+e.dsn)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start relay: %w", err)
	}
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	return p, nil
}

// waitReady waits until /readyz answers 200, or reports why the process exited.
func (p *relayProc) waitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-p.exited:
			return fmt.Errorf("relay exited (%v): %s", p.cmd.ProcessState, lastLines(p.out.String(), 5))
		default:
		}
		resp, err := http.Get("http://" + p.metricsAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("relay not ready after %s: %s", timeout, lastLines(p.out.String(), 5))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// stop sends SIGTERM and waits; the relay finishes its batch and exits.
func (p *relayProc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// published scrapes outbox_relay_events_published_total from /metrics.
func (p *relayProc) published() (float64, error) {
	resp, err := http.Get("http://" + p.metricsAddr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "outbox_relay_events_published_total") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum += v
		}
	}
	return sum, sc.Err()
}

// cpuSeconds is the process's user+system CPU time from /proc/<pid>/stat.
func cpuSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces; fields after ")" are fixed.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("malformed /proc stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("malformed /proc stat")
	}
	utime, _ := strconv.ParseFloat(f[11], 64) // field 14
	stime, _ := strconv.ParseFloat(f[12], 64) // field 15
	return (utime + stime) / clockTicks, nil
}

// clockTicks is USER_HZ, 100 on every Linux architecture Go supports here.
const clockTicks = 100

// memKiB reads VmRSS and VmHWM (peak RSS) from /proc/<pid>/status, in KiB.
func memKiB(pid int) (rss, hwm float64, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		v, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = v
		case "VmHWM:":
			hwm = v
		}
	}
	return rss, hwm, nil
}

// pgConnect opens one connection with the relay's session settings.
func pgConnect(ctx context.Context, dsn string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["plan_cache_mode"] = "force_custom_plan"
	return pgx.ConnectConfig(ctx, cfg)
}

// xactCommits is the benchmark database's committed transactions so far.
func (e *benchEnv) xactCommits(ctx context.Context) (float64, error) {
	var n float64
	// pg_stat_database is refreshed when a session reports; clear the snapshot.
	if _, err := e.pool.Exec(ctx, "SELECT pg_stat_clear_snapshot()"); err != nil {
		return 0, err
	}
	err := e.pool.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}
