package caddymodule

import (
	"context"
	"math"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// The prefill queueing term reads E[P²]/2E[P] of recent uncached prompts: 20% of 2,000-token prompts
// among 200-token ones give 832,000 / 1,120 = 743 tokens. A prompt's cached part is not prefilled,
// so it does not count. The means are gathered from what was sent to each upstream, at most every
// sizesEvery.
func TestCostParamsFollowRecentPromptSizes(t *testing.T) {
	p := &Policy{}
	if err := p.parseOptions(); err != nil {
		t.Fatal(err)
	}
	if got := paramsOf(p).ResidualPromptTokens; got != 0 {
		t.Fatalf("before any request: residual %v, want 0", got)
	}
	short, long := &endpoint{state: new(sharedState)}, &endpoint{state: new(sharedState)}
	eps := map[string]*endpoint{"10.0.0.1:30000": short, "10.0.0.2:30000": long}
	now := int64(1_000_000)
	for range 100 {
		for range 40 {
			short.placed(loadpolicy.Request{PromptTokens: 200, OutputTokens: 64}, 0, time.Now(), new(loadpolicy.CostParams))
		}
		for range 10 {
			long.placed(loadpolicy.Request{PromptTokens: 3800, OutputTokens: 512}, 1800, time.Now(), new(loadpolicy.CostParams))
		}
		p.sizes.gather(now, eps)
		now += sizesEvery
	}
	if got, want := paramsOf(p).ResidualPromptTokens, 832000.0/1120; math.Abs(got-want) > 1e-9*want {
		t.Errorf("residual prompt %.0f tokens, want %.0f", got, want)
	}
	if got, want := paramsOf(p).MeanOutputTokens, (4*64+512)/5.0; math.Abs(got-want) > 1e-9*want {
		t.Errorf("mean output %.1f tokens, want %.1f", got, want)
	}

	// Before the next gathering is due nothing moves; when it is, the requests since weigh as many
	// folds of meanWeight: 50 of 1,000 output tokens move the mean by 1 - 0.99^50 of the way.
	for range 50 {
		short.placed(loadpolicy.Request{PromptTokens: 200, OutputTokens: 1000}, 0, time.Now(), new(loadpolicy.CostParams))
	}
	before := paramsOf(p).MeanOutputTokens
	p.sizes.gather(now-1, eps)
	if got := paramsOf(p).MeanOutputTokens; got != before {
		t.Fatalf("mean output %v before the gathering is due, want %v", got, before)
	}
	p.sizes.gather(now, eps)
	if got, want := paramsOf(p).MeanOutputTokens, 1000+math.Pow(0.99, 50)*(before-1000); math.Abs(got-want) > 1e-9*want {
		t.Errorf("mean output after 50 requests of 1,000 tokens %.3f, want %.3f", got, want)
	}
}

// A request counts as the worker holds it: nothing where SGLang refuses its prompt (a prompt of the
// rank's pool less 6 tokens or more), its output cut to what the rank holds beside the prompt. A
// max_tokens of 2^63-1, or a Content-Length of 2^62 where the body is not read, overflowed the totals
// sent (output x size, the squares), and the first set the mean output size, which prices every
// worker's admission, to 9.2e16 tokens: some 3,000 requests more before it was back under a thousand.
func TestClaimedSizesCountAsTheWorkerHoldsThem(t *testing.T) {
	const rankPool = 65536
	for _, v := range []struct {
		name, path, body string
		contentLength    int64
		prompt, output   int64 // as the worker holds the request
	}{
		{"max_tokens 2^63-1", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hello"}],"max_tokens":9223372036854775807}`, 0, 2, rankPool - 2 - 2},
		{"Content-Length 2^62, body not read", "/v1/embeddings", `{"input":"hello"}`, 1 << 62, 0, 0},
		{"held", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hello"}],"max_tokens":60000}`, 0, 2, 60000},
	} {
		p := &Policy{Metric: "cost"}
		pool := UpstreamsForTest(1)
		err := ProvisionWithReports(p, pool, func(int) *loadpolicy.Report {
			rank := loadpolicy.Rank{Running: 2, MaxTotalTokens: rankPool, MaxRunning: 64,
				Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldMaxTotalTokens | loadpolicy.FieldMaxRunning}
			return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{rank, rank})
		})
		if err != nil {
			t.Fatal(err)
		}
		before := p.sizes.out.Load()
		req := httptest.NewRequest("POST", v.path, strings.NewReader(v.body))
		if v.contentLength > 0 {
			req.ContentLength = v.contentLength
		}
		if p.Select(pool, req, nil) == nil {
			t.Fatalf("%s: no upstream selected", v.name)
		}
		ep := (*p.endpoints.Load())[pool[0].Dial]
		var got loadpolicy.SentTotals
		ep.sentTotals(&got)
		prompt, output := v.prompt, v.output
		want := loadpolicy.SentTotals{Requests: 1, PromptTokens: prompt, OutputTokens: output,
			Weighted: output * (prompt + output), Uncached: prompt}
		if got != want {
			t.Errorf("%s: sent %+v, want %+v", v.name, got, want)
		}
		if got, want := ep.sentUncachedSq.Load(), prompt*prompt; got != want {
			t.Errorf("%s: squares of uncached prompts %d, want %d", v.name, got, want)
		}
		p.sizes.gather(time.Now().UnixMilli()+sizesEvery, *p.endpoints.Load())
		if got, want := p.sizes.out.Load(), float64(output)+0.99*(before-float64(output)); math.Abs(got-want) > 1e-9*want {
			t.Errorf("%s: mean output %v tokens, want %v", v.name, got, want)
		}
	}
}

// An endpoint that two upstreams share counts once; one whose totals began again (another config's)
// adds nothing until they grow; one that left the pool is forgotten, and counts from zero if it comes
// back.
func TestRequestSizesGatherEachEndpointOnce(t *testing.T) {
	var s requestSizes
	s.out.Store(100)
	shared := &endpoint{state: new(sharedState)}
	eps := map[string]*endpoint{"10.0.0.1:30000": shared, "10.0.0.1:30001": shared}
	shared.placed(loadpolicy.Request{PromptTokens: 10, OutputTokens: 200}, 0, time.Now(), new(loadpolicy.CostParams))
	s.gather(0, eps)
	if got, want := s.out.Load(), 200+0.99*(100-200.0); math.Abs(got-want) > 1e-9 {
		t.Fatalf("mean output after one request through a shared endpoint %v, want %v (counted once)", got, want)
	}
	if len(s.seen) != 1 {
		t.Fatalf("%d endpoints remembered, want 1", len(s.seen))
	}
	after := s.out.Load()
	s.seen[shared] = sentSum{requests: 10, output: 5000}
	s.gather(sizesEvery, eps)
	if got := s.out.Load(); got != after {
		t.Errorf("totals below the last gathering's moved the mean to %v from %v", got, after)
	}
	s.gather(2*sizesEvery, map[string]*endpoint{})
	if len(s.seen) != 0 {
		t.Errorf("%d endpoints remembered after the pool emptied, want 0", len(s.seen))
	}
	s.gather(3*sizesEvery, eps)
	if got, want := s.out.Load(), 200+0.99*(after-200); math.Abs(got-want) > 1e-9 {
		t.Errorf("mean output after the endpoint came back %v, want %v (its one request counted from zero)", got, want)
	}
}

// A worker not yet seen decoding is priced from the fleet's decode to prefill ratio, pooled over the
// reports that measured both, unless decode_tokens_per_sec fixes its speed.
func TestCostParamsFleetDecodeRatio(t *testing.T) {
	app := &App{}
	p := &Policy{app: app}
	if err := p.parseOptions(); err != nil {
		t.Fatal(err)
	}
	if got := paramsOf(p).DecodePerPrefill; got != 0 {
		t.Fatalf("before any report: ratio %v, want 0", got)
	}
	report := func(gen float64, prefillTokens int64) *loadpolicy.Report {
		rank := func(at, tokens, busyUS int64) *loadpolicy.Report {
			r := loadpolicy.Rank{Running: 2, GenThroughput: gen, PrefillUncachedTokens: tokens, PrefillBusyUS: busyUS,
				Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldGenThroughput | loadpolicy.FieldPrefillCounters}
			return loadpolicy.NewReport(time.Unix(at, 0), "", []loadpolicy.Rank{r})
		}
		prev, rep := rank(0, 0, 0), rank(1, prefillTokens, 1_000_000)
		rep.Follow(prev)
		return rep
	}
	// 400 tok/s at batch 2 is 206.25 alone at the reference halving; prefill 8000 tok/s: 206.25/8000.
	const batch2 = 400 / 206.25 // lone requests' worth of decoding in a batch of 2
	p.fleet.note(report(400, 8000), nil)
	first := 206.25 / 8000
	if got := paramsOf(p).DecodePerPrefill; math.Abs(got-first) > 1e-12 {
		t.Fatalf("after one report: ratio %v, want %v", got, first)
	}
	// The same reading from a worker of half the prefill speed, read at the same moment: the two
	// readings over the two batches, weighed by their prefill speeds.
	p.fleet.note(report(400, 4000), nil)
	if got, want := paramsOf(p).DecodePerPrefill, (400+400)/(batch2*(8000+4000)); math.Abs(got-want) > 1e-12 {
		t.Errorf("after two reports: ratio %v, want %v", got, want)
	}
	if got, want := paramsOf(p).DecodeTokensPerSec, 206.25; math.Abs(got-want) > 1e-9 {
		t.Errorf("fleet's fastest %v, want %v", got, want)
	}
	fixed := &Policy{app: app, DecodeTokensPerSec: 120}
	if err := fixed.parseOptions(); err != nil {
		t.Fatal(err)
	}
	if got := paramsOf(fixed); got.DecodeTokensPerSec != 120 || got.DecodePerPrefill != 0 {
		t.Errorf("with decode_tokens_per_sec 120: %v tok/s, ratio %v; want 120 and no ratio", got.DecodeTokensPerSec, got.DecodePerPrefill)
	}
}

// Each policy prices its workers not yet measured from its own workers' speeds: two reverse_proxy
// blocks may serve models a tenfold apart. A worker in both pools feeds both; one a policy let go feeds
// it no more.
func TestFleetSpeedPerPolicy(t *testing.T) {
	measured := func(gen float64) *loadpolicy.Report {
		r := loadpolicy.Rank{Running: 1, GenThroughput: gen, Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldGenThroughput}
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{r})
	}
	small, large := &Policy{}, &Policy{}
	smallOnly, largeOnly, both := &endpoint{state: new(sharedState)}, &endpoint{state: new(sharedState)}, &endpoint{state: new(sharedState)}
	smallOnly.joinFleetLocked(&small.fleet)
	largeOnly.joinFleetLocked(&large.fleet)
	both.joinFleetLocked(&small.fleet)
	both.joinFleetLocked(&large.fleet)
	poll := func(ep *endpoint, rep *loadpolicy.Report) {
		t.Helper()
		if _, err := (stampingFetcher{Fetcher: fixedFetcher{rep}, ep: ep}).Fetch(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	fastest := func(p *Policy) float64 { f, _, _ := p.fleet.load(); return f }

	poll(smallOnly, measured(1000))
	if got, want := fastest(small), measured(1000).DecodeAloneTokensPerSec(); got != want {
		t.Errorf("small model's fleet: fastest %v, want %v", got, want)
	}
	if got := fastest(large); got != 0 {
		t.Errorf("large model's fleet took a speed of the other pool's worker: %v", got)
	}
	poll(largeOnly, measured(80))
	if got, want := fastest(large), measured(80).DecodeAloneTokensPerSec(); got != want {
		t.Errorf("large model's fleet: fastest %v, want %v", got, want)
	}
	poll(both, measured(2000))
	if got, want := fastest(large), measured(2000).DecodeAloneTokensPerSec(); got != want {
		t.Errorf("a worker in both pools: large model's fastest %v, want %v", got, want)
	}
	if got, want := fastest(small), measured(2000).DecodeAloneTokensPerSec(); got != want {
		t.Errorf("a worker in both pools: small model's fastest %v, want %v", got, want)
	}
	both.leaveFleetLocked(&large.fleet)
	before := fastest(large)
	poll(both, measured(4000))
	if got := fastest(large); got != before {
		t.Errorf("after the large pool let the worker go: fastest %v, want %v unchanged", got, before)
	}
}

// A worker whose prefill is not measured is priced at no slower than the fastest prefill per rank
// that the policy's workers measured lately (here two ranks that each prefilled 40,000 tokens in a
// second), unless prefill_tokens_per_sec fixes its speed.
func TestCostParamsPrefillFloor(t *testing.T) {
	rank := loadpolicy.Rank{PrefillUncachedTokens: 40000, PrefillBusyUS: 1e6,
		Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldPrefillCounters}
	rep := loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{rank, rank})
	for _, tc := range []struct {
		name   string
		policy *Policy
		want   float64
	}{
		{"default", &Policy{}, 40000},
		{"prefill_tokens_per_sec set", &Policy{PrefillTokensPerSec: 5000}, 0},
	} {
		p := tc.policy
		if err := p.parseOptions(); err != nil {
			t.Fatal(err)
		}
		p.app = new(App)
		p.fleet.note(rep, nil)
		if got := paramsOf(p).PrefillPerRankFloor; got != tc.want {
			t.Errorf("%s: prefill floor %v tokens/s per rank, want %v", tc.name, got, tc.want)
		}
	}
}

// The delay a request brings its batch counts in full by default, not at all with affinity, and as
// the option says when set.
func TestCostParamsDelayToOthers(t *testing.T) {
	half, none := 0.5, 0.0
	tests := []struct {
		name   string
		policy func() *Policy
		want   float64
	}{
		{"default", func() *Policy { return &Policy{} }, 1},
		{"metric cost", func() *Policy { return &Policy{Metric: "cost"} }, 1},
		{"affinity prefix", func() *Policy { return &Policy{Affinity: affinityPrefix} }, 0},
		{"affinity header", func() *Policy { return &Policy{Affinity: affinityHeader, AffinityHeader: "X-Session-ID"} }, 0},
		{"set to 0.5", func() *Policy { return &Policy{DelayToOthers: &half} }, 0.5},
		{"set to 0", func() *Policy { return &Policy{DelayToOthers: &none} }, 0},
		{"set to 0.5 with affinity", func() *Policy { return &Policy{Affinity: affinityPrefix, DelayToOthers: &half} }, 0.5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.policy()
			if err := p.parseOptions(); err != nil {
				t.Fatal(err)
			}
			if got := paramsOf(p).DelayToOthers; got != tt.want {
				t.Errorf("delay to others %v, want %v", got, tt.want)
			}
		})
	}
}

// Other senders are counted without affinity only: with it, the uncached tokens sent are the index's
// estimates.
func TestCostParamsOtherSenders(t *testing.T) {
	for _, tt := range []struct {
		affinity string
		want     bool
	}{{"", true}, {affinityPrefix, false}} {
		p := &Policy{Affinity: tt.affinity}
		if err := p.parseOptions(); err != nil {
			t.Fatal(err)
		}
		if got := paramsOf(p).OtherSenders; got != tt.want {
			t.Errorf("affinity %q: other senders %v, want %v", tt.affinity, got, tt.want)
		}
	}
}

// paramsOf is p's cost parameters for a Select now.
func paramsOf(p *Policy) loadpolicy.CostParams {
	var params loadpolicy.CostParams
	p.costParams(&params)
	return params
}

// A request whose answer's length is not read is priced at the mean answer the workers' reports
// measure, once some tens of requests are counted: 256 before, and default_max_tokens where set.
func TestUnreadAnswersPricedAtTheMeasuredMean(t *testing.T) {
	report := func(at int64, gen float64, sent int64) *loadpolicy.Report {
		r := loadpolicy.NewReport(time.Unix(at, 0), "", []loadpolicy.Rank{{Running: 4, GenThroughput: gen,
			Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldGenThroughput}})
		r.Sent = loadpolicy.SentTotals{Requests: sent}
		return r
	}
	for _, tt := range []struct {
		name   string
		option int64
		want   []int64 // after 0, 20 and 60 requests were sent, 3 s of 100 tok/s decoded for each 10
	}{
		{"default", 0, []int64{256, 256, 30}},
		{"default_max_tokens 100", 100, []int64{100, 100, 100}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := &Policy{app: &App{}, DefaultMaxTokens: tt.option}
			if err := p.parseOptions(); err != nil {
				t.Fatal(err)
			}
			prev := report(0, 100, 0)
			for i, sent := range []int64{0, 20, 60} {
				if sent > 0 {
					rep := report(int64(3*sent/10), 100, sent)
					p.fleet.note(rep, prev)
					prev = rep
				}
				if got := p.unreadSize(httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(chatOf(`"hello"`)))).OutputTokens; got != tt.want[i] {
					t.Errorf("after %d sent: priced at %d output tokens, want %d", sent, got, tt.want[i])
				}
			}
		})
	}
}
