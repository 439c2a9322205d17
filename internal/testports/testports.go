// Package testports finds loopback ports for tests that start processes which bind ports of their own.
package testports

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// lowest is the lowest port Free picks: above the well-known and most registered services' ports.
const lowest = 10000

// Free returns the first of n consecutive TCP ports that are free on 127.0.0.1 now. It picks them
// below the kernel's ephemeral range: a port in that range can be taken between this probe and the
// process's bind by any outgoing connection on the machine, as its source port (seen: a simulated
// worker of the demo failed to bind while other tests ran). Below it only listeners take ports; the
// probe finds those, and the random pick keeps concurrent tests apart.
func Free(t testing.TB, n int) int {
	t.Helper()
	high := ephemeralLow() - n
	if high <= lowest {
		t.Fatalf("the ephemeral port range starts at %d: no room below it for %d ports", high+n, n)
	}
	for range 100 {
		base := lowest + rand.IntN(high-lowest)
		var ls []net.Listener
		for i := range n {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			_ = l.Close()
		}
		if len(ls) == n {
			return base
		}
	}
	t.Fatalf("no %d consecutive free ports below %d", n, high+n)
	return 0
}

// ephemeralLow is the first port of the kernel's ephemeral range: Linux's from /proc, else the
// IANA range's first, 49152.
func ephemeralLow() int {
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if p, err := strconv.Atoi(f[0]); err == nil {
				return p
			}
		}
	}
	return 49152
}

// Unused returns a loopback address that was listened on a moment ago and no longer is: a port
// nothing listens on, in the ephemeral range, where a dial from the port itself connects to itself.
func Unused(t testing.TB) *net.TCPAddr {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().(*net.TCPAddr)
	_ = l.Close()
	return addr
}
