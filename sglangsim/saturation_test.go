package sglangsim

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// saturatedConfig is the benchmark's smallest worker (w0-1x), answers ending early as the benchmark's do.
func saturatedConfig() Config {
	return Config{MaxTotalTokens: 16384, MaxRunningRequests: 16, DecodeTokensPerSec: 100, PrefillTokensPerSec: 4000,
		FinishEarly: 0.3, SGLangAdmission: true}
}

type arrival struct {
	at time.Duration
	j  job
}

// saturatingArrivals are n requests of the benchmark's quality workload at the third of its busy rate
// that round_robin sends the smallest worker, past its saturation: Poisson arrivals at 8/s, 80% short
// (prompt 200, max_tokens 64), 20% long (2,000 and 512).
func saturatingArrivals(w *Worker, seed uint64, n int) []arrival {
	rnd := rand.New(rand.NewPCG(seed, 0x5a7))
	var at time.Duration
	out := make([]arrival, n)
	for i := range out {
		at += time.Duration(rnd.ExpFloat64() / 8 * float64(time.Second))
		prompt, maxTokens := int64(200), int64(64)
		if rnd.Float64() < 0.2 {
			prompt, maxTokens = 2000, 512
		}
		unique := fmt.Sprintf("%08x%08x", seed, i) // no two prompts share a cached block
		out[i] = arrival{at, w.plan(chatKey([]byte(unique+filler(4, prompt))), prompt, maxTokens, -1, -1, 0)}
	}
	return out
}

