package sglangsim

import (
	"fmt"
	"math"
	"testing"
	"time"
)

// The default step costs, written out (Llama-3.1-8B-Instruct on one H100, step.go), so the tests below
// compute their times by hand rather than through the code they test.
const (
	base    = 0.006 // s a pass
	perTok  = 30e-6 // s a prefilled token
	attn    = 1e-9  // s a prefilled token per token of context
	perReq  = 20e-6 // s a decoding request
	perKV   = 49e-9 // s a KV token read
	hostTPS = 190000.0
)

// prefillPass is a pass that prefills a chunk of n tokens after ctx tokens of its prompt.
func prefillPass(n, ctx float64) float64 { return base + perTok*n + attn*n*(ctx+n/2) }

// decodePass is a pass that decodes n requests reading kv KV tokens in all.
func decodePass(n int, kv float64) float64 { return base + perReq*float64(n) + perKV*kv }

func TestStepSeconds(t *testing.T) {
	cfg := Config{Timing: TimingStep}.withDefaults()
	fast := Config{Timing: TimingStep, Speed: 2}.withDefaults()
	cases := []struct {
		name string
		cfg  Config
		work stepWork
		want float64
	}{
		{"lone prefill of 8192", cfg, stepWork{prefill: 8192, attention: 8192 * 4096}, 0.006 + 0.24576 + 0.033554432},
		{"a chunk of 8192 after 90000 cached", cfg, stepWork{prefill: 8192, attention: 8192 * (90000 + 4096)}, 0.006 + 0.24576 + 0.770834432},
		{"lone decode at 1000 context", cfg, stepWork{decodes: 1, kv: 1000}, 0.006 + 0.00002 + 0.000049},
		{"32 decoding at 8192 context", cfg, stepWork{decodes: 32, kv: 32 * 8192}, 0.006 + 0.00064 + 0.012845056},
		{"twice as fast", fast, stepWork{decodes: 32, kv: 32 * 8192}, (0.006 + 0.00064 + 0.012845056) / 2},
		{"bound by a host load", cfg, stepWork{prefill: 16, attention: 16 * 8, load: 190000}, 1},
		{"host load beside compute", cfg, stepWork{prefill: 8192, attention: 8192 * 4096, load: 19000}, 0.285314432},
	}
	for _, c := range cases {
		if got := c.cfg.stepSeconds(c.work); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%s: %.12f s, want %.12f", c.name, got, c.want)
		}
	}
}

// clock drives a hand-driven worker's model in ticks of the real loop's length.
type clock struct {
	w   *Worker
	now time.Time
}

