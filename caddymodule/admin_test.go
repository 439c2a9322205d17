package caddymodule_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/monitor"
)

const adminURL = "http://localhost:2999"

// worker is the subset of an /sglang_load/workers entry the tests read.
type worker struct {
	Upstreams        []string `json:"upstreams"`
	Endpoint         string   `json:"endpoint"`
	LoadAddress      string   `json:"load_address"`
	Transport        string   `json:"transport"`
	Interval         string   `json:"interval"`
	StaleAfter       string   `json:"stale_after"`
	State            string   `json:"state"`
	ReportAgeSeconds *float64 `json:"report_age_seconds"`
	Report           *struct {
		Received time.Time `json:"received"`
		Totals   struct {
			Running    *int64   `json:"num_running_reqs"`
			Waiting    *int64   `json:"num_waiting_reqs"`
			TokenUsage *float64 `json:"token_usage"`
		} `json:"totals"`
		Ranks []struct {
			DPRank     *int     `json:"dp_rank"`
			TokenUsage *float64 `json:"token_usage"`
		} `json:"ranks"`
	} `json:"report"`
	LastError       string     `json:"last_error"`
	LastErrorResult string     `json:"last_error_result"`
	LastErrorAt     *time.Time `json:"last_error_at"`
	PollsOK         uint64     `json:"polls_ok"`
	PollsFailed     uint64     `json:"polls_failed"`
	Inflight        int64      `json:"inflight"`
	Score           *struct {
		Signal      string             `json:"signal"`
		Value       float64            `json:"value"`
		Signals     map[string]float64 `json:"signals"`
		CostSeconds *float64           `json:"cost_seconds"`
		CostRequest *struct {
			PromptTokens int64 `json:"prompt_tokens"`
			MaxTokens    int64 `json:"max_tokens"`
		} `json:"cost_request"`
		Prefill     *float64 `json:"prefill_tokens_per_sec"`
		DecodeAlone *float64 `json:"decode_alone_tokens_per_sec"`
		Senders     *float64 `json:"senders"`
		Sent        struct {
			Requests     int64 `json:"requests"`
			PromptTokens int64 `json:"prompt_tokens"`
			OutputTokens int64 `json:"output_tokens"`
		} `json:"sent_since_report"`
	} `json:"score"`
	AffinityBlocks   *int64 `json:"affinity_blocks"`
	AffinityHomeKeys *int64 `json:"affinity_home_keys"`
}

// adminDo sends a request to the admin API and returns the status and the body.
func adminDo(t *testing.T, method, path string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, adminURL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Timeout: 15 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return resp.StatusCode, body
}

// workers returns the admin view, keyed by upstream address.
func workers(t *testing.T) map[string]worker {
	t.Helper()
	code, body := adminDo(t, http.MethodGet, "/sglang_load/workers")
	if code != http.StatusOK {
		t.Fatalf("GET /sglang_load/workers: status %d: %s", code, body)
	}
	return decodeWorkers(t, body)
}

func decodeWorkers(t *testing.T, body []byte) map[string]worker {
	t.Helper()
	var list []worker
	if err := json.Unmarshal(body, &list); err != nil {
		t.Fatalf("decoding workers: %v: %s", err, body)
	}
	byAddr := make(map[string]worker, len(list))
	for _, w := range list {
		if len(w.Upstreams) != 1 {
			t.Fatalf("worker %s: upstreams %v, want one", w.Endpoint, w.Upstreams)
		}
		byAddr[w.Upstreams[0]] = w
	}
	return byAddr
}

// waitWorkers waits until the admin view satisfies cond for every named worker.
func waitWorkers(t *testing.T, within time.Duration, what string, cond func(worker) bool, ws ...*testWorker) map[string]worker {
	t.Helper()
	addrs := make([]string, len(ws))
	for i, w := range ws {
		addrs[i] = w.addr()
	}
	return waitAddrs(t, within, what, cond, addrs...)
}

