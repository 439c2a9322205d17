package caddymodule_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddytest"
)

// Reloads under traffic: the config is reloaded through the admin API while requests flow. No request
// may fail, every selection must still be made on loads (the new config reads the loads the old one
// polled), and after many reloads the process holds no more goroutines than after the first config.
//
// Caddy hands its listener over to the new config's server on every reload and shuts the old server
// down, which breaks a few connections before any answer (EOF, reset), whatever the selection policy:
// with least_conn, 200 req/s and a reload a second for 30 s broke 0-1 of ~6,000 keep-alive requests,
// and 33 of ~5,900 without keep-alive. The client here, like any client of a reloading server, sends
// such a request again once; the retries are counted and reported.

const (
	reloadRate    = 200 // requests per second during the traffic phase
	reloadTraffic = 30 * time.Second
	reloadEvery   = time.Second
	soakReloads   = 1000 // about 20-40 ms each with -race: well within CI's budget
)

// adapt turns a Caddyfile into the JSON that /load takes.
func adapt(t *testing.T, cfg string) []byte {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cfg), nil)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	return out
}

// newAdminClient is a client for loadConfig. Each load replaces the admin server, which closes the
// connection a load came on: every load dials anew.
func newAdminClient() *http.Client {
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
}

// loadConfig posts a JSON config to the admin API's /load and returns once Caddy runs it.
func loadConfig(client *http.Client, cfg []byte) error {
	resp, err := client.Post(adminURL+"/load", "application/json", bytes.NewReader(cfg))
	if err != nil {
		// The admin server that the previous load replaced may take the connection as it stops. A
		// second load of the same config, if the first went through, changes nothing.
		resp, err = client.Post(adminURL+"/load", "application/json", bytes.NewReader(cfg))
	}
	if err != nil {
		return err
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: status %d: %s", resp.StatusCode, body)
	}
	return nil
}

// settledGoroutines is the goroutine count once the count stops falling (GC'd timers, closing conns).
func settledGoroutines() int {
	runtime.GC()
	return runtime.NumGoroutine()
}

// closingWorker is a testWorker that closes the connection of every proxied request. Caddy leaves an
// idle upstream connection of a replaced config open after the reload, whatever the selection policy
// (measured with least_conn: three goroutines more per reload); closing them here keeps the goroutine
// count about this plugin.
func closingWorker(t *testing.T, name string, tokenUsage float64, waiting int) *testWorker {
	t.Helper()
	w := &testWorker{name: name, release: make(chan struct{})}
	w.setLoad(tokenUsage, waiting)
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/loads" && r.URL.Path != "/get_load" {
			rw.Header().Set("Connection", "close")
		}
		w.serve(rw, r)
	}))
	t.Cleanup(func() {
		close(w.release)
		w.srv.Close()
	})
	return w
}

// workerStates is what the admin view says of each worker now (state, report age, in flight, the
// score's signal and value), for a failure message; the error where the view cannot be read.
func workerStates(admin *http.Client, ws ...*testWorker) string {
	resp, err := admin.Get(adminURL + "/sglang_load/workers")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	var list []worker
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, w := range ws {
		for _, v := range list {
			if len(v.Upstreams) == 0 || v.Upstreams[0] != w.addr() {
				continue
			}
			fmt.Fprintf(&b, "%s: %s, report age %v s, in flight %d", w.name, v.State, ptr(v.ReportAgeSeconds), v.Inflight)
			if v.Score != nil {
				fmt.Fprintf(&b, ", %s %g", v.Score.Signal, v.Score.Value)
			}
			if v.LastError != "" {
				fmt.Fprintf(&b, ", last error %q", v.LastError)
			}
			b.WriteString("; ")
		}
	}
	return b.String()
}

// getOnce sends a GET through Caddy, again once if its connection broke before any answer, and
// returns the worker that answered; a status other than 200 is an error.
func getOnce(client *http.Client) (worker string, retried bool, err error) {
	resp, err := client.Get(proxyURL)
	if err != nil {
		// The reload that broke the connection closed those idle beside it too: the retry dials anew.
		client.CloseIdleConnections()
		retried = true
		resp, err = client.Get(proxyURL)
	}
	if err != nil {
		return "", retried, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", retried, fmt.Errorf("status %d", resp.StatusCode)
	}
	return resp.Header.Get("X-Worker"), retried, nil
}

// trafficResult is what a run of requests saw.
type trafficResult struct {
	sent, failed int64
	retried      int64 // requests sent again after their connection broke before an answer
	byWorker     map[string]int
	errs         []string // the first few failures
	reloads      int
	took         time.Duration
}

