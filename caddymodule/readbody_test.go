package caddymodule

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// watchedBody is a request body that counts the reads of it.
type watchedBody struct {
	io.Reader
	reads int
}

func (b *watchedBody) Read(p []byte) (int, error) {
	b.reads++
	return b.Reader.Read(p)
}

func (*watchedBody) Close() error { return nil }

// chatOf is a chat of one user message whose content is the JSON value content, max_tokens 77.
func chatOf(content string) string {
	return `{"messages":[{"role":"user","content":` + content + `}],"max_tokens":77}`
}

// imageChat carries 24,000 bytes of base64 image: 6,000 tokens by the Content-Length, a few by the text.
var imageChat = chatOf(`[{"type":"image_url","image_url":{"url":"data:image/png;base64,` + strings.Repeat("QUJD", 6000) +
	`"}},{"type":"text","text":"What is in this picture?"}]`)

// provisionTwo provisions p over two upstreams whose reports have running requests and pools of KV
// tokens as given, upstream by upstream, and returns the pool.
func provisionTwo(t *testing.T, p *Policy, running, pools [2]int64) reverseproxy.UpstreamPool {
	t.Helper()
	pool := UpstreamsForTest(2)
	err := ProvisionWithReports(p, pool, func(i int) *loadpolicy.Report {
		rank := loadpolicy.Rank{Running: running[i], MaxTotalTokens: pools[i], MaxRunning: 64, GenThroughput: 400,
			Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldMaxTotalTokens |
				loadpolicy.FieldMaxRunning | loadpolicy.FieldGenThroughput}
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{rank})
	})
	if err != nil {
		t.Fatal(err)
	}
	return pool
}

// sentTotals sums the requests that p's cost model counted as sent to its upstreams, and their
// output tokens.
func sentTotals(p *Policy) (sent loadpolicy.SentTotals) {
	for _, ep := range *p.endpoints.Load() {
		var totals loadpolicy.SentTotals
		ep.sentTotals(&totals)
		sent.Requests, sent.OutputTokens = sent.Requests+totals.Requests, sent.OutputTokens+totals.OutputTokens
	}
	return sent
}

// The default policy (the cost metric, metric and affinity unset) reads a body only where the signal
// metrics do: when the Content-Length says a worker would refuse the prompt, or the body is chunked.
// Otherwise it prices the prompt by the Content-Length and the answer at default_max_tokens. Named,
// the cost metric reads every body; read_body off reads none. The small worker takes prompts of up to
// 4,090 tokens, the large one 65,530.
func TestDefaultPolicyReadsTheBodyOnlyWhereAWorkerWouldRefuse(t *testing.T) {
	short := chatOf(`"hello"`)
	longText := chatOf(`"` + strings.Repeat("a long document. ", 20000/17) + `"`)
	for _, v := range []struct {
		name      string
		metric    string
		readBody  int
		body      string
		chunked   bool
		wantRead  bool
		wantLarge bool // the request must go to the large worker
	}{
		{name: "default, short", body: short},
		{name: "default, chunked", body: short, chunked: true, wantRead: true},
		{name: "default, long by its Content-Length and its text", body: longText, wantRead: true, wantLarge: true},
		{name: "default, long by its Content-Length, short by its text", body: imageChat, wantRead: true},
		{name: "metric cost, short", metric: "cost", body: short, wantRead: true},
		{name: "metric auto, short", metric: "auto", body: short},
		{name: "default, read_body off, chunked", readBody: -1, body: short, chunked: true},
		{name: "default, read_body 1KiB, short", readBody: 1 << 10, body: short, wantRead: true},
	} {
		t.Run(v.name, func(t *testing.T) {
			p := &Policy{Metric: v.metric, ReadBody: v.readBody}
			pool := provisionTwo(t, p, [2]int64{2, 2}, [2]int64{4096, 65536})
			for range 20 { // each pick is drawn; twenty draws make a wrong one show
				body := &watchedBody{Reader: strings.NewReader(v.body)}
				req := httptest.NewRequest("POST", "/v1/chat/completions", body)
				req.ContentLength = int64(len(v.body))
				if v.chunked {
					req.ContentLength = -1
				}
				u := p.Select(pool, req, nil)
				if u == nil {
					t.Fatal("no upstream selected")
				}
				if read := body.reads > 0; read != v.wantRead {
					t.Fatalf("body read: %v, want %v", read, v.wantRead)
				}
				if v.wantLarge && u != pool[1] {
					t.Fatalf("sent to %s, want the large worker %s", u.Dial, pool[1].Dial)
				}
				if got, err := io.ReadAll(req.Body); err != nil || string(got) != v.body {
					t.Fatalf("the upstream would read %d bytes (%v), want the %d sent", len(got), err, len(v.body))
				}
			}
			sent := sentTotals(p)
			wantOutput := int64(defaultMaxTokens)
			if v.wantRead {
				wantOutput = 77
			}
			if p.metric.Cost() && sent.OutputTokens != 20*wantOutput {
				t.Errorf("output tokens sent %d, want 20 × %d", sent.OutputTokens, wantOutput)
			}
		})
	}
}

