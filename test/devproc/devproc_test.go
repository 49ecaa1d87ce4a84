package devproc

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSetFlag(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"absent", []string{"--table", "outbox"}, []string{"--table", "outbox", "--metrics-addr=A"}},
		{"separate value", []string{"--metrics-addr", ":9090", "--table", "t"}, []string{"--metrics-addr=A", "--table", "t"}},
		{"joined value", []string{"--table", "t", "--metrics-addr=:9090"}, []string{"--table", "t", "--metrics-addr=A"}},
		{"single dash", []string{"-metrics-addr", ":9090"}, []string{"--metrics-addr=A"}},
		{"single dash joined", []string{"-metrics-addr=:9090", "x"}, []string{"--metrics-addr=A", "x"}},
		{"a longer flag is another flag", []string{"--metrics-address=1"}, []string{"--metrics-address=1", "--metrics-addr=A"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, SetFlag(tc.args, "--metrics-addr", "A"))
		})
	}
}

// TestProcOutputExitAndStop runs a shell as the child: its output is kept,
// its exit code read, and Stop ends a running one with SIGTERM.
func TestProcOutputExitAndStop(t *testing.T) {
	t.Parallel()
	log := filepath.Join(t.TempDir(), "out.log")
	p, err := Start(Options{Binary: "/bin/sh", Args: []string{"-c", "echo one; echo two >&2; exit 3"}, LogPath: log})
	require.NoError(t, err)
	code, err := p.Wait(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, 3, code)
	require.Equal(t, "one | two", p.Tail(2))
	b, err := os.ReadFile(log)
	require.NoError(t, err)
	require.Equal(t, "one\ntwo\n", string(b))

	p, err = Start(Options{Binary: "/bin/sh", Args: []string{"-c", "sleep 60"}})
	require.NoError(t, err)
	require.False(t, p.HasExited())
	p.Stop(10 * time.Second)
	require.True(t, p.HasExited())
	require.Equal(t, syscall.SIGTERM, p.Cmd.ProcessState.Sys().(syscall.WaitStatus).Signal())
	code, err = p.Wait(time.Second)
	require.NoError(t, err)
	require.Equal(t, -1, code, "a signal ended it")
}
