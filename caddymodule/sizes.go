package caddymodule

import (
	"maps"
	"math"
	"sync"
	"sync/atomic"
)

// requestSizes are the mean sizes of recent requests that the cost model reads: their output tokens,
// and their uncached prompt tokens with the mean of their squares (its prefill queueing term). They are
// gathered from each upstream's totals of what was sent there, at most every sizesEvery. Folded request
// by request into means of the policy's own, they were three compare-and-swaps on lines that every
// core's Select wrote: with two cores selecting at once, half of a Select's time.
type requestSizes struct {
	out, prompt, promptSq atomicFloat
	due                   atomic.Int64 // Unix milliseconds from which the next gathering is due

	mu    sync.Mutex            // serialises gatherings
	seen  map[*endpoint]sentSum // totals at the last gathering; guarded by mu
	round uint64                // guarded by mu
}

// sentSum is what the means read of an endpoint's totals, and the gathering that read them.
type sentSum struct {
	requests, output, uncached, uncachedSq int64
	round                                  uint64
}

// sizesEvery is how often the means are gathered, in milliseconds: a tenth of a second of requests
// counts as one step of a mean that moves by meanWeight a request.
const sizesEvery = 100

// meanWeight is the weight of one request in the mean request size: about the last hundred count.
const meanWeight = 0.01

// gather folds the requests sent to eps's endpoints since the last gathering into the means, when one
// is due at now (Unix milliseconds). Each request weighs meanWeight, as if folded one by one in the
// order sent; within a gathering they weigh alike. The totals include what the other policies of the
// config sent to the same upstreams: requests to the same workers, sized as this policy's are.
func (s *requestSizes) gather(now int64, eps map[string]*endpoint) {
	due := s.due.Load()
	if now < due || !s.due.CompareAndSwap(due, now+sizesEvery) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen == nil {
		s.seen = make(map[*endpoint]sentSum, len(eps))
	}
	s.round++
	var sum sentSum
	for _, ep := range eps {
		prev := s.seen[ep] // zero for an endpoint not seen before: its totals began at zero
		if prev.round == s.round {
			continue // an endpoint that two upstreams share, counted once
		}
		cur := sentSum{ep.sentRequests.Load(), ep.sentOutput.Load(), ep.sentUncached.Load(), ep.sentUncachedSq.Load(), s.round}
		if cur.requests >= prev.requests {
			sum.requests += cur.requests - prev.requests
			sum.output += cur.output - prev.output
			sum.uncached += cur.uncached - prev.uncached
			sum.uncachedSq += cur.uncachedSq - prev.uncachedSq
		}
		s.seen[ep] = cur
	}
	maps.DeleteFunc(s.seen, func(_ *endpoint, v sentSum) bool { return v.round != s.round })
	if sum.requests <= 0 {
		return
	}
	n := float64(sum.requests)
	kept := math.Pow(1-meanWeight, n) // what n requests folded one by one leave of the mean before
	fold := func(a *atomicFloat, mean float64) { a.Store(mean + kept*(a.Load()-mean)) }
	fold(&s.out, float64(sum.output)/n)
	fold(&s.prompt, float64(sum.uncached)/n)
	fold(&s.promptSq, float64(sum.uncachedSq)/n)
}