// waitAddrs waits until the admin view satisfies cond for the worker at every address, and returns
// the view that did.
func waitAddrs(t *testing.T, within time.Duration, what string, cond func(worker) bool, addrs ...string) map[string]worker {
	t.Helper()
	var view map[string]worker
	eventually(t, within, func() bool {
		view = workers(t)
		for _, a := range addrs {
			if v, ok := view[a]; !ok || !cond(v) {
				return false
			}
		}
		return true
	}, "admin view: %s", what)
	return view
}

func polledOK(w worker) bool { return w.State == "fresh" && w.PollsOK >= 1 }

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

func TestAdminListsEveryWorker(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "", busy, mid, idle), "caddyfile")
	view := waitWorkers(t, 10*time.Second, "every worker polled", polledOK, busy, mid, idle)

	if len(view) != 3 {
		t.Fatalf("admin view has %d workers, want 3: %v", len(view), view)
	}
	for _, tc := range []struct {
		w                 *testWorker
		usage             float64
		running, waiting  int64
		queuedTokensScore float64 // (waiting+1)*500 queued tokens / 1000 tokens/s: Select counts the request being placed
		// 1000 tokens/s over the running batch, carried to a batch of one at a halving of 32 requests:
		// 1000/running × (1 + (running-1)/32).
		decodeAlone float64
	}{
		{busy, 0.9, 90, 20, 10.5, 1000.0 / 90 * (1 + 89.0/32)}, {mid, 0.5, 50, 5, 3, 1000.0 / 50 * (1 + 49.0/32)},
		{idle, 0.1, 10, 0, 0, 1000.0 / 10 * (1 + 9.0/32)},
	} {
		v := view[tc.w.addr()]
		if v.Endpoint != "http://"+tc.w.addr() || v.LoadAddress != tc.w.addr() || v.Transport != "http" ||
			v.Interval != "100ms" || v.StaleAfter != "300ms" || v.State != "fresh" {
			t.Errorf("%s: endpoint %q load address %q transport %q interval %q stale_after %q state %q", tc.w.name,
				v.Endpoint, v.LoadAddress, v.Transport, v.Interval, v.StaleAfter, v.State)
		}
		if v.Report == nil || v.ReportAgeSeconds == nil {
			t.Fatalf("%s: no report", tc.w.name)
		}
		tot := v.Report.Totals
		if tot.TokenUsage == nil || !near(*tot.TokenUsage, tc.usage) || tot.Running == nil || *tot.Running != tc.running ||
			tot.Waiting == nil || *tot.Waiting != tc.waiting {
			t.Errorf("%s: totals usage %v running %v waiting %v, want %v %d %d", tc.w.name,
				ptr(tot.TokenUsage), ptr(tot.Running), ptr(tot.Waiting), tc.usage, tc.running, tc.waiting)
		}
		if len(v.Report.Ranks) != 1 || v.Report.Ranks[0].DPRank == nil || *v.Report.Ranks[0].DPRank != 0 {
			t.Errorf("%s: ranks %+v, want one rank 0", tc.w.name, v.Report.Ranks)
		}
		if *v.ReportAgeSeconds < 0 || *v.ReportAgeSeconds > 5 {
			t.Errorf("%s: report age %vs", tc.w.name, *v.ReportAgeSeconds)
		}
		if v.PollsFailed != 0 || v.LastError != "" || v.Inflight != 0 {
			t.Errorf("%s: polls failed %d, last error %q, in flight %d", tc.w.name, v.PollsFailed, v.LastError, v.Inflight)
		}
		// Each running request holds 1% of the pool; the request being placed is counted.
		if v.Score == nil || v.Score.Signal != "queued_tokens" || !near(v.Score.Value, tc.queuedTokensScore) ||
			!near(v.Score.Signals["token_usage"], tc.usage+0.01) || !near(v.Score.Signals["waiting"], float64(tc.waiting+1)) {
			t.Errorf("%s: score %+v, want queued_tokens %v", tc.w.name, v.Score, tc.queuedTokensScore)
		}
		if v.Score != nil && (v.Score.CostSeconds == nil || !(*v.Score.CostSeconds > 0)) {
			t.Errorf("%s: cost_seconds %v, want a price > 0", tc.w.name, ptr(v.Score.CostSeconds))
		}
		if v.Score != nil && (v.Score.CostRequest == nil || v.Score.CostRequest.PromptTokens != 512 || v.Score.CostRequest.MaxTokens != 256) {
			t.Errorf("%s: cost_request %+v, want the reference request of 512 prompt and 256 output tokens", tc.w.name, v.Score.CostRequest)
		}
		if v.Score != nil && v.Score.Senders != nil {
			t.Errorf("%s: senders %v from a worker without prefill counters, want none", tc.w.name, *v.Score.Senders)
		}
		if v.Score != nil && (v.Score.DecodeAlone == nil || !near(*v.Score.DecodeAlone, tc.decodeAlone)) {
			t.Errorf("%s: decode_alone_tokens_per_sec %v, want %v", tc.w.name, ptr(v.Score.DecodeAlone), tc.decodeAlone)
		}
	}

	code, body := adminDo(t, http.MethodGet, "/sglang_load/workers/"+mid.addr())
	var one worker
	if err := json.Unmarshal(body, &one); code != http.StatusOK || err != nil || one.Endpoint != "http://"+mid.addr() {
		t.Errorf("GET /sglang_load/workers/%s: status %d, %v: %s", mid.addr(), code, err, body)
	}
	code, body = adminDo(t, http.MethodGet, "/sglang_load/workers/127.0.0.1:1")
	if code != http.StatusNotFound || !strings.Contains(string(body), `"error"`) {
		t.Errorf("unknown worker: status %d: %s, want 404 with a JSON error", code, body)
	}
}