// Where a worker's refusal by the Content-Length makes the default policy read the body, every worker
// is priced at the size the body says, not only those priced after the read: the large worker, priced
// first and a little less loaded, wins the chat with an image that the small one would take too. (At
// the Content-Length's 6,000 prompt tokens it would lose.)
func TestDefaultPolicyPricesEveryWorkerAtTheBodysSize(t *testing.T) {
	// inflight_correction off: priced on the reports as they came, each pick sees the same fleet.
	p := &Policy{InflightCorrection: new(false)}
	pool := provisionTwo(t, p, [2]int64{2, 3}, [2]int64{65536, 4096})
	for range 20 {
		req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(imageChat))
		if u := p.Select(pool, req, nil); u != pool[0] {
			t.Fatalf("sent to %v, want the large, less loaded worker %s", u, pool[0].Dial)
		}
	}
}

// The cost model prices a request by the work it asks (workOf). One that asks none (a GET, a POST
// without a body, tokenizing, a gRPC call to the scheduler other than Generate and Embed, a gRPC
// health check) is priced as a one-token answer, so it goes where the wait is least, and is counted
// nowhere; its body is not read. One that reads a prompt and decodes nothing (embeddings, scores,
// reranking, classification, gRPC Embed) is counted with no output tokens; any other with
// default_max_tokens, or the max_tokens its body says where it is read.
func TestRequestsArePricedByTheWorkTheyAsk(t *testing.T) {
	grpcCall := func(method string) *http.Request {
		req := httptest.NewRequest("POST", method, &watchedBody{Reader: strings.NewReader("\x00\x00\x00\x00\x02\x12\x00")})
		req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/2.0", 2, 0
		req.Header.Set("Content-Type", "application/grpc")
		req.ContentLength = -1
		return req
	}
	post := func(path, body string) func() *http.Request {
		return func() *http.Request { return httptest.NewRequest("POST", path, strings.NewReader(body)) }
	}
	const embedding = `{"model":"m","input":"a sentence to embed"}`
	for _, v := range []struct {
		name    string
		request func() *http.Request
		work    work
	}{
		{"GET /v1/models", func() *http.Request { return httptest.NewRequest("GET", "/v1/models", nil) }, workNone},
		{"HEAD /health", func() *http.Request { return httptest.NewRequest("HEAD", "/health", nil) }, workNone},
		{"POST /flush_cache without a body", func() *http.Request { return httptest.NewRequest("POST", "/flush_cache", nil) }, workNone},
		{"POST /tokenize", post("/tokenize", `{"prompt":"hello"}`), workNone},
		{"gRPC GetLoads", func() *http.Request { return grpcCall("/sglang.grpc.scheduler.SglangScheduler/GetLoads") }, workNone},
		{"gRPC HealthCheck", func() *http.Request { return grpcCall("/sglang.grpc.scheduler.SglangScheduler/HealthCheck") }, workNone},
		{"gRPC health service", func() *http.Request { return grpcCall("/grpc.health.v1.Health/Check") }, workNone},
		{"POST /v1/embeddings", post("/v1/embeddings", embedding), workPrefill},
		{"POST /encode", post("/encode", `{"text":"a sentence to embed"}`), workPrefill},
		{"POST /v1/rerank", post("/v1/rerank", `{"query":"q","documents":["a","b"]}`), workPrefill},
		{"POST /v1/embeddings, one byte", post("/v1/embeddings", "x"), workPrefill},
		{"gRPC Embed", func() *http.Request { return grpcCall("/sglang.grpc.scheduler.SglangScheduler/Embed") }, workPrefill},
		{"gRPC Generate", func() *http.Request { return grpcCall("/sglang.grpc.scheduler.SglangScheduler/Generate") }, workGenerate},
		{"gRPC of another service", func() *http.Request { return grpcCall("/example.Inference/Run") }, workGenerate},
		{"POST a chat", post("/v1/chat/completions", chatOf(`"hello"`)), workGenerate},
		{"POST to a path of no known API", post("/v2/ask", `{"q":"hello"}`), workGenerate},
	} {
		for _, policy := range []struct{ name, metric, affinity string }{
			{name: "default"}, {name: "metric cost", metric: "cost"}, {name: "affinity prefix", affinity: affinityPrefix},
		} {
			t.Run(v.name+", "+policy.name, func(t *testing.T) {
				p := &Policy{Metric: policy.metric, Affinity: policy.affinity}
				pool := provisionTwo(t, p, [2]int64{8, 0}, [2]int64{65536, 65536})
				for range 20 { // the fallback would draw between two upstreams with none in flight
					req := v.request()
					if u := p.Select(pool, req, nil); u != pool[1] {
						t.Fatalf("sent to %v, want the idle worker %s", u, pool[1].Dial)
					}
					if body, ok := req.Body.(*watchedBody); ok && v.work == workNone && body.reads > 0 {
						t.Fatalf("body read %d times, want none", body.reads)
					}
				}
				sent := sentTotals(p)
				wantRequests := int64(20)
				if v.work == workNone {
					wantRequests = 0
				}
				if sent.Requests != wantRequests {
					t.Errorf("requests counted as sent: %d, want %d", sent.Requests, wantRequests)
				}
				if decodes := sent.OutputTokens > 0; v.work != workNone && decodes != (v.work == workGenerate) {
					t.Errorf("output tokens counted: %d; the request decodes: %v", sent.OutputTokens, v.work == workGenerate)
				}
			})
		}
	}
}
