package outboxtest

import (
	"context"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

var (
	buildOnce sync.Once
	relayBin  string
	buildErr  error
)

// RelayBinary builds cmd/relay once per test binary and returns its path.
func RelayBinary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		var bins []string
		bins, buildErr = devproc.Build(filepath.Join(testenv.LogDir(), "bin"), "./cmd/relay")
		if buildErr == nil {
			relayBin = bins[0]
		}
	})
	require.NoError(t, buildErr)
	return relayBin
}

// Proc is a relay process started by StartRelayProcess: the test-only face
// of devproc.Proc.
type Proc struct {
	// Cmd is the command; Cmd.ProcessState stays nil while it runs.
	Cmd *exec.Cmd
	// MetricsAddr serves /metrics, /healthz and /readyz.
	MetricsAddr string

	p *devproc.Proc
}

// StartRelayProcess runs the relay binary with args (plus --metrics-addr on
// a free port) and env, and kills it when the test ends. Its output is
// logged if the test fails.
func StartRelayProcess(t *testing.T, args []string, env ...string) *Proc {
	t.Helper()
	p, err := devproc.StartRelay(RelayBinary(t), args, env...)
	require.NoError(t, err)
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("relay %d output:\n%s", p.Pid(), p.Output())
		}
	})
	return &Proc{Cmd: p.Cmd, MetricsAddr: p.Addr, p: p}
}

// WaitReady waits until /readyz answers 200.
func (p *Proc) WaitReady(t *testing.T, timeout time.Duration) {
	t.Helper()
	require.NoError(t, p.p.WaitReady(context.Background(), timeout))
}

// Signal sends sig to the process.
func (p *Proc) Signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.p.Signal(sig))
}

// Wait waits for the process to exit and returns its exit code.
func (p *Proc) Wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	code, err := p.p.Wait(timeout)
	require.NoError(t, err)
	return code
}

// Output is what the process printed so far.
func (p *Proc) Output() string { return p.p.Output() }

// Args returns the relay flags for the fixture.
func (f *Fixture) Args(extra ...string) []string {
	args := []string{"--brokers", testenv.Broker().Addr(), "--table", f.Table, "--poll-interval", "20ms"}
	for et, topic := range f.Topics {
		args = append(args, "--topic", et+"="+topic)
	}
	return append(args, extra...)
}

// Env returns the environment passing the DSN as the operator does.
func (f *Fixture) Env() []string { return []string{"RELAY_DSN=" + f.DSN} }