func ptr[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

func TestAdminShowsHungWorkerStale(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	tester.InitServer(withDebugLog(caddyfile("interval 100ms\n\t\ttimeout 100ms\n\t\tstale_after 300ms", "", busy, mid, idle), logFile), "caddyfile")
	waitWorkers(t, 10*time.Second, "every worker polled", polledOK, busy, mid, idle)

	mid.hanging.Store(true)
	view := waitWorkers(t, 10*time.Second, "hung worker stale", func(w worker) bool { return w.State == "stale" }, mid)
	v := view[mid.addr()]
	if v.LastErrorResult != "timeout" || !strings.Contains(v.LastError, "timeout") || v.LastErrorAt == nil || v.PollsFailed == 0 {
		t.Errorf("hung worker: error %q (%s) at %v, %d failed polls", v.LastError, v.LastErrorResult, v.LastErrorAt, v.PollsFailed)
	}
	if v.Report == nil || v.ReportAgeSeconds == nil || *v.ReportAgeSeconds < 0.3 || v.Score != nil {
		t.Errorf("hung worker: report %v age %v score %+v, want the old report, older than 300ms, and no score",
			v.Report != nil, ptr(v.ReportAgeSeconds), v.Score)
	}
	for _, w := range []*testWorker{busy, idle} {
		if s := view[w.addr()].State; s != "fresh" {
			t.Errorf("%s: state %q beside a hung worker, want fresh", w.name, s)
		}
	}
	if n := metricValue(t, scrape(t), "caddy_sglang_load_polls_total", "endpoint", "http://"+mid.addr(), "result", "timeout"); n < 1 {
		t.Errorf("polls_total{result=timeout} of the hung worker = %v, want >= 1", n)
	}
	waitLog(t, logFile, "the stale event", `"name":"sglang_load_stale"`, `"endpoint":"http://`+mid.addr()+`"`)

	// Enough failed polls that a line per poll would show.
	waitWorkers(t, 10*time.Second, "6 failed polls", func(w worker) bool { return w.PollsFailed >= 6 }, mid)
	mid.hanging.Store(false)
	waitWorkers(t, 10*time.Second, "recovered worker fresh", polledOK, mid)
	logs := waitLog(t, logFile, "the recovered event", `"name":"sglang_load_recovered"`, `"endpoint":"http://`+mid.addr()+`"`)
	// One line per state change, not one per failed poll.
	var changes int
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, `"msg":"worker load state changed"`) && strings.Contains(line, mid.addr()) {
			changes++
		}
	}
	// missing -> fresh, fresh/ok -> fresh/timeout (unless the first failure ends past stale_after),
	// fresh -> stale, stale -> fresh/ok.
	if changes < 3 || changes > 4 {
		t.Errorf("%d state-change lines for the hung worker over 6 failed polls, want 3 or 4:\n%s", changes, logs)
	}
}

