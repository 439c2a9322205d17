package testports

import (
	"net"
	"strconv"
	"testing"
)

func TestFreeIsBelowTheEphemeralRange(t *testing.T) {
	low := ephemeralLow()
	for range 20 {
		base := Free(t, 3)
		if base < lowest || base+3 > low {
			t.Fatalf("ports %d..%d: want within %d..%d", base, base+2, lowest, low-1)
		}
		for i := range 3 {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				t.Fatalf("port %d of %d..%d: %v", base+i, base, base+2, err)
			}
			_ = l.Close()
		}
	}
}
