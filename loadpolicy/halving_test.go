package loadpolicy

import (
	"math"
	"testing"
	"time"
)

// decodingAt is a worker's report with running requests decoding at alone tokens/s each in a batch of
// one, halving at halving more, its throughput scaled by noise.
func decodingAt(running int64, alone, halving, noise float64) []Rank {
	gen := float64(running) * alone / (1 + float64(running-1)/halving) * noise
	return []Rank{worker(running, 0, 0, 100*running, 1e6, 1024, gen)}
}

// chain is the last of reports a second apart, each following the one before, as the monitor builds them.
func chain(reports ...[]Rank) *Report {
	var prev *Report
	for i, ranks := range reports {
		r := NewReport(time.Unix(int64(i), 0), "", ranks)
		r.Follow(prev)
		prev = r
	}
	return prev
}

func TestHalvingFit(t *testing.T) {
	batches := []int64{1, 6, 12, 3, 16, 9, 2, 14}
	series := func(halving float64, noise func(i int) float64, bs ...int64) [][]Rank {
		var out [][]Rank
		for i, b := range bs {
			out = append(out, decodingAt(b, 100, halving, noise(i)))
		}
		return out
	}
	exact := func(int) float64 { return 1 }
	// ±5%, alternating in a pattern that does not follow the batch.
	noisy := func(i int) float64 { return 1 + 0.05*float64(i%3-1) }
	tests := []struct {
		name    string
		reports [][]Rank
		want    float64 // 0: not measured
		within  float64 // relative
	}{
		{name: "a line", reports: series(12, exact, batches...), want: 12, within: 1e-9},
		{name: "noisy throughput", reports: series(16, noisy, append(append([]int64{}, batches...), batches...)...), want: 16, within: 0.25},
		{name: "one batch size", reports: series(12, exact, 8, 8, 8, 8, 8, 8, 8, 8)},
		{name: "batch varies too little", reports: series(12, exact, 7, 8, 9, 8, 7, 8, 9, 8)},
		{name: "too few reports", reports: series(12, exact, 1, 16, 2)},
		{name: "no slowdown", reports: series(math.Inf(1), exact, batches...)},
		{name: "slower alone than together", reports: series(-64, exact, batches...)},
		{name: "slight slowdown, capped", reports: series(1e5, exact, batches...), want: maxHalving, within: 1e-9},
		{name: "idle reports keep the fit", reports: append(series(12, exact, batches...), []Rank{worker(0, 0, 0, 0, 1e6, 1024, 0)}), want: 12, within: 1e-9},
		{
			// Old reports fade: after 60 reports at 32 the fit is near 32, not the mean of the two.
			name: "a worker that changes", within: 0.1, want: 32,
			reports: append(series(8, exact, batches...), series(32, exact, append(append(append(append(append(append(append([]int64{},
				batches...), batches...), batches...), batches...), batches...), batches...), batches...)...)...),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := chain(tt.reports...).DecodeBatchHalving()
			switch {
			case tt.want == 0 && ok:
				t.Errorf("measured %v, want nothing measured", got)
			case tt.want != 0 && !ok:
				t.Errorf("nothing measured, want %v", tt.want)
			case tt.want != 0 && math.Abs(got-tt.want) > tt.within*tt.want:
				t.Errorf("measured %v, want %v within %v%%", got, tt.want, 100*tt.within)
			}
		})
	}
}

func TestCostUsesMeasuredHalving(t *testing.T) {
	var reports [][]Rank
	for _, b := range []int64{1, 6, 12, 3, 16, 9, 2, 4} {
		reports = append(reports, decodingAt(b, 100, 8, 1))
	}
	rep := chain(reports...)
	req := Request{PromptTokens: 800, OutputTokens: 100}
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 32, MeanOutputTokens: 100}
	// The last report: 4 running at 100/(1 + 3/8) each. The request joins a batch of 5, and its 800
	// prompt tokens prefill at the stand-in 8000 tok/s: 0.1 s.
	if got, want := rep.Cost(req, 0, &Since{}, &params), 0.1+100/(100/(1+4.0/8)); math.Abs(got-want) > 1e-9 {
		t.Errorf("measured halving: cost %.6f s, want %.6f s (halving 8)", got, want)
	}
	// Fixed, the stand-in holds: the speed at batch 4 carried to 5 at halving 32.
	params.FixedHalving = true
	alone := 100 / (1 + 3.0/8) * (1 + 3.0/32)
	if got, want := rep.Cost(req, 0, &Since{}, &params), 0.1+100/(alone/(1+4.0/32)); math.Abs(got-want) > 1e-9 {
		t.Errorf("fixed halving: cost %.6f s, want %.6f s (halving 32)", got, want)
	}
}
