// Package devproc runs the project's binaries — the relay and the manager —
// as child processes, for the tests, the benchmark and the local stack: it
// builds them, starts them with their HTTP endpoint on a free loopback port,
// waits for /readyz, signals and stops them, and keeps the end of their
// output for error messages. It is development tooling; the binaries users
// run do not import it.
package devproc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Build builds main packages (such as "./cmd/relay") into dir as `make build`
// does (no cgo, -trimpath) and returns the binaries' paths in the same order.
func Build(dir string, pkgs ...string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	args := append([]string{"build", "-trimpath", "-o", dir + string(filepath.Separator)}, pkgs...)
	cmd := exec.Command("go", args...)
	cmd.Dir = testenv.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build %s: %w\n%s", strings.Join(pkgs, " "), err, out)
	}
	bins := make([]string, len(pkgs))
	for i, p := range pkgs {
		bins[i] = filepath.Join(dir, filepath.Base(p))
	}
	return bins, nil
}

// Options say what Start runs.
type Options struct {
	// Binary is the program.
	Binary string
	// Args are its arguments.
	Args []string
	// Env is the process's whole environment; nil passes this process's on.
	Env []string
	// AddrFlag names the flag that sets the address of the process's HTTP
	// endpoint (the relay's --metrics-addr, the manager's
	// --health-probe-bind-address). Start sets it to a free loopback port,
	// replacing any value in Args. Without it, the process has no Addr.
	AddrFlag string
	// ReadyPath is the readiness endpoint at that address; default /readyz.
	ReadyPath string
	// LogPath, when set, is a file that receives the process's output too.
	LogPath string
}

// Proc is a running (or exited) child process.
type Proc struct {
	// Cmd is the command; read Cmd.ProcessState only once Exited is closed.
	Cmd *exec.Cmd
	// Addr is the host:port of the process's HTTP endpoint.
	Addr string

	readyURL string
	out      tailBuffer
	exited   chan struct{}
}

// Start starts the process in its own process group (so a terminal's Ctrl-C
// reaches only its parent, which stops it), killed if its parent dies.
func Start(o Options) (*Proc, error) {
	p := &Proc{exited: make(chan struct{})}
	args := o.Args
	if o.AddrFlag != "" {
		port, err := testenv.FreePort()
		if err != nil {
			return nil, err
		}
		p.Addr = fmt.Sprintf("127.0.0.1:%d", port)
		p.readyURL = "http://" + p.Addr + cmp.Or(o.ReadyPath, "/readyz")
		args = SetFlag(args, o.AddrFlag, p.Addr)
	}
	var out io.Writer = &p.out
	var logf *os.File
	if o.LogPath != "" {
		if err := os.MkdirAll(filepath.Dir(o.LogPath), 0o755); err != nil {
			return nil, err
		}
		var err error
		if logf, err = os.Create(o.LogPath); err != nil {
			return nil, err
		}
		out = io.MultiWriter(&p.out, logf)
	}
	p.Cmd = exec.Command(o.Binary, args...)
	p.Cmd.Env = o.Env
	p.Cmd.Stdout, p.Cmd.Stderr = out, out
	p.Cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// A daemon's children (containerd's shims) may keep its output open
	// after it exited; do not wait for them.
	p.Cmd.WaitDelay = 5 * time.Second
	if err := p.Cmd.Start(); err != nil {
		if logf != nil {
			logf.Close()
		}
		return nil, fmt.Errorf("start %s: %w", o.Binary, err)
	}
	go func() {
		_ = p.Cmd.Wait()
		if logf != nil {
			logf.Close()
		}
		close(p.exited)
	}()
	return p, nil
}

// StartRelay runs the relay binary with args, with text logs and its
// metrics endpoint on a free loopback port; env is added to this process's
// environment.
func StartRelay(bin string, args []string, env ...string) (*Proc, error) {
	return Start(Options{
		Binary:   bin,
		Args:     append(append([]string{}, args...), "--"+relayconfig.FlagLogFormat, "text"),
		Env:      append(os.Environ(), env...),
		AddrFlag: "--" + relayconfig.FlagMetricsAddr,
	})
}

