package caddymodule_test

import (
	"cmp"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// With the cost metric, a request whose prompt is too long for a worker's KV pool goes to a worker that
// takes it: the small worker would refuse it, as SGLang does (400). An output longer than a worker
// holds beside the prompt does not keep the request away: SGLang cuts max_new_tokens to fit, and the
// worker answers. One that no worker takes gets a worker's own refusal, not a proxy error, and with
// affinity its prompt is not recorded as cached there. With affinity too, whichever worker a prompt's
// home is. (Where short requests go is not checked: the two workers are alike but for their pools,
// and the model prices them apart by what their first polls measured of their speeds.)
func TestCostMetricSendsARequestWhereItFits(t *testing.T) {
	for _, policy := range []string{"metric cost", "affinity prefix"} {
		t.Run(strings.ReplaceAll(policy, " ", "_"), func(t *testing.T) { testSentWhereItFits(t, policy) })
	}
}

func testSentWhereItFits(t *testing.T, policy string) {
	addrs := smallAndLarge(t, policy)

	send := func(body string) (int, string) {
		t.Helper()
		code, by, _ := sendGenerate(t, body)
		return code, by
	}
	// 5,000 prompt tokens: past what the small worker's 4,096 take (4,090). One document, so that with
	// affinity every request after the first has a home.
	long := `{"text":"` + strings.Repeat("a long shared document. ", 100) + `","prompt_tokens":5000,"sampling_params":{"max_new_tokens":16}}`
	for i := range 20 {
		code, by := send(long)
		if code != http.StatusOK || by != "large" {
			t.Fatalf("request %d: status %d from %q, want 200 from the large worker", i, code, by)
		}
	}
	// 3,000 prompt tokens and 2,000 output: the small worker answers with the output cut to 1,094.
	for i := range 10 {
		code, by, answer := sendGenerate(t, `{"text":"a question","prompt_tokens":3000,"sampling_params":{"max_new_tokens":2000}}`)
		want := map[string]int64{"small": 1094, "large": 2000}[by]
		if code != http.StatusOK || answer.MetaInfo.CompletionTokens != want {
			t.Fatalf("request %d of 3,000 + 2,000 tokens: status %d from %q, %d tokens, want 200 and %d", i, code, by, answer.MetaInfo.CompletionTokens, want)
		}
	}
	// A client that asks for as long an answer as can be: no worker holds a million tokens, every one
	// takes the prompt and cuts the output to what it holds. Each answers; none refuses.
	for i := range 10 {
		code, by, answer := sendGenerate(t, `{"text":"a question","prompt_tokens":100,"sampling_params":{"max_new_tokens":1000000}}`)
		want := map[string]int64{"small": 3994, "large": 65434}[by]
		if code != http.StatusOK || answer.MetaInfo.CompletionTokens != want {
			t.Fatalf("request %d of 100 + 1,000,000 tokens: status %d from %q, %d tokens, want 200 and %d", i, code, by, answer.MetaInfo.CompletionTokens, want)
		}
	}
	blocks := func() [2]int64 {
		ws := workers(t)
		var n [2]int64
		for i, a := range addrs {
			if b := ws[a].AffinityBlocks; b != nil {
				n[i] = *b
			}
		}
		return n
	}
	before := blocks()
	code, by := send(`{"text":"` + strings.Repeat("a longer document. ", 100) + `","prompt_tokens":70000,"sampling_params":{"max_new_tokens":16}}`)
	if code != http.StatusBadRequest || by == "" {
		t.Errorf("a request no worker holds: status %d from %q, want a worker's 400", code, by)
	}
	// The worker refused it: its prompt is cached nowhere.
	if after := blocks(); after != before {
		t.Errorf("prompt blocks recorded per worker %v after a request no worker holds, want %v as before", after, before)
	}
}

// With the signal metrics, and with the default policy (the cost metric reading the body only where
// they do), a request whose prompt is too long for a worker's KV pool by its Content-Length or its
// text goes to a worker that takes it, and one that no worker takes gets a worker's own refusal,
// chosen by the fallback policy with the signals and by price with the cost metric. A request that
// both take may go to either: with a metric that counts requests, two idle workers tie and both get
// such requests, a chat whose Content-Length is mostly an image too. (The token metrics weigh one more
// request by the worker's pool, and send it to the large one.)
func TestDefaultAndSignalMetricsPassOverAWorkerThatRefuses(t *testing.T) {
	for _, policy := range []string{"", "metric auto", "metric auto\n\t\t\tchoose least", "metric waiting", "metric running"} {
		name := strings.NewReplacer(" ", "_", "\n\t\t\t", "_").Replace(cmp.Or(policy, "default"))
		t.Run(name, func(t *testing.T) {
			testSignalsPassOver(t, policy, strings.HasPrefix(policy, "metric ") && !strings.HasPrefix(policy, "metric auto"))
		})
	}
}

// testSignalsPassOver runs TestDefaultAndSignalMetricsPassOverAWorkerThatRefuses with policy; ties says that
// two idle workers tie under it.
func testSignalsPassOver(t *testing.T, policy string, ties bool) {
	addrs := smallAndLarge(t, policy)

	// 20,000 bytes of text: 5,000 prompt tokens to the simulator, as to the policy's Content-Length ÷ 4,
	// past the 4,090 the small worker takes.
	long := `{"text":"` + strings.Repeat("a long document. ", 20000/17+1) + `","sampling_params":{"max_new_tokens":16}}`
	for i := range 20 {
		if code, by, _ := sendGenerate(t, long); code != http.StatusOK || by != "large" {
			t.Fatalf("request %d: status %d from %q, want 200 from the large worker", i, code, by)
		}
	}
	// Sent chunked, without a Content-Length: the policy reads the body to size it.
	for i := range 10 {
		if code, by, _ := postGenerate(t, io.MultiReader(strings.NewReader(long))); code != http.StatusOK || by != "large" {
			t.Fatalf("chunked request %d: status %d from %q, want 200 from the large worker", i, code, by)
		}
	}
	idleAtLastPoll(t, addrs)
	served := map[string]int{}
	for range 40 {
		code, by, _ := sendGenerate(t, `{"text":"a question","sampling_params":{"max_new_tokens":16}}`)
		if code != http.StatusOK {
			t.Fatalf("a short request: status %d from %q", code, by)
		}
		served[by]++
	}
	if ties && (served["small"] == 0 || served["large"] == 0) {
		t.Errorf("short requests served %v, want both workers", served)
	}
	// A chat with 24,000 bytes of base64 image and a short question: its Content-Length says 6,000
	// tokens, past what the small worker takes, but the image is no prompt text, to SGLang as to the
	// simulator. The policy reads the body and finds the question: both workers take it.
	chat := `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,` +
		strings.Repeat("QUJD", 6000) + `"}},{"type":"text","text":"What is in this picture?"}]}],"max_tokens":16}`
	idleAtLastPoll(t, addrs)
	served = map[string]int{}
	for range 40 {
		resp, err := http.Post("http://127.0.0.1:9080/v1/chat/completions", "application/json", strings.NewReader(chat))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("a chat with an image: status %d", resp.StatusCode)
		}
		served[resp.Header.Get(sglangsim.HeaderWorker)]++
	}
	if ties && (served["small"] == 0 || served["large"] == 0) {
		t.Errorf("chats with an image served %v, want both workers", served)
	}
	before := scrape(t)
	huge := `{"text":"` + strings.Repeat("a longer document. ", 280000/19) + `","sampling_params":{"max_new_tokens":16}}`
	if code, by, _ := sendGenerate(t, huge); code != http.StatusBadRequest || by == "" {
		t.Errorf("a request no worker takes: status %d from %q, want a worker's 400", code, by)
	}
	branch := "fallback"
	if policy == "" {
		branch = "load" // the cost metric prices every worker out, and sends it to one
	}
	if d := selected(t, scrape(t), branch) - selected(t, before, branch); d != 1 {
		t.Errorf("selections by %s grew by %v with the request no worker takes, want 1", branch, d)
	}
}

