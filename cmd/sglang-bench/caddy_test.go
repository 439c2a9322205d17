package main

import "testing"

func TestLogTailKeepsTheEnd(t *testing.T) {
	l := &logTail{max: 8}
	for _, s := range []string{"abc", "defgh", "ijk"} {
		if n, err := l.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", s, n, err)
		}
	}
	if got := l.String(); got != "defghijk" {
		t.Fatalf("tail %q, want the last 8 bytes", got)
	}
}

// Two Caddy instances given one port would both bind it (SO_REUSEPORT) and split its connections.
func TestFreePortNeverRepeats(t *testing.T) {
	seen := make(map[int]bool)
	for range 300 {
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		if seen[port] {
			t.Fatalf("port %d handed out twice", port)
		}
		seen[port] = true
	}
}