// withDebugLog adds a global log block that writes debug lines to path.
func withDebugLog(cfg, path string) string {
	return strings.Replace(cfg, "skip_install_trust\n", fmt.Sprintf("skip_install_trust\n\tlog {\n\t\toutput file %s\n\t\tlevel DEBUG\n\t}\n", path), 1)
}

// waitLog waits until one line of the log file holds every one of parts, and returns the file.
func waitLog(t *testing.T, path, what string, parts ...string) string {
	t.Helper()
	var logs string
	eventually(t, 10*time.Second, func() bool {
		b, err := os.ReadFile(path)
		logs = string(b)
		if err != nil {
			return false
		}
	lines:
		for _, line := range strings.Split(logs, "\n") {
			for _, p := range parts {
				if !strings.Contains(line, p) {
					continue lines
				}
			}
			return true
		}
		return false
	}, "log line: %s", what)
	return logs
}

func TestAdminRefreshAndMethods(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	// Polled once at start, then not for an hour: only a refresh can show a new load.
	tester.InitServer(caddyfile("interval 1h", "", busy, mid, idle), "caddyfile")
	waitWorkers(t, 10*time.Second, "every worker polled", polledOK, busy, mid, idle)

	idle.setLoad(0.75, 3)
	before := idle.loadPolls.Load()
	code, body := adminDo(t, http.MethodPost, "/sglang_load/refresh")
	if code != http.StatusOK {
		t.Fatalf("POST /sglang_load/refresh: status %d: %s", code, body)
	}
	if idle.loadPolls.Load() == before {
		t.Errorf("refresh answered without polling")
	}
	for name, view := range map[string]map[string]worker{"refresh answer": decodeWorkers(t, body), "view after refresh": workers(t)} {
		v := view[idle.addr()]
		if v.Report == nil || v.Report.Totals.TokenUsage == nil || !near(*v.Report.Totals.TokenUsage, 0.75) || v.PollsOK != 2 {
			t.Errorf("%s: idle worker usage %v after %d ok polls, want 0.75 after 2", name, v.Report, v.PollsOK)
		}
	}

	for _, tc := range []struct{ method, path, allow string }{
		{http.MethodPost, "/sglang_load/workers", "GET"},
		{http.MethodDelete, "/sglang_load/workers/" + idle.addr(), "GET"},
		{http.MethodGet, "/sglang_load/refresh", "POST"},
		{http.MethodPut, "/sglang_load/refresh", "POST"},
	} {
		req, _ := http.NewRequest(tc.method, adminURL+tc.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e struct{ Error string }
		err = json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed || err != nil || e.Error == "" || resp.Header.Get("Allow") != tc.allow {
			t.Errorf("%s %s: status %d, Allow %q, JSON error %q (%v); want 405, %s and an error",
				tc.method, tc.path, resp.StatusCode, resp.Header.Get("Allow"), e.Error, err, tc.allow)
		}
	}
}

// With affinity prefix, the admin view shows per worker the blocks the index remembers sending there
// and how many of the system prompts seen lately the latest placement makes it home to: each prompt
// sent is home to one worker.
func TestAdminShowsAffinityPerWorker(t *testing.T) {
	a, b := newTestWorker(t, "a", 0.1, 0), newTestWorker(t, "b", 0.1, 0)
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
}
http://127.0.0.1:9080 {
	reverse_proxy %s %s {
		lb_policy sglang_load {
			interval 100ms
			affinity prefix
		}
	}
}
`, a.addr(), b.addr()), "caddyfile")
	waitWorkers(t, 10*time.Second, "both workers polled", polledOK, a, b)
	const prompts = 6
	send := func(i int) {
		system := strings.Repeat(fmt.Sprintf("You are assistant %d; answer briefly. ", i), 60)
		body := `{"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"}]}`
		resp, err := http.Post("http://127.0.0.1:9080/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("prompt %d: status %d", i, resp.StatusCode)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		for i := range prompts { // a placement runs in a Select once a second
			send(i)
		}
		var blocks, homeKeys int64
		view := workers(t)
		for addr, w := range view {
			if w.AffinityBlocks == nil || w.AffinityHomeKeys == nil {
				t.Fatalf("%s: affinity_blocks %v, affinity_home_keys %v; want both", addr, ptr(w.AffinityBlocks), ptr(w.AffinityHomeKeys))
			}
			blocks += *w.AffinityBlocks
			homeKeys += *w.AffinityHomeKeys
		}
		if blocks > 0 && homeKeys == prompts {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10 s: %d blocks, %d home keys over the workers; want some blocks and %d keys", blocks, homeKeys, prompts)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// onDemandCaddyfile has no sglang_load global option: the policy creates the app with its defaults.
func onDemandCaddyfile(workers ...*testWorker) string {
	addrs := make([]string, len(workers))
	for i, w := range workers {
		addrs[i] = w.addr()
	}
	return fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
}
http://127.0.0.1:9080 {
	reverse_proxy %s {
		lb_policy sglang_load {
			interval 150ms
		}
	}
}
`, strings.Join(addrs, " "))
}

