package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddy-sglang/caddy-sglang/affinity"
)

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

func TestRoutingCountsFromMetrics(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, `# HELP caddy_sglang_load_selections_total Upstream selections by branch.
# TYPE caddy_sglang_load_selections_total counter
caddy_sglang_load_selections_total{branch="fallback"} 5
caddy_sglang_load_selections_total{branch="load"} 95
caddy_sglang_load_selections_total{branch="none"} 0
caddy_sglang_load_polls_total{endpoint="127.0.0.1:1",result="ok",transport="http"} 40
caddy_sglang_load_polls_total{endpoint="127.0.0.1:1",result="timeout",transport="http"} 3
caddy_sglang_load_polls_total{endpoint="127.0.0.1:2",result="ok",transport="http"} 43
caddy_sglang_load_poll_duration_seconds_count{result="ok",transport="http"} 83
caddy_sglang_load_affinity_decisions_total{outcome="followed"} 90
caddy_sglang_load_affinity_decisions_total{outcome="new"} 5
caddy_sglang_load_affinity_homes_moved_total 2
`)
	}))
	defer srv.Close()
	p := &caddyProc{admin: strings.TrimPrefix(srv.URL, "http://")}
	got, err := p.routingCounts()
	if err != nil {
		t.Fatal(err)
	}
	want := routingCounts{byLoad: 95, byFallback: 5, polls: 86, pollsFailed: 3, homesMoved: 2}
	want.affinity[affinity.Followed], want.affinity[affinity.New] = 90, 5
	if got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	if s, want := got.String(), " fallback 5.0% polls failed 3/86 affinity followed 90, new 5, homes moved 2"; s != want {
		t.Fatalf("String() = %q, want %q", s, want)
	}
}
