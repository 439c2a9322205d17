package loadpolicy

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

const coreFields = FieldRunning | FieldWaiting | FieldWaitingUncachedTokens | FieldUsedTokens |
	FieldMaxTotalTokens | FieldMaxRunning | FieldGenThroughput

// worker is one rank with every core field sent.
func worker(running, waiting, uncached, used, capacity, maxRunning int64, gen float64) Rank {
	return Rank{Running: running, Waiting: waiting, WaitingUncachedTokens: uncached, UsedTokens: used,
		MaxTotalTokens: capacity, MaxRunning: maxRunning, GenThroughput: gen, Fields: coreFields}
}

// perRequest is the decode speed at batch of a worker whose requests decode at alone tokens/s each
// in a batch of one, halving at 16 more.
func perRequest(alone float64, batch int) float64 { return alone / (1 + float64(batch-1)/16) }

func TestCost(t *testing.T) {
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 16, MeanOutputTokens: 100}
	// 4 running at 200 tok/s: 50 each at batch 4, so 50 x (1 + 3/16) alone (a reading is carried to a
	// batch of one at the worker's halving, DecodeBatchHalving, and from there to the batch the
	// request joins).
	busyAlone := 50 * (1 + 3.0/16)
	meanBatch := (4 + 2*math.Sqrt(0.5)) / (1 + math.Sqrt(0.5)) // of "decode readings summed"
	busy := worker(4, 0, 0, 4000, 10000, 8, 200)
	withCounters := func(rk Rank, tokens, busyUS int64) Rank {
		rk.PrefillUncachedTokens, rk.PrefillBusyUS = tokens, busyUS
		rk.Fields |= FieldPrefillCounters
		return rk
	}
	tests := []struct {
		name     string
		ranks    []Rank
		prev     []Rank        // the previous report, for Follow; nil for none
		gap      time.Duration // how long before this report the previous one came
		residual float64       // CostParams.ResidualPromptTokens
		others   float64       // CostParams.DelayToOthers
		req      Request
		cached   int64
		since    Since
		// backlog are the uncached prompts the proxy sent since the report, each at its time after the
		// report's arrival (Backlog.Add); since.Elapsed after the report is when the choice is priced.
		backlog []sentAt
		// sentUncached is what this proxy sent the worker between the previous report and this one,
		// uncached: the rest of what the worker prefilled came from other senders (OtherSenders on).
		sentUncached int64
		want         float64 // seconds, computed by hand in the comment
	}{
		{
			// Nothing measured: prefill 800/8000 = 0.1, decode 100/50 = 2.
			name: "idle worker, defaults", ranks: []Rank{worker(0, 0, 0, 0, 10000, 8, 0)},
			req: Request{800, 100}, want: 2.1,
		},
		{
			// 600 of 800 prompt tokens cached: prefill 200/8000 = 0.025, decode 2.
			name: "cached prefix", ranks: []Rank{worker(0, 0, 0, 0, 10000, 8, 0)},
			req: Request{800, 100}, cached: 600, want: 2.025,
		},
		{
			// Batch 4+1 = 5; prefill 400/8000 = 0.05.
			name: "busy worker", ranks: []Rank{busy}, req: Request{400, 100}, want: 100/perRequest(busyAlone, 5) + 0.05,
		},
		{
			// 4 running + 2 queued hold 9000 + 1000 tokens, the queued ones 2 x 100 output to come:
			// 10200 tokens, 1700 a request. Adding 500 is 700 over the 10000 pool: 700 x 100/1700 tokens of
			// output at the batch-7 throughput. Prefill (1000 queued + 400)/8000 = 0.175.
			name: "full pool", ranks: []Rank{worker(4, 2, 1000, 9000, 10000, 8, 200)},
			req:  Request{400, 100},
			want: 700.0*100/1700/(7*perRequest(busyAlone, 7)) + 0.175 + 100/perRequest(busyAlone, 7),
		},
		{
			// 8 running of 8 at 400 tok/s: 50 each, 50 x (1 + 7/16) alone. The batch stays 8: decode 100
			// tokens at perRequest(alone, 8); one must finish first, 100 tokens at 8 times that speed;
			// prefill 0.05.
			name: "full batch", ranks: []Rank{worker(8, 0, 0, 800, 100000, 8, 400)},
			req: Request{400, 100}, want: 100/perRequest(50*(1+7.0/16), 8)*(1+1.0/8) + 0.05,
		},
		{
			// Two requests sent since (800 prompt, 200 output tokens), none finished, 1 s ago: 6 present,
			// batch 7; the 800 queued prompt tokens were prefilled in that second: prefill 0.05.
			name: "sent since, projected", ranks: []Rank{busy}, req: Request{400, 100},
			since:   Since{Elapsed: time.Second, Extra: 2, Sent: 2, SentPrompt: 800, SentOutput: 200, SentUncached: 800},
			backlog: []sentAt{{0, 800}},
			want:    100/perRequest(busyAlone, 7) + 0.05,
		},
		{
			// The same two sent 50 ms ago, 10 s after the report: 0.1 s of prefill each was sent, 0.05
			// of it drained; the 10 s before they were sent drained none of it. Prefill 0.05 + 0.05.
			name: "sent late in the interval", ranks: []Rank{busy}, req: Request{400, 100},
			since:   Since{Elapsed: 10050 * time.Millisecond, Extra: 2, Sent: 2, SentPrompt: 800, SentOutput: 200, SentUncached: 800},
			backlog: []sentAt{{10 * time.Second, 400}, {10 * time.Second, 400}},
			want:    100/perRequest(busyAlone, 7) + 0.1,
		},
		{
			// 800 tokens sent 0.05 s ago, 10 s after the report, as above, but the in-flight count fell
			// by 4: the 4 reported and both sent finished, so both were prefilled, whatever the backlog
			// made of the speed. Alone in its batch; prefill 0.05.
			name: "sent late, finished", ranks: []Rank{busy}, req: Request{400, 100},
			since:   Since{Elapsed: 10050 * time.Millisecond, Extra: -4, Sent: 2, SentPrompt: 800, SentOutput: 200, SentUncached: 800},
			backlog: []sentAt{{10 * time.Second, 800}},
			want:    100/busyAlone + 0.05,
		},
		{
			// The report's queue, 1000 tokens, drains from its arrival: 0.125 s. 1200 tokens sent 0.1 s
			// after it queue behind its rest, done 0.275 s after the report. Priced at 0.2 s, 0.075 s of
			// prefill is ahead, then its own 400/8000; batch 8.
			name: "queue and sent since", ranks: []Rank{worker(4, 2, 1000, 1000, 100000, 8, 200)}, req: Request{400, 100},
			since:   Since{Elapsed: 200 * time.Millisecond, Extra: 1, Sent: 1, SentPrompt: 1200, SentOutput: 100, SentUncached: 1200},
			backlog: []sentAt{{100 * time.Millisecond, 1200}},
			want:    100/perRequest(busyAlone, 8) + 0.125,
		},
		{
			// The same two sent but the count fell by 1: 3 finished, the oldest first, so 1 of the 4
			// reported and both new ones remain: batch 4; prefill 0.05.
			name: "finished since", ranks: []Rank{busy}, req: Request{400, 100},
			since:   Since{Elapsed: time.Second, Extra: -1, Sent: 2, SentPrompt: 800, SentOutput: 200, SentUncached: 800},
			backlog: []sentAt{{0, 800}},
			want:    100/perRequest(busyAlone, 4) + 0.05,
		},
		{
			// Sent since: three short requests (100 + 10 tokens) and a long one (2000 + 1000); the count
			// fell by 2, so 6 finished: none of the 4 reported, 2 of the 4 sent are left. They are most
			// likely the long one and a short one: the output-weighted mean size is 3003300/1030 tokens,
			// 2 of them capped at the 3330 sent. Adding 500 is 330 over the pool of 3500; 3330/2 tokens a
			// request; batch 3; the 2300 prompt tokens were prefilled in the second since.
			name: "finished since, the long ones left", ranks: []Rank{worker(4, 0, 0, 1000, 3500, 8, 200)},
			req:   Request{400, 100},
			since: Since{Elapsed: time.Second, Extra: -2, Sent: 4, SentPrompt: 2300, SentOutput: 1030, SentWeighted: 3003300},
			want:  330.0/1665*(100/perRequest(busyAlone, 3)/3) + 100/perRequest(busyAlone, 3) + 0.05,
		},
		{
			// Just sent, not yet prefilled: 800 tokens ahead, (800 + 400)/8000 = 0.15; batch 7.
			name: "sent since, queued", ranks: []Rank{busy}, req: Request{400, 100},
			since:   Since{Extra: 2, Sent: 2, SentPrompt: 800, SentOutput: 200, SentUncached: 800},
			backlog: []sentAt{{0, 800}}, want: 100/perRequest(busyAlone, 7) + 0.15,
		},
		{
			// A report stamped after the choice's clock reading: nothing drained since, so it prices as
			// one received now (the row above), not 10 ms of prefill (80 tokens) more.
			name: "report newer than the clock", ranks: []Rank{busy}, req: Request{400, 100},
			since:   Since{Elapsed: -10 * time.Millisecond, Extra: 2, Sent: 2, SentPrompt: 800, SentOutput: 200, SentUncached: 800},
			backlog: []sentAt{{0, 800}},
			want:    100/perRequest(busyAlone, 7) + 0.15,
		},
		{
			// Counters moved 4000 tokens in 1 s of busy prefill: 4000 tok/s. Idle now; decode carried
			// from the previous report, 100 tok/s at batch 2, 50 x (1 + 1/16) alone; prefill 400/4000 = 0.1.
			name:  "measured prefill, carried decode",
			prev:  []Rank{withCounters(worker(2, 0, 0, 1000, 10000, 8, 100), 1000, 1_000_000)},
			ranks: []Rank{withCounters(worker(0, 0, 0, 0, 10000, 8, 0), 5000, 2_000_000)},
			req:   Request{400, 100}, want: 100/(50*(1+1.0/16)) + 0.1,
		},
		{
			// 4000 tokens in 0.5 s of prefill busy over the 1 s between the reports: 8000 tok/s, busy half
			// the time; this proxy sent 1000 of them, so others keep it busy 0.375 of the time: a prompt
			// waits 0.375/0.625 residual prompts of 800, 0.06 s; its own 400/8000 = 0.05.
			name:  "others' prompts queue",
			prev:  []Rank{withCounters(worker(2, 0, 0, 1000, 10000, 8, 100), 1000, 1_000_000)},
			ranks: []Rank{withCounters(worker(0, 0, 0, 0, 10000, 8, 0), 5000, 1_500_000)},
			gap:   time.Second, residual: 800, sentUncached: 1000,
			req: Request{400, 100}, want: 100/(50*(1+1.0/16)) + 0.05 + 0.06,
		},
		{
			// The same, all 4000 sent by this proxy: they were in its backlog, no one else's queue to wait
			// for.
			name:  "own prompts do not queue twice",
			prev:  []Rank{withCounters(worker(2, 0, 0, 1000, 10000, 8, 100), 1000, 1_000_000)},
			ranks: []Rank{withCounters(worker(0, 0, 0, 0, 10000, 8, 0), 5000, 1_500_000)},
			gap:   time.Second, residual: 800, sentUncached: 4000,
			req: Request{400, 100}, want: 100/(50*(1+1.0/16)) + 0.05,
		},
		{
			// Busy the whole second at 4000 tok/s, a tenth of it this proxy's: the busy fraction 0.9 counts
			// as 0.9 others', a wait of 9 residual prompts of 800 at 4000 tok/s: 1.8 s; its own 400/4000.
			// Busy all the time and all of it others': capped at 0.95.
			name:  "saturated prefill, wait capped",
			prev:  []Rank{withCounters(worker(2, 0, 0, 1000, 10000, 8, 100), 1000, 1_000_000)},
			ranks: []Rank{withCounters(worker(0, 0, 0, 0, 10000, 8, 0), 5000, 2_000_000)},
			gap:   time.Second, residual: 800, sentUncached: 400,
			req: Request{400, 100}, want: 100/(50*(1+1.0/16)) + 0.1 + 1.8,
		},
		{
			// The previous report, 30 s before, read 400 tok/s at batch 2; this one reads 50 at batch 4
			// (a window that lagged the batch). The earlier reading weighs 2^-0.5 (half a minute): alone
			// (50 + 400 x 2^-0.5) / (4/(1 + 3/32) + 2/(1 + 1/32) x 2^-0.5) tok/s at the reference halving,
			// read at a mean batch of b = (4 + 2 x 2^-0.5) / (1 + 2^-0.5), so (1 + (b-1)/16) / (1 + (b-1)/32)
			// times that at halving 16; batch 5; prefill 0.05.
			name:  "decode readings summed with the previous report's",
			prev:  []Rank{worker(2, 0, 0, 1000, 10000, 8, 400)},
			ranks: []Rank{worker(4, 0, 0, 1000, 10000, 8, 50)}, gap: 30 * time.Second,
			req: Request{400, 100},
			want: 100/perRequest((50+400*math.Sqrt(0.5))/(4/(1+3.0/32)+2/(1+1.0/32)*math.Sqrt(0.5))*
				(1+(meanBatch-1)/16)/(1+(meanBatch-1)/32), 5) + 0.05,
		},
		{
			// As "busy worker", and each of the 100 tokens slows the 4 others by 1/16 of a token at
			// the speed alone: 4 x 100 x (1/16) / busyAlone more.
			name: "delay to others", ranks: []Rank{busy}, req: Request{400, 100}, others: 1,
			want: 100/perRequest(busyAlone, 5) + 0.05 + 4*100.0/16/busyAlone,
		},
		{
			// Half of it counts.
			name: "half the delay to others", ranks: []Rank{busy}, req: Request{400, 100}, others: 0.5,
			want: 100/perRequest(busyAlone, 5) + 0.05 + 0.5*4*100.0/16/busyAlone,
		},
		{
			// Alone in its batch, it delays no one: 2.1 as with the defaults.
			name: "delay to others, idle worker", ranks: []Rank{worker(0, 0, 0, 0, 10000, 8, 0)},
			req: Request{800, 100}, others: 1, want: 2.1,
		},
		{
			// Two DP ranks: the worker prefills 8000 tok/s, a prompt runs on one rank at 4000: 400/4000 = 0.1.
			name: "two ranks", ranks: []Rank{worker(0, 0, 0, 0, 10000, 8, 0), worker(0, 0, 0, 0, 10000, 8, 0)},
			req: Request{400, 100}, want: 2.1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep := NewReport(time.Unix(0, 0), "", tt.ranks)
			if tt.sentUncached > 0 {
				rep.Sent = SentTotals{Requests: 1, Uncached: tt.sentUncached}
			}
			if tt.prev != nil {
				rep.Follow(NewReport(time.Unix(0, 0).Add(-tt.gap), "", tt.prev))
			}
			if !rep.Priced() {
				t.Fatal("report not priced")
			}
			p := params
			p.ResidualPromptTokens = tt.residual
			p.DelayToOthers = tt.others
			p.OtherSenders = tt.sentUncached > 0
			since := tt.since
			if tt.backlog != nil {
				since.Backlog = new(Backlog)
				for _, s := range tt.backlog {
					since.Backlog.Add(rep, s.at, s.tokens, &p)
				}
			}
			got := rep.Cost(tt.req, tt.cached, &since, &p)
			tolerance := 1e-9
			if tt.backlog != nil {
				tolerance = 2e-6 // a backlog keeps whole microseconds, rounded up
			}
			if math.Abs(got-tt.want) > tolerance {
				t.Errorf("cost %.6f s, want %.6f s", got, tt.want)
			}
		})
	}
}

