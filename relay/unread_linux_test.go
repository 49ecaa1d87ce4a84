package relay

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// unreadBytes counts what arrived on a socket and is not read yet, without
// reading it, and says when a connection is no socket.
func TestUnreadBytesCountsWhatArrived(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer client.Close()
	server, err := ln.Accept()
	require.NoError(t, err)
	defer server.Close()

	require.Zero(t, unreadBytes(server), "nothing sent yet")
	_, err = client.Write([]byte("hello"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return unreadBytes(server) == 5 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 5, unreadBytes(server), "counting reads nothing")
	buf := make([]byte, 3)
	_, err = io.ReadFull(server, buf)
	require.NoError(t, err)
	require.Equal(t, 2, unreadBytes(server))

	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	require.Equal(t, -1, unreadBytes(a), "a pipe is no socket: cannot tell")
}
