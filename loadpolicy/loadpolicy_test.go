package loadpolicy

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

const allCore = FieldRunning | FieldWaiting | FieldWaitingUncachedTokens | FieldUsedTokens | FieldTotalTokens |
	FieldMaxTotalTokens | FieldMaxRunning | FieldTokenUsage | FieldGenThroughput

func rank(running, waiting, queued, used, capacity int64, usage, throughput float64) Rank {
	return Rank{Running: running, Waiting: waiting, WaitingUncachedTokens: queued, UsedTokens: used,
		MaxTotalTokens: capacity, MaxRunning: 64, TokenUsage: usage, GenThroughput: throughput, Fields: allCore}
}

func TestNewReportSumsInInt64(t *testing.T) {
	ranks := make([]Rank, 64)
	for i := range ranks {
		ranks[i] = rank(1, 0, 0, 2_000_000_000, 2_100_000_000, 0.95, 1)
	}
	r := NewReport(time.Now(), "", ranks)
	if want := int64(64 * 2_000_000_000); r.UsedTokens != want {
		t.Fatalf("UsedTokens = %d, want %d", r.UsedTokens, want)
	}
	if r.UsedTokens < 0 {
		t.Fatal("overflow")
	}
}

func TestNewReportSanitises(t *testing.T) {
	r := NewReport(time.Now(), "", []Rank{
		{Running: -3, TokenUsage: math.NaN(), GenThroughput: math.Inf(1), UsedTokens: 10,
			Fields: FieldRunning | FieldTokenUsage | FieldGenThroughput | FieldUsedTokens},
	})
	rk := r.Ranks[0]
	if rk.Has(FieldRunning) || rk.Has(FieldTokenUsage) || rk.Has(FieldGenThroughput) || !rk.Has(FieldUsedTokens) {
		t.Fatalf("fields after sanitising = %b", rk.Fields)
	}
	s := r.Signals()
	if s.Set.Has(Running) || s.Set.Has(TokenUsage) || !s.Set.Has(UsedTokens) {
		t.Fatalf("signals = %b", s.Set)
	}
	over := NewReport(time.Now(), "", []Rank{{TokenUsage: 1e9, Fields: FieldTokenUsage}})
	if over.MaxTokenUsage != maxTokenUsage {
		t.Fatalf("token_usage above 1 capped to %v, want %v", over.MaxTokenUsage, maxTokenUsage)
	}
}

// The lifetime prefill speed is one rank's: the ranks' prefilled tokens over their busy time summed, and
// none where a rank lacks the counters, sent a negative one, or prefill has been busy too briefly.
func TestLifetimePrefillPerRank(t *testing.T) {
	counters := func(tokens, busyUS int64) Rank {
		return Rank{PrefillUncachedTokens: tokens, PrefillBusyUS: busyUS, Fields: FieldPrefillCounters}
	}
	tests := []struct {
		name  string
		ranks []Rank
		want  float64
	}{
		{"one rank", []Rank{counters(8000, 2e6)}, 4000},
		{"two ranks, each busy its share", []Rank{counters(12000, 1e6), counters(4000, 1e6)}, 8000},
		{"a rank without counters", []Rank{counters(8000, 2e6), {}}, 0},
		{"a negative counter", []Rank{counters(-1, 2e6)}, 0},
		{"busy less than minPrefillBusy", []Rank{counters(80, minPrefillBusy.Microseconds()-1)}, 0},
		{"busy minPrefillBusy", []Rank{counters(80, minPrefillBusy.Microseconds())}, 4000},
		{"no ranks", nil, 0},
	}
	for _, tt := range tests {
		if got := NewReport(time.Now(), "", tt.ranks).LifetimePrefillPerRank; got != tt.want {
			t.Errorf("%s: LifetimePrefillPerRank = %g, want %g", tt.name, got, tt.want)
		}
	}
}

