package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sys/unix"

	"github.com/outbox-relay/outbox-operator/outbox"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// eventType is the one event type the benchmark tables hold.
const eventType = "OrderConfirmed"

// benchEnv is the PostgreSQL cluster, the Kafka broker and the binaries
// every scenario shares.
type benchEnv struct {
	work       string
	pg         *testenv.PostgresCluster
	kafka      *testenv.KafkaBroker
	relayBin   string
	managerBin string
	dsn        string // the benchmark database
	pool       *pgxpool.Pool
	pgVer      string
	postmaster int          // the database server's pid, once serverCPUSeconds found it
	relayCPUs  *unix.CPUSet // the CPUs of the relays startRelay starts, while a cpuSplit applies

	orderingProbe map[string]string // mode -> "" when available, else why not
}

func startEnv(ctx context.Context, o *options, work string) (*benchEnv, error) {
	e := &benchEnv{work: work}
	var err error
	// The autoscale scenario starts a cluster of its own (and the backlog
	// scenario needs no broker).
	needKafka := slices.ContainsFunc(o.scenarios, func(s string) bool {
		return s != scCeiling && s != scFootprint && s != scBacklog && s != scAutoscale
	})
	needManager := slices.Contains(o.scenarios, scFootprint)
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
	if e.dsn, err = e.pg.CreateDatabase(ctx, "bench"); err != nil {
		e.close()
		return nil, err
	}
	if e.pool, err = pgxpool.New(ctx, e.dsn); err != nil {
		e.close()
		return nil, err
	}
	_ = e.pool.QueryRow(ctx, "SHOW server_version").Scan(&e.pgVer)
	e.relayBin = o.relayBin
	var pkgs []string
	if e.relayBin == "" && needKafka {
		pkgs = append(pkgs, "./cmd/relay")
	}
	if needManager {
		pkgs = append(pkgs, "./cmd/manager")
	}
	if len(pkgs) > 0 {
		logf("building %s", strings.Join(pkgs, " and "))
		bins, err := devproc.Build(filepath.Join(work, "bin"), pkgs...)
		if err != nil {
			e.close()
			return nil, err
		}
		for _, b := range bins {
			switch filepath.Base(b) {
			case "relay":
				e.relayBin = b
			case "manager":
				e.managerBin = b
			}
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
	return e.fillTable(ctx, tableFill{rows: n})
}

// tableFill says what a fresh outbox table holds.
type tableFill struct {
	// rows is the number of unpublished rows.
	rows int
	// published is the number of rows, inserted first (the lowest ids),
	// published a day ago: old enough for any retention to prune.
	published int
	// headers gives every unpublished row a headers object of three
	// entries: a W3C traceparent (a distinct trace per row) and two custom ones.
	headers bool
}

// rowHeaders is the headers column's value when tableFill.headers is set:
// about 110 bytes, as a service with tracing and two headers of its own stores.
const rowHeaders = `jsonb_build_object(
    'traceparent', '00-' || md5(random()::text) || '-' || left(md5(random()::text), 16) || '-01',
    'tenant', 'tenant-' || (random() * 100)::int,
    'origin', 'orders-service')`

// fillTable drops and recreates the outbox table with the shipped DDL and
// fills it as f says, with outboxtest.InsertRows' rows (the columns it does
// not set come from defaults set for the insert), then vacuums, analyzes and
// checkpoints, so every run starts from the same state.
func (e *benchEnv) fillTable(ctx context.Context, f tableFill) error {
	if _, err := e.pool.Exec(ctx, "DROP TABLE IF EXISTS outbox"); err != nil {
		return err
	}
	if _, err := e.pool.Exec(ctx, outbox.SchemaDDL(outbox.Table{Name: "outbox"})); err != nil {
		return fmt.Errorf("create outbox table: %w", err)
	}
	insert := func(n int, column, value string) error {
		if n == 0 {
			return nil
		}
		if column != "" {
			if _, err := e.pool.Exec(ctx, "ALTER TABLE outbox ALTER COLUMN "+column+" SET DEFAULT "+value); err != nil {
				return err
			}
		}
		if err := outboxtest.InsertRows(ctx, e.pool, n, 1000, eventType); err != nil {
			return err
		}
		if column != "" {
			if _, err := e.pool.Exec(ctx, "ALTER TABLE outbox ALTER COLUMN "+column+" DROP DEFAULT"); err != nil {
				return err
			}
		}
		return nil
	}
	if err := insert(f.published, "published_at", "now() - interval '1 day'"); err != nil {
		return err
	}
	column := ""
	if f.headers {
		column = "headers"
	}
	if err := insert(f.rows, column, rowHeaders); err != nil {
		return err
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
	topic := e.kafka.UniqueTopic("bench", name)
	return topic, e.kafka.CreateTopicErr(topic, o.partitions)
}

// deleteTopic frees the broker's disk after a run; a topic left behind
// costs only disk, so a failure is logged, not returned.
func (e *benchEnv) deleteTopic(topic string) {
	if err := e.kafka.DeleteTopic(topic); err != nil {
		logf("%v", err)
	}
}

// drainSpan reads the drain's rate from the database's own timestamps:
// published_at is now(), the start of each claim transaction, so between the
// first and the last batch's start every row but the last batch's was done.
func (e *benchEnv) drainSpan(ctx context.Context) (done int, rate float64, err error) {
	return e.drainSpanAfter(ctx, 0)
}

// drainSpanAfter is drainSpan over the rows with ids above afterID (the
// rows a table held published before the drain have the lowest ids).
func (e *benchEnv) drainSpanAfter(ctx context.Context, afterID int64) (done int, rate float64, err error) {
	var first, last time.Time
	var lastBatch int
	err = e.pool.QueryRow(ctx, `
SELECT count(*), min(published_at), max(published_at),
       count(*) FILTER (WHERE published_at = (SELECT max(published_at) FROM outbox WHERE id > $1))
FROM outbox WHERE published_at IS NOT NULL AND id > $1`, afterID).Scan(&done, &first, &last, &lastBatch)
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

// relayArgs are the flags of a benchmark relay; poll interval and the
// rest stay at their defaults unless extra says otherwise.
func (e *benchEnv) relayArgs(topic string, batch int, ordering string, extra ...string) []string {
	args := []string{flagArg(relayconfig.FlagBrokers, e.kafka.Addr()), flagArg(relayconfig.FlagTable, "outbox"),
		flagArg(relayconfig.FlagTopic, eventType+"="+topic), flagArg(relayconfig.FlagBatchSize, strconv.Itoa(batch))}
	if ordering != "" {
		args = append(args, flagArg(relayconfig.FlagOrdering, ordering))
	}
	return append(args, extra...)
}

// flagArg is one relay flag with its value, as --name=value.
func flagArg(name string, value any) string { return fmt.Sprintf("--%s=%v", name, value) }

// startRelay runs the relay binary on the benchmark database; env is added
// to its environment.
func (e *benchEnv) startRelay(args []string, env ...string) (*devproc.Proc, error) {
	p, err := devproc.StartRelay(e.relayBin, args, append([]string{relayconfig.EnvDSN + "=" + e.dsn}, env...)...)
	if err == nil && e.relayCPUs != nil {
		if err = pinProcess(p.Cmd.Process.Pid, e.relayCPUs); err != nil {
			stopRelay(p)
			return nil, err
		}
	}
	return p, err
}

// stopRelay sends SIGTERM and waits; the relay finishes its batch and exits.
func stopRelay(p *devproc.Proc) { p.Stop(30 * time.Second) }

// Counters the benchmark reads from a relay's /metrics.
const (
	metricPublished = "outbox_relay_events_published_total"
	metricPruned    = "outbox_relay_pruned_rows_total"
)

// published scrapes outbox_relay_events_published_total from a relay
// process's /metrics.
func published(p *devproc.Proc) (float64, error) { return scrape(p, metricPublished) }

// scrape sums a metric's series (every label set) from a relay process's /metrics.
func scrape(p *devproc.Proc, metric string) (float64, error) {
	resp, err := http.Get("http://" + p.Addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		name, _, _ := strings.Cut(line, " ")
		if name, _, _ = strings.Cut(name, "{"); name != metric {
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
	st, err := readProcStat(pid)
	return st.utime + st.stime, err
}

// procStat is what the benchmark reads of /proc/<pid>/stat: the parent's
// pid, and the process's CPU seconds in user and kernel mode, and those
// of its children it has waited for.
type procStat struct {
	ppid                         int
	utime, stime, cutime, cstime float64
}

func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	// The command name (field 2) may hold spaces; fields after ")" are fixed.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return procStat{}, errors.New("malformed /proc stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 15 {
		return procStat{}, errors.New("malformed /proc stat")
	}
	var st procStat
	st.ppid, _ = strconv.Atoi(f[1]) // field 4
	for j, v := range []*float64{&st.utime, &st.stime, &st.cutime, &st.cstime} {
		t, _ := strconv.ParseFloat(f[11+j], 64) // fields 14 to 17
		*v = t / clockTicks
	}
	return st, nil
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
