// Package tcpdial dials a worker's port for the load pollers, HTTP and gRPC alike, and refuses a
// connection that reached its own socket.
package tcpdial

import (
	"context"
	"fmt"
	"net"
	"syscall"
)

// ErrSelfConnection is a dial that reached its own socket: nothing listens on the port, which is in the
// host's ephemeral range, and the kernel picked it as the source too (a TCP simultaneous open). Kept,
// the connection would hold the port the worker is about to listen on, and the poll would read its own
// request as the answer. It wraps ECONNREFUSED: the worker is not there.
var ErrSelfConnection = fmt.Errorf("connected to itself, nothing listens there: %w", syscall.ECONNREFUSED)

// Dial connects to addr over TCP with d. A connection to itself is reset at once, which frees the port
// now rather than after TIME_WAIT, and fails with ErrSelfConnection.
func Dial(ctx context.Context, d *net.Dialer, addr string) (net.Conn, error) {
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if isSelfConnection(conn) {
		if tc, ok := conn.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = conn.Close()
		return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: conn.RemoteAddr(), Err: ErrSelfConnection}
	}
	return conn, nil
}

func isSelfConnection(c net.Conn) bool {
	l, ok1 := c.LocalAddr().(*net.TCPAddr)
	r, ok2 := c.RemoteAddr().(*net.TCPAddr)
	return ok1 && ok2 && l.Port == r.Port && l.IP.Equal(r.IP)
}
