package loadpolicy

import (
	"fmt"
	"math"
)

// Candidate is one upstream as a chooser sees it. It has at most four fields of at most 32 bytes in
// all, so that the compiler keeps the one a chooser's at returns in registers: a pass over 1,024
// upstreams costs a quarter of what a larger struct, copied through memory, did.
type Candidate struct {
	// Signals of the upstream's fresh report; nil when the report is missing or stale.
	Signals *Signals
	// Extra is the number of the proxy's requests to this upstream started since the report.
	Extra int64
	// Inflight is the proxy's current in-flight request count to this upstream.
	Inflight int64
	// Cost is the cost model's price of the request on this upstream, in seconds, above 0; 0 when it
	// was not priced. Only the cost metric reads it.
	Cost float64
}

// Priced reports whether the cost model priced the candidate.
func (c *Candidate) Priced() bool { return c.Cost > 0 }

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
	return compareInt(a.Inflight, b.Inflight)
}

func compareInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// compareFloat treats values within a relative 1e-9 as equal, so rounding noise does not decide.
// It decides without branches but for the common tie: which of two random candidates wins is a coin
// toss that a branch predictor loses.
func compareFloat(a, b float64) int {
	if a == b {
		return 0 // the common tie: equal loads, as two idle workers have
	}
	d, tol := a-b, 1e-9*max(math.Abs(a), math.Abs(b))
	if tol > math.MaxFloat64 {
		tol = 0 // an infinite cost (a request the worker refuses) is dearer than any finite one
	}
	return isTrue(d > tol) - isTrue(d < -tol)
}

// isTrue is 1 for true and 0 for false; the compiler makes it a flag move, not a branch.
func isTrue(b bool) int {
	var i int
	if b {
		i = 1
	}
	return i
}

// Choice says how a chooser should pick among candidates.
type Choice uint8

const (
	// Auto is the default: Window with the cost metric, PowerOfTwo with the signals.
	Auto Choice = iota
	// PowerOfTwo compares two random candidates and takes the better: it spreads load between
	// polls instead of sending every request to the one worker that looked idlest.
	PowerOfTwo
	// Least takes the best candidate of all.
	Least
	// Window takes the best of all candidates in a pool of up to WindowSize, and the best of
	// WindowSize consecutive ones from a random start in a larger pool, so its cost stays flat.
	Window
)

// WindowSize is how many candidates Window compares at most.
const WindowSize = 16

var choiceNames = [...]string{"auto", "power_of_two", "least", "window"}

// ParseChoice parses auto (the default), power_of_two, least or window.
func ParseChoice(s string) (Choice, error) {
	if s == "" {
		return Auto, nil
	}
	for i, n := range choiceNames {
		if n == s {
			return Choice(i), nil
		}
	}
	return 0, fmt.Errorf("unknown choice %q: want auto, power_of_two, least or window", s)
}

func (c Choice) String() string {
	if int(c) < len(choiceNames) {
		return choiceNames[c]
	}
	return fmt.Sprintf("choice(%d)", c)
}

// resolve is the choice Auto stands for under metric.
func (c Choice) resolve(metric Metric) Choice {
	if c != Auto {
		return c
	}
	if metric.cost {
		return Window
	}
	return PowerOfTwo
}

// Choose picks among the n candidates, and returns the index of the chosen one and whether the choice
// was made on loads. at(i) returns candidate i and whether it is available. Choose returns -1 when
// none is available, and (-1, false) with available candidates when none has usable loads: the caller
// then falls back. intn(n) must return a uniform integer in [0, n). Choose does not allocate.
func Choose(choice Choice, metric Metric, n int, at func(i int) (Candidate, bool), intn func(int) int) (int, bool) {
	switch choice.resolve(metric) {
	case Least:
		if metric.cost {
			return cheapest(0, n, n, at, intn)
		}
		return least(metric, n, at, intn)
	case Window:
		return window(n, at, intn)
	}
	return powerOfTwo(metric, n, at, intn)
}

// window returns the cheapest of every candidate of a pool up to WindowSize, else of WindowSize
// consecutive ones from a random start.
func window(n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	if n <= WindowSize {
		return cheapest(0, n, n, at, intn)
	}
	return cheapest(intn(n), WindowSize, n, at, intn)
}

// neitherAdmits reports, for the cost metric, that neither candidate takes the request (both priced
// +Inf): power_of_two then looks for one that does in a window.
func neitherAdmits(metric Metric, a, b *Candidate) bool {
	return metric.cost && math.IsInf(a.Cost, 1) && math.IsInf(b.Cost, 1)
}

