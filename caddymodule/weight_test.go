package caddymodule

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// With affinity, a worker's share of the keys is its batch cap times its lifetime prefill speed per
// rank; a worker whose report lacks one takes the fleet's mean of it, through the static pool's slots
// and through a dynamic pool's endpoints alike. The admin view shows the speed.
func TestAffinityWeighsByBatchCapAndSpeed(t *testing.T) {
	type worker struct {
		batchCap      int64 // 0: not sent
		tokens, busyS int64 // lifetime prefill counters, tokens over the ranks, seconds per rank; busyS 0: not sent
		ranks         int
	}
	tests := []struct {
		name    string
		workers []worker
		want    []float64
	}{
		{"cap and speed", []worker{{16, 4000, 1, 1}, {32, 8000, 1, 1}, {64, 16000, 1, 1}}, []float64{16 * 4000, 32 * 8000, 64 * 16000}},
		{"speed per rank", []worker{{64, 16000, 1, 1}, {64, 32000, 1, 2}}, []float64{64 * 16000, 64 * 16000}},
		{"a worker without counters takes the mean speed", []worker{{16, 4000, 1, 1}, {32, 0, 0, 1}, {64, 16000, 1, 1}}, []float64{16 * 4000, 32 * 10000, 64 * 16000}},
		{"a worker without a cap takes the mean cap", []worker{{16, 4000, 1, 1}, {0, 8000, 1, 1}, {64, 16000, 1, 1}}, []float64{16 * 4000, 40 * 8000, 64 * 16000}},
		{"no counters anywhere: batch cap alone", []worker{{16, 0, 0, 1}, {32, 0, 0, 1}}, []float64{16, 32}},
		{"no cap anywhere: alike", []worker{{0, 4000, 1, 1}, {0, 16000, 1, 1}}, []float64{0, 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pool := make(reverseproxy.UpstreamPool, len(tt.workers))
			for i := range pool {
				pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("10.0.0.%d:30000", i+1)}
			}
			p := &Policy{Metric: "cost", Affinity: affinityPrefix}
			err := ProvisionWithReports(p, pool, func(i int) *loadpolicy.Report {
				w := tt.workers[i]
				ranks := make([]loadpolicy.Rank, w.ranks)
				for r := range ranks {
					rk := &ranks[r]
					rk.Running, rk.Fields = 1, loadpolicy.FieldRunning|loadpolicy.FieldWaiting
					if w.batchCap > 0 {
						rk.MaxRunning, rk.Fields = w.batchCap/int64(w.ranks), rk.Fields|loadpolicy.FieldMaxRunning
					}
					if w.busyS > 0 {
						rk.PrefillUncachedTokens, rk.PrefillBusyUS = w.tokens/int64(w.ranks), w.busyS*1e6
						rk.Fields |= loadpolicy.FieldPrefillCounters
					}
				}
				return loadpolicy.NewReport(time.Now(), "", ranks)
			})
			if err != nil {
				t.Fatal(err)
			}
			// The admin view shows each worker's lifetime prefill speed per rank, the weight's factor.
			for i, u := range pool {
				w, ep := tt.workers[i], (*p.endpoints.Load())[u.Dial]
				v := ep.view(time.Now(), nil)
				var got float64
				if v.Score != nil && v.Score.PrefillLifetimePerRank != nil {
					got = *v.Score.PrefillLifetimePerRank
				}
				want := 0.0
				if w.busyS > 0 {
					want = float64(w.tokens) / float64(w.busyS*int64(w.ranks))
				}
				if v.Score == nil || got != want {
					t.Errorf("admin view of worker %d: score %+v, prefill_lifetime_tokens_per_sec_per_rank %g, want %g", i, v.Score, got, want)
				}
			}
			for _, static := range []bool{true, false} {
				c := new(affinityCandidates)
				x := p.index.Load()
				if !static {
					x = nil
				}
				c.reset(p, pool, x)
				c.look()
				for i, want := range tt.want {
					if _, _, got := c.Candidate(i); math.Abs(got-want) > 1e-9*want {
						t.Errorf("static pool %v: worker %d weighs %g, want %g", static, i, got, want)
					}
				}
			}
		})
	}
}
