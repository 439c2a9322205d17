package caddymodule_test

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// hashingWorker reports a fixed load and answers each request with the SHA-256 and length of the body
// it received, so a test can check that the policy's reading of the body left it intact.
type hashingWorker struct {
	srv      *httptest.Server
	gen      float64 // gen_throughput it reports; higher is less loaded
	requests atomic.Int64
	// reset, when set, makes the worker drop the connection of each request before answering.
	reset atomic.Bool
}

// setBodyHash answers with the SHA-256 and the length of the body a request carried (X-Body-Sha256,
// X-Body-Length).
func setBodyHash(rw http.ResponseWriter, body []byte) {
	sum := sha256.Sum256(body)
	rw.Header().Set("X-Body-Sha256", hex.EncodeToString(sum[:]))
	rw.Header().Set("X-Body-Length", fmt.Sprint(len(body)))
}

func newHashingWorker(t *testing.T, running int, gen float64) *hashingWorker {
	t.Helper()
	w := &hashingWorker{gen: gen}
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/loads" {
			fmt.Fprintf(rw, `{"version":"0.5.9","loads":[{"dp_rank":0,"num_running_reqs":%d,"num_waiting_reqs":0,`+
				`"num_waiting_uncached_tokens":0,"num_used_tokens":%d,"max_total_num_tokens":100000,`+
				`"max_running_requests":64,"token_usage":0.01,"gen_throughput":%g}]}`, running, running*100, w.gen)
			return
		}
		w.requests.Add(1)
		body, err := io.ReadAll(r.Body)
		if w.reset.Load() {
			if hj, ok := rw.(http.Hijacker); ok {
				if conn, _, err := hj.Hijack(); err == nil {
					conn.Close()
					return
				}
			}
		}
		if err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		setBodyHash(rw, body)
	}))
	t.Cleanup(w.srv.Close)
	return w
}

func (w *hashingWorker) addr() string { return strings.TrimPrefix(w.srv.URL, "http://") }

// chatBody is a chat request of about size bytes whose max_tokens comes after the messages, its text
// dense with escapes (3 in 51 bytes).
func chatBody(size int) []byte {
	return chatBodyOf(size, `the quick brown fox \"jumps\" over the lazy dog\n `)
}

// chatBodyOf is a chat request of about size bytes whose system message repeats line (JSON text) and
// whose max_tokens comes after the messages.
func chatBodyOf(size int, line string) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"m","messages":[{"role":"system","content":"`)
	for b.Len() < size-64 {
		b.WriteString(line)
	}
	b.WriteString(`"}],"max_tokens":77,"stream":false}`)
	return b.Bytes()
}

// TestCostMetricKeepsTheBody sends bodies of every kind the policy reads, skips or reads only the head of
// through Caddy with the cost metric (named, and as the default, which reads chunked bodies only
// here), and checks that the upstream receives exactly the bytes sent.
func TestCostMetricKeepsTheBody(t *testing.T) {
	for _, policy := range []string{"metric cost\n\t\t\tread_body 64KiB", "affinity prefix", ""} {
		t.Run(cmp.Or(policy, "default"), func(t *testing.T) { testBodyKept(t, policy) })
	}
}

func testBodyKept(t *testing.T, policy string) {
	a, b := newHashingWorker(t, 1, 1000), newHashingWorker(t, 1, 1000)
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	https_port 9443
	grace_period 1ns
	sglang_load {
		interval 100ms
	}
}
http://localhost:9080 {
	reverse_proxy %s %s {
		lb_policy sglang_load {
			%s
		}
	}
}`, a.addr(), b.addr(), policy), "caddyfile")
	waitWorkers(t, 10*time.Second, "both polled", polledOK, &testWorker{srv: a.srv}, &testWorker{srv: b.srv})

	big := chatBody(10 << 20)
	for _, tc := range []struct {
		name    string
		path    string
		body    []byte
		chunked bool
		header  map[string]string
	}{
		{name: "small chat", path: "/v1/chat/completions", body: chatBody(2 << 10)},
		{name: "head of a 200 KiB chat", path: "/v1/chat/completions", body: chatBody(200 << 10)},
		{name: "10 MiB chat", path: "/v1/chat/completions", body: big},
		{name: "10 MiB chunked", path: "/v1/chat/completions", body: big, chunked: true},
		{name: "chunked generate", path: "/generate", body: []byte(`{"text":"hello","sampling_params":{"max_new_tokens":9}}`), chunked: true},
		{name: "not JSON", path: "/v1/completions", body: []byte("\x00\x01 not json {{{")},
		{name: "compressed", path: "/v1/chat/completions", body: []byte("\x1f\x8b\x08 gzip-ish"), header: map[string]string{"Content-Encoding": "gzip"}},
		{name: "unknown path", path: "/other", body: chatBody(1 << 10)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var body io.Reader = bytes.NewReader(tc.body)
			if tc.chunked {
				pr, pw := io.Pipe()
				go func() {
					// Several writes, so the body arrives in chunks.
					for rest := tc.body; len(rest) > 0; {
						n := min(len(rest), 3000)
						if _, err := pw.Write(rest[:n]); err != nil {
							return
						}
						rest = rest[n:]
					}
					pw.Close()
				}()
				body = pr
			}
			req, err := http.NewRequest(http.MethodPost, "http://localhost:9080"+tc.path, body)
			if err != nil {
				t.Fatal(err)
			}
			for k, v := range tc.header {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			sum := sha256.Sum256(tc.body)
			if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Body-Sha256") != hex.EncodeToString(sum[:]) ||
				resp.Header.Get("X-Body-Length") != fmt.Sprint(len(tc.body)) {
				t.Errorf("status %d, upstream got %s bytes with sha256 %s; sent %d with %x", resp.StatusCode,
					resp.Header.Get("X-Body-Length"), resp.Header.Get("X-Body-Sha256"), len(tc.body), sum)
			}
		})
	}
}

// TestCostMetricRetryResendsTheBody: with request_buffers, a request whose first upstream drops the
// connection is retried on the other with the same body, sized once.
func TestCostMetricRetryResendsTheBody(t *testing.T) {
	// bad looks idle (fast decode), so the cost metric tries it first; it drops every request.
	bad, good := newHashingWorker(t, 1, 100000), newHashingWorker(t, 30, 100)
	bad.reset.Store(true)
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	https_port 9443
	grace_period 1ns
	sglang_load {
		interval 100ms
	}
}
http://localhost:9080 {
	reverse_proxy %s %s {
		request_buffers 1MiB
		lb_retries 2
		lb_retry_match {
			method POST
		}
		fail_duration 30s
		max_fails 1
		lb_policy sglang_load {
			metric cost
		}
	}
}`, bad.addr(), good.addr()), "caddyfile")
	waitWorkers(t, 10*time.Second, "both polled", polledOK, &testWorker{srv: bad.srv}, &testWorker{srv: good.srv})

	body := chatBody(100 << 10)
	resp, err := http.Post("http://localhost:9080/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	sum := sha256.Sum256(body)
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Body-Sha256") != hex.EncodeToString(sum[:]) {
		t.Errorf("status %d, sha256 %s; want 200 and %x", resp.StatusCode, resp.Header.Get("X-Body-Sha256"), sum)
	}
	if bad.requests.Load() != 1 || good.requests.Load() != 1 {
		t.Errorf("requests: dropping upstream %d, good one %d; want 1 each (tried, then retried)",
			bad.requests.Load(), good.requests.Load())
	}
}