// sentAt is an uncached prompt of tokens sent at after a report's arrival.
type sentAt struct {
	at     time.Duration
	tokens int64
}

// pollEverySecond follows prev with reports of r at seconds from to to, and returns the last.
func pollEverySecond(prev *Report, from, to int, r Rank) *Report {
	for i := from; i <= to; i++ {
		rep := NewReport(time.Unix(int64(i), 0), "", []Rank{r})
		rep.Follow(prev)
		prev = rep
	}
	return prev
}

// eff is how many lone requests' worth of decoding a batch of n does at the reference halving of 32.
func eff(n int) float64 { return float64(n) / (1 + float64(n-1)/32) }

func TestDecodeReadingsAgeInTime(t *testing.T) {
	prev := NewReport(time.Unix(0, 0), "", []Rank{worker(2, 0, 0, 1000, 10000, 8, 400)})
	// Ten polls a second apart read 50 at batch 4. After them the first reading weighs 2^(-10/60), the
	// one j seconds before the last 2^(-j/60): a reading's weight halves in a minute, whether it took
	// one poll or ten to get there.
	prev = pollEverySecond(prev, 1, 10, worker(4, 0, 0, 1000, 10000, 8, 50))
	gen, batch := 400*math.Exp2(-10.0/60), eff(2)*math.Exp2(-10.0/60)
	for j := range 10 {
		gen += 50 * math.Exp2(-float64(j)/60)
		batch += eff(4) * math.Exp2(-float64(j)/60)
	}
	if got, want := prev.DecodeAloneTokensPerSec(), gen/batch; math.Abs(got-want) > 1e-9 {
		t.Errorf("speed alone after ten polls %.3f tok/s, want %.3f", got, want)
	}
}

