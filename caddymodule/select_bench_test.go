package caddymodule_test

import (
	"bytes"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-sglang/caddy-sglang/caddymodule"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// benchReport is a current-shape report of one DP rank whose load varies with i, so that comparisons
// are decided on the most precise signal rather than on ties.
func benchReport(i int) *loadpolicy.Report {
	const all = loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldWaitingUncachedTokens |
		loadpolicy.FieldUsedTokens | loadpolicy.FieldTotalTokens | loadpolicy.FieldMaxTotalTokens |
		loadpolicy.FieldMaxRunning | loadpolicy.FieldTokenUsage | loadpolicy.FieldGenThroughput
	used := int64(1000 + (i*7919)%60000)
	waiting := int64(i % 5)
	return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{
		Running: 1 + int64(i%40), Waiting: waiting, WaitingUncachedTokens: waiting * 700, UsedTokens: used,
		TotalTokens: used + waiting*700, MaxTotalTokens: 65536, MaxRunning: 64,
		TokenUsage: float64(used) / 65536, GenThroughput: 800, Fields: all,
	}})
}

// namedSelector is a selection policy and its name in the benchmark.
type namedSelector struct {
	name string
	sel  reverseproxy.Selector
}

// benchSelectors are Caddy's built-in policies and the sglang_load policy's variants, provisioned over
// pool.
func benchSelectors(b *testing.B, pool reverseproxy.UpstreamPool) []namedSelector {
	selectors := []namedSelector{
		{"least_conn", reverseproxy.LeastConnSelection{}},
		{"random_choose_2", reverseproxy.RandomChoiceSelection{Choose: 2}},
		{"round_robin", new(reverseproxy.RoundRobinSelection)},
	}
	for _, v := range []struct {
		name   string
		policy *caddymodule.Policy
	}{
		{"sglang_load_default", &caddymodule.Policy{}},
		{"sglang_load_power_of_two", &caddymodule.Policy{Metric: "auto", Choose: "power_of_two"}},
		{"sglang_load_least", &caddymodule.Policy{Metric: "auto", Choose: "least"}},
		{"sglang_load_cost_window", &caddymodule.Policy{Metric: "cost", Choose: "window"}},
		{"sglang_load_cost_power_of_two", &caddymodule.Policy{Metric: "cost", Choose: "power_of_two"}},
		// A request without a key (no body) with affinity on: chosen for as by the cost metric alone.
		{"sglang_load_affinity_prefix_no_key", &caddymodule.Policy{Affinity: "prefix"}},
	} {
		if err := caddymodule.ProvisionWithReports(v.policy, pool, benchReport); err != nil {
			b.Fatal(err)
		}
		selectors = append(selectors, namedSelector{v.name, v.policy})
	}
	return selectors
}

// BenchmarkSelect compares the sglang_load policy's Select with Caddy's built-in policies on the same
// pools. Run with -benchmem; bench/microbench.sh prints the ratios to least_conn.
func BenchmarkSelect(b *testing.B) {
	req := httptest.NewRequest("POST", "/v1/chat/completions", nil)
	for _, n := range []int{4, 64, 1024} {
		pool := caddymodule.UpstreamsForTest(n)
		for _, s := range benchSelectors(b, pool) {
			b.Run(fmt.Sprintf("n=%d/%s", n, s.name), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if s.sel.Select(pool, req, nil) == nil {
						b.Fatal("no upstream selected")
					}
				}
			})
		}
	}
}

// BenchmarkSelectParallel is BenchmarkSelect with Select called back to back on every core (GOMAXPROCS
// goroutines): what one core's writes cost the others, which a single goroutine does not see. Its
// ns/op is wall time over all cores' Selects.
func BenchmarkSelectParallel(b *testing.B) {
	for _, n := range []int{4, 64} {
		pool := caddymodule.UpstreamsForTest(n)
		for _, s := range benchSelectors(b, pool) {
			b.Run(fmt.Sprintf("n=%d/%s", n, s.name), func(b *testing.B) {
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					req := httptest.NewRequest("POST", "/v1/chat/completions", nil)
					for pb.Next() {
						if s.sel.Select(pool, req, nil) == nil {
							b.Error("no upstream selected")
							return
						}
					}
				})
			})
		}
	}
}

// rewindBody is a request body that a benchmark rewinds before each Select, allocation-free.
type rewindBody struct{ bytes.Reader }

func (*rewindBody) Close() error { return nil }

// BenchmarkSelectReadingBody is Select with a 16 KiB chat body that the policy reads: the cost metric
// alone (read_body), and with affinity prefix. Each body is then read to its end in one Read, as a
// transport sends it, which hands the head's buffer back for reuse. Three bodies: escapes, dense as in
// code or quoted text (3 in 51 bytes), and prose (a newline in 81 bytes), each sent again and again;
// and prose-new, the prose with a number of its own at the start of each request, so that with
// affinity every request is a prompt the index has not seen (after the first few thousand, each
// evicts as many blocks as it records: the index is full).
func BenchmarkSelectReadingBody(b *testing.B) {
	prose := chatBodyOf(16<<10, `You are a careful assistant who answers briefly, cites sources and avoids jargon.\n`)
	bodies := []struct {
		name string
		body []byte
		new  bool
	}{{"escapes", chatBody(16 << 10), false}, {"prose", prose, false}, {"prose-new", bytes.Clone(prose), true}}
	for _, n := range []int{4, 64} {
		pool := caddymodule.UpstreamsForTest(n)
		for _, v := range []struct{ name, affinity string }{{"cost", ""}, {"affinity_prefix", "prefix"}} {
			p := &caddymodule.Policy{Metric: "cost", Affinity: v.affinity}
			if err := caddymodule.ProvisionWithReports(p, pool, benchReport); err != nil {
				b.Fatal(err)
			}
			for _, body := range bodies {
				b.Run(fmt.Sprintf("n=%d/%s/body=%s", n, v.name, body.name), func(b *testing.B) {
					rb := new(rewindBody)
					sent := make([]byte, 64<<10)
					req := httptest.NewRequest("POST", "/v1/chat/completions", nil)
					b.ReportAllocs()
					content := bytes.Index(body.body, []byte(`"content":"`)) + len(`"content":"`)
					var seq uint64
					for b.Loop() {
						if body.new {
							seq++
							number(body.body[content:content+16], seq)
						}
						rb.Reset(body.body)
						req.Body, req.ContentLength = rb, int64(len(body.body))
						if p.Select(pool, req, nil) == nil {
							b.Fatal("no upstream selected")
						}
						if n, err := req.Body.Read(sent); n != len(body.body) && err == nil {
							b.Fatalf("read %d of %d bytes", n, len(body.body))
						}
					}
				})
			}
		}
	}
}

// number writes n in hexadecimal over dst, allocation-free.
func number(dst []byte, n uint64) {
	for i := len(dst) - 1; i >= 0; i-- {
		dst[i] = "0123456789abcdef"[n&15]
		n >>= 4
	}
}
