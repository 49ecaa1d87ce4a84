package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresCluster is a throwaway PostgreSQL cluster on a loopback port.
type PostgresCluster struct {
	// Port is the TCP port the server listens on at 127.0.0.1 (and at
	// Listen.Host, when given).
	Port int
	// Host is the address clients outside this machine's loopback (pods on
	// a local node) reach the server at: Listen.Host, or 127.0.0.1.
	Host string

	binDir  string
	dataDir string
	logFile string
	asUser  *user.User // the unprivileged user the server runs as when we are root
	dbSeq   atomic.Int64
}

// StartPostgres creates a cluster under dir (initdb, trust auth on
// loopback, for the postgres superuser too) and starts it on a free port.
// With a Listen, it also listens at Listen.Host and takes connections from
// Listen.Clients with a password (scram-sha-256), and never as postgres.
func StartPostgres(dir string, listen ...Listen) (*PostgresCluster, error) {
	binDir, err := findDir("OUTBOX_PG_BIN", "make deps-postgres", "postgres",
		filepath.Join(RepoRoot(), "bin", "postgresql", "*"),
		"/usr/lib/postgresql/*/bin")
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL server binaries: %w", err)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	l := listenOf(listen)
	c := &PostgresCluster{Port: port, Host: l.Host, binDir: binDir, dataDir: filepath.Join(dir, "data"), logFile: filepath.Join(dir, "postgres.log")}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// initdb and postgres refuse to run as root: run them as the postgres
	// system user, which owns the folder.
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs the postgres system user (Debian's postgresql package creates it; run `make deps-postgres`): %w", err)
		}
		c.asUser = u
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		for p := dir; p != "/" && p != "."; p = filepath.Dir(p) {
			// The parents (a 0700 temp dir) must be traversable.
			if st, err := os.Stat(p); err == nil && st.Mode().Perm()&0o001 == 0 {
				_ = os.Chmod(p, st.Mode().Perm()|0o011)
			}
		}
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, err
		}
	}
	if out, err := c.command("initdb", "-D", c.dataDir, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	conf := fmt.Sprintf(`
listen_addresses = '%s'
port = %d
unix_socket_directories = '%s'
max_connections = 300
shared_buffers = 128MB
fsync = %s
synchronous_commit = %s
full_page_writes = %s
log_min_messages = warning
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
log_line_prefix = '%%m [%%p] %%d '
`, l.addresses(), port, c.dataDir, onOff(os.Getenv("OUTBOX_PG_FSYNC") == "on"), onOff(os.Getenv("OUTBOX_PG_FSYNC") == "on"), onOff(os.Getenv("OUTBOX_PG_FSYNC") == "on"))
	if err := appendFile(filepath.Join(c.dataDir, "postgresql.conf"), conf); err != nil {
		return nil, err
	}
	if l.Clients != "" {
		// Clients there (the local cluster's pods) log in with a password,
		// never as the superuser.
		hba := fmt.Sprintf("host all postgres %[1]s reject\nhost all all %[1]s scram-sha-256\n", l.Clients)
		if err := appendFile(filepath.Join(c.dataDir, "pg_hba.conf"), hba); err != nil {
			return nil, err
		}
	}
	if err := c.Start(); err != nil {
		return nil, err
	}
	return c, nil
}

// appendFile appends text to an existing file.
func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(text)
	return errors.Join(err, f.Close())
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// command runs a PostgreSQL binary, as the postgres user when we are root.
func (c *PostgresCluster) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(c.binDir, name), args...)
	if c.asUser != nil {
		uid, _ := strconv.Atoi(c.asUser.Uid)
		gid, _ := strconv.Atoi(c.asUser.Gid)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
		cmd.Env = append(os.Environ(), "HOME="+c.asUser.HomeDir)
	}
	cmd.Dir = filepath.Dir(c.dataDir)
	return cmd
}

// Start starts the server and waits until it accepts connections.
func (c *PostgresCluster) Start() error {
	if out, err := c.command("pg_ctl", "start", "-w", "-t", "60", "-D", c.dataDir, "-l", c.logFile).CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl start: %w\n%s", err, out)
	}
	return nil
}

// Stop stops the server (fast mode: open sessions are disconnected).
func (c *PostgresCluster) Stop() error {
	if out, err := c.command("pg_ctl", "stop", "-w", "-m", "fast", "-D", c.dataDir).CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl stop: %w\n%s", err, out)
	}
	return nil
}

// Close stops the server; its files go with the log folder.
func (c *PostgresCluster) Close() error {
	if _, err := os.Stat(filepath.Join(c.dataDir, "postmaster.pid")); err != nil {
		return nil
	}
	return c.Stop()
}

// DSN returns a connection string for a database of the cluster.
func (c *PostgresCluster) DSN(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.Port, database)
}

// BinDir is the folder of the PostgreSQL server binaries in use.
func (c *PostgresCluster) BinDir() string { return c.binDir }

var nonIdent = regexp.MustCompile(`[^a-z0-9_]+`)

// NewDatabase creates a fresh database for the test, dropped when it ends,
// and returns its DSN.
func (c *PostgresCluster) NewDatabase(t testing.TB) string {
	t.Helper()
	name := nonIdent.ReplaceAllString(strings.ToLower(t.Name()), "_")
	if len(name) > 40 {
		name = name[:40]
	}
	name = fmt.Sprintf("t%d_%s", c.dbSeq.Add(1), name)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dsn, err := c.CreateDatabase(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := c.DropDatabase(ctx, name); err != nil {
			t.Log(err)
		}
	})
	return dsn
}

// CreateDatabase creates a database and returns its DSN.
func (c *PostgresCluster) CreateDatabase(ctx context.Context, name string) (string, error) {
	if err := c.Exec(ctx, "postgres", "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return c.DSN(name), nil
}

// DropDatabase drops a database, disconnecting its sessions.
func (c *PostgresCluster) DropDatabase(ctx context.Context, name string) error {
	if err := c.Exec(ctx, "postgres", "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// Exec runs statements in a database as the superuser.
func (c *PostgresCluster) Exec(ctx context.Context, database, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, c.DSN(database))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql, args...)
	return err
}
