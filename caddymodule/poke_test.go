package caddymodule_test

import (
	"math"
	"net/http"
	"net/http/httptest"
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
	waitAddrs(t, 5*time.Second, "the warm-up's last poll published", func(w worker) bool { return w.PollsOK >= monitor.WarmUpPolls }, addr)
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

// A proxy started in front of workers that have served before (a Caddy restarted, or one more instance
// scaled out) prices each at its own prefill speed from its first report, the ratio of its counters
// over its life: long prompts go to the faster prefill before two polls could measure either between
// them. Two workers alike but for prefill speed; before, both were priced at the stand-in and tied.
func TestCostMetricPricesPrefillFromTheFirstReport(t *testing.T) {
	slow := serveSim(t, sglangsim.Config{Name: "slow", MaxTotalTokens: 200000, PrefillTokensPerSec: 1e4, DecodeTokensPerSec: 1e5}, nil)
	fast := serveSim(t, sglangsim.Config{Name: "fast", MaxTotalTokens: 200000, PrefillTokensPerSec: 1e5, DecodeTokensPerSec: 1e5}, nil)
	speeds := map[string]float64{}
	var addrs []string
	for _, w := range []struct {
		hs    *httptest.Server
		speed float64
	}{{slow, 1e4}, {fast, 1e5}} {
		// 4,000 tokens prefilled before the proxy starts: 0.4 s and 0.04 s of prefill.
		post(t, w.hs.URL+"/generate", `{"text":"warm up","prompt_tokens":4000,"sampling_params":{"max_new_tokens":1}}`, nil)
		addr := strings.TrimPrefix(w.hs.URL, "http://")
		addrs, speeds[addr] = append(addrs, addr), w.speed
	}
	tester := caddytest.NewTester(t)
	// An interval of a minute: the warm-up polls are 6 s apart, and the requests below go out before
	// the second.
	tester.InitServer(caddyfileFor("interval 1m", "metric cost", addrs...), "caddyfile")
	ws := waitAddrs(t, 5*time.Second, "both workers polled", func(w worker) bool { return w.PollsOK > 0 }, addrs...)
	for _, addr := range addrs {
		if s := ws[addr].Score; ws[addr].PollsOK != 1 || s == nil || s.Prefill == nil || math.Abs(*s.Prefill-speeds[addr]) > speeds[addr]/100 {
			t.Fatalf("%s after %d polls: score %+v, want a prefill speed of %v tokens/s from its first report", addr, ws[addr].PollsOK, s, speeds[addr])
		}
	}
	// 20,000 prompt tokens: 2 s of prefill on the slow worker, 0.2 s on the fast one.
	for i := range 10 {
		if code, by, _ := sendGenerate(t, `{"text":"a long document","prompt_tokens":20000,"sampling_params":{"max_new_tokens":1}}`); code != http.StatusOK || by != "fast" {
			t.Fatalf("long prompt %d: status %d from %q, want 200 from the fast worker", i, code, by)
		}
	}
}