// A worker that nobody sends to measures nothing: its readings must not age while it stands idle, or
// the first reading after (a window that lagged the batch, say) decides its speed alone.
func TestDecodeReadingsKeptWhileIdle(t *testing.T) {
	prev := NewReport(time.Unix(0, 0), "", []Rank{worker(2, 0, 0, 1000, 10000, 8, 400)})
	prev = pollEverySecond(prev, 1, 1, worker(4, 0, 0, 1000, 10000, 8, 50))     // a low reading
	prev = pollEverySecond(prev, 2, 600, worker(0, 0, 0, 1000, 10000, 8, 0))    // ten idle minutes
	prev = pollEverySecond(prev, 601, 601, worker(4, 0, 0, 1000, 10000, 8, 50)) // another low one
	// Each reading ages the earlier ones by the second since the report before it: the idle minutes
	// age nothing.
	k := math.Exp2(-1.0 / 60)
	gen, batch := 50+k*(50+400*k), eff(4)+k*(eff(4)+eff(2)*k)
	if got, want := prev.DecodeAloneTokensPerSec(), gen/batch; math.Abs(got-want) > 1e-9 {
		t.Errorf("speed alone after ten idle minutes %.3f tok/s, want %.3f", got, want)
	}
}

// gen_throughput is the output of a window over which the batch changed; the count of running
// requests is the batch at the poll. Requests that decode at 100 tok/s alone, two at a time through
// every window, are read right: by a poll that finds the batch just emptied and one that finds two
// just started, and by polls that find one or three running. Each reading alone is far off.
func TestDecodeSpeedOfAChangingBatch(t *testing.T) {
	const alone = 100.0
	windowGen := 2 * alone / (1 + 1.0/32) // two requests at batch 2 through the window
	for _, tc := range []struct {
		name     string
		readings [][2]float64 // gen_throughput, running
		within   float64      // relative error allowed: the readings' batch sizes straddle the mean one
	}{
		{"emptied, then just started", [][2]float64{{windowGen, 0}, {0, 2}}, 1e-4},
		{"one, then three running", [][2]float64{{windowGen, 1}, {windowGen, 3}}, 0.02},
	} {
		var prev *Report
		for i, r := range tc.readings {
			// A millisecond apart, so that the readings weigh the same to a part in a million.
			rep := NewReport(time.Unix(0, int64(i)*1e6), "", []Rank{worker(int64(r[1]), 0, 0, 1000, 10000, 8, r[0])})
			rep.Follow(prev)
			prev = rep
		}
		if got := prev.DecodeAloneTokensPerSec(); math.Abs(got/alone-1) > tc.within {
			t.Errorf("%s: %.3f tok/s alone, want %v within %v", tc.name, got, alone, tc.within)
		}
	}
}