func TestAdminViewSurvivesReload(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "", busy, mid), "caddyfile")
	first := waitWorkers(t, 10*time.Second, "two workers polled", polledOK, busy, mid)
	if len(first) != 2 {
		t.Fatalf("before reload: %d workers, want 2", len(first))
	}

	// The new config has no sglang_load block (the app is created on demand) and one more worker.
	tester.InitServer(onDemandCaddyfile(busy, mid, idle), "caddyfile")
	view := waitWorkers(t, 10*time.Second, "three workers polled at the new interval",
		func(w worker) bool { return polledOK(w) && w.Interval == "150ms" }, busy, mid, idle)
	if len(view) != 3 {
		t.Fatalf("after reload: %d workers, want 3: %v", len(view), view)
	}
	// The loads survived the reload: the counts go on from the old config's.
	if ok := view[busy.addr()].PollsOK; ok < first[busy.addr()].PollsOK {
		t.Errorf("busy: %d ok polls after the reload, fewer than the %d before", ok, first[busy.addr()].PollsOK)
	}
	if v := view[idle.addr()]; v.Report == nil || !near(*v.Report.Totals.TokenUsage, 0.1) {
		t.Errorf("idle worker after reload: report %+v", v.Report)
	}
}

// scrape returns the admin /metrics page.
func scrape(t *testing.T) string {
	t.Helper()
	code, body := adminDo(t, http.MethodGet, "/metrics")
	if code != http.StatusOK {
		t.Fatalf("GET /metrics: status %d", code)
	}
	return string(body)
}

// selected is the count of selections by branch (load, fallback, none) on the metrics page.
func selected(t *testing.T, page, branch string) float64 {
	t.Helper()
	return metricValue(t, page, "caddy_sglang_load_selections_total", "branch", branch)
}

// metricValue returns the value of the series of name whose labels include the given name/value pairs,
// or NaN when there is none.
func metricValue(t *testing.T, page, name string, labels ...string) float64 {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(page))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
lines:
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if !strings.Contains(line, fmt.Sprintf("%s=%q", labels[i], labels[i+1])) {
				continue lines
			}
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("series %q: %v", line, err)
		}
		return v
	}
	return math.NaN()
}

