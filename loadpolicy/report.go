// Package loadpolicy is the load model and the routing logic of caddy-sglang: a worker's load report,
// the signals derived from it, and the choosers that compare workers. It does not import Caddy.
package loadpolicy

import (
	"math"
	"time"
)

// Field is a bit set of the per-rank fields a worker actually sent. Workers of different SGLang
// versions send different subsets, and a missing field must never read as zero load.
type Field uint16

const (
	FieldRunning Field = 1 << iota
	FieldWaiting
	FieldWaitingUncachedTokens
	FieldUsedTokens
	FieldTotalTokens
	FieldMaxTotalTokens
	FieldMaxRunning
	FieldTokenUsage
	FieldGenThroughput
	FieldCacheHitRate
	FieldUtilization
	// FieldPrefillCounters is total_prefill_uncached_tokens with total_prefill_busy_us: one is no use
	// without the other.
	FieldPrefillCounters
)

// Rank is the load of one data-parallel rank of a worker.
type Rank struct {
	DPRank                int
	Running               int64   // num_running_reqs
	Waiting               int64   // num_waiting_reqs
	WaitingUncachedTokens int64   // num_waiting_uncached_tokens: queued prompt tokens the prefix cache misses
	UsedTokens            int64   // num_used_tokens: KV tokens in use
	TotalTokens           int64   // num_total_tokens: used + queued sequence length
	MaxTotalTokens        int64   // max_total_num_tokens: KV pool capacity
	MaxRunning            int64   // max_running_requests
	TokenUsage            float64 // token_usage, 0..1
	GenThroughput         float64 // gen_throughput, decode tokens/s
	CacheHitRate          float64
	Utilization           float64
	// Cumulative since the worker started: prompt tokens prefilled (the prefix cache missed them) and
	// the microseconds prefill was busy. Two polls apart they measure the prefill speed.
	PrefillUncachedTokens int64 // total_prefill_uncached_tokens
	PrefillBusyUS         int64 // total_prefill_busy_us
	Fields                Field
}

// Has reports whether every field in f was sent.
func (r *Rank) Has(f Field) bool { return r.Fields&f == f }

// Report is one poll's answer from one worker, with the signals computed once when it is built so that
// the hot path only reads them. A Report is immutable once published.
type Report struct {
	Received time.Time // when the poll answered, local clock
	Version  string    // the worker's SGLang version, when sent
	Ranks    []Rank

	// Totals over ranks, in int64 so that many large ranks cannot overflow.
	Running, Waiting, WaitingUncachedTokens, UsedTokens, MaxTotalTokens, MaxRunning int64
	GenThroughput                                                                   float64
	// MaxTokenUsage is the usage of the hottest rank: averaging over ranks would hide it.
	MaxTokenUsage float64
	// LifetimePrefillPerRank is one rank's prefill speed over the worker's life, tokens/s: the ratio of
	// its cumulative prefill counters, which every Caddy instance reading them finds alike (a speed
	// measured between two polls depends on when each one polled). 0 when a rank lacks the counters or
	// prefill has been busy for less than minPrefillBusy.
	LifetimePrefillPerRank float64

	// Inflight is the proxy's own in-flight request count to this worker when the poll answered; the
	// policy adds the requests started since then.
	Inflight int64
	// Sent is the proxy's running totals of requests sent to this worker when the poll answered; the
	// cost model counts the requests sent since.
	Sent SentTotals

	signals Signals
	work    workload
}

// Empty reports whether the worker sent no per-rank loads: early in start-up that means "no data yet".
func (r *Report) Empty() bool { return r == nil || len(r.Ranks) == 0 }

// Signals returns the comparable signals this report carries.
func (r *Report) Signals() *Signals { return &r.signals }

// NewReport builds a Report from per-rank loads: it sanitises each rank (negative counts and non-finite
// ratios are dropped as if not sent), sums the totals and derives the signals.
func NewReport(received time.Time, version string, ranks []Rank) *Report {
	r := &Report{Received: received, Version: version, Ranks: ranks}
	var usageKnown bool
	prefillCounters := len(r.Ranks) > 0
	var prefilled, prefillBusyUS int64
	for i := range r.Ranks {
		rk := &r.Ranks[i]
		sanitize(rk)
		r.Running += rk.Running
		r.Waiting += rk.Waiting
		r.WaitingUncachedTokens += rk.WaitingUncachedTokens
		r.UsedTokens += rk.UsedTokens
		r.MaxTotalTokens += rk.MaxTotalTokens
		r.MaxRunning += rk.MaxRunning
		r.GenThroughput += rk.GenThroughput
		if u, ok := rankUsage(rk); ok {
			usageKnown = true
			r.MaxTokenUsage = math.Max(r.MaxTokenUsage, u)
		}
		prefillCounters = prefillCounters && rk.Has(FieldPrefillCounters)
		prefilled += rk.PrefillUncachedTokens
		prefillBusyUS += rk.PrefillBusyUS
	}
	if prefillCounters {
		r.LifetimePrefillPerRank, _ = prefillPerRank(prefilled, prefillBusyUS)
	}
	r.signals = deriveSignals(r, usageKnown)
	r.work = deriveWorkload(r)
	return r
}

// rankUsage is the rank's KV usage: token_usage when sent, else used/capacity.
func rankUsage(rk *Rank) (float64, bool) {
	if rk.Has(FieldTokenUsage) {
		return rk.TokenUsage, true
	}
	if rk.Has(FieldUsedTokens|FieldMaxTotalTokens) && rk.MaxTotalTokens > 0 {
		return float64(rk.UsedTokens) / float64(rk.MaxTotalTokens), true
	}
	return 0, false
}

// sanitize clears fields whose values cannot be a load: a negative count, a NaN or infinite ratio.
// token_usage above 1 is kept (a pool can be oversubscribed briefly) but capped at 4 so one absurd
// value cannot dominate the score forever.
func sanitize(rk *Rank) {
	ints := []struct {
		v *int64
		f Field
	}{
		{&rk.Running, FieldRunning}, {&rk.Waiting, FieldWaiting},
		{&rk.WaitingUncachedTokens, FieldWaitingUncachedTokens}, {&rk.UsedTokens, FieldUsedTokens},
		{&rk.TotalTokens, FieldTotalTokens}, {&rk.MaxTotalTokens, FieldMaxTotalTokens},
		{&rk.MaxRunning, FieldMaxRunning},
		{&rk.PrefillUncachedTokens, FieldPrefillCounters}, {&rk.PrefillBusyUS, FieldPrefillCounters},
	}
	for _, x := range ints {
		if *x.v < 0 {
			*x.v = 0
			rk.Fields &^= x.f
		}
	}
	floats := []struct {
		v *float64
		f Field
	}{
		{&rk.TokenUsage, FieldTokenUsage}, {&rk.GenThroughput, FieldGenThroughput},
		{&rk.CacheHitRate, FieldCacheHitRate}, {&rk.Utilization, FieldUtilization},
	}
	for _, x := range floats {
		if math.IsNaN(*x.v) || math.IsInf(*x.v, 0) || *x.v < 0 {
			*x.v = 0
			rk.Fields &^= x.f
		}
	}
	if rk.TokenUsage > maxTokenUsage {
		rk.TokenUsage = maxTokenUsage
	}
}

const maxTokenUsage = 4