// counters is a one-rank report at second at, with the prefill counters and a decode reading.
func counters(at int64, running int64, gen float64, tokens, busyUS int64) *Report {
	r := worker(running, 0, 0, 1000, 10000, 8, gen)
	r.PrefillUncachedTokens, r.PrefillBusyUS = tokens, busyUS
	r.Fields |= FieldPrefillCounters
	return NewReport(time.Unix(at, 0), "", []Rank{r})
}

// The fleet's ratio is a ratio of sums over its workers' own readings, each batch weighed by the prefill
// speed of the worker that read it, and aged in time as a worker's own sums are. A reading of a worker
// whose prefill speed is not measured adds nothing.
func TestFleetDecodeRatioOfSums(t *testing.T) {
	var f FleetDecode
	if got := f.PerPrefill(); got != 0 {
		t.Fatalf("before a reading: %v, want 0", got)
	}
	unmeasured := counters(0, 2, 400, 0, 0)
	f.Add(unmeasured)
	if got := f.PerPrefill(); got != 0 {
		t.Fatalf("a reading without a prefill speed: %v, want 0", got)
	}
	// A worker reading 400 tok/s at batch 2, prefill 8000 tok/s; then, a minute later, one reading
	// 300 tok/s at batch 1, prefill 4000 tok/s. The first weighs half by then.
	fast := counters(1, 2, 400, 4000, 500_000)
	fast.Follow(counters(0, 2, 400, 0, 0))
	f.Add(fast)
	if got, want := f.PerPrefill(), 400/(eff(2)*8000); math.Abs(got-want) > 1e-12 {
		t.Fatalf("after one reading: %v, want %v", got, want)
	}
	slow := counters(61, 1, 300, 2000, 500_000)
	slow.Follow(counters(60, 0, 0, 0, 0))
	f.Add(slow)
	if got, want := f.PerPrefill(), (400*0.5+300)/(eff(2)*8000*0.5+1*4000); math.Abs(got-want) > 1e-12 {
		t.Errorf("after two: %v, want %v", got, want)
	}
}

// A worker whose prefill speed is measured but that no poll has caught decoding is priced at its
// prefill speed times the fleet's ratio of the two, not at the fleet's fastest decode speed; once it
// has readings, by both, its own weighing as many lone requests as they caught.
func TestDecodeFromPrefillRatio(t *testing.T) {
	// Idle at both polls, 2000 tokens prefilled in half a second between them: 4000 tok/s.
	idle := counters(1, 0, 0, 2000, 500_000)
	idle.Follow(counters(0, 0, 0, 0, 0))
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 400, DecodePerPrefill: 0.025, DecodeBatchHalving: 32, MeanOutputTokens: 100}
	// 800 prompt tokens at 4000 tok/s, then 100 output tokens alone at 4000 × 0.025 = 100 tok/s.
	if got, want := idle.Cost(Request{800, 100}, 0, &Since{}, &params), 0.2+1.0; math.Abs(got-want) > 1e-9 {
		t.Errorf("priced from the prefill ratio: %v s, want %v", got, want)
	}
	// Without the ratio, the stand-in: 100 tokens at 400 tok/s.
	noRatio := params
	noRatio.DecodePerPrefill = 0
	if got, want := idle.Cost(Request{800, 100}, 0, &Since{}, &noRatio), 0.2+0.25; math.Abs(got-want) > 1e-9 {
		t.Errorf("priced from the stand-in: %v s, want %v", got, want)
	}

	// Three readings a millisecond apart of 20 tok/s at batch 1, the last idle again: a tenth of what
	// the fleet says, 16 lone requests' worth against its own 3.
	prev := idle
	for i := range trustedReadings {
		rep := counters(1, 1, 20, 2000, 500_000)
		rep.Received = idle.Received.Add(time.Duration(i+1) * time.Millisecond)
		rep.Follow(prev)
		prev = rep
	}
	own := prev.DecodeAloneTokensPerSec()
	if math.Abs(own-20) > 1e-3 {
		t.Fatalf("own readings %v tok/s alone, want 20", own)
	}
	blended := (3*20*1.0 + fleetReadings*100) / (3 + fleetReadings)
	// Read to a part in 10⁵: the readings are a millisecond apart, and age each other that much.
	if got, want := prev.AloneCost(Request{0, 100}, &params), 100/blended; math.Abs(got/want-1) > 1e-5 {
		t.Errorf("priced by both: %v s, want %v (%.2f tok/s)", got, want, blended)
	}
	if got, want := prev.AloneCost(Request{0, 100}, &noRatio), 100/own; math.Abs(got/want-1) > 1e-5 {
		t.Errorf("without the ratio, by its own readings: %v s, want %v", got, want)
	}
}

