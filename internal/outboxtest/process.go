package outboxtest

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/internal/testenv"
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
		relayBin = filepath.Join(testenv.LogDir(), "relay")
		out, err := exec.Command("go", "build", "-o", relayBin, filepath.Join(testenv.RepoRoot(), "cmd", "relay")).CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build ./cmd/relay: %w\n%s", err, out)
		}
	})
	require.NoError(t, buildErr)
	return relayBin
}

// Proc is a relay process.
type Proc struct {
	Cmd         *exec.Cmd
	MetricsAddr string
	out         *syncBuffer
	exited      chan struct{}
	exitErr     error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// StartRelayProcess runs the relay binary with args (plus --metrics-addr on
// a free port) and env, and kills it when the test ends. Its output is
// logged if the test fails.
func StartRelayProcess(t *testing.T, args []string, env ...string) *Proc {
	t.Helper()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	p := &Proc{MetricsAddr: fmt.Sprintf("127.0.0.1:%d", port), out: &syncBuffer{}, exited: make(chan struct{})}
	p.Cmd = exec.Command(RelayBinary(t), append(args, "--metrics-addr", p.MetricsAddr, "--log-format", "text")...)
	p.Cmd.Env = append(os.Environ(), env...)
	p.Cmd.Stdout, p.Cmd.Stderr = p.out, p.out
	require.NoError(t, p.Cmd.Start())
	go func() { p.exitErr = p.Cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		_ = p.Cmd.Process.Kill()
		<-p.exited
		if t.Failed() {
			t.Logf("relay %d output:\n%s", p.Cmd.Process.Pid, p.out.String())
		}
	})
	return p
}

// WaitReady waits until /readyz answers 200.
func (p *Proc) WaitReady(t *testing.T, timeout time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case <-p.exited:
			return false
		default:
		}
		resp, err := http.Get("http://" + p.MetricsAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, timeout, 50*time.Millisecond, "relay not ready; output:\n%s", p.out.String())
}

// Signal sends sig to the process.
func (p *Proc) Signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.Cmd.Process.Signal(sig))
}

// Wait waits for the process to exit and returns its exit code.
func (p *Proc) Wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		t.Fatalf("relay did not exit within %s; output:\n%s", timeout, p.out.String())
	}
	return p.Cmd.ProcessState.ExitCode()
}

// Output is what the process printed so far.
func (p *Proc) Output() string { return p.out.String() }

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
