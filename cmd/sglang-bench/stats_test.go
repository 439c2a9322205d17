package main

import (
	"strings"
	"testing"
	"time"
)

func TestQuantileByHand(t *testing.T) {
	ten := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct {
		xs   []float64
		q    float64
		want float64
	}{
		{ten, 0.5, 5},   // rank round(5) = 5
		{ten, 0.9, 9},   // rank 9
		{ten, 0.99, 10}, // rank round(9.9) = 10
		{ten, 0.1, 1},
		{ten, 0, 1},
		{ten, 1, 10},
		{[]float64{4}, 0.99, 4},
		{[]float64{1, 2, 3}, 0.5, 2}, // rank round(1.5) = 2
		{nil, 0.5, 0},
	} {
		if got := quantile(c.xs, c.q); got != c.want {
			t.Errorf("quantile(%v, %g) = %g, want %g", c.xs, c.q, got, c.want)
		}
	}
	// 200 values: p99 is the 198th, so the two slowest are above it.
	var xs []float64
	for i := 1; i <= 200; i++ {
		xs = append(xs, float64(i))
	}
	if got := quantile(xs, 0.99); got != 198 {
		t.Errorf("p99 of 1..200 = %g, want 198", got)
	}
}

func TestBand(t *testing.T) {
	var ss []sample
	for i := range 200 {
		ss = append(ss, sample{latency: time.Duration(i+1) * time.Second}) // 1 s .. 200 s, sorted
	}
	for _, c := range []struct {
		ss               []sample
		q, share         float64
		first, last, len int // latencies in seconds
	}{
		{ss, 1, 0.01, 199, 200, 2},    // the slowest 1%: above p99 (the 198th)
		{ss, 0.5, 0.05, 96, 105, 10},  // around p50, the 100th
		{ss, 0, 0.05, 1, 10, 10},      // clipped at the fastest
		{ss[:3], 0.5, 0.05, 2, 2, 1},  // at least one: the median
		{ss[:1], 0.99, 0.01, 1, 1, 1}, // the only one
	} {
		b := band(c.ss, c.q, c.share)
		if len(b) != c.len || b[0].latency != time.Duration(c.first)*time.Second || b[len(b)-1].latency != time.Duration(c.last)*time.Second {
			t.Errorf("band(%d samples, %g, %g): %d from %v to %v, want %d from %d s to %d s", len(c.ss), c.q, c.share,
				len(b), b[0].latency, b[len(b)-1].latency, c.len, c.first, c.last)
		}
	}
	if b := band(nil, 0.5, 0.05); len(b) != 0 {
		t.Errorf("band of no samples: %v", b)
	}
}

func TestSpread(t *testing.T) {
	if s := spreadOf([]float64{3, 1, 2}); s != (spread{med: 2, lo: 1, hi: 3, n: 3}) {
		t.Errorf("odd count: %+v", s)
	}
	if s := spreadOf([]float64{4, 1, 3, 2}); s != (spread{med: 2.5, lo: 1, hi: 4, n: 4}) {
		t.Errorf("even count: %+v", s)
	}
	if s := spreadOf(nil); s != (spread{}) {
		t.Errorf("none: %+v", s)
	}
	if got := spreadOf([]float64{0.5, 0.4, 0.6}).format(2); got != "0.50 (0.40..0.60)" {
		t.Errorf("format: %q", got)
	}
	for _, c := range []struct {
		xs   []float64
		want string
	}{
		{[]float64{0.5, 0.9, 0.99}, "better on every seed"},
		{[]float64{1.01, 1.2}, "worse on every seed"},
		{[]float64{0.9, 1.1}, "within seed range"},
		{[]float64{0.9, 1}, "within seed range"},
		{[]float64{0.5}, "one seed"},
	} {
		if got := spreadOf(c.xs).verdict(); got != c.want {
			t.Errorf("verdict(%v) = %q, want %q", c.xs, got, c.want)
		}
	}
}

func TestRatios(t *testing.T) {
	got := ratios([]float64{1, 2, 3, 9}, []float64{2, 0, 6})
	if len(got) != 2 || got[0] != 0.5 || got[1] != 0.5 {
		t.Fatalf("ratios = %v, want [0.5 0.5] (zero baseline and unmatched seed left out)", got)
	}
	if m := mean([]float64{1, 2, 6}); m != 3 {
		t.Fatalf("mean = %g", m)
	}
}

func TestSeedsAtOnce(t *testing.T) {
	for _, c := range []struct {
		parallel, arms int
		rate           float64
		want           int
	}{
		{0, 11, 24, 1}, // the busy quality rate: one seed at a time
		{0, 11, 8, 3},  // light: three seeds carry the same offered load
		{0, 11, 12, 2}, // in between
		{0, 12, 1, 3},  // never more than three
		{0, 30, 24, 1}, // never fewer than one
		{2, 11, 24, 2}, // -parallel wins
	} {
		if got := (qualityOptions{parallel: c.parallel}).seedsAtOnce(c.rate, c.arms); got != c.want {
			t.Errorf("parallel %d, %d arms at %g/s: %d seeds at once, want %d", c.parallel, c.arms, c.rate, got, c.want)
		}
	}
}

func TestStudyRowsRunOnlyWhenNamed(t *testing.T) {
	all := qualityPolicies()
	byDefault, err := selectPolicies(all, "")
	if err != nil {
		t.Fatal(err)
	}
	var studies []string
	for _, p := range all {
		if p.study {
			studies = append(studies, p.name)
		}
	}
	if len(studies) == 0 || len(byDefault) != len(all)-len(studies) {
		t.Fatalf("%d rows, %d studies, %d run by default", len(all), len(studies), len(byDefault))
	}
	for _, p := range byDefault {
		if p.study {
			t.Errorf("study row %q runs by default", p.name)
		}
	}
	named, err := selectPolicies(all, "least_conn, "+studies[0])
	if err != nil || len(named) != 2 || named[1].name != studies[0] {
		t.Fatalf("naming least_conn and %q ran %d rows (%v)", studies[0], len(named), err)
	}
}

// The overhead mode always runs its four rows, in the positions its report reads; -policies adds
// studies after them, and names nothing else.
func TestOverheadRowsAddNamedStudies(t *testing.T) {
	rows, err := overheadRows("")
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 4 || rows[0].name != "least_conn" || rows[overheadControl].name != "least_conn again" || rows[overheadDefault].lb != "lb_policy sglang_load" {
		t.Fatalf("rows by default: %v", rows)
	}
	rows, err = overheadRows("first, random")
	if err != nil || len(rows) != 6 || rows[4].lb != "lb_policy first" || rows[5].lb != "lb_policy random" {
		t.Fatalf("naming first and random: %v (%v)", rows, err)
	}
	for _, only := range []string{"least_conn", "no such row"} {
		if _, err := overheadRows(only); err == nil || !strings.Contains(err.Error(), only) {
			t.Errorf("-policies %q: error %v, want one naming it", only, err)
		}
	}
}