func TestMetricsSeries(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 100ms", "choose least", busy, mid, idle), "caddyfile")
	// A poll's count belongs to its endpoint across configs, and a worker may listen on the port of one
	// that the test before polled as it closed (seen once: a refused poll counted on the idle worker):
	// failures are counted from this config on.
	start := scrape(t)
	waitWorkers(t, 10*time.Second, "every worker polled", polledOK, busy, mid, idle)

	before := scrape(t)
	sendRequests(t, proxyURL, 20)
	page := scrape(t)
	for _, tc := range []struct {
		w                       *testWorker
		usage, running, waiting float64
	}{{busy, 0.9, 90, 20}, {mid, 0.5, 50, 5}, {idle, 0.1, 10, 0}} {
		ep := []string{"endpoint", "http://" + tc.w.addr(), "transport", "http"}
		for name, want := range map[string]float64{
			"caddy_sglang_load_token_usage":      tc.usage,
			"caddy_sglang_load_running_requests": tc.running,
			"caddy_sglang_load_waiting_requests": tc.waiting,
		} {
			if got := metricValue(t, page, name, ep...); !near(got, want) {
				t.Errorf("%s %s = %v, want %v", tc.w.name, name, got, want)
			}
		}
		if age := metricValue(t, page, "caddy_sglang_load_report_age_seconds", ep...); !(age >= 0 && age < 5) {
			t.Errorf("%s report age %v", tc.w.name, age)
		}
		if ok := metricValue(t, page, "caddy_sglang_load_polls_total", append(ep, "result", "ok")...); !(ok >= 1) {
			t.Errorf("%s ok polls %v", tc.w.name, ok)
		}
		for _, r := range pollResultLabels[1:] {
			labels := append(ep, "result", r)
			n := metricValue(t, page, "caddy_sglang_load_polls_total", labels...) // NaN, an error, without the series
			if was := metricValue(t, start, "caddy_sglang_load_polls_total", labels...); !math.IsNaN(was) {
				n -= was
			}
			if n != 0 {
				t.Errorf("%s polls_total{result=%s} grew by %v, want 0", tc.w.name, r, n)
			}
		}
	}
	if n := metricValue(t, page, "caddy_sglang_load_poll_duration_seconds_count", "transport", "http", "result", "ok"); !(n >= 3) {
		t.Errorf("poll duration histogram count %v, want >= 3", n)
	}
	if d := selected(t, page, "load") - selected(t, before, "load"); d != 20 {
		t.Errorf("selections by load grew by %v over 20 requests, want 20", d)
	}
	if d := selected(t, page, "fallback") - selected(t, before, "fallback"); d != 0 {
		t.Errorf("selections by fallback grew by %v with fresh loads, want 0", d)
	}

	// Without loads every selection is the fallback's.
	a, b := newTestWorker(t, "a", 0, 0), newTestWorker(t, "b", 0, 0)
	a.noLoads.Store(true)
	b.noLoads.Store(true)
	tester.InitServer(caddyfile("interval 100ms", "", a, b), "caddyfile")
	waitPolls(t, 1, a, b)
	before = scrape(t)
	sendRequests(t, proxyURL, 10)
	page = scrape(t)
	if d := selected(t, page, "fallback") - selected(t, before, "fallback"); d != 10 {
		t.Errorf("selections by fallback grew by %v over 10 requests without loads, want 10", d)
	}
	// The old config's workers are no longer monitored: their gauges are gone.
	if v := metricValue(t, page, "caddy_sglang_load_token_usage", "endpoint", "http://"+busy.addr()); !math.IsNaN(v) {
		t.Errorf("token_usage of an unmonitored worker still exported: %v", v)
	}
}

// pollResultLabels is every value of the result label.
var pollResultLabels = []string{"ok", "timeout", "http_status", "grpc_status", "too_large", "decode", "unavailable"}