// Past saturation, with SGLang's admission and the clock ticking as the worker's own does, every
// request is answered in full within what the work queued ahead of it takes (a retracted request, from
// when it went to the back of the queue), no request is retracted
// again and again, the pool is never over capacity, and an idle worker holds no KV. A worker that
// stalls holds requests for minutes in the benchmark: with the decode steps of a tick rounded down to
// no token, a pool filled exactly once let no request decode, and none was retracted, until a late
// tick came.
func TestSGLangAdmissionPastSaturation(t *testing.T) {
	const requests = 500
	// Before decode asked at least a token per request, the first three seeds filled the pool exactly
	// and stalled there.
	for _, seed := range []uint64{27, 39, 52, 0, 1, 2, 3, 4} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			w, start := handDriven(t, saturatedConfig())
			defer handBack(w)
			cfg, rk := w.cfg, w.ranks[0]
			arrivals := saturatingArrivals(w, seed, requests)

			// The bound a request's latency must keep: the work of every request unfinished when it
			// arrives (itself included), prefilled and decoded one after the other, not side by side
			// as the worker does, with decode at the throughput of the smallest batch the pool holds
			// when every request is long; and its own decode at the speed of a full batch.
			leastBatch := int(cfg.MaxTotalTokens / (2000 + 512))
			leastThroughput := float64(leastBatch) * cfg.decodeSpeed(leastBatch)
			work := func(r *request) float64 {
				return float64(r.prompt)/cfg.PrefillTokensPerSec + float64(r.output)/leastThroughput
			}
			ownDecode := func(r *request) float64 { return float64(r.output) / cfg.decodeSpeed(cfg.MaxRunningRequests) }
			bound := map[*request]float64{}
			var all []*request
			var queued float64 // the work of requests not yet finished
			retracted := map[*request]int{}
			wasDecoding := map[*request]bool{}

			now, next := start, 0
			for w.served < requests {
				now = now.Add(tickEvery)
				if now.Sub(start) > arrivals[requests-1].at+time.Duration(queued*float64(time.Second))+time.Minute {
					t.Fatalf("at %v: %d of %d served, %d running, %d waiting, %d of %d KV tokens used, new_token_ratio %.3f",
						now.Sub(start), w.served, requests, len(rk.running), len(rk.waiting), rk.used(), cfg.MaxTotalTokens, rk.newTokenRatio)
				}
				for ; next < requests && !start.Add(arrivals[next].at).After(now); next++ {
					r := queueByHand(w, arrivals[next].j, start.Add(arrivals[next].at))
					queued += work(r)
					bound[r] = queued + ownDecode(r)
					all = append(all, r)
					w.admit(rk, now) // as submit does
				}
				clear(wasDecoding)
				for _, r := range rk.running {
					wasDecoding[r] = r.state == stateDecode
				}
				w.step(now)
				for r, decoding := range wasDecoding {
					// Out of decode and not done: retracted (and maybe admitted again at once).
					if decoding && (r.state == stateWaiting || r.state == statePrefill) {
						retracted[r]++
						// At the back of the queue again: behind every request unfinished now.
						bound[r] = max(bound[r], now.Sub(r.enqueued).Seconds()+queued+ownDecode(r))
					}
					if r.state == stateDone {
						queued -= work(r)
					}
				}
				if rk.used()+rk.cache.evictable > cfg.MaxTotalTokens {
					t.Fatalf("at %v: %d used and %d evictable in a pool of %d", now.Sub(start), rk.used(), rk.cache.evictable, cfg.MaxTotalTokens)
				}
			}

			var total int
			for i, r := range all {
				if r.err != nil || r.emitted.Load() != r.output {
					t.Fatalf("request %d: err %v, %d of %d tokens", i, r.err, r.emitted.Load(), r.output)
				}
				if took := r.finished.Sub(r.enqueued).Seconds(); took > bound[r] {
					t.Errorf("request %d (prompt %d, output %d, retracted %d times) took %.1f s, more than the %.1f s its work allows",
						i, r.prompt, r.output, retracted[r], took, bound[r])
				}
				if retracted[r] > maxRetractions {
					t.Errorf("request %d (prompt %d, output %d) retracted %d times", i, r.prompt, r.output, retracted[r])
				}
				total += retracted[r]
			}
			if int64(total) != rk.retracted {
				t.Errorf("%d retractions seen, the rank counted %d", total, rk.retracted)
			}

			w.step(now.Add(tickEvery)) // an idle step
			if rk.private != 0 || rk.cache.pinned != 0 || rk.waitingPrompt != 0 || rk.waitingUncached != 0 || len(rk.waiting) != 0 {
				t.Errorf("idle rank holds: private %d, pinned %d, queued %d / %d uncached, %d waiting",
					rk.private, rk.cache.pinned, rk.waitingPrompt, rk.waitingUncached, len(rk.waiting))
			}
			if l := w.loadsLocked(now)[0]; l.UsedTokens != 0 || l.TokenUsage != 0 || l.TotalTokens != 0 {
				t.Errorf("idle rank reports %d used tokens (usage %g), %d in total", l.UsedTokens, l.TokenUsage, l.TotalTokens)
			}
			if rk.newTokenRatio != initNewTokenRatio {
				t.Errorf("idle new_token_ratio %g, want %g", rk.newTokenRatio, initNewTokenRatio)
			}
		})
	}
}

// maxRetractions is the most times a request may be retracted in TestSGLangAdmissionPastSaturation: a
// request retracted again and again is what a livelock looks like. Over 200 seeds, with retracted
// requests queued at the back, three requests were retracted twice and none more.
const maxRetractions = 2

// outgrowingPool is the KV pool of outgrowingPair's worker.
const outgrowingPool = 2000

// outgrowingPair starts two requests whose output outgrows the pool, on a hand-driven worker (the
// caller hands it back): a first of 100 + 1,500 decodes alone for 6 s, so the guess falls to its
// least, then a second of 100 + 1,000 is admitted beside it: 700 used, 899 more guessed at 0.098 (88),
// so it fits, though both need 2,699 in all.
func outgrowingPair(t *testing.T) (w *Worker, first, second *request, now time.Time) {
	t.Helper()
	w, now = handDriven(t, Config{PrefillTokensPerSec: 1e9, DecodeTokensPerSec: 100, MaxTotalTokens: outgrowingPool, SGLangAdmission: true})
	rk := w.ranks[0]
	first = queueByHand(w, sized(100, 1500), now)
	w.admit(rk, now)
	for range 6 * time.Second / tickEvery {
		now = now.Add(tickEvery)
		w.step(now)
	}
	second = queueByHand(w, sized(100, 1000), now)
	w.admit(rk, now)
	if len(rk.running) != 2 {
		handBack(w)
		t.Fatalf("%d running after the second arrived, want 2 (first has %d tokens)", len(rk.running), first.emitted.Load())
	}
	return w, first, second, now
}