// cheapest returns the priced candidate of least cost among count candidates from start on (wrapping
// at n), ties broken at random; (-1, false) when none is priced.
func cheapest(start, count, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	best, ties := -1, 0
	var bestCost float64
	for k := range count {
		i := start + k
		if i >= n {
			i -= n
		}
		c, ok := at(i)
		if !ok || !c.Priced() {
			continue
		}
		if best < 0 {
			best, bestCost, ties = i, c.Cost, 1
			continue
		}
		switch compareFloat(c.Cost, bestCost) {
		case -1:
			best, bestCost, ties = i, c.Cost, 1
		case 0:
			ties++
			if intn(ties) == 0 {
				best = i
			}
		}
	}
	return best, best >= 0
}

// least takes the best candidate in one pass while the candidates with loads share the first one's
// signals, as in a fleet of one SGLang version; when one offers fewer, the comparison so far used signals
// not every candidate has, and leastTwoPass starts again on the common ones.
func least(metric Metric, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	return leastOn(metric, 0, n, at, intn)
}

// leastTwoPass finds the signals every candidate with loads shares, then the best on those.
func leastTwoPass(metric Metric, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
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
	return leastOn(metric, common, n, at, intn)
}

// leastOn is least comparing on the signals in common, or, when common is 0, on those the first
// candidate with loads offers (handing over to leastTwoPass when a later one offers fewer). Most
// candidates cost one score: one clearly above the best on the most precise signal is passed over, and
// only a near tie there compares the next signals.
func leastOn(metric Metric, common SignalSet, n int, at func(int) (Candidate, bool), intn func(int) int) (int, bool) {
	learn := common == 0
	var first Signal
	if !learn {
		first, _ = common.First()
	}
	var bestC Candidate
	best, ties := -1, 0
	var bestScore, worse float64
	for i := range n {
		c, ok := at(i)
		if !ok || !metric.Usable(c.Signals) {
			continue
		}
		switch {
		case learn && best < 0:
			if common = metric.Common(metric.AllSignals(), c.Signals); common == 0 {
				return -1, false
			}
			first, _ = common.First()
		case learn && c.Signals.Set&common != common:
			return leastTwoPass(metric, n, at, intn)
		}
		score := c.Signals.Score(first, c.Extra+1)
		cmp := -1
		if best >= 0 {
			if score > worse {
				continue
			}
			if cmp = compareFloat(score, bestScore); cmp == 0 {
				tied := c // the next signals decide
				cmp = Compare(&tied, &bestC, common&^(1<<first))
			}
		}
		switch {
		case cmp < 0:
			ties = 1
		case cmp == 0:
			// Reservoir sampling among equals, so ties do not always favour the first upstream.
			ties++
			if intn(ties) != 0 {
				continue
			}
		default:
			continue
		}
		best, bestScore, bestC = i, score, c
		// Above this, compareFloat would find a score worse than the best's: see clearlyAbove.
		worse = clearlyAbove(bestScore)
	}
	return best, best >= 0
}

// clearlyAbove is a bound above which every value compares as greater than x by compareFloat: from
// a > x + 2e-9|x| follows a - x > 1e-9 max(|a|, |x|).
func clearlyAbove(x float64) float64 { return x + 2e-9*math.Abs(x) }

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
		if !metric.usable(&a) && !metric.usable(&b) {
			break // only a full pass can tell whether any candidate has loads, or the caller falls back
		}
		if neitherAdmits(metric, &a, &b) {
			return window(n, at, intn)
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
		if metric.usable(&c) {
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
	case neitherAdmits(metric, &cand[0], &cand[1]):
		return window(n, at, intn)
	}
	return better(metric, pick, &cand[0], &cand[1], intn), true
}

// better returns the index in pick of the better of the pair a, b; a tie is broken at random.
func better(metric Metric, pick [2]int, a, b *Candidate, intn func(int) int) int {
	if metric.cost {
		c := 0
		if a.Priced() && b.Priced() {
			c = compareFloat(a.Cost, b.Cost)
		} else if a.Priced() != b.Priced() {
			c = compareInt(a.Inflight, b.Inflight)
		}
		switch c {
		case -1:
			return pick[0]
		case 1:
			return pick[1]
		}
		return pick[intn(2)]
	}
	set := metric.AllSignals()
	if a.Signals != nil && b.Signals != nil {
		set = metric.Common(metric.Common(set, a.Signals), b.Signals)
	}
	if c := Compare(a, b, set); c != 0 {
		return pick[isTrue(c > 0)]
	}
	return pick[intn(2)]
}
