// Package testenv starts the real dependencies the project's tests run
// against — a throwaway PostgreSQL cluster, a single-node Apache Kafka broker
// (KRaft) and a Kubernetes API server with etcd through envtest — on free
// loopback ports, once per test binary.
//
// A package's TestMain asks for what it needs:
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Run(m, testenv.NeedPostgres|testenv.NeedKafka)) }
//
// and its tests then use PG(), Broker() and Kube(). Nothing skips: a missing
// binary fails the run with a message naming the `make deps` step that
// provides it. Logs of every process are kept when a test fails.
package testenv

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Needs says which dependencies a test binary starts.
type Needs uint

const (
	// NeedPostgres starts a throwaway PostgreSQL cluster.
	NeedPostgres Needs = 1 << iota
	// NeedKafka starts a single-node Kafka broker.
	NeedKafka
	// NeedKube starts kube-apiserver and etcd through envtest, with the
	// project's CRDs installed.
	NeedKube
)

var (
	pg     *PostgresCluster
	broker *KafkaBroker
	kube   *KubeEnv
	logDir string
)

// PG returns the package's PostgreSQL cluster; Run must have started it.
func PG() *PostgresCluster {
	if pg == nil {
		panic("testenv: PostgreSQL was not requested in TestMain (testenv.Run(m, testenv.NeedPostgres))")
	}
	return pg
}

// Broker returns the package's Kafka broker; Run must have started it.
func Broker() *KafkaBroker {
	if broker == nil {
		panic("testenv: Kafka was not requested in TestMain (testenv.Run(m, testenv.NeedKafka))")
	}
	return broker
}

// Kube returns the package's API server; Run must have started it.
func Kube() *KubeEnv {
	if kube == nil {
		panic("testenv: Kubernetes was not requested in TestMain (testenv.Run(m, testenv.NeedKube))")
	}
	return kube
}

// LogDir is the folder that holds the logs of the processes testenv started.
func LogDir() string { return logDir }

// Run starts what needs asks for, runs the tests, stops everything and
// returns the exit code for os.Exit. Logs are removed after a green run and
// kept (their path printed) after a red one.
func Run(m *testing.M, needs Needs) (code int) {
	var err error
	logDir, err = os.MkdirTemp("", "outbox-testenv-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "testenv:", err)
		return 1
	}
	var stops []func() error
	defer func() {
		for i := len(stops) - 1; i >= 0; i-- {
			if err := stops[i](); err != nil {
				fmt.Fprintln(os.Stderr, "testenv: stop:", err)
			}
		}
		if code == 0 {
			os.RemoveAll(logDir)
		} else {
			fmt.Fprintf(os.Stderr, "testenv: logs of PostgreSQL, Kafka and the API server are kept in %s\n", logDir)
			dumpLogTails(logDir)
		}
	}()
	if needs&NeedPostgres != 0 {
		if pg, err = StartPostgres(filepath.Join(logDir, "postgres")); err != nil {
			fmt.Fprintln(os.Stderr, "testenv:", err)
			return 1
		}
		stops = append(stops, pg.Close)
	}
	if needs&NeedKafka != 0 {
		if broker, err = StartKafka(filepath.Join(logDir, "kafka")); err != nil {
			fmt.Fprintln(os.Stderr, "testenv:", err)
			return 1
		}
		stops = append(stops, broker.Close)
	}
	if needs&NeedKube != 0 {
		if kube, err = StartKube(filepath.Join(logDir, "kube")); err != nil {
			fmt.Fprintln(os.Stderr, "testenv:", err)
			return 1
		}
		stops = append(stops, kube.Close)
	}
	return m.Run()
}

// RepoRoot is the repository's top folder (where go.mod is); see FindRepoRoot.
func RepoRoot() string {
	root, err := FindRepoRoot()
	if err != nil {
		return compiledRoot()
	}
	return root
}

// FindRepoRoot returns the repository this package was compiled from, or
// else the first one above the working directory: a binary built with
// -trimpath knows no source path.
func FindRepoRoot() (string, error) {
	if root := compiledRoot(); isRepoRoot(root) {
		return root, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for d := dir; ; d = filepath.Dir(d) {
		if isRepoRoot(d) {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("run from inside the outbox-operator repository (no go.mod of it above %s)", dir)
		}
	}
}

func compiledRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

func isRepoRoot(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	return err == nil && strings.Contains(string(b), "module github.com/outbox-relay/outbox-operator\n")
}

// Listen makes a server reachable beyond loopback: from the pods of a local
// node, whose network reaches this machine at Host.
type Listen struct {
	// Host is an address of this machine the server listens at.
	Host string
	// Clients is the network (CIDR) of the clients, for servers that
	// authorise by address (PostgreSQL trusts it).
	Clients string
}

// listenOf is the one Listen of a variadic argument, or loopback.
func listenOf(ls []Listen) Listen {
	if len(ls) == 0 || ls[0].Host == "" {
		return Listen{Host: "127.0.0.1"}
	}
	return ls[0]
}

// addresses is PostgreSQL's listen_addresses for l.
func (l Listen) addresses() string {
	if l.Host == "127.0.0.1" {
		return l.Host
	}
	return "127.0.0.1," + l.Host
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// findDir returns the first folder that exists among an environment
// variable's value and globbed candidates, or an error naming the make step.
func findDir(envVar, makeStep string, marker string, globs ...string) (string, error) {
	var tried []string
	if v := os.Getenv(envVar); v != "" {
		if _, err := os.Stat(filepath.Join(v, marker)); err == nil {
			return v, nil
		}
		return "", fmt.Errorf("%s=%s does not contain %s; run `%s`", envVar, v, marker, makeStep)
	}
	for _, g := range globs {
		matches, _ := filepath.Glob(g)
		// Newest version last in lexical order is good enough for one cached version.
		for i := len(matches) - 1; i >= 0; i-- {
			if _, err := os.Stat(filepath.Join(matches[i], marker)); err == nil {
				return matches[i], nil
			}
		}
		tried = append(tried, g)
	}
	return "", fmt.Errorf("%s not found (looked at $%s and %s); run `%s` to provide it",
		marker, envVar, strings.Join(tried, ", "), makeStep)
}

func dumpLogTails(dir string) {
	_ = filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() && d.Name() == "data" {
			return filepath.SkipDir // Kafka's and PostgreSQL's own files
		}
		if d.IsDir() || !strings.HasSuffix(path, ".log") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		const tail = 3000
		if len(b) > tail {
			b = b[len(b)-tail:]
		}
		fmt.Fprintf(os.Stderr, "---- tail of %s ----\n%s\n", path, b)
		return nil
	})
}