// affinityCaddy starts Caddy in front of three equally loaded workers with `affinity <option>`, and
// waits until it has polled them all.
func affinityCaddy(t *testing.T, option string) []*hashingWorker {
	t.Helper()
	ws := []*hashingWorker{newHashingWorker(t, 2, 1000), newHashingWorker(t, 2, 1000), newHashingWorker(t, 2, 1000)}
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	https_port 9443
	grace_period 1ns
	sglang_load {
		interval 100ms
	}
}
http://localhost:9080 {
	reverse_proxy %s %s %s {
		lb_policy sglang_load {
			affinity %s
		}
	}
}`, ws[0].addr(), ws[1].addr(), ws[2].addr(), option), "caddyfile")
	waitWorkers(t, 10*time.Second, "all polled", polledOK, &testWorker{srv: ws[0].srv}, &testWorker{srv: ws[1].srv}, &testWorker{srv: ws[2].srv})
	return ws
}

// sentTo is how many requests each worker received while send ran.
func sentTo(ws []*hashingWorker, send func()) []int64 {
	start := make([]int64, len(ws))
	for i, w := range ws {
		start[i] = w.requests.Load()
	}
	send()
	got := make([]int64, len(ws))
	for i, w := range ws {
		got[i] = w.requests.Load() - start[i]
	}
	return got
}

// post sends body (JSON) to url, with header's fields, and fails the test unless the answer is 200 OK.
func post(t *testing.T, url, body string, header http.Header) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	maps.Copy(req.Header, header)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %s", url, resp.Status)
	}
}

// TestAffinityPrefix: requests that share a long system prompt go to one worker while the workers are
// equally loaded; requests with prompts of their own spread; the decisions are counted.
func TestAffinityPrefix(t *testing.T) {
	ws := affinityCaddy(t, "prefix")
	page := scrape(t)
	followedBefore := metricValue(t, page, "caddy_sglang_load_affinity_decisions_total", "outcome", "followed")
	newBefore := metricValue(t, page, "caddy_sglang_load_affinity_decisions_total", "outcome", "new")
	movedBefore := metricValue(t, page, "caddy_sglang_load_affinity_homes_moved_total")
	if math.IsNaN(movedBefore) {
		t.Fatal("caddy_sglang_load_affinity_homes_moved_total is not exported")
	}

	send := func(system string, n int) []int64 {
		return sentTo(ws, func() {
			for i := range n {
				post(t, "http://localhost:9080/v1/chat/completions",
					fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}],"max_tokens":16}`, system, i), nil)
			}
		})
	}
	shared := strings.Repeat("You are a helpful assistant who answers in French. ", 60) // ~3 KiB: 12 blocks
	got := send(shared, 30)
	if most := max(got[0], got[1], got[2]); most != 30 {
		t.Errorf("requests sharing a system prompt went to %v, want all 30 on one worker", got)
	}
	// A system prompt is shared from its first request: every one follows the key to its home.
	page = scrape(t)
	if got := metricValue(t, page, "caddy_sglang_load_affinity_decisions_total", "outcome", "new") - newBefore; got != 0 {
		t.Errorf("new decisions grew by %v, want 0", got)
	}
	if got := metricValue(t, page, "caddy_sglang_load_affinity_decisions_total", "outcome", "followed") - followedBefore; got != 30 {
		t.Errorf("followed decisions grew by %v, want 30", got)
	}
	// One prompt on workers with room for it: its home never changes.
	if got := metricValue(t, page, "caddy_sglang_load_affinity_homes_moved_total") - movedBefore; got != 0 {
		t.Errorf("homes moved grew by %v with one prompt, want 0", got)
	}

	// 30 prompts of their own, one request each: rendezvous spreads them over the workers.
	spread := make([]int64, len(ws))
	for i := range 30 {
		got := send(fmt.Sprintf("%d: %s", i, shared), 1)
		for j := range spread {
			spread[j] += got[j]
		}
	}
	for j, n := range spread {
		if n == 0 {
			t.Errorf("distinct prefixes went to %v: worker %d got none", spread, j)
		}
	}

	// A long prompt with no system message is new until seen.
	post(t, "http://localhost:9080/v1/chat/completions", fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":16}`, shared), nil)
	if got := metricValue(t, scrape(t), "caddy_sglang_load_affinity_decisions_total", "outcome", "new") - newBefore; got != 1 {
		t.Errorf("new decisions grew by %v after a user's prompt, want 1", got)
	}
}