func TestSignals(t *testing.T) {
	tests := []struct {
		name  string
		ranks []Rank
		want  map[Signal]float64
		lacks []Signal
	}{
		{
			name:  "all core fields",
			ranks: []Rank{rank(10, 4, 2000, 40000, 100000, 0.4, 500)},
			want:  map[Signal]float64{QueuedTokens: 4, TokenLatency: 0.02, TokenUsage: 0.4, UsedTokens: 40000, Waiting: 4, Running: 10},
		},
		{
			name:  "token latency: running over the throughput summed over ranks",
			ranks: []Rank{rank(6, 0, 0, 10, 100, 0.1, 100), rank(2, 0, 0, 10, 100, 0.1, 300)},
			want:  map[Signal]float64{TokenLatency: 0.02, Running: 8},
		},
		{
			name:  "just drained: no running request, decoded lately",
			ranks: []Rank{rank(0, 0, 0, 0, 100, 0, 50)},
			want:  map[Signal]float64{TokenLatency: 0},
		},
		{
			name:  "idle for a while: no throughput, no latency",
			ranks: []Rank{rank(0, 0, 0, 0, 100, 0, 0)},
			want:  map[Signal]float64{TokenUsage: 0, Running: 0},
			lacks: []Signal{TokenLatency},
		},
		{
			name:  "no gen_throughput field: no latency",
			ranks: []Rank{{Running: 4, UsedTokens: 10, Fields: FieldRunning | FieldUsedTokens}},
			want:  map[Signal]float64{Running: 4},
			lacks: []Signal{TokenLatency},
		},
		{
			name:  "hottest rank, not the average",
			ranks: []Rank{rank(1, 0, 0, 10, 100, 0.1, 1), rank(1, 0, 0, 90, 100, 0.9, 1)},
			want:  map[Signal]float64{TokenUsage: 0.9, UsedTokens: 100},
		},
		{
			name:  "usage from used and capacity when token_usage is absent",
			ranks: []Rank{{UsedTokens: 250, MaxTotalTokens: 1000, Fields: FieldUsedTokens | FieldMaxTotalTokens}},
			want:  map[Signal]float64{TokenUsage: 0.25, UsedTokens: 250},
			lacks: []Signal{QueuedTokens, Waiting, Running},
		},
		{
			name: "a field one rank lacks is no signal",
			ranks: []Rank{rank(1, 1, 1, 1, 10, 0.1, 1),
				{Running: 1, TokenUsage: 0.2, Fields: FieldRunning | FieldTokenUsage}},
			want:  map[Signal]float64{TokenUsage: 0.2, Running: 2},
			lacks: []Signal{QueuedTokens, UsedTokens, Waiting},
		},
		{
			name:  "old servers without queued tokens",
			ranks: []Rank{{Running: 3, Waiting: 1, Fields: FieldRunning | FieldWaiting}},
			want:  map[Signal]float64{Waiting: 1, Running: 3},
			lacks: []Signal{QueuedTokens, TokenUsage, UsedTokens},
		},
		{
			name:  "no ranks: no signals",
			lacks: []Signal{QueuedTokens, TokenLatency, TokenUsage, UsedTokens, Waiting, Running},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := NewReport(time.Now(), "", tt.ranks).Signals()
			for sig, want := range tt.want {
				if !s.Set.Has(sig) {
					t.Errorf("%s missing", sig)
				} else if got := s.Value[sig]; math.Abs(got-want) > 1e-9 {
					t.Errorf("%s = %v, want %v", sig, got, want)
				}
			}
			for _, sig := range tt.lacks {
				if s.Set.Has(sig) {
					t.Errorf("%s present, want absent", sig)
				}
			}
		})
	}
}

