package loadpolicy

import (
	"math"
	"testing"
	"time"
)

// Whatever a worker reports that the decoders pass (they refuse totals past int64), the totals never
// wrap (a huge load must not read as a small or negative one and draw the traffic), the signals are
// finite and not negative, and a request is priced at a positive number of seconds (+Inf where the
// report cannot price it or the worker refuses the request), whatever sizes the request claims.
func FuzzNewReport(f *testing.F) {
	f.Add(int64(3), int64(1), int64(700), int64(30000), int64(65536), int64(64), 0.45, 800.0, int64(2), true, int64(512), int64(256))
	const half = math.MaxInt64 / 2
	f.Add(int64(half), int64(half), int64(half), int64(half), int64(half), int64(half), math.MaxFloat64, math.MaxFloat64, int64(2), true, int64(math.MaxInt64), int64(math.MaxInt64))
	f.Add(int64(1)<<60, int64(0), int64(0), int64(1)<<60, int64(1)<<60, int64(1)<<60, 1.0, 1e300, int64(3), false, int64(1)<<62, int64(-1))
	f.Fuzz(func(t *testing.T, running, waiting, queued, used, capacity, maxRunning int64, usage, gen float64, ranks int64, counters bool, prompt, output int64) {
		n := int(min(max(ranks, 1), 8))
		for _, v := range []int64{running, waiting, queued, used, capacity, maxRunning} {
			if v > math.MaxInt64/int64(n) {
				return // the decoders refuse its totals
			}
		}
		rs := make([]Rank, n)
		fields := FieldRunning | FieldWaiting | FieldWaitingUncachedTokens | FieldUsedTokens | FieldTotalTokens |
			FieldMaxTotalTokens | FieldMaxRunning | FieldTokenUsage | FieldGenThroughput
		if counters {
			fields |= FieldPrefillCounters
		}
		for i := range rs {
			rs[i] = Rank{Running: running, Waiting: waiting, WaitingUncachedTokens: queued, UsedTokens: used,
				TotalTokens: used, MaxTotalTokens: capacity, MaxRunning: maxRunning, TokenUsage: usage,
				GenThroughput: gen, PrefillUncachedTokens: used, PrefillBusyUS: running, Fields: fields}
		}
		r := NewReport(time.Unix(100, 0), "", rs)
		for _, v := range []struct {
			name       string
			total, one int64
		}{
			{"running", r.Running, r.Ranks[0].Running}, {"waiting", r.Waiting, r.Ranks[0].Waiting},
			{"waiting uncached", r.WaitingUncachedTokens, r.Ranks[0].WaitingUncachedTokens},
			{"used", r.UsedTokens, r.Ranks[0].UsedTokens}, {"pool", r.MaxTotalTokens, r.Ranks[0].MaxTotalTokens},
			{"max running", r.MaxRunning, r.Ranks[0].MaxRunning},
		} {
			if v.one < 0 || v.total < v.one {
				t.Fatalf("%s: total %d over %d ranks of %d", v.name, v.total, n, v.one)
			}
		}
		s := r.Signals()
		for sig := range numSignals {
			if !s.Set.Has(sig) {
				continue
			}
			if v, c := s.Value[sig], s.Cost[sig]; math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || math.IsNaN(c) || math.IsInf(c, 0) || c < 0 {
				t.Fatalf("%s: value %v, cost per request %v", sig, v, c)
			}
		}
		prev := NewReport(time.Unix(90, 0), "", rs)
		r.Follow(prev)
		p := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 32, MeanOutputTokens: 256, DelayToOthers: 1}
		since := Since{Elapsed: 3 * time.Second, Extra: 2, Sent: 2, SentPrompt: 1000, SentOutput: 512, SentWeighted: 512 * 1512, SentUncached: 1000}
		// A client's sizes are its own word too: any max_tokens, a prompt from any Content-Length.
		cost := r.Cost(Request{PromptTokens: prompt, OutputTokens: output}, 0, &since, &p)
		admits := r.work.admits(prompt)
		if math.IsNaN(cost) || cost <= 0 || math.IsInf(cost, 1) && r.Priced() && admits {
			t.Fatalf("priced at %v s (priced: %v)", cost, r.Priced())
		}
	})
}