// One low reading (a throughput window in which the batch ran only a moment) does not price a worker
// out of the traffic that would measure it again: until trustedReadings reports caught it decoding, it
// is priced at no less than a worker not yet measured.
func TestDecodeTrustedAfterReadings(t *testing.T) {
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 400, DecodeBatchHalving: 32, MeanOutputTokens: 100}
	// 40 tok/s at batch 1: 40 alone; idle, the worker would take 100 tokens in 100/40 s.
	var prev *Report
	for i := range trustedReadings {
		rep := NewReport(time.Unix(int64(i), 0), "", []Rank{worker(1, 0, 0, 1000, 10000, 8, 40)})
		rep.Follow(prev)
		prev = rep
		// Idle: 100 tokens at the stand-in's 400 tok/s until the last reading, then at the 40 read.
		idle := NewReport(time.Unix(int64(i), 5e8), "", []Rank{worker(0, 0, 0, 1000, 10000, 8, 0)})
		idle.Follow(prev)
		want := 100.0 / 400
		if i == trustedReadings-1 {
			want = 100.0 / 40
		}
		if got := idle.Cost(Request{0, 100}, 0, &Since{}, &params); math.Abs(got-want) > 1e-9 {
			t.Errorf("after %d readings: %v s, want %v", i+1, got, want)
		}
	}
}

// A worker is measured once its decode speed is trusted and its prefill speed read from its counters;
// a speed its reports do not carry, or a request does not need, never holds it back.
func TestMeasured(t *testing.T) {
	follow := func(reps ...*Report) *Report {
		var prev *Report
		for i, rep := range reps {
			rep.Received = time.Unix(int64(i), 0)
			rep.Follow(prev)
			prev = rep
		}
		return prev
	}
	countsOnly := Rank{Running: 1, Waiting: 0, Fields: FieldRunning | FieldWaiting}
	decoding := worker(1, 0, 0, 1000, 10000, 8, 40)
	embedding := func() []*Report { return []*Report{counters(0, 0, 0, 0, 0), counters(0, 0, 0, 2000, 500_000)} }
	for _, tc := range []struct {
		name        string
		rep         *Report
		want        bool
		prefillOnly bool // for a request that decodes nothing
	}{
		{"counts only: nothing to measure", follow(NewReport(time.Time{}, "", []Rank{countsOnly})), true, false},
		{"one decode reading", follow(NewReport(time.Time{}, "", []Rank{decoding})), false, false},
		{"three decode readings, no counters", follow(NewReport(time.Time{}, "", []Rank{decoding}),
			NewReport(time.Time{}, "", []Rank{decoding}), NewReport(time.Time{}, "", []Rank{decoding})), true, false},
		{"three decode readings, counters that never moved", follow(counters(0, 1, 40, 0, 0), counters(0, 1, 40, 0, 0),
			counters(0, 1, 40, 0, 0)), false, false},
		{"three decode readings, a prefill between counters", follow(counters(0, 1, 40, 0, 0), counters(0, 1, 40, 2000, 500_000),
			counters(0, 1, 40, 2000, 500_000)), true, false},
		{"a prefill, one decode reading", follow(counters(0, 0, 0, 0, 0), counters(0, 1, 40, 2000, 500_000)), false, false},
		{"embedding only, for a generation", follow(embedding()...), false, false},
		{"embedding only, for an embedding", follow(embedding()...), true, true},
		{"embedding only, counters that never moved, for an embedding", follow(counters(0, 0, 0, 0, 0), counters(0, 0, 0, 0, 0)), false, true},
	} {
		if got := tc.rep.Measured(!tc.prefillOnly); got != tc.want {
			t.Errorf("%s: measured %v, want %v", tc.name, got, tc.want)
		}
	}
}

// Readings are carried to a batch of one by the worker's own halving where one is set: a simulated 4x
// worker (400 tok/s alone, halving 16) read at 20 running is 400 tok/s alone at 16, and what the
// reference halving of 32 makes of the same readings without it.
func TestDecodeHalvingCarriesReadingsBack(t *testing.T) {
	const alone, running = 400.0, 20
	gen := running * alone / (1 + (running-1)/16.0)
	var rep *Report
	for i := range trustedReadings {
		next := NewReport(time.Unix(int64(i), 0), "", []Rank{worker(running, 0, 0, 1000, 100000, 64, gen)})
		next.Follow(rep)
		rep = next
	}
	for _, tc := range []struct {
		halving, want float64 // s for 100 tokens alone
	}{
		{16, 100 / alone},
		{32, 100 / (gen / running * (1 + (running-1)/32.0))},
		{0, 100 / (gen / running * (1 + (running-1)/32.0))}, // unset: the reference
	} {
		p := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: tc.halving}
		if got := rep.AloneCost(Request{0, 100}, &p); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("halving %v: %.6f s alone, want %.6f", tc.halving, got, tc.want)
		}
	}
}

