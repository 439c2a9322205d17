package caddymodule_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// A worker that receives as much from another sender as from this Caddy: its prefill counters grow
// twice as fast as what Caddy sent it, and the admin view's senders reads about 2.
func TestSendersCountAnotherSender(t *testing.T) {
	hs := serveSim(t, sglangsim.Config{Name: "w", MaxTotalTokens: 100000, PrefillTokensPerSec: 1e6, DecodeTokensPerSec: 1e5}, nil)
	addr := strings.TrimPrefix(hs.URL, "http://")
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfileFor("interval 100ms", "metric cost", addr), "caddyfile")
	// waitSenders waits until the admin view's senders lies within [lo, hi].
	waitSenders := func(lo, hi float64) {
		t.Helper()
		waitAddrs(t, 15*time.Second, fmt.Sprintf("senders within [%v, %v]", lo, hi), func(w worker) bool {
			return w.Score != nil && w.Score.Senders != nil && *w.Score.Senders >= lo && *w.Score.Senders <= hi
		}, addr)
	}
	// Each prompt's text is its own, so the worker's prefix cache prefills all 300 tokens of each.
	send := func(base string, i int) {
		post(t, base+"/generate", fmt.Sprintf(`{"text":"%d: a prompt of its own","prompt_tokens":300,"sampling_params":{"max_new_tokens":2}}`, i), nil)
	}
	for i := range 150 {
		send("http://127.0.0.1:9080", i)
	}
	waitSenders(0.95, 1.05)
	for i := range 300 {
		send("http://127.0.0.1:9080", 1000+2*i)
		send(hs.URL, 1001+2*i)
	}
	// Twice the tokens Caddy sent, now; the sums remember the first 150 requests (their weight halves
	// in a minute), so at least (150 + 2×300) / (150 + 300) = 1.67, at most 2.
	waitSenders(1.6, 2.05)
}

// serveSim serves a simulated worker on loopback, its handler wrapped by wrap where not nil, until the
// test ends.
func serveSim(t *testing.T, cfg sglangsim.Config, wrap func(http.Handler) http.Handler) *httptest.Server {
	sim := sglangsim.New(cfg)
	h := sim.Handler()
	if wrap != nil {
		h = wrap(h)
	}
	hs := httptest.NewServer(h)
	t.Cleanup(func() {
		sim.Close()
		hs.Close()
	})
	return hs
}
