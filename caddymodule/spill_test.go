package caddymodule_test

import (
	"math"
	"strings"
	"testing"
)

// affinityBound is the most requests affinity lets a worker have in flight, counting the one being
// placed, when the fleet of workers has total in flight: HAProxy's ceil(factor × mean), the mean
// counting the request, never below the mean plus affinity.BalanceSlack (8). affinity_balance is left
// at its default, 1.25.
func affinityBound(total, workers int) int {
	mean := float64(total+1) / float64(workers)
	return int(math.Ceil(max(1.25*mean, mean+8)))
}

// With affinity prefix, requests that share a long system prompt go to its home while the home stays
// within the balance bound, and spill past it. Each request is held at its worker, so the proxy's
// in-flight counts, which the bound weighs, are the requests sent so far. On three idle workers the
// bound for the n-th request is ceil(n/3 + 8) (the mean plus 8 is the larger below a mean of 32): the
// home takes the first 13 (13 <= ceil(13/3 + 8) = 13), the 14th and 15th spill (the home would hold 14,
// past 13), and no request ever goes to a worker past the bound. Elsewhere than the home a request
// prefills the 8,000-token prompt (a second at the stand-in 8,000 tokens/s), which the home has
// cached: within the bound the home is far the cheaper, whatever its batch.
func TestAffinitySpillsPastTheBalanceBound(t *testing.T) {
	h := newHeldRequests(t)
	ws := holdingCaddy(t, h, "affinity prefix", idleRank(0), idleRank(0), idleRank(0))
	body := `{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat("You answer in French, briefly. ", 32<<10/31) +
		`"},{"role":"user","content":"a question"}],"max_tokens":16}`
	inflight := map[string]int{}
	var home string
	var order []string
	firstSpill := -1 // the first request for which the home was past the bound
	for i := range 20 {
		bound := affinityBound(i, len(ws))
		if firstSpill < 0 && home != "" && inflight[home]+1 > bound {
			firstSpill = i
		}
		to := h.send("/v1/chat/completions", body).worker
		order = append(order, to)
		if i == 0 {
			home = to
		}
		if inflight[to]+1 > bound {
			t.Fatalf("request %d went to %s with %d in flight, past the bound of %d (%d in flight in all); sent to %v",
				i+1, to, inflight[to], bound, i, order)
		}
		if firstSpill < 0 && to != home {
			t.Fatalf("request %d went to %s, where its home %s holds %d in flight, within the bound of %d; sent to %v",
				i+1, to, home, inflight[home], bound, order)
		}
		inflight[to]++
	}
	// After a spill the worker it went to holds the prompt too: which of the two within the bound takes
	// the next is the cost model's choice, not the bound's.
	if firstSpill != 13 || order[13] == home || order[14] == home {
		t.Errorf("sent to %v: want the first 13 on the home %s, the 14th and 15th elsewhere", order, home)
	}
	h.finish()
}
