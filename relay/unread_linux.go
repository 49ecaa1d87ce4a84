package relay

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// unreadBytes is how many bytes have arrived on c's socket and wait to be
// read (SIOCINQ), without waiting; -1 when it cannot tell (a connection
// that is not a socket), which the streaming loop takes as "some".
func unreadBytes(c net.Conn) int {
	if t, ok := c.(interface{ NetConn() net.Conn }); ok { // TLS: its records count
		c = t.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return -1
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return -1
	}
	n := -1
	if err := raw.Control(func(fd uintptr) {
		if v, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
			n = v
		}
	}); err != nil {
		return -1
	}
	return n
}
