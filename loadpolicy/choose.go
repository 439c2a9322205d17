package loadpolicy

import (
	"fmt"
	"math"
)

// Candidate is one upstream as a chooser sees it.
type Candidate struct {
	// Signals of the upstream's fresh report; nil when the report is missing or stale.
	Signals *Signals
	// Extra is the number of the proxy's requests to this upstream started since the report.
	Extra int64
	// Inflight is the proxy's current in-flight request count to this upstream.
	Inflight int64
}

// Compare orders two candidates on the signals in set, most precise first, then on in-flight
// requests: negative when a is the better choice, positive when b is, 0 on a tie.
func Compare(a, b *Candidate, set SignalSet) int {
	if a.Signals != nil && b.Signals != nil {
		for s := Signal(0); s < numSignals; s++ {
			if !set.Has(s) {
				continue
			}
			// Each score counts the request being placed: the load it would join, so a small worker
			// does not win a tie at equal load when one more request weighs more on it.
			if c := compareFloat(a.Signals.Score(s, a.Extra+1), b.Signals.Score(s, b.Extra+1)); c != 0 {
				return c
			}
		}
	}
	switch {
	case a.Inflight < b.Inflight:
		return -1
	case a.Inflight > b.Inflight:
		return 1
	}
	return 0
}

// compareFloat treats values within a relative 1e-9 as equal, so rounding noise does not decide.
func compareFloat(a, b float64) int {
	if math.Abs(a-b) <= 1e-9*math.Max(math.Abs(a), math.Abs(b)) {
		return 0
	}
	if a < b {
		return -1
	}
	return 1
}

// Choice says how a chooser should pick among candidates.
type Choice uint8

const (
	// PowerOfTwo compares two random candidates and takes the better: it spreads load between
	// polls instead of sending every request to the one worker that looked idlest.
	PowerOfTwo Choice = iota
	// Least takes the best candidate of all.
	Least
)

// ParseChoice parses power_of_two (the default) or least.
func ParseChoice(s string) (Choice, error) {
	switch s {
	case "", "power_of_two":
		return PowerOfTwo, nil
	case "least":
		return Least, nil
	}
	return 0, fmt.Errorf("unknown choice %q: want power_of_two or least", s)
}

func (c Choice) String() string {
	if c == Least {
		return "least"
	}
	return "power_of_two"
}

// Choose picks among the n candidates that at(i) returns as available, and returns the index of the
// chosen one and whether the choice was made on loads. It returns -1 when none is available, and
// (-1, false) with available candidates when none has usable loads: the caller then falls back.
// intn(n) must return a uniform integer in [0, n). Choose does not allocate.
func Choose(choice Choice, metric Metric, n int, at func(i int) (Candidate, bool), intn func(int) int) (int, bool) {
	if choice == Least {
		return least(metric, n, at, intn)
	}
	return powerOfTwo(metric, n, at, intn)
}

func least(metric Metric, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	// First pass: the signals that every candidate with loads shares.
	common, loaded := metric.AllSignals(), 0
	for i := range n {
		c, ok := at(i)
		if !ok || !metric.Usable(c.Signals) {
			continue
		}
		loaded++
		common = metric.Common(common, c.Signals)
	}
	if loaded == 0 || common == 0 {
		return -1, false
	}
	best, ties := -1, 0
	var bestC Candidate
	for i := range n {
		c, ok := at(i)
		if !ok || !metric.Usable(c.Signals) {
			continue
		}
		if best < 0 {
			best, bestC, ties = i, c, 1
			continue
		}
		switch cmp := Compare(&c, &bestC, common); {
		case cmp < 0:
			best, bestC, ties = i, c, 1
		case cmp == 0:
			// Reservoir sampling among equals, so ties do not always favour the first upstream.
			ties++
			if intn(ties) == 0 {
				best, bestC = i, c
			}
		}
	}
	return best, true
}

// sampleTries bounds the random draws of a pair of available candidates before powerOfTwo falls back
// to a full pass: with a few unavailable upstreams a draw almost always succeeds, and a pool that is
// mostly unavailable still gets an answer.
const sampleTries = 4

func powerOfTwo(metric Metric, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	// Draw two distinct indices and look at those two only, so the cost does not grow with the pool.
	// Redrawing both when either is unavailable keeps the pair uniform among available candidates.
	for range sampleTries {
		if n < 2 {
			break
		}
		// One draw for the ordered pair: a random number costs as much as the rest of a comparison.
		k := intn(n * (n - 1))
		i, j := k/(n-1), k%(n-1)
		if j >= i {
			j++
		}
		a, ok := at(i)
		if !ok {
			continue
		}
		b, ok := at(j)
		if !ok {
			continue
		}
		if !metric.Usable(a.Signals) && !metric.Usable(b.Signals) {
			break // only a full pass can tell whether any candidate has loads, or the caller falls back
		}
		return better(metric, [2]int{i, j}, &a, &b, intn), true
	}
	return powerOfTwoScan(metric, n, at, intn)
}

// powerOfTwoScan is powerOfTwo in one pass over every candidate: it counts the available ones and
// those with usable loads, and reservoir-samples two.
func powerOfTwoScan(metric Metric, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	var pick [2]int
	var cand [2]Candidate
	available, loaded := 0, 0
	for i := range n {
		c, ok := at(i)
		if !ok {
			continue
		}
		if metric.Usable(c.Signals) {
			loaded++
		}
		available++
		slot := available - 1
		if available > 2 {
			slot = intn(available)
		}
		if slot < 2 {
			pick[slot], cand[slot] = i, c
		}
	}
	switch {
	case available == 0:
		return -1, false
	case loaded == 0:
		return -1, false
	case available == 1:
		return pick[0], true
	}
	return better(metric, pick, &cand[0], &cand[1], intn), true
}

// better returns the index in pick of the better of the pair a, b; a tie is broken at random.
func better(metric Metric, pick [2]int, a, b *Candidate, intn func(int) int) int {
	set := metric.AllSignals()
	if a.Signals != nil && b.Signals != nil {
		set = metric.Common(metric.Common(set, a.Signals), b.Signals)
	}
	switch c := Compare(a, b, set); {
	case c < 0:
		return pick[0]
	case c > 0:
		return pick[1]
	}
	return pick[intn(2)]
}