func TestInflightCorrectionCosts(t *testing.T) {
	s := NewReport(time.Now(), "", []Rank{rank(10, 2, 1000, 20000, 100000, 0.2, 100)}).Signals()
	// 2000 tokens per running request over a 100000-token pool: each extra request adds 0.02 usage.
	if got := s.Score(TokenUsage, 5); math.Abs(got-0.3) > 1e-9 {
		t.Errorf("token usage with 5 extra = %v, want 0.3", got)
	}
	if got := s.Score(Waiting, 3); got != 5 {
		t.Errorf("waiting with 3 extra = %v, want 5", got)
	}
	// 500 queued tokens per waiting request at 100 tokens/s: 5 s per extra request.
	if got := s.Score(QueuedTokens, 1); math.Abs(got-15) > 1e-9 {
		t.Errorf("queued with 1 extra = %v, want 15", got)
	}
	// 10 running at 100 tokens/s: 0.1 s per token, and one more request shares the same 100 tokens/s.
	if got := s.Score(TokenLatency, 5); math.Abs(got-0.15) > 1e-9 {
		t.Errorf("token latency with 5 extra = %v, want 0.15", got)
	}
	drained := NewReport(time.Now(), "", []Rank{rank(0, 0, 0, 0, 100000, 0, 50)}).Signals()
	if got := drained.Score(TokenLatency, 2); math.Abs(got-0.04) > 1e-9 {
		t.Errorf("token latency of a drained worker with 2 extra = %v, want 0.04", got)
	}
	idle := NewReport(time.Now(), "", []Rank{rank(0, 0, 0, 0, 100000, 0, 0)}).Signals()
	if idle.Cost[TokenUsage] <= 0 {
		t.Error("an idle worker must still price extra requests, or it would draw every request until the next poll")
	}
}

func cand(usage float64, waiting int64, extra, inflight int64) Candidate {
	return Candidate{Signals: NewReport(time.Now(), "", []Rank{rank(1, waiting, 0, int64(usage*1000), 1000, usage, 1)}).Signals(),
		Extra: extra, Inflight: inflight}
}

// decoding is a candidate with running requests decoding at throughput tokens/s in total.
func decoding(usage float64, running int64, throughput float64, extra ...int64) Candidate {
	c := Candidate{Signals: NewReport(time.Now(), "", []Rank{rank(running, 0, 0, int64(usage*1000), 1000, usage, throughput)}).Signals()}
	for _, e := range extra {
		c.Extra += e
	}
	return c
}

// idleWorker is a candidate whose report shows nothing running, with room for maxRunning requests.
func idleWorker(maxRunning int64) Candidate {
	rk := rank(0, 0, 0, 0, 1000*maxRunning, 0, 0)
	rk.MaxRunning = maxRunning
	return Candidate{Signals: NewReport(time.Now(), "", []Rank{rk}).Signals()}
}

func TestCompare(t *testing.T) {
	oldServer := Candidate{Signals: NewReport(time.Now(), "", []Rank{{Running: 0, Waiting: 0, Fields: FieldRunning | FieldWaiting}}).Signals()}
	tests := []struct {
		name string
		a, b Candidate
		set  SignalSet
		want int
	}{
		{"lower usage wins", cand(0.2, 0, 0, 9), cand(0.5, 0, 0, 0), MetricAuto.set, -1},
		{"extra requests count", cand(0.2, 0, 40, 0), cand(0.5, 0, 0, 0), MetricAuto.set, 1},
		{"tie on usage broken by waiting", cand(0.5, 3, 0, 0), cand(0.5, 1, 0, 0), MetricAuto.set, 1},
		{"full tie broken by in-flight", cand(0.5, 1, 0, 2), cand(0.5, 1, 0, 1), MetricAuto.set, 1},
		{"exact tie", cand(0.5, 1, 0, 1), cand(0.5, 1, 0, 1), MetricAuto.set, 0},
		{"missing loads: in-flight only", Candidate{Inflight: 1}, cand(0.9, 9, 0, 3), MetricAuto.set, -1},
		{"slow worker loses although its pool is emptier", decoding(0.1, 4, 100), decoding(0.5, 20, 1600), MetricAuto.set, 1},
		{"fast worker loses once extra requests slow it down", decoding(0.5, 20, 1600, 60), decoding(0.1, 4, 100), MetricAuto.set, 1},
		{"idle workers: the one a request weighs less on wins", idleWorker(16), idleWorker(64), MetricAuto.set, 1},
		{"nothing in common: in-flight only", oldServer, cand(0.9, 9, 0, 3), 1 << TokenUsage, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Compare(&tt.a, &tt.b, tt.set); got != tt.want {
				t.Errorf("Compare = %d, want %d", got, tt.want)
			}
			if got := Compare(&tt.b, &tt.a, tt.set); got != -tt.want {
				t.Errorf("Compare reversed = %d, want %d", got, -tt.want)
			}
		})
	}
}