// StartManager runs the manager binary against kubeconfig with its health
// probes on a free loopback port, without metrics endpoint or leader
// election, its output in logPath; extra flags follow.
func StartManager(bin, kubeconfig, logPath string, extra ...string) (*Proc, error) {
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("manager binary: %w (run `make build`)", err)
	}
	return Start(Options{
		Binary:   bin,
		Args:     append([]string{"--metrics-bind-address=0", "--leader-elect=false"}, extra...),
		Env:      append(os.Environ(), "KUBECONFIG="+kubeconfig),
		AddrFlag: "--health-probe-bind-address",
		LogPath:  logPath,
	})
}

// Pid is the process id.
func (p *Proc) Pid() int { return p.Cmd.Process.Pid }

// Exited is closed once the process has exited.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// HasExited says whether the process has exited.
func (p *Proc) HasExited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

var probeClient = &http.Client{Timeout: 2 * time.Second}

// Ready probes the readiness endpoint once: true on 200.
func (p *Proc) Ready() bool {
	if p.readyURL == "" || p.HasExited() {
		return false
	}
	resp, err := probeClient.Get(p.readyURL)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// WaitReady waits until the readiness endpoint answers 200; it fails with
// the end of the output when the process exits first or timeout passes.
func (p *Proc) WaitReady(ctx context.Context, timeout time.Duration) error {
	if p.readyURL == "" {
		return errors.New("the process has no readiness endpoint (Options.AddrFlag)")
	}
	deadline := time.Now().Add(timeout)
	for {
		if p.Ready() {
			return nil
		}
		if p.HasExited() {
			return fmt.Errorf("%s exited (%v): %s", filepath.Base(p.Cmd.Path), p.Cmd.ProcessState, p.Tail(5))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %s: %s", filepath.Base(p.Cmd.Path), timeout, p.Tail(5))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.exited:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) error { return p.Cmd.Process.Signal(sig) }

// Wait waits up to timeout for the process to exit and returns its exit
// code (-1 when a signal ended it).
func (p *Proc) Wait(timeout time.Duration) (int, error) {
	select {
	case <-p.exited:
		return p.Cmd.ProcessState.ExitCode(), nil
	case <-time.After(timeout):
		return 0, fmt.Errorf("%s did not exit within %s: %s", filepath.Base(p.Cmd.Path), timeout, p.Tail(5))
	}
}

// Stop ends the process group as the kubelet ends a container: SIGTERM,
// then SIGKILL after grace. It returns once the process has exited.
func (p *Proc) Stop(grace time.Duration) {
	if p.HasExited() {
		return
	}
	_ = syscall.Kill(-p.Pid(), syscall.SIGTERM)
	select {
	case <-p.exited:
		return
	case <-time.After(grace):
	}
	p.Kill()
}

// Kill sends SIGKILL to the process group and waits until the process exited.
func (p *Proc) Kill() {
	_ = syscall.Kill(-p.Pid(), syscall.SIGKILL)
	<-p.exited
}

// Output is what the process printed so far (its last MiB at least).
func (p *Proc) Output() string { return p.out.String() }

// Tail is the last n lines of the output, joined with " | " for one-line
// error messages.
func (p *Proc) Tail(n int) string {
	lines := strings.Split(strings.TrimSpace(p.out.String()), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// SetFlag sets flag (written "--name") to value in args: it replaces the
// flag's value in any of its forms (--name v, --name=v, -name v, -name=v),
// or appends the flag.
func SetFlag(args []string, flag, value string) []string {
	name := strings.TrimLeft(flag, "-")
	out := make([]string, 0, len(args)+1)
	found := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--"+name || a == "-"+name:
			i++ // the value follows
			found = true
		case strings.HasPrefix(a, "--"+name+"=") || strings.HasPrefix(a, "-"+name+"="):
			found = true
		default:
			out = append(out, a)
			continue
		}
		out = append(out, "--"+name+"="+value)
	}
	if !found {
		out = append(out, "--"+name+"="+value)
	}
	return out
}

// tailBuffer keeps the last MiB (up to two) written to it: enough to say
// why a process failed, bounded however long it runs.
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

const keepOutput = 1 << 20

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 2*keepOutput {
		t.b = append([]byte(nil), t.b[len(t.b)-keepOutput:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}
