package caddymodule_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-sglang/caddy-sglang/caddymodule"
)

const proxyURL = "http://127.0.0.1:9080/"

// caddyfile builds a Caddyfile with the given global sglang_load block and lb_policy block in front
// of the workers.
func caddyfile(global, policy string, workers ...*testWorker) string {
	addrs := make([]string, len(workers))
	for i, w := range workers {
		addrs[i] = w.addr()
	}
	return caddyfileFor(global, policy, addrs...)
}

// caddyfileFor is caddyfile for upstreams given by address.
func caddyfileFor(global, policy string, addrs ...string) string {
	return fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	sglang_load {
		%s
	}
}
http://127.0.0.1:9080 {
	reverse_proxy %s {
		lb_policy sglang_load {
			%s
		}
	}
}
`, global, strings.Join(addrs, " "), policy)
}

func threeWorkers(t *testing.T) (busy, mid, idle *testWorker) {
	return newTestWorker(t, "busy", 0.9, 20), newTestWorker(t, "mid", 0.5, 5), newTestWorker(t, "idle", 0.1, 0)
}

func TestChooseLeastSendsToLeastLoaded(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "choose least", busy, mid, idle), "caddyfile")
	waitPolls(t, 2, busy, mid, idle)

	counts := sendRequests(t, proxyURL, 300)
	if counts["idle"] < 270 {
		t.Fatalf("least-loaded got %d of 300 requests, want >= 270: %v", counts["idle"], counts)
	}
}

func TestPowerOfTwoAvoidsMostLoaded(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "", busy, mid, idle), "caddyfile")
	waitPolls(t, 2, busy, mid, idle)

	counts := sendRequests(t, proxyURL, 300)
	if counts["busy"] != 0 {
		t.Errorf("most-loaded got %d requests, want 0: %v", counts["busy"], counts)
	}
	if counts["idle"] <= counts["mid"] {
		t.Errorf("least-loaded got %d, not the largest share: %v", counts["idle"], counts)
	}
}

func TestRoutingFollowsLoadChangesWithinTwoIntervals(t *testing.T) {
	const interval = 200 * time.Millisecond
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 200ms", "choose least", busy, mid, idle), "caddyfile")
	waitPolls(t, 2, busy, mid, idle)
	if c := sendRequests(t, proxyURL, 20); c["idle"] != 20 {
		t.Fatalf("before the change: %v, want all on idle", c)
	}

	busy.setLoad(0.05, 0)
	idle.setLoad(0.95, 30)
	changed := time.Now()
	var followedAfter time.Duration
	eventually(t, 10*interval, func() bool {
		c := sendRequests(t, proxyURL, 1)
		if c["busy"] == 1 {
			followedAfter = time.Since(changed)
			return true
		}
		return false
	}, "routing to follow the new loads")
	// Two intervals, plus the 10% jitter of each wait.
	if limit := 2*interval + 2*interval/10; followedAfter > limit {
		t.Errorf("routing followed the change after %s, want within %s", followedAfter, limit)
	}
	if c := sendRequests(t, proxyURL, 50); c["busy"] != 50 {
		t.Errorf("after the change: %v, want all 50 on the now least-loaded worker", c)
	}
}

func TestHungLoadEndpointDelaysNobody(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	busy.hanging.Store(true)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms\n\t\ttimeout 5s", "choose least", busy, mid, idle), "caddyfile")

	// While busy's poll hangs for its whole 5s deadline, the others are polled on their own schedule.
	start := time.Now()
	waitPolls(t, 5, mid, idle)
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("5 polls of the healthy workers took %s with one hung worker", took)
	}
	counts := sendRequests(t, proxyURL, 100)
	if counts["idle"] < 90 {
		t.Errorf("least-loaded got %d of 100 with a hung worker: %v", counts["idle"], counts)
	}
}

func TestWorkersWithoutLoadEndpointFallBack(t *testing.T) {
	a, b, c := newTestWorker(t, "a", 0, 0), newTestWorker(t, "b", 0, 0), newTestWorker(t, "c", 0, 0)
	for _, w := range []*testWorker{a, b, c} {
		w.noLoads.Store(true)
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "", a, b, c), "caddyfile")
	waitPolls(t, 2, a, b, c)

	counts := sendRequests(t, proxyURL, 150)
	for _, name := range []string{"a", "b", "c"} {
		if counts[name] == 0 {
			t.Errorf("fallback sent nothing to %s: %v", name, counts)
		}
	}
}

func TestJSONConfigThroughAdminLoad(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	"admin": {"listen": "localhost:2999"},
	"apps": {
		"sglang_load": {"interval": "100ms"},
		"http": {
			"http_port": 9080,
			"servers": {"srv0": {
				"listen": [":9080"],
				"routes": [{"handle": [{
					"handler": "reverse_proxy",
					"load_balancing": {"selection_policy": {"policy": "sglang_load", "choose": "least"}},
					"upstreams": [{"dial": %q}, {"dial": %q}, {"dial": %q}]
				}]}]
			}}
		},
		"pki": {"certificate_authorities": {"local": {"install_trust": false}}}
	}
}`, busy.addr(), mid.addr(), idle.addr()), "json")
	waitPolls(t, 2, busy, mid, idle)

	counts := sendRequests(t, proxyURL, 100)
	if counts["idle"] < 90 {
		t.Fatalf("least-loaded got %d of 100: %v", counts["idle"], counts)
	}
}

func TestReloadKeepsLastLoads(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "choose least", busy, mid, idle), "caddyfile")
	waitPolls(t, 2, busy, mid, idle)

	// From now on no poll can answer: whatever the new config routes on, it kept from the old one.
	for _, w := range []*testWorker{busy, mid, idle} {
		w.hanging.Store(true)
	}
	tester.InitServer(caddyfile("interval 150ms\n\t\tstale_after 1m", "choose least", busy, mid, idle), "caddyfile")
	counts := sendRequests(t, proxyURL, 100)
	if counts["idle"] < 90 {
		t.Fatalf("after reload, least-loaded got %d of 100: %v", counts["idle"], counts)
	}
}

// A worker that vanishes looks least loaded in its last report; once a poll finds nobody answering,
// that report no longer counts, so requests stop going to the dead address even without Caddy's
// retries (lb_try_duration) or health checks.
func TestVanishedWorkerLosesItsReport(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms\n\t\tstale_after 1m", "choose least", busy, mid, idle), "caddyfile")
	waitPolls(t, 2, busy, mid, idle)
	if c := sendRequests(t, proxyURL, 10); c["idle"] != 10 {
		t.Fatalf("before: %v, want all on idle", c)
	}

	idle.srv.Close()
	waitWorkers(t, 10*time.Second, "the vanished worker unreachable", func(v worker) bool {
		return v.LastErrorResult == "unavailable"
	}, idle)
	// sendRequests fails the test on any non-200: a request routed to the dead address answers 502.
	if c := sendRequests(t, proxyURL, 50); c["mid"] < 45 {
		t.Errorf("after the worker vanished: %v, want the next least loaded to take >= 45 of 50", c)
	}
}