// to advances the model to t, tick by tick.
func (c *clock) to(t time.Time) {
	for c.now.Before(t) {
		c.now = earlier(c.now.Add(tickEvery), t)
		c.w.step(c.now)
	}
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// at is start plus s seconds.
func at(start time.Time, s float64) time.Time {
	return start.Add(time.Duration(s * float64(time.Second)))
}

// near fails unless got is within a microsecond of want (passes end on whole nanoseconds).
func near(t *testing.T, what string, got, want time.Time) {
	t.Helper()
	if d := got.Sub(want); d < -time.Microsecond || d > time.Microsecond {
		t.Errorf("%s at %v, want %v (off by %v)", what, got.Format("05.000000"), want.Format("05.000000"), d)
	}
}

// A lone request: its prompt's pass, then one pass per token, each reading one more token of KV.
func TestStepLoneRequest(t *testing.T) {
	w, start := handDriven(t, Config{Timing: TimingStep})
	defer handBack(w)
	r := queueByHand(w, sized(3000, 3), start)
	w.admit(w.ranks[0], start)
	c := &clock{w, start}
	first := prefillPass(3000, 0)
	second := first + decodePass(1, 3001)
	third := second + decodePass(1, 3002)
	c.to(at(start, second-1e-4))
	if r.emitted.Load() != 1 {
		t.Fatalf("before its second pass ends: %d tokens, want 1", r.emitted.Load())
	}
	c.to(at(start, third+0.01))
	near(t, "first token", r.firstToken, at(start, first))
	near(t, "finished", r.finished, at(start, third))
	if r.state != stateDone || r.emitted.Load() != 3 {
		t.Fatalf("state %d, %d tokens", r.state, r.emitted.Load())
	}
	l := w.loadsLocked(c.now)[0]
	if l.PrefillUncachedTokens != 3000 || l.PrefillBusyMicros != int64(math.Round(first*1e6)) {
		t.Errorf("prefill counters %d tokens in %d us, want 3000 in %.0f", l.PrefillUncachedTokens, l.PrefillBusyMicros, first*1e6)
	}
}

// A long prompt is prefilled in chunks of ChunkedPrefillSize, each attending to the chunks before it.
// Each pass is longer than a tick (at Speed 0.25, longer than the second one step of the clock may
// cover), and the model ends every pass at the same moment whether the clock ticks every 5 ms or in
// coarse steps.
func TestStepChunkedPrompt(t *testing.T) {
	for _, speed := range []float64{1, 0.25} {
		// 20000 tokens: chunks of 8192, 8192 and 3616.
		chunks := []float64{
			prefillPass(8192, 0) / speed,
			prefillPass(8192, 8192) / speed,
			prefillPass(3616, 16384) / speed,
		}
		first := chunks[0] + chunks[1] + chunks[2]
		for _, tick := range []time.Duration{tickEvery, 700 * time.Millisecond, time.Second} {
			t.Run(fmt.Sprintf("speed %g tick %v", speed, tick), func(t *testing.T) {
				w, start := handDriven(t, Config{Timing: TimingStep, Speed: speed})
				defer handBack(w)
				r := queueByHand(w, sized(20000, 2), start)
				w.admit(w.ranks[0], start)
				now := start
				step := func(to time.Time) {
					for now.Before(to) {
						now = earlier(now.Add(tick), to)
						w.step(now)
					}
				}
				step(at(start, chunks[0]+0.001))
				if l := w.loadsLocked(now)[0]; r.prefillLeft != 11808 || l.PrefillUncachedTokens != 8192 ||
					l.PrefillBusyMicros != int64(math.Round(chunks[0]*1e6)) || l.Running != 1 {
					t.Fatalf("after the first chunk %v tokens left, counters %d tokens %d us, running %d",
						r.prefillLeft, l.PrefillUncachedTokens, l.PrefillBusyMicros, l.Running)
				}
				done := first + decodePass(1, 20001)/speed
				step(at(start, done+0.01))
				near(t, "first token", r.firstToken, at(start, first))
				near(t, "finished", r.finished, at(start, done))
				if l := w.loadsLocked(now)[0]; l.PrefillUncachedTokens != 20000 || l.PrefillBusyMicros != int64(math.Round(first*1e6)) {
					t.Errorf("counters %d tokens %d us, want 20000 in %.0f", l.PrefillUncachedTokens, l.PrefillBusyMicros, first*1e6)
				}
			})
		}
	}
}

// A batch of 32 decoding requests at 8192 tokens of context each: every pass reads all their KV.
func TestStepDecodeBatch(t *testing.T) {
	w, start := handDriven(t, Config{Timing: TimingStep, MaxTotalTokens: 1 << 20})
	defer handBack(w)
	var reqs []*request
	for range 32 {
		reqs = append(reqs, queueByHand(w, sized(8191, 3), start))
	}
	w.admit(w.ranks[0], start)
	// 32 × 8191 = 262112 prompt tokens in passes of 8192: each pass cuts a prompt where its budget
	// ends and the next goes on with it; a chunk attends to its own prompt's earlier chunks.
	var prefill float64
	left := make([]float64, 32)
	for i := range left {
		left[i] = 8191
	}
	for i := 0; i < 32; {
		pass, budget := base, 8192.0
		for i < 32 && budget > 0 {
			n := math.Min(budget, left[i])
			pass += perTok*n + attn*n*((8191-left[i])+n/2)
			left[i] -= n
			budget -= n
			if left[i] == 0 {
				i++
			}
		}
		prefill += pass
	}
	c := &clock{w, start}
	c.to(at(start, prefill+1e-4))
	for i, r := range reqs {
		if r.emitted.Load() != 1 {
			t.Fatalf("request %d: %d tokens after the prefill passes, want 1", i, r.emitted.Load())
		}
	}
	step := decodePass(32, 32*8192)
	c.to(at(start, prefill+step-1e-4))
	if reqs[0].emitted.Load() != 1 {
		t.Fatalf("a token before the decode pass ended")
	}
	c.to(at(start, prefill+step+1e-4))
	for i, r := range reqs {
		if r.emitted.Load() != 2 {
			t.Fatalf("request %d: %d tokens after one decode pass, want 2", i, r.emitted.Load())
		}
	}
	c.to(at(start, prefill+step+decodePass(32, 32*8193)+1e-4))
	for i, r := range reqs {
		if r.state != stateDone {
			t.Fatalf("request %d not done", i)
		}
		near(t, "finished", r.finished, at(start, prefill+step+decodePass(32, 32*8193)))
	}
}

// A prefill pass stalls decoding, as SGLang's default scheduler runs it; with MixedChunk the decode
// batch rides in the prefill pass.
func TestStepPrefillStallsDecode(t *testing.T) {
	for _, mixed := range []bool{false, true} {
		t.Run(fmt.Sprintf("mixed %t", mixed), func(t *testing.T) { stallsDecode(t, mixed) })
	}
}

func stallsDecode(t *testing.T, mixed bool) {
	w, start := handDriven(t, Config{Timing: TimingStep, MixedChunk: mixed})
	defer handBack(w)
	a := queueByHand(w, sized(100, 50), start)
	w.admit(w.ranks[0], start)
	c := &clock{w, start}
	t1 := prefillPass(100, 0)
	c.to(at(start, t1)) // a's prefill pass ends exactly here: a has its first token
	b := queueByHand(w, sized(8000, 5), c.now)
	w.admit(w.ranks[0], c.now)
	var aNext, bFirst float64 // when a's second token and b's first come
	if mixed {
		bFirst = t1 + prefillPass(8000, 0) + perReq + perKV*101
		aNext = bFirst
	} else {
		bFirst = t1 + prefillPass(8000, 0)
		aNext = bFirst + decodePass(2, 101+8001)
	}
	c.to(at(start, aNext-1e-4))
	if a.emitted.Load() != 1 {
		t.Errorf("mixed %t: a has %d tokens before its next pass ends, want 1", mixed, a.emitted.Load())
	}
	c.to(at(start, aNext+1e-4))
	if a.emitted.Load() != 2 {
		t.Errorf("mixed %t: a has %d tokens after its next pass, want 2", mixed, a.emitted.Load())
	}
	near(t, "b's first token", b.firstToken, at(start, bFirst))
}

// A pass that decodes nothing starts when its request arrives, not at the tick before.
func TestStepStartsOnArrival(t *testing.T) {
	w, start := handDriven(t, Config{Timing: TimingStep})
	defer handBack(w)
	c := &clock{w, start}
	c.to(at(start, 0.002))
	arrive := at(start, 0.003)
	r := queueByHand(w, sized(1000, 1), arrive)
	w.admit(w.ranks[0], arrive)
	c.to(at(start, 0.5))
	near(t, "first token", r.firstToken, at(start, 0.003+prefillPass(1000, 0)))
	if l := w.loadsLocked(c.now)[0]; math.Abs(l.Utilization-prefillPass(1000, 0)) > 1e-4 {
		t.Errorf("utilization %v, want the pass's %v s of the last second", l.Utilization, prefillPass(1000, 0))
	}
}

// gen_throughput reports the tokens the passes decode over the last second.
func TestStepGenThroughput(t *testing.T) {
	w, start := handDriven(t, Config{Timing: TimingStep})
	defer handBack(w)
	r := queueByHand(w, sized(1000, 2000), start)
	w.admit(w.ranks[0], start)
	c := &clock{w, start}
	c.to(at(w.start, 2.0999)) // the window's ten 100 ms buckets end here: it covers a whole second
	// About 6.1 ms a token at 1000..1330 tokens of context.
	got, want := w.loadsLocked(c.now)[0].GenThroughput, 1/decodePass(1, 1165)
	if math.Abs(got-want) > 0.02*want {
		t.Errorf("gen_throughput %v, want %v within 2%%", got, want)
	}
	if r.emitted.Load() < 300 {
		t.Errorf("%d tokens in 2 s", r.emitted.Load())
	}
}

// Over HTTP, a step-model worker's prefill counters give the prefill speed its passes ran at, and
// Speed scales it.
func TestStepPrefillCountersOverHTTP(t *testing.T) {
	_, base := startWorker(t, Config{Name: "step", Timing: TimingStep, Speed: 20})
	before := loads(t, base)
	g := postGenerate(t, base, gen(8192, 4))
	after := loads(t, base)
	if g.MetaInfo.CompletionTokens != 4 {
		t.Fatalf("answer %+v", g.MetaInfo)
	}
	tokens := *after.TotalPrefillUncached - *before.TotalPrefillUncached
	busy := *after.TotalPrefillBusyUs - *before.TotalPrefillBusyUs
	if want := int64(math.Round(prefillPass(8192, 0) / 20 * 1e6)); tokens != 8192 || busy != want {
		t.Fatalf("%d tokens in %d us, want 8192 in %d", tokens, busy, want)
	}
}

// The cost of one tick of the step model with a full batch of 64 decoding requests: about one pass.
func BenchmarkStepTick(b *testing.B) {
	for _, timing := range []Timing{TimingLinear, TimingStep} {
		b.Run(timing.String(), func(b *testing.B) {
			w := New(Config{Timing: timing, MaxTotalTokens: 1 << 23, PrefillTokensPerSec: 1e9, DecodeTokensPerSec: 150})
			w.mu.Lock()
			defer w.mu.Unlock()
			now := time.Now()
			w.last = now
			for range 64 {
				queueByHand(w, sized(2000, 1<<16), now)
			}
			w.admit(w.ranks[0], now)
			for range 100 { // prefilled, decoding
				now = now.Add(tickEvery)
				w.step(now)
			}
			if n := len(w.ranks[0].running); n != 64 {
				b.Fatalf("%d running", n)
			}
			b.ReportAllocs()
			for b.Loop() {
				now = now.Add(tickEvery)
				w.step(now)
			}
		})
	}
}