// The metrics, the admin view and the log lines name a failed poll's class alike.
func TestMetricsCountFailuresByResult(t *testing.T) {
	notFound := newTestWorker(t, "not-found", 0, 0)
	notFound.noLoads.Store(true)
	garbage := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(rw, "<html>not json</html>")
	}))
	t.Cleanup(garbage.Close)
	huge := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Length", strconv.Itoa(2<<20))
	}))
	t.Cleanup(huge.Close)
	// A port that refuses: listen, take the address, close.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	ln.Close()
	logFile := filepath.Join(t.TempDir(), "caddy.log")

	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	log {
		output file %s
	}
	sglang_load {
		interval 100ms
	}
}
http://127.0.0.1:9080 {
	reverse_proxy %s %s %s %s {
		lb_policy sglang_load
	}
}
`, logFile, notFound.addr(), strings.TrimPrefix(garbage.URL, "http://"), strings.TrimPrefix(huge.URL, "http://"), refused), "caddyfile")

	want := map[string]string{
		notFound.addr(): "http_status",
		strings.TrimPrefix(garbage.URL, "http://"): "decode",
		strings.TrimPrefix(huge.URL, "http://"):    "too_large",
		refused:                                    "unavailable",
	}
	var page string
	eventually(t, 10*time.Second, func() bool {
		page = scrape(t)
		for addr, result := range want {
			if !(metricValue(t, page, "caddy_sglang_load_polls_total", "endpoint", "http://"+addr, "result", result) >= 2) {
				return false
			}
		}
		return true
	}, "two failed polls of each worker")
	for addr, result := range want {
		for _, r := range pollResultLabels {
			if r == result {
				continue
			}
			if n := metricValue(t, page, "caddy_sglang_load_polls_total", "endpoint", "http://"+addr, "result", r); n != 0 {
				t.Errorf("%s: polls_total{result=%s} = %v, want 0 (its polls fail with %s)", addr, r, n, result)
			}
		}
	}
	view := workers(t)
	for addr, result := range want {
		if v := view[addr]; v.State != "missing" || v.LastErrorResult != result || v.Score != nil {
			t.Errorf("%s: state %q, last error %q (%s), score %+v; want missing, %s, no score", addr, v.State, v.LastError,
				v.LastErrorResult, v.Score, result)
		}
	}
	// Each worker's first failure is logged once, at warn, with the same result.
	logged := make(map[string]string)
	eventually(t, 10*time.Second, func() bool {
		b, err := os.ReadFile(logFile)
		if err != nil {
			return false
		}
		for _, line := range strings.Split(string(b), "\n") {
			var entry struct{ Msg, Endpoint, Result string }
			if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "worker load state changed" {
				logged[strings.TrimPrefix(entry.Endpoint, "http://")] = entry.Result
			}
		}
		return len(logged) >= len(want)
	}, "a state-change line per worker")
	for addr, result := range want {
		if logged[addr] != result {
			t.Errorf("%s: logged result %q, want %q", addr, logged[addr], result)
		}
	}
}

func TestAPIKeyNeverShown(t *testing.T) {
	const secret = "sk-test-9f8e7d6c5b4a"
	var authorized, echoed atomic.Int64
	keyed := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+secret {
			http.Error(rw, "unauthorized", http.StatusUnauthorized)
			return
		}
		authorized.Add(1)
		fmt.Fprint(rw, `{"version":"0.5.9","loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":0,"num_used_tokens":10,"max_total_num_tokens":100,"token_usage":0.1}]}`)
	}))
	t.Cleanup(keyed.Close)
	// A worker that rejects the key and echoes it back, as a careless server might.
	echo := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		echoed.Add(1)
		http.Error(rw, "bad credentials: "+r.Header.Get("Authorization"), http.StatusForbidden)
	}))
	t.Cleanup(echo.Close)
	logFile := filepath.Join(t.TempDir(), "caddy.log")

	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	log {
		output file %s
		level DEBUG
	}
	sglang_load {
		interval 100ms
	}
}
http://127.0.0.1:9080 {
	reverse_proxy %s %s {
		lb_policy sglang_load {
			api_key %s
		}
	}
}
`, logFile, strings.TrimPrefix(keyed.URL, "http://"), strings.TrimPrefix(echo.URL, "http://"), secret), "caddyfile")

	eventually(t, 10*time.Second, func() bool { return authorized.Load() >= 2 && echoed.Load() >= 2 }, "polls with the key")
	var shown strings.Builder
	for _, req := range []struct{ method, path string }{
		{http.MethodGet, "/sglang_load/workers"},
		{http.MethodGet, "/sglang_load/workers/" + strings.TrimPrefix(echo.URL, "http://")},
		{http.MethodPost, "/sglang_load/refresh"},
		{http.MethodGet, "/metrics"},
	} {
		_, body := adminDo(t, req.method, req.path)
		shown.Write(body)
	}
	if !strings.Contains(shown.String(), "http_status") {
		t.Errorf("admin output does not show the rejected poll: %s", shown.String())
	}
	if strings.Contains(shown.String(), secret) {
		t.Errorf("the api key appears in the admin output")
	}

	// Every poll is logged at debug level, and the rejected worker's state change at warn: the
	// capture holds both, and never the key.
	var logs []byte
	eventually(t, 10*time.Second, func() bool {
		var err error
		logs, err = os.ReadFile(logFile)
		return err == nil && strings.Contains(string(logs), `"msg":"worker load state changed"`) &&
			strings.Contains(string(logs), `"result":"http_status"`) && strings.Contains(string(logs), `"msg":"poll"`)
	}, "poll and state-change lines in the captured log")
	if strings.Contains(string(logs), secret) {
		for _, line := range strings.Split(string(logs), "\n") {
			if strings.Contains(line, secret) {
				t.Errorf("the api key appears in a log line: %s", line)
			}
		}
	}
}

