package relay_test

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// freezingProxy forwards TCP connections to target until freeze: from
// then on the connections it carried stay open and carry nothing either
// way, as a failover that leaves the old address dropping packets does,
// while new ones are forwarded (to the new primary, as it were).
type freezingProxy struct {
	ln     net.Listener
	target string
	done   chan struct{}

	mu    sync.Mutex
	gen   int // connections of an earlier generation are frozen
	conns []net.Conn
}

func newFreezingProxy(t *testing.T, target string) *freezingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &freezingProxy{ln: ln, target: target, done: make(chan struct{})}
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		close(p.done)
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

// dsn is dsn through the proxy.
func (p *freezingProxy) dsn(t *testing.T, dsn string) string {
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	u.Host = p.ln.Addr().String()
	return u.String()
}

// freeze silences every connection carried so far.
func (p *freezingProxy) freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.gen++
}

func (p *freezingProxy) frozen(gen int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return gen < p.gen
}

func (p *freezingProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		gen := p.gen
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		go p.pipe(u, c, gen)
		go p.pipe(c, u, gen)
	}
}

func (p *freezingProxy) pipe(dst, src net.Conn, gen int) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if p.frozen(gen) {
			<-p.done // what was read is never delivered, nor anything after
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err == io.EOF {
				_ = dst.Close()
			}
			return
		}
	}
}

// silenceAndWaitPublished freezes proxy, writes rows, and waits until
// relay x has published them, within a minute, never looking wedged.
func silenceAndWaitPublished(t *testing.T, proxy *freezingProxy, f *outboxtest.Fixture, x *outboxtest.Running) {
	t.Helper()
	proxy.freeze()
	f.Insert(5, 1, "E")
	deadline := time.Now().Add(time.Minute)
	for f.Unpublished() > 0 {
		require.NoError(t, x.R.Live(), "the relay looks wedged")
		require.True(t, time.Now().Before(deadline), "%d rows still unpublished a minute after the connections went silent", f.Unpublished())
		<-time.After(100 * time.Millisecond) // between two looks at the table
	}
}

// A failover that leaves the old address dropping packets silences the
// stream's connection and the pool's. The stream asks the server to
// answer and, hearing nothing, streams again on a new connection; its own
// statements on the pool give up within a statement's timeout. So the
// rows written meanwhile go out, the relay never looks wedged, and it then
// closes without waiting for the silent connections. Before,
// a statement on a silent connection waited for ever (the server's
// statement_timeout never reaches the client), and the stream took the
// silence for an idle database: nothing went out until the liveness probe
// restarted the relay.
func TestLogicalReplicationRidesOutASilentConnection(t *testing.T) {
	t.Parallel()
	f, cfg := captureFixture(t, 1, "E")
	u, err := url.Parse(f.DSN)
	require.NoError(t, err)
	proxy := newFreezingProxy(t, u.Host)
	// A short wal_sender_timeout makes the stream report, and ask, every
	// second (a third of it), so the test waits seconds, not tens.
	u.RawQuery += "&options=-c%20wal_sender_timeout%3D3s"
	cfg.DSN = proxy.dsn(t, u.String())
	x := startStreaming(t, cfg)
	f.Insert(1, 1, "E")
	f.WaitDrained(0, 30*time.Second)

	silenceAndWaitPublished(t, proxy, f, x)
	closing := time.Now()
	require.NoError(t, x.Close())
	require.Less(t, time.Since(closing), 10*time.Second,
		"the relay closes without waiting for its silent connections (pgx reads each for 15 s before it closes it)")
}

// Polling rides out the same silence within a batch's deadline: the
// claim that meets a silent connection fails when its batch runs out of
// time (25 s by default), pgx drops the connection, and the next batch
// takes or opens another. The relay never looks wedged meanwhile.
func TestPollingRidesOutASilentConnection(t *testing.T) {
	t.Parallel()
	f := outboxtest.NewFixture(t, 1, "E")
	u, err := url.Parse(f.DSN)
	require.NoError(t, err)
	proxy := newFreezingProxy(t, u.Host)
	cfg := f.Config()
	cfg.DSN = proxy.dsn(t, f.DSN)
	x := outboxtest.Start(t, cfg)
	f.Insert(20, 4, "E")
	f.WaitDrained(0, 30*time.Second)

	silenceAndWaitPublished(t, proxy, f, x)
}
