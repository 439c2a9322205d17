package caddymodule_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/monitor"
	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// A request the cost model sends to a worker it has not measured brings that worker's next poll
// forward from the interval to the next tenth of it.
func TestRequestToUnmeasuredWorkerPollsIt(t *testing.T) {
	polls := make(chan time.Time, 64)
	hs := serveSim(t, sglangsim.Config{Name: "w", MaxTotalTokens: 100000, PrefillTokensPerSec: 1e5, DecodeTokensPerSec: 1e4},
		func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/v1/loads" {
					polls <- time.Now()
				}
				h.ServeHTTP(w, r)
			})
		})
	const interval = 10 * time.Second
	addr := strings.TrimPrefix(hs.URL, "http://")
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfileFor("interval 10s", "metric cost", addr), "caddyfile")
	next := func(within time.Duration) (time.Time, bool) {
		select {
		case at := <-polls:
			return at, true
		case <-time.After(within):
			return time.Time{}, false
		}
	}
	// The warm-up's polls, a tenth of the interval apart; the next is an interval after the last, once
	// the last is published.
	for i := range monitor.WarmUpPolls {
		if _, ok := next(5 * time.Second); !ok {
			t.Fatalf("warm-up poll %d did not come", i+1)
		}
	}
	eventually(t, 5*time.Second, func() bool { return workers(t)[addr].PollsOK >= monitor.WarmUpPolls },
		"the warm-up's last poll published")
	sent := time.Now()
	post(t, "http://127.0.0.1:9080/generate", `{"text":"a prompt","sampling_params":{"max_new_tokens":2}}`, nil)
	at, ok := next(interval / 2)
	if !ok {
		t.Fatalf("no poll within %s of a request to a worker not measured", interval/2)
	}
	if waited := at.Sub(sent); waited > 3*interval/10 {
		t.Errorf("poll came %s after the request, want within a slot of a tenth of the interval", waited)
	}
}