// A worker new to the process makes its first polls a tenth of the interval apart, so that what one
// poll cannot measure (speeds, from the difference of counters) is known within an interval; a worker
// that a reload keeps has been measured, and is polled at the interval from the start.
func TestNewWorkersWarmUp(t *testing.T) {
	busy, mid, idle := threeWorkers(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfile("interval 2s", "", busy, mid), "caddyfile")
	// At the interval, monitor.WarmUpPolls polls would take 18 s.
	first := waitWorkers(t, 8*time.Second, "the warm-up polls", func(w worker) bool { return w.PollsOK >= uint64(monitor.WarmUpPolls) }, busy, mid)

	tester.InitServer(caddyfile("interval 2s", "", busy, mid, idle), "caddyfile")
	view := waitWorkers(t, 8*time.Second, "the new worker's warm-up", func(w worker) bool { return w.PollsOK >= uint64(monitor.WarmUpPolls/2) }, idle)
	for _, w := range []*testWorker{busy, mid} {
		// A poll by the new config as it starts, and one by the old before it stops, at most.
		if more := view[w.addr()].PollsOK - first[w.addr()].PollsOK; more > 2 {
			t.Errorf("%s: %d more polls while the new worker made %d, want at most 2", w.addr(), more, view[idle.addr()].PollsOK)
		}
	}
}

// Through Caddy, the admin view's sent_since_report counts what the default policy priced as work: a
// chat (its answer at default_max_tokens, 256, the body unread) and an embedding (no answer), never a
// model list or a health check.
func TestAdminCountsTheWorkSentSinceTheReport(t *testing.T) {
	a, b := newTestWorker(t, "a", 0.1, 0), newTestWorker(t, "b", 0.1, 0)
	tester := caddytest.NewTester(t)
	// A minute's interval: its warm-up polls are 6 s apart, and a poll between the two reads of the
	// view, which starts the count again, makes the attempt start over.
	tester.InitServer(caddyfile("interval 1m", "", a, b), "caddyfile")
	waitPolls(t, 1, a, b)
	sent := func() (requests, prompt, output int64, received []time.Time) {
		for _, w := range workers(t) {
			if w.Score == nil || w.Report == nil {
				t.Fatalf("%s: no score or report: %+v", w.Endpoint, w)
			}
			requests, prompt, output = requests+w.Score.Sent.Requests, prompt+w.Score.Sent.PromptTokens, output+w.Score.Sent.OutputTokens
			received = append(received, w.Report.Received)
		}
		slices.SortFunc(received, time.Time.Compare)
		return requests, prompt, output, received
	}
	for attempt := 1; ; attempt++ {
		requests0, prompt0, output0, received0 := sent()
		sendRequests(t, proxyURL+"v1/models", 10)
		sendRequests(t, proxyURL+"health", 10)
		for range 4 {
			post(t, proxyURL+"v1/embeddings", `{"model":"m","input":"a sentence to embed"}`, nil)
		}
		for range 3 {
			post(t, proxyURL+"v1/chat/completions", `{"messages":[{"role":"user","content":"hello"}],"max_tokens":77}`, nil)
		}
		requests, prompt, output, received := sent()
		if !slices.Equal(received, received0) {
			if attempt == 3 {
				t.Fatal("a poll came between the reads of the view three times")
			}
			continue
		}
		if requests-requests0 != 7 || output-output0 != 3*256 || prompt <= prompt0 {
			t.Errorf("sent since the report: %d requests, %d prompt and %d output tokens more; want 7 (4 embeddings, 3 chats), some prompt and 3 × 256 output",
				requests-requests0, prompt-prompt0, output-output0)
		}
		return
	}
}
