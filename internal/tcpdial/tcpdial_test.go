package tcpdial

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/testports"
)

// A dial from the very port it dials (what the kernel may pick for a port nothing listens on) fails
// as refused, and the port is free at once: no socket in TIME_WAIT holds it.
func TestDialRefusesItself(t *testing.T) {
	addr := testports.Unused(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := Dial(ctx, &net.Dialer{LocalAddr: addr}, addr.String())
	if conn != nil || !errors.Is(err, ErrSelfConnection) || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial of %s from itself: %v, %v; want ErrSelfConnection, refused", addr, conn, err)
	}
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatalf("the port after the dial: %v", err)
	}
	defer ln.Close()
	conn, err = Dial(ctx, new(net.Dialer), addr.String())
	if err != nil {
		t.Fatalf("dial of a listener: %v", err)
	}
	_ = conn.Close()
}