type fixedRand struct{ seq []int }

func (f *fixedRand) intn(n int) int {
	if len(f.seq) == 0 {
		return 0
	}
	v := f.seq[0] % n
	f.seq = f.seq[1:]
	return v
}

func TestChoose(t *testing.T) {
	loads := []Candidate{cand(0.9, 0, 0, 0), cand(0.1, 0, 0, 0), cand(0.5, 0, 0, 0)}
	tests := []struct {
		name      string
		choice    Choice
		avail     []bool
		cands     []Candidate
		rnd       []int
		want      int
		wantLoads bool
	}{
		{"least picks the minimum", Least, []bool{true, true, true}, loads, nil, 1, true},
		{"least skips unavailable", Least, []bool{true, false, true}, loads, nil, 2, true},
		{"nothing available", Least, []bool{false, false, false}, loads, nil, -1, false},
		{"no loads: fall back", Least, []bool{true, true}, []Candidate{{}, {}}, nil, -1, false},
		// The pair is k/(n-1), k%(n-1) for k = intn(n*(n-1)), the second shifted past the first.
		{"p2c keeps the better of the pair", PowerOfTwo, []bool{true, true, true}, loads, []int{5}, 1, true},
		{"p2c pair without the best", PowerOfTwo, []bool{true, true, true}, loads, []int{4}, 2, true},
		{"p2c redraws past an unavailable one", PowerOfTwo, []bool{true, false, true}, loads, []int{2, 1}, 2, true},
		// A drawn pair without loads leads to a full pass, which finds that one has loads and samples
		// (0, 2); without common signals they compare on in-flight requests: 2 wins.
		{"p2c pair without loads scans", PowerOfTwo, []bool{true, true, true}, []Candidate{{Inflight: 1}, {}, loads[2]},
			[]int{0, 1}, 2, true},
		{"p2c single available", PowerOfTwo, []bool{false, false, true}, loads, nil, 2, true},
		{"p2c nothing available", PowerOfTwo, []bool{false, false, false}, loads, nil, -1, false},
		{"p2c no loads: fall back", PowerOfTwo, []bool{true, true}, []Candidate{{}, {}}, nil, -1, false},
	}
	// The first candidate offers token_latency, the second token usage only, the third is the fastest
	// decoder: least may compare only on usage, which the second wins.
	usageOnly := Candidate{Signals: NewReport(time.Now(), "", []Rank{{TokenUsage: 0.1, Fields: FieldTokenUsage}}).Signals()}
	tests = append(tests, struct {
		name      string
		choice    Choice
		avail     []bool
		cands     []Candidate
		rnd       []int
		want      int
		wantLoads bool
	}{"least narrows to the signals all share", Least, []bool{true, true, true},
		[]Candidate{decoding(0.9, 4, 100), usageOnly, decoding(0.5, 1, 1000)}, nil, 1, true})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fixedRand{seq: tt.rnd}
			got, byLoad := Choose(tt.choice, MetricAuto, len(tt.avail), func(i int) (Candidate, bool) {
				return tt.cands[i], tt.avail[i]
			}, r.intn)
			if got != tt.want || byLoad != tt.wantLoads {
				t.Errorf("Choose = (%d, %v), want (%d, %v)", got, byLoad, tt.want, tt.wantLoads)
			}
		})
	}
}

func TestPowerOfTwoNeverPicksTheWorst(t *testing.T) {
	loads := []Candidate{cand(0.9, 0, 0, 0), cand(0.1, 0, 0, 0), cand(0.5, 0, 0, 0), cand(0.3, 0, 0, 0)}
	counts := make([]int, len(loads))
	rnd := rand.New(rand.NewPCG(1, 2))
	for range 4000 {
		i, _ := Choose(PowerOfTwo, MetricAuto, len(loads), func(i int) (Candidate, bool) { return loads[i], true }, rnd.IntN)
		counts[i]++
	}
	if counts[0] != 0 {
		t.Errorf("the most loaded was picked %d times", counts[0])
	}
	if !(counts[1] > counts[3] && counts[3] > counts[2]) {
		t.Errorf("shares not ordered by load: %v", counts)
	}
}