func TestCostFallbacks(t *testing.T) {
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 16, MeanOutputTokens: 100}
	// No running/waiting counts: nothing to price.
	rep := NewReport(time.Unix(0, 0), "", []Rank{{GenThroughput: 100, Fields: FieldGenThroughput}})
	if rep.Priced() || !math.IsInf(rep.Cost(Request{1, 1}, 0, &Since{}, &params), 1) {
		t.Error("a report without request counts is priced")
	}
	if (*Report)(nil).Priced() {
		t.Error("nil report priced")
	}
	// Only counts: no pool, no batch cap, no throughput; defaults for both speeds, the decode one at
	// batch 3+1.
	rep = NewReport(time.Unix(0, 0), "", []Rank{{Running: 3, Fields: FieldRunning | FieldWaiting}})
	if got, want := rep.Cost(Request{400, 100}, 0, &Since{}, &params), 0.05+100/perRequest(50, 4); math.Abs(got-want) > 1e-9 {
		t.Errorf("counts only: %v s, want %v", got, want)
	}
	// A restarted worker's counters go backwards: nothing is measured between the two reports, and the
	// worker is priced at its new counters' ratio (10 tokens in 1 s).
	prev := NewReport(time.Unix(0, 0), "", []Rank{{Running: 1, PrefillUncachedTokens: 9000, PrefillBusyUS: 9e6, Fields: FieldRunning | FieldWaiting | FieldPrefillCounters}})
	rep = NewReport(time.Unix(1, 0), "", []Rank{{Running: 1, PrefillUncachedTokens: 10, PrefillBusyUS: 1e6, Fields: FieldRunning | FieldWaiting | FieldPrefillCounters}})
	rep.Follow(prev)
	if s, ok := rep.PrefillTokensPerSec(); !ok || s != 10 {
		t.Errorf("backward counters: prefill speed %v %v, want the new counters' 10", s, ok)
	}
	// Too little busy time between polls measures nothing either, but keeps an earlier measurement.
	prev.work.prefill, prev.work.prefillOK, prev.work.prefillWindowed = 3000, true, true
	rep = NewReport(time.Unix(1, 0), "", []Rank{{Running: 1, PrefillUncachedTokens: 9010, PrefillBusyUS: 9e6 + 100, Fields: FieldRunning | FieldWaiting | FieldPrefillCounters}})
	rep.Follow(prev)
	if s, ok := rep.PrefillTokensPerSec(); !ok || s != 3000 {
		t.Errorf("prefill speed %v %v, want the previous 3000", s, ok)
	}
	// Negative counters are dropped as not sent.
	rep = NewReport(time.Unix(0, 0), "", []Rank{{PrefillUncachedTokens: -1, PrefillBusyUS: 5, Fields: FieldPrefillCounters}})
	if rep.Ranks[0].Has(FieldPrefillCounters) {
		t.Error("negative prefill counter kept")
	}
}

// A worker that prefilled before its first report (a proxy started in front of a running fleet) is
// priced at its counters' ratio over its life from that report on, until two reports measure its speed
// between them: that one then stands, as the recent speed, while the counters stand still. A worker
// not measured is priced at no slower than the fleet's fastest per rank (CostParams.PrefillPerRankFloor).
func TestPrefillSpeedFromTheFirstReport(t *testing.T) {
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 16, MeanOutputTokens: 100}
	var prev *Report
	for _, tc := range []struct {
		name   string
		rep    *Report
		follow bool    // follow the previous case's report
		speed  float64 // prefill tokens/s; 0: not measured
		want   float64 // seconds for 800 prompt and 100 output tokens: 800/speed + 100/50
	}{
		{"first report, 40,000 tokens in 10 s of prefill", counters(0, 0, 0, 40000, 10e6), false, 4000, 800.0/4000 + 2},
		{"2,000 more in 0.25 s", counters(1, 0, 0, 42000, 10.25e6), true, 8000, 800.0/8000 + 2},
		{"counters still: the window's speed stands", counters(2, 0, 0, 42000, 10.25e6), true, 8000, 800.0/8000 + 2},
		{"first report, under 20 ms of prefill: the stand-in", counters(0, 0, 0, 100, 10e3), false, 0, 800.0/8000 + 2},
	} {
		if tc.follow {
			tc.rep.Follow(prev)
		}
		prev = tc.rep
		speed, ok := tc.rep.PrefillTokensPerSec()
		if ok != (tc.speed > 0) || math.Abs(speed-tc.speed) > 1e-9 {
			t.Errorf("%s: prefill speed %v (measured %v), want %v", tc.name, speed, ok, tc.speed)
		}
		if got := tc.rep.Cost(Request{800, 100}, 0, &Since{}, &params); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: %.6f s, want %.6f", tc.name, got, tc.want)
		}
	}
	// Not measured, on two ranks, with the fleet's fastest at 10,000 tokens/s per rank: the worker
	// prefills at no less than 20,000, a prompt on one rank at 10,000: 800/10000 + 2.
	two := NewReport(time.Unix(0, 0), "", []Rank{worker(0, 0, 0, 0, 10000, 8, 0), worker(0, 0, 0, 0, 10000, 8, 0)})
	params.PrefillPerRankFloor = 10000
	if got, want := two.Cost(Request{800, 100}, 0, &Since{}, &params), 800.0/10000+2; math.Abs(got-want) > 1e-9 {
		t.Errorf("not measured, the fleet's floor: %.6f s, want %.6f", got, want)
	}
}