// A prompt is keyed as far as the policy reads it (64 KiB by default), not only its first 16 KiB: an
// agent's instructions and tools often run longer, and a key that holds nothing else gives all of its
// conversations one key. A chat of 40 KiB is 160 blocks of 256 bytes, which the index records where it
// went; a body of up to 16 KiB keeps its key in the request's state, a longer one in a slice of its own.
func TestAffinityKeysALongPrompt(t *testing.T) {
	ws := affinityCaddy(t, "prefix")
	recorded := func() (n int64) {
		for _, w := range workers(t) {
			if w.AffinityBlocks != nil {
				n += *w.AffinityBlocks
			}
		}
		return n
	}
	before := recorded()
	long := strings.Repeat("an agent's instructions and tools. ", 40<<10/35+1)[:40<<10]
	got := sentTo(ws, func() {
		post(t, "http://localhost:9080/v1/chat/completions", fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":4}`, long), nil)
	})
	if got[0]+got[1]+got[2] != 1 {
		t.Fatalf("one request reached %v", got)
	}
	// The key: "user", 0, the content, 0: 40,966 bytes, 160 whole blocks.
	if n := recorded() - before; n != 160 {
		t.Errorf("the index recorded %d blocks of a 40 KiB prompt, want 160", n)
	}
}

// With affinity header, a session's requests follow it to one worker whatever their prompts, and
// sessions spread over the workers; a request without the header is routed on load alone.
func TestAffinityHeader(t *testing.T) {
	ws := affinityCaddy(t, "header X-Session-ID")
	send := func(session string, n int) []int64 {
		return sentTo(ws, func() {
			header := http.Header{}
			if session != "" {
				header.Set("X-Session-ID", session)
			}
			for i := range n {
				post(t, "http://localhost:9080/v1/chat/completions",
					fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"turn %d of %s"}],"max_tokens":16}`, i, session), header)
			}
		})
	}
	noKeyBefore := metricValue(t, scrape(t), "caddy_sglang_load_affinity_decisions_total", "outcome", "no_key")

	if got := send("session-a", 20); max(got[0], got[1], got[2]) != 20 {
		t.Errorf("one session's requests went to %v, want all 20 on one worker", got)
	}
	spread := make([]int64, len(ws))
	for i := range 30 {
		for j, n := range send(fmt.Sprintf("session-%d", i), 1) {
			spread[j] += n
		}
	}
	for j, n := range spread {
		if n == 0 {
			t.Errorf("30 sessions went to %v: worker %d got none", spread, j)
		}
	}
	send("", 5)
	if got := metricValue(t, scrape(t), "caddy_sglang_load_affinity_decisions_total", "outcome", "no_key") - noKeyBefore; got != 5 {
		t.Errorf("no-key decisions grew by %v after 5 requests without the header, want 5", got)
	}
}