// trafficWithReloads sends reloadRate requests per second through Caddy, d's worth of them, and loads
// the next of configs every reloadEvery until the last request was sent, calling after(i) once reload i
// has returned. The count is fixed, not the time: a busy machine stretches the run instead of
// thinning the traffic.
func trafficWithReloads(t *testing.T, traffic, admin *http.Client, configs [2][]byte, d time.Duration, after func(i int)) trafficResult {
	t.Helper()
	res := trafficResult{byWorker: make(map[string]int)}
	var sent, failed, retried atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	total := int64(reloadRate * d.Seconds())
	allSent := make(chan struct{})
	go func() {
		defer close(allSent)
		tick := time.NewTicker(time.Second / reloadRate)
		defer tick.Stop()
		for range total {
			<-tick.C
			sent.Add(1)
			wg.Go(func() {
				w, again, err := getOnce(traffic)
				if again {
					retried.Add(1)
				}
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					failed.Add(1)
					if len(res.errs) < 5 {
						res.errs = append(res.errs, err.Error())
					}
					return
				}
				res.byWorker[w]++
			})
		}
	}()
	start := time.Now()
	reloadTick := time.NewTicker(reloadEvery)
	for done := false; !done; {
		select {
		case <-allSent:
			done = true
		case <-reloadTick.C:
			if err := loadConfig(admin, configs[res.reloads%2]); err != nil {
				t.Errorf("reload %d under traffic: %v", res.reloads, err)
			}
			res.reloads++
			after(res.reloads)
		}
	}
	reloadTick.Stop()
	wg.Wait()
	res.took = time.Since(start)
	res.sent, res.failed, res.retried = sent.Load(), failed.Load(), retried.Load()
	return res
}

func TestReloadsUnderTraffic(t *testing.T) {
	const reloads = soakReloads
	busy, mid, idle := closingWorker(t, "busy", 0.9, 20), closingWorker(t, "mid", 0.5, 5), closingWorker(t, "idle", 0.1, 0)
	// stale_after is generous so that a poll delayed by a busy machine cannot turn a selection into a
	// fallback one: what is measured is whether a reload loses the loads.
	configs := [2][]byte{
		adapt(t, caddyfile("interval 100ms\n\t\tstale_after 10s", "choose least", busy, mid, idle)),
		adapt(t, caddyfile("interval 150ms\n\t\tstale_after 10s", "choose least", busy, mid, idle)),
	}
	emptyConfig := adapt(t, `{
	admin localhost:2999
	http_port 9080
	skip_install_trust
}
http://127.0.0.1:9080 {
	respond "no workers"
}
`)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms\n\t\tstale_after 10s", "choose least", busy, mid, idle), "caddyfile")
	waitPolls(t, 2, busy, mid, idle)

	admin := newAdminClient()
	traffic := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	closeIdle := func() {
		admin.CloseIdleConnections()
		traffic.CloseIdleConnections()
	}
	// A request right after a reload: the new config must route on the loads it inherited.
	probe := func(i int) {
		t.Helper()
		if w, _, err := getOnce(traffic); err != nil || w != "idle" {
			t.Errorf("request right after reload %d: answered by %q, %v; want 200 from the least loaded worker; workers now: %s",
				i, w, err, workerStates(admin, busy, mid, idle))
		}
	}

	// Baseline: the app and the proxy have run, and a reload has happened, so that Caddy's lazily
	// started goroutines exist; then everything this test started is idle.
	for i := range 2 {
		if err := loadConfig(admin, configs[i%2]); err != nil {
			t.Fatal(err)
		}
		probe(i)
	}
	closeIdle()
	base := settledGoroutines()

	// Traffic phase: reloadRate requests per second for reloadTraffic, a reload every reloadEvery.
	before := scrape(t)
	res := trafficWithReloads(t, traffic, admin, configs, reloadTraffic, probe)
	after := scrape(t)
	t.Logf("traffic: %d requests in %s (%.0f/s), %d failed, %d retried after a broken connection, %d reloads; by worker: %v",
		res.sent, res.took.Round(time.Millisecond), float64(res.sent)/res.took.Seconds(), res.failed, res.retried, res.reloads, res.byWorker)
	if res.failed != 0 {
		t.Errorf("%d of %d requests failed across %d reloads, e.g. %v", res.failed, res.sent, res.reloads, res.errs)
	}
	// The last reload tick can race the last request.
	if want := int(reloadTraffic/reloadEvery) - 1; res.reloads < want {
		t.Errorf("%d reloads during the traffic, want >= %d", res.reloads, want)
	}
	if d := selected(t, after, "fallback") + selected(t, after, "none") - selected(t, before, "fallback") - selected(t, before, "none"); d != 0 {
		t.Errorf("%v selections were not made on loads across the reloads", d)
	}
	if res.byWorker["busy"] != 0 {
		t.Errorf("the most loaded worker got %d requests: %v", res.byWorker["busy"], res.byWorker)
	}

	// Soak: back-to-back reloads, each followed by a request that must still route on loads.
	start := time.Now()
	for i := range reloads {
		if err := loadConfig(admin, configs[i%2]); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		if probe(i); t.Failed() {
			t.FailNow()
		}
	}
	soak := time.Since(start)
	closeIdle()
	now := settledGoroutines()
	poll := time.NewTicker(50 * time.Millisecond)
	for deadline := time.After(30 * time.Second); now > base+goroutineSlack; now = settledGoroutines() {
		select {
		case <-poll.C:
			continue
		case <-deadline:
		}
		break
	}
	poll.Stop()
	t.Logf("soak: %d reloads in %s (%s each); goroutines %d at baseline, %d after %d + %d reloads",
		reloads, soak.Round(time.Millisecond), (soak / time.Duration(reloads)).Round(time.Microsecond), base, now, res.reloads, reloads)
	if now > base+goroutineSlack {
		t.Errorf("goroutines: %d after %d reloads, %d at baseline (slack %d)\n%s", now, res.reloads+reloads, base, goroutineSlack, goroutineDump())
	}

	// Without the policy the app stops: none of its pollers or connections may be left.
	if err := loadConfig(admin, emptyConfig); err != nil {
		t.Fatal(err)
	}
	closeIdle()
	pollsAfterStop := busy.loadPolls.Load() + mid.loadPolls.Load() + idle.loadPolls.Load()
	eventually(t, 10*time.Second, func() bool { return settledGoroutines() <= base }, "goroutines at most %d once the app stopped (have %d)", base, runtime.NumGoroutine())
	if n := busy.loadPolls.Load() + mid.loadPolls.Load() + idle.loadPolls.Load() - pollsAfterStop; n != 0 {
		t.Errorf("%d polls after the app was stopped", n)
	}
}