// Two requests whose output outgrows the pool, on the worker's own tick: a tick is a fraction of a decode
// step, but the pool must hold the next token of each, so the one with fewer tokens is retracted when it
// cannot and both finish, where rounding the tick's tokens down to none let them stall on a pool filled
// exactly.
func TestDecodeOnAFullPoolRetracts(t *testing.T) {
	w, first, second, now := outgrowingPair(t)
	defer handBack(w)
	rk := w.ranks[0]
	// Alone, the two take under 25 s of decode.
	for step := 0; w.served < 2; step++ {
		if step > int(30*time.Second/tickEvery) {
			t.Fatalf("stalled: %d and %d tokens of %d and %d, %d of %d KV tokens used, %d retracted",
				first.emitted.Load(), second.emitted.Load(), first.output, second.output, rk.used(), outgrowingPool, rk.retracted)
		}
		now = now.Add(tickEvery)
		w.step(now)
	}
	if rk.retracted == 0 {
		t.Error("both finished with no retraction in a pool that could not hold them")
	}
}

// A retracted request goes to the back of the queue, behind a request that arrived after it, as
// SGLang's scheduler appends it with its default fcfs policy; prefilled again, it yields its next
// token at once, as SGLang's prefill of it does.
func TestRetractedRequestQueuesAtTheBack(t *testing.T) {
	w, first, second, now := outgrowingPair(t)
	defer handBack(w)
	rk := w.ranks[0]
	later := queueByHand(w, sized(100, 1500), now.Add(time.Millisecond)) // too large to be admitted beside them
	w.admit(rk, now)
	if len(rk.running) != 2 || len(rk.waiting) != 1 {
		t.Fatalf("%d running and %d waiting, want 2 and 1", len(rk.running), len(rk.waiting))
	}
	for step := 0; rk.retracted == 0; step++ {
		if step > int(30*time.Second/tickEvery) {
			t.Fatalf("no retraction: %d and %d tokens, %d of %d KV tokens used", first.emitted.Load(), second.emitted.Load(), rk.used(), outgrowingPool)
		}
		now = now.Add(tickEvery)
		w.step(now)
	}
	if second.state != stateWaiting || first.state != stateDecode {
		t.Fatalf("retracted: states %d (first) and %d (second), want the second, with fewer tokens, waiting", first.state, second.state)
	}
	if len(rk.waiting) != 2 || rk.waiting[0] != later || rk.waiting[1] != second {
		t.Fatalf("queue after the retraction: %d waiting, want the later arrival then the retracted request", len(rk.waiting))
	}
	had := second.emitted.Load() // retracted before the step's decode: what it had
	for step := 0; second.state != stateDecode; step++ {
		if step > int(60*time.Second/tickEvery) {
			t.Fatalf("the retracted request was not prefilled again: state %d, %d served", second.state, w.served)
		}
		if second.state == stateWaiting && second.emitted.Load() != had {
			t.Fatalf("a waiting request's output moved from %d to %d tokens", had, second.emitted.Load())
		}
		now = now.Add(tickEvery)
		w.step(now)
	}
	if later.admitted.IsZero() {
		t.Error("the retracted request was prefilled again ahead of the later arrival")
	}
	if got := second.emitted.Load(); got != had+1 {
		t.Errorf("prefilled again with %d tokens: %d after it, want %d", had, got, had+1)
	}
}
