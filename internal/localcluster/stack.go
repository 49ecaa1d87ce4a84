// Package localcluster runs the whole system on one machine for `make demo`
// and the end-to-end test: PostgreSQL, a Kafka broker, kube-apiserver + etcd
// with the CRDs installed, the real manager binary, and a local pod runner
// that stands in for the kubelet and the Deployment controller.
//
// It is a development and test tool. Nothing here is meant for a real
// cluster: the pod runner starts relay pods as local processes.
package localcluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/internal/devproc"
	"github.com/outbox-relay/outbox-operator/internal/testenv"
)

// Options say where the stack keeps its state and which binaries it runs.
type Options struct {
	// Dir holds every file of the stack: data, logs, kubeconfig. It is
	// created if missing; leftovers of an earlier run in it are the caller's
	// business (see CleanDir).
	Dir string
	// ManagerBinary is the built cmd/manager.
	ManagerBinary string
	// RelayBinary is the built cmd/relay; the pod runner runs it for the
	// container command "/relay".
	RelayBinary string
	// Log receives progress and the pod runner's log; nil discards.
	Log *slog.Logger
	// Progress, when set, is called with a short line as each piece starts.
	Progress func(string)
}

// Stack is a running local system.
type Stack struct {
	// Postgres is the PostgreSQL cluster (trust auth: any role logs in by name).
	Postgres *testenv.PostgresCluster
	// Kafka is the single-node broker.
	Kafka *testenv.KafkaBroker
	// Kube is the API server and etcd.
	Kube *testenv.KubeEnv
	// Runner is the local pod runner.
	Runner *Runner
	// Client reaches the API server as admin.
	Client client.Client
	// Kubeconfig is the path of an admin kubeconfig for kubectl.
	Kubeconfig string
	// Dir is Options.Dir.
	Dir string

	stopRun  context.CancelFunc
	runDone  chan error
	closeMu  sync.Mutex
	closers  []func() error
	isClosed bool
}

// Start brings the stack up. On error, what was started is stopped.
func Start(ctx context.Context, opts Options) (s *Stack, err error) {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	progress := opts.Progress
	if progress == nil {
		progress = func(string) {}
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	ctrl.SetLogger(logr.FromSlogHandler(opts.Log.Handler()))
	s = &Stack{Dir: dir, Kubeconfig: filepath.Join(dir, "kubeconfig")}
	defer func() {
		if err != nil {
			s.Close()
			s = nil
		}
	}()

	// The three dependencies start in parallel: the JVM is the slow one.
	var wg sync.WaitGroup
	var pgErr, kafkaErr, kubeErr error
	wg.Add(3)
	go func() {
		defer wg.Done()
		s.Postgres, pgErr = testenv.StartPostgres(filepath.Join(dir, "postgres"))
		if pgErr == nil {
			progress(fmt.Sprintf("PostgreSQL    127.0.0.1:%d", s.Postgres.Port))
		}
	}()
	go func() {
		defer wg.Done()
		s.Kafka, kafkaErr = testenv.StartKafka(filepath.Join(dir, "kafka"))
		if kafkaErr == nil {
			progress("Kafka broker  " + s.Kafka.Addr())
		}
	}()
	go func() {
		defer wg.Done()
		s.Kube, kubeErr = testenv.StartKube(filepath.Join(dir, "kube"))
		if kubeErr == nil {
			progress("kube-apiserver " + s.Kube.Config.Host + " (with etcd, CRDs installed)")
		}
	}()
	wg.Wait()
	if s.Postgres != nil {
		s.closers = append(s.closers, s.Postgres.Close)
	}
	if s.Kafka != nil {
		s.closers = append(s.closers, s.Kafka.Close)
	}
	if s.Kube != nil {
		s.closers = append(s.closers, s.Kube.Close)
	}
	if err := errors.Join(pgErr, kafkaErr, kubeErr); err != nil {
		return s, err
	}
	if err := s.Kube.WriteKubeconfig(s.Kubeconfig); err != nil {
		return s, err
	}
	if s.Client, err = client.New(s.Kube.Config, client.Options{Scheme: Scheme()}); err != nil {
		return s, err
	}
	if err := s.startManager(ctx, opts.ManagerBinary); err != nil {
		return s, err
	}
	progress("manager       " + opts.ManagerBinary + " (the real binary, log " + filepath.Join(dir, "logs", "manager.log") + ")")

	s.Runner, err = NewRunner(s.Kube.Config, RunnerOptions{
		Commands: map[string]string{"/relay": opts.RelayBinary},
		LogDir:   filepath.Join(dir, "logs", "pods"),
		Log:      opts.Log.With("component", "podrunner"),
	})
	if err != nil {
		return s, err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	s.stopRun, s.runDone = cancel, make(chan error, 1)
	go func() { s.runDone <- s.Runner.Run(runCtx) }()
	if err := s.Runner.WaitStarted(ctx); err != nil {
		return s, err
	}
	progress("pod runner    /relay -> " + opts.RelayBinary)
	return s, nil
}

// RestConfig is the admin REST config.
func (s *Stack) RestConfig() *rest.Config { return s.Kube.Config }

// KubectlPath is the kubectl built from the API server's Kubernetes version.
func (s *Stack) KubectlPath() string { return filepath.Join(s.Kube.AssetsDir, "kubectl") }

// Kubectl runs kubectl against the stack and returns its combined output.
func (s *Stack) Kubectl(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, s.KubectlPath(), args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.Kubeconfig)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("kubectl %v: %w\n%s", args, err, out)
	}
	return out, nil
}

// startManager runs the real manager binary with the admin kubeconfig and
// waits until its readiness endpoint answers.
func (s *Stack) startManager(ctx context.Context, bin string) error {
	logPath := filepath.Join(s.Dir, "logs", "manager.log")
	p, err := devproc.StartManager(bin, s.Kubeconfig, logPath)
	if err != nil {
		return err
	}
	s.closers = append(s.closers, func() error { p.Stop(10 * time.Second); return nil })
	if err := p.WaitReady(ctx, 60*time.Second); err != nil {
		return fmt.Errorf("manager: %w; see %s", err, logPath)
	}
	return nil
}

// Close stops everything, in reverse order: pod runner (and every relay
// process), manager, API server, Kafka, PostgreSQL. It is safe to call twice.
func (s *Stack) Close() error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.isClosed {
		return nil
	}
	s.isClosed = true
	var errs []error
	if s.stopRun != nil {
		s.stopRun()
		errs = append(errs, <-s.runDone)
	}
	if s.Runner != nil {
		s.Runner.StopAll()
	}
	// The manager goes first among the closers (it was added last).
	for i := len(s.closers) - 1; i >= 0; i-- {
		errs = append(errs, s.closers[i]())
	}
	return errors.Join(errs...)
}