// goroutineSlack allows for goroutines that come and go on their own: the proxy's coarse clock, a
// keep-alive connection being closed, a poll in flight.
const goroutineSlack = 10

// goroutineDump lists the goroutines grouped by stack, for a failure message.
func goroutineDump() string {
	var b strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
	s := b.String()
	if len(s) > 20000 {
		s = s[:20000] + "\n..."
	}
	return s
}

// Caddy does not wait for the requests in flight on a replaced config before cleaning it up, and such
// a request that retries calls Select on a policy whose app is gone. It must register nothing there:
// no poller, no fetcher, no metric series that nothing would ever remove.
func TestSelectAfterCleanupRegistersNothing(t *testing.T) {
	arrived, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	old := &testWorker{name: "old"}
	old.setLoad(0.1, 0)
	old.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/loads" && first.CompareAndSwap(false, true) {
			// The first request is held across the reload, then its connection breaks: Caddy retries it.
			close(arrived)
			<-release
			if conn, _, err := rw.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
			return
		}
		old.serve(rw, r)
	}))
	t.Cleanup(old.srv.Close)
	next := newTestWorker(t, "next", 0.1, 0)
	config := func(w *testWorker) string {
		return fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	sglang_load {
		interval 100ms
	}
}
http://127.0.0.1:9080 {
	reverse_proxy %s {
		lb_policy sglang_load
		lb_retries 2
	}
}
`, w.addr())
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(config(old), "caddyfile")
	waitPolls(t, 1, old)

	type answer struct {
		worker string
		err    error
	}
	answered := make(chan answer, 1)
	go func() {
		resp, err := http.Get(proxyURL)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		resp.Body.Close()
		answered <- answer{worker: resp.Header.Get("X-Worker")}
	}()
	<-arrived
	if err := loadConfig(newAdminClient(), adapt(t, config(next))); err != nil {
		t.Fatal(err)
	}
	close(release) // the replaced config is cleaned up: its request retries now
	if a := <-answered; a.err != nil || a.worker != "old" {
		t.Fatalf("the retried request: answered by %q, %v; want old", a.worker, a.err)
	}
	series := fmt.Sprintf("endpoint=%q", "http://"+old.addr())
	eventually(t, 3*time.Second, func() bool { return !strings.Contains(scrape(t), series) },
		"the metrics to have no series of %s, which only the replaced config polled", old.addr())
}
