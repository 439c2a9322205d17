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
		since := Since{Elapsed: 3 * time.Second, Extra: 2, Sent: 2, SentPrompt: 1000, SentOutput: 512, SentWeighted: 512 * 1512, SentUncached: 1000, Backlog: new(Backlog)}
		since.Backlog.Add(r, time.Second, 1000, &p)
		// A client's sizes are its own word too: any max_tokens, a prompt from any Content-Length.
		cost := r.Cost(Request{PromptTokens: prompt, OutputTokens: output}, 0, &since, &p)
		admits := r.work.admits(prompt)
		if math.IsNaN(cost) || cost <= 0 || math.IsInf(cost, 1) && r.Priced() && admits {
			t.Fatalf("priced at %v s (priced: %v)", cost, r.Priced())
		}
	})
}

// Whatever the proxy counted since a report (counts and sizes of any sign and size: totals that
// started again under another config, a report stamped after the caller's clock reading), whatever
// the stand-ins the options and the fleet give, and whatever the request claims, a worker is priced at
// a positive number of seconds, +Inf only where it refuses the request, and never NaN: a NaN compares
// as neither cheaper nor dearer, and would leave the choice to the candidates' order.
func FuzzCost(f *testing.F) {
	f.Add(int64(12), int64(3), int64(30000), 800.0, int64(3_000_000_000), int64(2), int64(5), int64(1000), int64(512), int64(512*1512), int64(1000),
		int64(512), int64(256), int64(0), 256.0, 743.0, 0.05, 4000.0, 1.0, 32.0, true)
	const big = math.MaxInt64
	f.Add(int64(64), int64(1000), int64(65000), 1e300, int64(-big), int64(-big), int64(big), int64(big), int64(big), int64(big), int64(-big),
		int64(big), int64(big), int64(big), 1e300, 1e300, 1e300, 1e300, 0.0, 1e300, false)
	f.Fuzz(func(t *testing.T, running, waiting, used int64, gen float64, elapsed, extra, sent, sentPrompt, sentOutput, sentWeighted, sentUncached,
		prompt, output, cached int64, meanOut, residual, decodePerPrefill, prefillFloor, delay, halving float64, otherSenders bool) {
		// The stand-ins as the policy's options and its fleet figures can set them.
		for _, v := range []float64{gen, meanOut, residual, decodePerPrefill, prefillFloor, delay, halving} {
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				return
			}
		}
		if delay > 1 || halving < 1 || running < 0 || waiting < 0 || used < 0 {
			return
		}
		rank := Rank{Running: running, Waiting: waiting, WaitingUncachedTokens: waiting * 100, UsedTokens: used,
			TotalTokens: used, MaxTotalTokens: 65536, MaxRunning: 64, GenThroughput: gen,
			PrefillUncachedTokens: used, PrefillBusyUS: 1_000_000,
			Fields: FieldRunning | FieldWaiting | FieldWaitingUncachedTokens | FieldUsedTokens | FieldTotalTokens |
				FieldMaxTotalTokens | FieldMaxRunning | FieldGenThroughput | FieldPrefillCounters}
		prev := NewReport(time.Unix(90, 0), "", []Rank{rank})
		rank.PrefillUncachedTokens, rank.PrefillBusyUS = used*2, 2_000_000
		r := NewReport(time.Unix(100, 0), "", []Rank{rank})
		r.Follow(prev)
		p := CostParams{PrefillTokensPerSec: 8000, PrefillPerRankFloor: prefillFloor, DecodeTokensPerSec: 50,
			DecodePerPrefill: decodePerPrefill, DecodeBatchHalving: halving, MeanOutputTokens: meanOut,
			DelayToOthers: delay, OtherSenders: otherSenders, ResidualPromptTokens: residual}
		since := Since{Elapsed: time.Duration(elapsed), Extra: extra, Sent: sent, SentPrompt: sentPrompt,
			SentOutput: sentOutput, SentWeighted: sentWeighted, SentUncached: sentUncached, Backlog: new(Backlog)}
		since.Backlog.Add(r, time.Duration(elapsed/2), sentUncached, &p) // any time, any size: twice
		since.Backlog.Add(r, time.Duration(elapsed), sentUncached, &p)
		req := Request{PromptTokens: prompt, OutputTokens: output}.Bounded()
		cost := r.Cost(req, cached, &since, &p)
		if math.IsNaN(cost) || cost <= 0 || math.IsInf(cost, 1) && r.Admits(req.PromptTokens) {
			t.Fatalf("priced at %v s, %+v since the report, params %+v", cost, since, p)
		}
	})
}
