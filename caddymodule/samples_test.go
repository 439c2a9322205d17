package caddymodule_test

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// A request for n answers is n sequences on the worker (SGLang decodes them side by side), and the
// cost metric counts it so until the next poll: after one request for 8 answers, the next 5 requests
// of one answer all go to the other worker. Counted as one request, the third would have gone back.
func TestCostMetricCountsEveryAnswer(t *testing.T) {
	cfg := sglangsim.Config{MaxTotalTokens: 65536, PrefillTokensPerSec: 1e6, DecodeTokensPerSec: 5}
	cfg.Name = "a"
	a := serveSim(t, cfg, nil)
	cfg.Name = "b"
	b := serveSim(t, cfg, nil)
	addrs := []string{strings.TrimPrefix(a.URL, "http://"), strings.TrimPrefix(b.URL, "http://")}
	tester := caddytest.NewTester(t)
	// An hour between polls: every choice below is made on the first reports, projected by what was
	// sent since.
	tester.InitServer(caddyfileFor("interval 1h", "metric cost", addrs...), "caddyfile")
	eventually(t, 10*time.Second, func() bool {
		ws := workers(t)
		return ws[addrs[0]].PollsOK > 0 && ws[addrs[1]].PollsOK > 0
	}, "both workers polled")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // the answers decode for a minute: the clients leave once the choices are made
	// start sends a streamed request and returns the worker that answers once its prefill is done, by
	// when the proxy has counted it where it went.
	start := func(n int) string {
		t.Helper()
		body := `{"messages":[{"role":"user","content":"a question"}],"max_tokens":300,"n":` + strconv.Itoa(n) + `,"stream":true}`
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://127.0.0.1:9080/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("n %d: status %d", n, resp.StatusCode)
		}
		return resp.Header.Get(sglangsim.HeaderWorker)
	}
	first := start(8)
	for i := range 5 {
		if by := start(1); by == first || by == "" {
			t.Fatalf("request %d of one answer went to %q, beside the 8 answers of the first", i+1, by)
		}
	}
}