// SGLang refuses a prompt of the pool less 6 tokens or more, on the rank the request would run on: such
// a request is priced +Inf, so that any worker that takes it goes first. An output past what the rank
// holds is cut to it (max_new_tokens to the pool less 2 less the prompt), and holds KV so; its decode
// is priced at the length asked for, as on any worker. Where no pool is reported every request is priced.
func TestCostOfARequestTheWorkerCannotHold(t *testing.T) {
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 16, MeanOutputTokens: 100}
	ranks := NewReport(time.Unix(0, 0), "", []Rank{worker(1, 0, 0, 0, 4096, 8, 0), worker(1, 0, 0, 0, 8192, 8, 0)})
	noPool := NewReport(time.Unix(0, 0), "", []Rank{{Running: 1, Fields: FieldRunning | FieldWaiting}})
	for _, v := range []struct {
		name     string
		rep      *Report
		req      Request
		infinite bool
	}{
		{"the larger rank holds it exactly", ranks, Request{8000, 190}, false},
		{"an output past the pool", ranks, Request{8000, 5000}, false},
		{"max_tokens 2^63-1", ranks, Request{10, math.MaxInt64}, false},
		{"the longest prompt taken", ranks, Request{8185, 1}, false},
		{"a token more: refused", ranks, Request{8186, 1}, true},
		{"no pool reported", noPool, Request{1 << 40, 1 << 40}, false},
	} {
		if got := v.rep.Cost(v.req, 0, &Since{}, &params); math.IsInf(got, 1) != v.infinite || math.IsNaN(got) || got <= 0 {
			t.Errorf("%s: %+v priced at %v s, want infinite %t", v.name, v.req, got, v.infinite)
		}
	}
	// Cut to 190 tokens, 8,000 + 190 fit the 12,288 of the pools, so it waits for none: it costs the
	// decode of 4,810 tokens more than a request of 190 does, at 50 tok/s alone slowed by 1 + 2/16 in a
	// batch of 3. Held whole, 13,000 tokens would wait for 712 to be freed.
	long, held := ranks.Cost(Request{8000, 5000}, 0, &Since{}, &params), ranks.Cost(Request{8000, 190}, 0, &Since{}, &params)
	if want := 4810 * (1 + 2.0/16) / 50; math.Abs(long-held-want) > 1e-9 {
		t.Errorf("an output of 5,000 cut to 190 costs %v s more than one of 190, want %v s: its decode alone", long-held, want)
	}
	// SGLang admits a request for its prompt and at most 4,096 of its output. Beside 8,000 tokens in use
	// of 16,384, a prompt of 1,000 and an output of 8,000 is admitted at once (8,000 + 1,000 + 4,096),
	// as one of 4,096 is: it costs the decode of 3,904 tokens more, at 50 tok/s alone slowed by
	// 1 + 1/16 in a batch of 2. Counted whole, 17,000 tokens would wait for 616 to be freed.
	half := NewReport(time.Unix(0, 0), "", []Rank{worker(1, 0, 0, 8000, 16384, 8, 0)})
	longer, clipped := half.Cost(Request{1000, 8000}, 0, &Since{}, &params), half.Cost(Request{1000, 4096}, 0, &Since{}, &params)
	if want := 3904 * (1 + 1.0/16) / 50; math.Abs(longer-clipped-want) > 1e-9 {
		t.Errorf("an output of 8,000 costs %v s more than one of 4,096, want %v s: its decode alone", longer-clipped, want)
	}
	// Dearer than any finite price, whichever comes first and however it is chosen; two infinite
	// ones tie. Compared within a relative tolerance, they tied with every price.
	for _, costs := range [][2]float64{{math.Inf(1), 5e6}, {5e6, math.Inf(1)}} {
		at := func(i int) (Candidate, bool) { return Candidate{Cost: costs[i]}, true }
		want := 0
		if math.IsInf(costs[0], 1) {
			want = 1
		}
		for _, choice := range []Choice{Least, Window, PowerOfTwo} {
			for draw := range 2 {
				if i, _ := Choose(choice, MetricCost, 2, at, func(int) int { return draw }); i != want {
					t.Errorf("%v, costs %v, draw %d: chose %d, want %d", choice, costs, draw, i, want)
				}
			}
		}
	}
	// power_of_two draws two; when neither holds the request it looks for one that does in a window.
	holdsAt := func(k int) func(int) (Candidate, bool) {
		return func(i int) (Candidate, bool) {
			if i == k {
				return Candidate{Cost: 9}, true
			}
			return Candidate{Cost: math.Inf(1)}, true
		}
	}
	for range 100 {
		if i, ok := Choose(PowerOfTwo, MetricCost, 10, holdsAt(7), rand.IntN); i != 7 || !ok {
			t.Fatalf("power_of_two among 10, one holding the request: chose %d %v, want 7", i, ok)
		}
	}
	if c := compareFloat(math.Inf(1), math.Inf(1)); c != 0 {
		t.Errorf("two infinite prices compare %d, want 0", c)
	}
}

func TestChooseCost(t *testing.T) {
	costs := []struct {
		cost  float64 // 0: not priced
		avail bool
	}{{3, true}, {1, false}, {2, true}, {0, true}, {2.5, true}}
	at := func(i int) (Candidate, bool) {
		c := costs[i]
		return Candidate{Cost: c.cost}, c.avail
	}
	first := func(int) int { return 0 }
	for _, choice := range []Choice{Auto, Least, Window} {
		if i, ok := Choose(choice, MetricCost, len(costs), at, first); i != 2 || !ok {
			t.Errorf("%v: chose %d %v, want 2 (the cheapest available priced)", choice, i, ok)
		}
	}
	none := func(i int) (Candidate, bool) { return Candidate{Inflight: int64(i)}, true }
	if i, ok := Choose(Auto, MetricCost, 5, none, first); i != -1 || ok {
		t.Errorf("nothing priced: chose %d %v, want -1 false (fall back)", i, ok)
	}
	// power_of_two compares the pair on cost.
	for range 50 {
		i, ok := Choose(PowerOfTwo, MetricCost, 2, func(i int) (Candidate, bool) {
			return Candidate{Cost: float64(2 - i)}, true
		}, func(n int) int { return n - 1 })
		if i != 1 || !ok {
			t.Fatalf("power_of_two: chose %d, want 1", i)
		}
	}
}

func TestChooseWindowIsBounded(t *testing.T) {
	const n = 1024
	calls := 0
	at := func(i int) (Candidate, bool) {
		calls++
		return Candidate{Cost: float64(i + 1)}, true
	}
	// A start of 1020 wraps: 1020..1023, 0..11; the cheapest of those is 0.
	i, ok := Choose(Window, MetricCost, n, at, func(int) int { return 1020 })
	if i != 0 || !ok || calls != WindowSize {
		t.Errorf("chose %d %v after %d candidates, want 0 after %d", i, ok, calls, WindowSize)
	}
}

func BenchmarkCost(b *testing.B) {
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, MeanOutputTokens: 100}
	rep := NewReport(time.Unix(0, 0), "", []Rank{worker(4, 2, 1000, 9000, 10000, 8, 200)})
	since := Since{Elapsed: time.Second, Extra: 2, Sent: 2, SentPrompt: 800, SentOutput: 200, Backlog: new(Backlog)}
	since.Backlog.Add(rep, 0, 800, &params)
	var sink float64
	for b.Loop() {
		sink += rep.Cost(Request{400, 100}, 0, &since, &params)
	}
	_ = sink
}