// smallAndLarge serves a simulated worker named small of a 4,096-token KV pool and one named large of
// 65,536, both fast, behind the test's Caddy with policy in its lb_policy sglang_load block, and
// returns their addresses once both are polled.
func smallAndLarge(t *testing.T, policy string) []string {
	t.Helper()
	small := serveSim(t, sglangsim.Config{Name: "small", MaxTotalTokens: 4096, PrefillTokensPerSec: 1e6, DecodeTokensPerSec: 1e5}, nil)
	large := serveSim(t, sglangsim.Config{Name: "large", MaxTotalTokens: 65536, PrefillTokensPerSec: 1e6, DecodeTokensPerSec: 1e5}, nil)
	addrs := []string{strings.TrimPrefix(small.URL, "http://"), strings.TrimPrefix(large.URL, "http://")}
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfileFor("interval 1s", policy, addrs...), "caddyfile")
	waitAddrs(t, 10*time.Second, "both workers polled", func(w worker) bool { return w.PollsOK > 0 }, addrs...)
	return addrs
}

// idleAtLastPoll waits until the last report of each worker at addrs counts no request running or
// waiting: until then a report that caught a request in flight ranks its worker busier than an idle
// one, under a metric that counts requests, and two idle workers do not tie.
func idleAtLastPoll(t *testing.T, addrs []string) {
	t.Helper()
	waitAddrs(t, 10*time.Second, "both workers idle at their last poll", func(w worker) bool {
		r := w.Report
		return r != nil && r.Totals.Running != nil && *r.Totals.Running == 0 && r.Totals.Waiting != nil && *r.Totals.Waiting == 0
	}, addrs...)
}

// generateAnswer is what a test reads of a /generate answer.
type generateAnswer struct {
	MetaInfo struct {
		CompletionTokens int64 `json:"completion_tokens"`
	} `json:"meta_info"`
}

// sendGenerate posts body to /generate through the test's Caddy; it returns the status, the worker
// that answered, and the answer as far as it is one.
func sendGenerate(t *testing.T, body string) (int, string, generateAnswer) {
	t.Helper()
	return postGenerate(t, strings.NewReader(body))
}

// postGenerate is sendGenerate of a body read from r: sent chunked unless r is one whose length the
// client knows (a strings.Reader).
func postGenerate(t *testing.T, body io.Reader) (int, string, generateAnswer) {
	t.Helper()
	resp, err := http.Post("http://127.0.0.1:9080/generate", "application/json", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var a generateAnswer
	_ = json.Unmarshal(b, &a) // a refusal is not an answer: zero
	return resp.StatusCode, resp.Header.Get(sglangsim.HeaderWorker), a
}
