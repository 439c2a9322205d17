package trace

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// Slice returns the requests arriving in [from, from+length), their At rebased to the slice start
// (from, not the first request in it); length <= 0 means to the end. The result is a new slice; its
// requests share their HashIDs with reqs. reqs must be in arrival order, as the readers return them.
func Slice(reqs []Request, from, length time.Duration) []Request {
	lo, _ := slices.BinarySearchFunc(reqs, from, func(r Request, at time.Duration) int { return cmp.Compare(r.At, at) })
	hi := len(reqs)
	if length > 0 && from <= math.MaxInt64-length {
		hi, _ = slices.BinarySearchFunc(reqs, from+length, func(r Request, at time.Duration) int { return cmp.Compare(r.At, at) })
	}
	out := slices.Clone(reqs[lo:max(lo, hi)])
	for i := range out {
		out[i].At -= from
	}
	return out
}

// Compress divides every At by factor: 4 sends the trace 4x faster. It returns a new slice (sharing
// HashIDs). A factor that is not a positive finite number leaves the times as they are.
func Compress(reqs []Request, factor float64) []Request {
	out := slices.Clone(reqs)
	if !(factor > 0) || math.IsInf(factor, 1) {
		return out
	}
	for i := range out {
		at := float64(out[i].At) / factor
		if at >= math.MaxInt64 { // float64(MaxInt64) is 2^63, one past it
			out[i].At = math.MaxInt64
		} else {
			out[i].At = time.Duration(at)
		}
	}
	return out
}

// Stats summarises a trace or a slice of one for reports. Sizes are in tokens, percentiles by nearest
// rank.
type Stats struct {
	Requests int
	Duration time.Duration // from the first arrival to the last
	Rate     float64       // requests per second over Duration; 0 if Duration is 0

	PromptMean, PromptP50, PromptP99, PromptMax, OutputMean, OutputP99 float64
}

// Summarize computes the Stats of reqs.
func Summarize(reqs []Request) Stats {
	s := Stats{Requests: len(reqs)}
	if len(reqs) == 0 {
		return s
	}
	s.Duration = reqs[len(reqs)-1].At - reqs[0].At
	if s.Duration > 0 {
		s.Rate = float64(len(reqs)) / s.Duration.Seconds()
	}
	in := make([]int, len(reqs))
	out := make([]int, len(reqs))
	for i, r := range reqs {
		in[i], out[i] = r.InputTokens, r.OutputTokens
	}
	slices.Sort(in)
	slices.Sort(out)
	s.PromptMean, s.PromptP50, s.PromptP99 = mean(in), percentile(in, 0.50), percentile(in, 0.99)
	s.PromptMax = float64(in[len(in)-1])
	s.OutputMean, s.OutputP99 = mean(out), percentile(out, 0.99)
	return s
}

func mean(xs []int) float64 {
	var sum float64
	for _, x := range xs {
		sum += float64(x)
	}
	return sum / float64(len(xs))
}

// percentile is the nearest-rank p-quantile of sorted, non-empty xs.
func percentile(sorted []int, p float64) float64 {
	rank := int(math.Ceil(p * float64(len(sorted))))
	return float64(sorted[min(max(rank, 1), len(sorted))-1])
}