func TestParse(t *testing.T) {
	for _, name := range []string{"", "auto", "queued_tokens", "token_latency", "token_usage", "used_tokens", "waiting", "running"} {
		if _, err := ParseMetric(name); err != nil {
			t.Errorf("ParseMetric(%q): %v", name, err)
		}
	}
	if _, err := ParseMetric("tokens"); err == nil || !strings.Contains(err.Error(), `"tokens"`) {
		t.Errorf("ParseMetric(tokens) error = %v, want one naming the value", err)
	}
	if c, err := ParseChoice("least"); err != nil || c != Least {
		t.Errorf("ParseChoice(least) = %v, %v", c, err)
	}
	if _, err := ParseChoice("p2c"); err == nil || !strings.Contains(err.Error(), `"p2c"`) {
		t.Errorf("ParseChoice(p2c) error = %v, want one naming the value", err)
	}
}

func TestPowerOfTwoSamplesOnlyAvailable(t *testing.T) {
	const n = 100
	loads := make([]Candidate, n)
	for i := range loads {
		loads[i] = cand(float64(i)/n, 0, 0, 0)
	}
	rnd := rand.New(rand.NewPCG(3, 4))
	seen := make(map[int]bool)
	for range 5000 {
		// Only every tenth candidate is available: most draws miss, some fall back to a full pass.
		i, byLoad := Choose(PowerOfTwo, MetricAuto, n, func(i int) (Candidate, bool) { return loads[i], i%10 == 0 }, rnd.IntN)
		if i%10 != 0 || !byLoad {
			t.Fatalf("Choose = (%d, %v), want an available candidate chosen by load", i, byLoad)
		}
		seen[i] = true
	}
	if seen[90] || len(seen) != 9 {
		t.Errorf("chosen %v: want every available candidate but the most loaded (90)", seen)
	}
}

// TestLeastBeatsEveryCandidate checks least's shortcut (passing over a candidate clearly worse on the
// most precise signal) against the full comparison: on pools full of ties, no candidate may beat the
// chosen one, and every candidate tied with the best is chosen sometimes.
func TestLeastBeatsEveryCandidate(t *testing.T) {
	rnd := rand.New(rand.NewPCG(5, 6))
	for round := range 300 {
		n := 1 + rnd.IntN(40)
		cands := make([]Candidate, n)
		for i := range cands {
			// Few distinct values, so that most candidates tie on the first signals.
			waiting := int64(rnd.IntN(3))
			cands[i] = Candidate{Signals: NewReport(time.Now(), "", []Rank{rank(1+int64(rnd.IntN(3)), waiting, waiting*100,
				int64(rnd.IntN(3))*100, 1000, float64(rnd.IntN(3))/10, 50)}).Signals(), Extra: int64(rnd.IntN(2)), Inflight: int64(rnd.IntN(2))}
		}
		set := MetricAuto.AllSignals()
		for i := range cands {
			set = MetricAuto.Common(set, cands[i].Signals)
		}
		chosen := make(map[int]bool)
		for range 200 {
			i, ok := Choose(Least, MetricAuto, n, func(i int) (Candidate, bool) { return cands[i], true }, rnd.IntN)
			if !ok {
				t.Fatalf("round %d: nothing chosen", round)
			}
			for j := range cands {
				if Compare(&cands[j], &cands[i], set) < 0 {
					t.Fatalf("round %d: chose %d, but %d is better", round, i, j)
				}
			}
			chosen[i] = true
		}
		for j := range cands {
			best := -1
			for i := range chosen {
				best = i
			}
			if Compare(&cands[j], &cands[best], set) == 0 && !chosen[j] && len(chosen) < 8 {
				t.Errorf("round %d: %d ties with the best but was never chosen in 200 draws", round, j)
			}
		}
	}
}