// A worker that prefilled three times the tokens this proxy sent it between two reports has other
// senders: the requests sent since a report count three times, and the price is the price of those
// three times over. Fewer tokens than sent (a prefix cache's hits) count as this proxy alone.
func TestSendersScaleWhatWasSentSince(t *testing.T) {
	counters := func(at, tokens, sent int64) *Report {
		rep := NewReport(time.Unix(at, 0), "", []Rank{{Running: 4, Waiting: 1, PrefillUncachedTokens: tokens, PrefillBusyUS: tokens * 100,
			Fields: FieldRunning | FieldWaiting | FieldPrefillCounters}})
		rep.Sent = SentTotals{Requests: sent / 100, PromptTokens: sent, Uncached: sent}
		return rep
	}
	prev := counters(0, 0, 0)
	rep := counters(10, 3000, 1000)
	rep.Follow(prev)
	if got := rep.Senders(); math.Abs(got-3) > 1e-12 {
		t.Fatalf("senders %v, want 3", got)
	}
	params := CostParams{PrefillTokensPerSec: 8000, DecodeTokensPerSec: 50, DecodeBatchHalving: 32, MeanOutputTokens: 100, OtherSenders: true}
	// The 600 uncached tokens sent 1 s after the report, counted as 1,800.
	backlog := func(r *Report, tokens int64, p *CostParams) *Backlog {
		b := new(Backlog)
		b.Add(r, time.Second, tokens, p)
		return b
	}
	alone := *rep
	alone.work.senders = 0
	since := Since{Elapsed: 2 * time.Second, Extra: 2, Sent: 3, SentPrompt: 600, SentOutput: 150, SentWeighted: 40000, SentUncached: 600, Backlog: backlog(rep, 600, &params)}
	tripled := Since{Elapsed: 2 * time.Second, Extra: 6, Sent: 9, SentPrompt: 1800, SentOutput: 450, SentWeighted: 120000, SentUncached: 1800, Backlog: backlog(&alone, 1800, &params)}
	req := Request{PromptTokens: 500, OutputTokens: 200}
	if got, want := rep.Cost(req, 0, &since, &params), alone.Cost(req, 0, &tripled, &params); math.Abs(got-want) > 1e-12 {
		t.Errorf("price with 3 senders %v s, want %v (the sends since tripled)", got, want)
	}
	if rep.Cost(req, 0, &since, &params) <= alone.Cost(req, 0, &since, &params) {
		t.Error("other senders did not raise the price")
	}
	off := params
	off.OtherSenders = false
	since.Backlog = backlog(rep, 600, &off)
	if got, want := rep.Cost(req, 0, &since, &off), alone.Cost(req, 0, &since, &off); got != want {
		t.Errorf("with OtherSenders off: %v s, want %v, as if this proxy sent alone", got, want)
	}

	// The next window: 2,000 received for 2,000 sent. Ratio of sums, the first window aged by 10 s.
	next := counters(20, 5000, 3000)
	next.Follow(rep)
	k := math.Exp2(-10.0 / 60)
	if got, want := next.Senders(), (3000*k+2000)/(1000*k+2000); math.Abs(got-want) > 1e-12 {
		t.Errorf("senders after two windows %v, want %v", got, want)
	}
	// A prefix cache: the worker prefilled less than was sent.
	cached := counters(10, 500, 1000)
	cached.Follow(prev)
	if got := cached.Senders(); got != 1 {
		t.Errorf("senders with cache hits %v, want 1", got)
	}
	// Totals that began again (another config's) add nothing; the factor stays.
	restarted := counters(30, 6000, 10)
	restarted.Follow(next)
	if got, want := restarted.Senders(), next.Senders(); got != want {
		t.Errorf("senders after the totals began again %v, want %v kept", got, want)
	}
	// Windows before this proxy counted anything it sent (a policy that does not count) add nothing:
	// the worker's tokens alone are not other senders.
	never := counters(10, 3000, 0)
	never.Follow(prev)
	if got := never.Senders(); got != 0 {
		t.Errorf("senders with nothing ever counted %v, want 0 (not measured)", got)
	}
	// Once it counts, a window it sent nothing in counts too: the others' share of a worker it rarely
	// uses is in such windows.
	idle := counters(30, 9000, 3000)
	idle.Follow(next)
	if got, want := idle.Senders(), (3000*k*k+2000*k+4000)/(1000*k*k+2000*k); math.Abs(got-want) > 1e-12 {
		t.Errorf("senders after a window with nothing sent %v, want %v", got, want)
	}
}

// A request counts as its worker holds it: not at all where its largest rank refuses its prompt (nor
// does Admits take the prompt there), its output cut to what that rank holds, and within
// MaxRequestTokens where no pool is reported.
func TestHeld(t *testing.T) {
	ranks := NewReport(time.Now(), "", []Rank{worker(1, 0, 0, 0, 4096, 8, 0), worker(1, 0, 0, 0, 8192, 8, 0)})
	noPool := NewReport(time.Now(), "", []Rank{{Running: 1, Fields: FieldRunning | FieldWaiting}})
	for _, v := range []struct {
		name      string
		rep       *Report
		req, want Request
	}{
		{"fits", ranks, Request{1000, 512}, Request{1000, 512}},
		{"fits the larger rank exactly", ranks, Request{1000, 7190}, Request{1000, 7190}},
		{"a token more: cut", ranks, Request{1000, 7191}, Request{1000, 7190}},
		{"max_tokens 2^63-1: cut", ranks, Request{10, math.MaxInt64}, Request{10, 8180}},
		{"the longest prompt taken", ranks, Request{8185, 100}, Request{8185, 5}},
		{"a token more: refused", ranks, Request{8186, 1}, Request{}},
		{"prompt past the pool: refused", ranks, Request{1 << 40, 256}, Request{}},
		{"negative", ranks, Request{-5, -7}, Request{0, 0}},
		{"no pool reported", noPool, Request{math.MaxInt64, math.MaxInt64}, Request{MaxRequestTokens, MaxRequestTokens}},
		{"no report", nil, Request{100, math.MaxInt64}, Request{100, MaxRequestTokens}},
	} {
		refused := strings.Contains(v.name, "refused")
		if got, held := v.rep.Held(v.req); got != v.want || held == refused {
			t.Errorf("%s: Held(%+v) = %+v, %t; want %+v, %t", v.name, v.req, got, held, v.want, !refused)
		}
		if admits := v.rep.Admits(v.req.PromptTokens); admits == refused {
			t.Errorf("%s: Admits(%d) = %t, want %t", v.name, v.req.PromptTokens, admits, !refused)
		}
	}
}
