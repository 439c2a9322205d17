package main

import (
	"fmt"
	"slices"
)

// quantile is the nearest-rank quantile of sorted values: the smallest value with at least q of the
// values at or below it. Zero when there are none.
func quantile[T any](sorted []T, q float64) T {
	var zero T
	if len(sorted) == 0 {
		return zero
	}
	i := int(q*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// spread is a figure over seeds: its median, lowest and highest value, and how many seeds.
type spread struct {
	med, lo, hi float64
	n           int
}

// spreadOf summarises one value per seed; the median of an even count is the mean of the middle two.
func spreadOf(xs []float64) spread {
	if len(xs) == 0 {
		return spread{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return spread{med: m, lo: s[0], hi: s[len(s)-1], n: len(s)}
}

// format prints "med (lo..hi)" with the given number of decimals.
func (s spread) format(decimals int) string {
	return fmt.Sprintf("%.*f (%.*f..%.*f)", decimals, s.med, decimals, s.lo, decimals, s.hi)
}

// verdict says whether a ratio (lower is better) differs from 1 by more than its spread over seeds;
// one seed has no spread to judge by.
func (s spread) verdict() string {
	switch {
	case s.n < 2:
		return "one seed"
	case s.hi < 1:
		return "better on every seed"
	case s.lo > 1:
		return "worse on every seed"
	}
	return "within seed range"
}

// ratios divides a by b seed by seed; a seed where b is 0 is left out.
func ratios(a, b []float64) []float64 {
	var r []float64
	for i := range min(len(a), len(b)) {
		if b[i] != 0 {
			r = append(r, a[i]/b[i])
		}
	}
	return r
}
