package main

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeResults builds per-seed results with the figures given per policy (p50, p99, seed by seed).
func fakeResults(figs map[string][2][]float64, order []string) seedResults {
	sr := seedResults{seeds: []int64{1, 2, 3}, policies: order}
	for _, name := range order {
		var rs []armResult
		for i := range sr.seeds {
			tail := sample{long: true, stream: true, worker: 0, latency: 10 * time.Second, ttft: 3 * time.Second, queue: 2, firstToken: 2.5}
			middle := sample{worker: 2, latency: 300 * time.Millisecond, queue: 0.01, firstToken: 0.11}
			rs = append(rs, armResult{name: name, p50: figs[name][0][i], p90: figs[name][1][i] / 2, p99: figs[name][1][i],
				ttftMean: 0.1, ttft90: 0.2, ttft99: 0.3, tokPerSec: 1000, share: []float64{0.2, 0.3, 0.5},
				kvMean: []float64{0.7, 0.2, 0.1}, kvPeak: []float64{0.9, 0.5, 0.3}, pollsPerSec: []float64{1, 1, 1}, seconds: 90,
				tail: []sample{tail}, middle: []sample{middle, middle}})
		}
		sr.byPolicy = append(sr.byPolicy, rs)
	}
	return sr
}

func TestQualityReport(t *testing.T) {
	order := []string{"round_robin", "least_conn", controlPolicy, "sglang_load power_of_two 10s", "sglang_load power_of_two 1s"}
	sr := fakeResults(map[string][2][]float64{
		"round_robin":                  {{1, 1, 1}, {20, 20, 20}},
		"least_conn":                   {{1, 1, 1}, {10, 10, 10}},
		controlPolicy:                  {{0.95, 1, 1.02}, {11, 10, 9}},
		"sglang_load power_of_two 10s": {{0.9, 0.9, 1}, {5, 4, 6}},
		"sglang_load power_of_two 1s":  {{0.9, 0.9, 1}, {5, 4, 6}},
	}, order)
	o := qualityOptions{requests: 2000, seeds: sr.seeds}
	md := qualityMarkdown(o, []qualityRun{{rate: 24, res: sr, cpu: cpuUse{wall: time.Second, machineBusy: -1}}}, cpuUse{wall: time.Second, machineBusy: -1})
	for _, want := range []string{
		"#### 24 requests/s",
		"| policy | p50 s | p90 s | p99 s | TTFT mean s | TTFT p90 s | TTFT p99 s | out tok/s | failed (max) | share 1x / 2x / 4x |",
		"| sglang_load power_of_two 10s | 0.90 (0.90..1.00) | 2.50 (2.00..3.00) | 5.00 (4.00..6.00) |",
		// p99 ÷ least_conn seed by seed: 0.5, 0.4, 0.6; its p50 ratio reaches 1.0 on seed 3: not a difference.
		"| sglang_load power_of_two 10s | 0.90 (0.90..1.00) ~ | 0.50 (0.40..0.60) **better** | 0.50 (0.40..0.60) **better** |",
		"| sglang_load power_of_two 10s | p99 ÷ least_conn | 0.50 | 0.40 | 0.60 |",
		"| sglang_load power_of_two 10s | p99 ÷ round_robin | 0.25 | 0.20 | 0.30 |",
		"| round_robin | 1.00 (1.00..1.00) ~ | 2.00 (2.00..2.00) **worse** | 2.00 (2.00..2.00) **worse** |",
		// Targets on the worst seed: 0.6 ≤ 0.6, 1.0 ≤ 1.0, 0.3 ≤ 0.5, equal to the 1 s row.
		"| sglang_load power_of_two 10s | 0.60 | 1.00 | 0.30 | 1.00..1.00 | yes |",
		// The control's seeds: p50 0.95, 1, 1.02; p99 1.1, 1, 0.9.
		"The control, a second least_conn on the same requests: p50 ÷ least_conn 0.95..1.02, p99 ÷ least_conn 0.90..1.10 over seeds",
		"| least_conn | 70% / 90% | 20% / 50% | 10% / 30% |",
		"Busy check: under least_conn the smallest worker's KV use peaks at 90% (90..90%) (mean 70% (70..70%)); above 70% on every seed: yes.",
		"| least_conn | 3 | 100% | 100% | 100% / 0% / 0% | 10.00 | 2.00 | 0.50 | 7.50 |",
		"Why the p50: the 5% of each seed's requests around its median",
		"| least_conn | 6 | 0% | 0% | 0% / 0% / 100% | 0.30 | 0.01 | 0.10 | 0.19 |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	_, targets, _ := strings.Cut(md, "Targets at a 10 s interval")
	targets, _, _ = strings.Cut(targets, "KV use per worker")
	if !strings.Contains(targets, "power_of_two 10s |") || strings.Contains(targets, "power_of_two 1s |") {
		t.Errorf("the targets table should have the 10 s row and no 1 s row:\n%s", targets)
	}
	checkTables(t, md)
}

// checkTables asserts that every row of every Markdown table has as many cells as its header.
func checkTables(t *testing.T, md string) {
	t.Helper()
	cells := -1
	for i, line := range strings.Split(md, "\n") {
		if !strings.HasPrefix(line, "|") {
			cells = -1
			continue
		}
		n := strings.Count(line, "|")
		if cells < 0 {
			cells = n
		} else if n != cells {
			t.Errorf("line %d has %d cell borders, its table's header %d: %s", i+1, n, cells, line)
		}
	}
}

func TestReplicasAndAffinityReportsAreWellFormed(t *testing.T) {
	order := []string{"least_conn", "least_conn ×3", "sglang_load", "sglang_load ×3"}
	sr := fakeResults(map[string][2][]float64{
		"least_conn": {{1, 1, 1}, {10, 10, 10}}, "least_conn ×3": {{1, 1, 1}, {11, 11, 12}},
		"sglang_load": {{1, 1, 1}, {8, 8, 8}}, "sglang_load ×3": {{1, 1, 1}, {8, 9, 10}},
	}, order)
	ps := []policy{{name: "least_conn"}, {name: "sglang_load", interval: 10 * time.Second}}
	md := replicasMarkdown(qualityOptions{requests: 10, seeds: sr.seeds, instances: []int{1, 3}}, ps,
		[]qualityRun{{rate: 24, res: sr, cpu: cpuUse{wall: time.Second, machineBusy: -1}}}, cpuUse{wall: time.Second, machineBusy: -1})
	for _, want := range []string{
		"| least_conn | 3 | 1.10 (1.10..1.20) | 1.00 (1.00..1.00) | 1.00 / 1.00 / 1.00 | - | no |",
		"| sglang_load | 3 | 1.12 (1.00..1.25) | 1.00 (1.00..1.00) | 1.00 / 1.00 / 1.00 | 0.60 | no |", // 3 × (1/10 + 9/90)
		"| sglang_load | 1 | 1.00 (1.00..1.00) | 1.00 (1.00..1.00) | 1.00 / 1.00 / 1.00 | 0.20 | - |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("replicas report lacks %q", want)
		}
	}
	checkTables(t, md)
	var b strings.Builder
	affinityTable(&b, sr)
	instanceRatios(&b, sr, []metric{mP99})
	checkTables(t, b.String())
	// least_conn ×3 ÷ least_conn, p99 seed by seed: 1.1, 1.1, 1.2.
	if want := "| least_conn ×3 | 1.10 (1.10..1.20) **worse** |"; !strings.Contains(b.String(), want) {
		t.Errorf("instance ratios lack %q:\n%s", want, b.String())
	}
}

func TestSummarise(t *testing.T) {
	f := &fleet{polls: make([]atomic.Int64, 3), kvSum: make([]float64, 3), kvPeak: make([]float64, 3)}
	a := &arm{policy: policy{name: "p"}, fleet: f, ideal: newIdealCache()}
	begin := time.Now()
	for i := range 100 {
		lat := time.Duration(i+1) * 100 * time.Millisecond // 0.1 s .. 10 s
		a.samples = append(a.samples, sample{job: i, ok: true, stream: i%2 == 0, worker: i % 4 % 3, latency: lat,
			ttft: lat / 10, end: begin.Add(10 * time.Second), prompt: 100, cached: 25, out: 50})
	}
	a.samples = append(a.samples, sample{job: 100, failure: "status 503"})
	r := summarise(a, "p", begin, []int64{0, 0, 0})
	if r.requests != 101 || r.failed != 1 || r.firstFailure != "status 503" {
		t.Fatalf("requests %d failed %d (%q)", r.requests, r.failed, r.firstFailure)
	}
	if r.p50 != 5 || r.p90 != 9 || r.p99 != 9.9 {
		t.Errorf("p50 %g p90 %g p99 %g, want 5, 9, 9.9", r.p50, r.p90, r.p99)
	}
	// Streamed: latencies 0.1, 0.3, ... 9.9; TTFT a tenth of them, mean 0.5, p50 the 25th: 0.49.
	if d := r.ttftMean - 0.5; d*d > 1e-12 || r.ttft50 != 0.49 {
		t.Errorf("TTFT mean %g p50 %g, want 0.5 and 0.49", r.ttftMean, r.ttft50)
	}
	if r.tokPerSec != 500 || r.reqPerSec != 10 || r.hit != 0.25 {
		t.Errorf("tok/s %g req/s %g hit %g, want 500, 10, 0.25", r.tokPerSec, r.reqPerSec, r.hit)
	}
	// i%4%3 gives workers 0,1,2,0 for every four.
	if r.share[0] != 0.5 || r.share[1] != 0.25 || r.share[2] != 0.25 {
		t.Errorf("shares %v", r.share)
	}
	if len(r.tail) != 1 || r.tail[0].latency != 10*time.Second {
		t.Errorf("tail %v, want the one 10 s request", r.tail)
	}
	// The 5 requests around the median (the 50th, 5 s): the 48th to the 52nd, 4.8 s to 5.2 s.
	if len(r.middle) != 5 || r.middle[0].latency != 4800*time.Millisecond || r.middle[4].latency != 5200*time.Millisecond {
		t.Errorf("middle %v, want the requests of 4.8 s to 5.2 s", r.middle)
	}
}

// TestArmsAgainstSimulatedWorkers sends small shared-prefix and session workloads through in-process
// routers to real simulated workers on loopback, and checks what the client measured against the workload.
func TestArmsAgainstSimulatedWorkers(t *testing.T) {
	ctx := context.Background()
	ca, err := startArm(ctx, "", policy{name: "cache_aware", router: newCacheAware}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Close()
	ph, err := startArm(ctx, "", policy{name: "prefix_hash", router: newPrefixHash}, 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ph.Close()
	shape := sharedPrefixShape{groups: 3, questions: 4, systemTokens: 64, questionTokens: 16, outputTokens: 4}
	jobs := sharedPrefixWorkload(1, 200, shape)
	runArms(ctx, []*arm{ca, ph}, sequences(jobs), nil)
	for _, a := range []*arm{ca, ph} {
		if len(a.samples) != len(jobs) {
			t.Fatalf("%s: %d samples for %d jobs", a.policy.name, len(a.samples), len(jobs))
		}
		for _, s := range a.samples {
			// Answers end early (benchSimOptions): between 0.3x and 1x of the output asked for.
			if !s.ok || s.worker < 0 || s.ttft <= 0 || s.ttft > s.latency || s.out < 1 || s.out > shape.outputTokens {
				t.Fatalf("%s: sample %+v", a.policy.name, s)
			}
			if want := shape.systemTokens + shape.questionTokens; s.prompt != want {
				t.Fatalf("%s: job %d prompt %d tokens by the worker's count, want %d", a.policy.name, s.job, s.prompt, want)
			}
		}
		want := float64(shape.questions-1) / float64(shape.questions) * float64(shape.systemTokens) / float64(shape.systemTokens+shape.questionTokens)
		if got := a.ideal.rate(); got < want-1e-9 || got > want+1e-9 {
			t.Fatalf("%s: ideal %g, want %g", a.policy.name, got, want)
		}
	}
	// cache_aware keeps each group on one worker: with at most 12 in flight the fleet never counts as
	// imbalanced (balance_abs_threshold 32), and a group's later questions match most of their text.
	byGroup := map[int]int{}
	for _, s := range ca.samples {
		g := jobs[s.job].group
		if w, ok := byGroup[g]; ok && w != s.worker {
			t.Fatalf("cache_aware sent group %d to workers %d and %d", g, w, s.worker)
		}
		byGroup[g] = s.worker
	}

	// Tools: the definitions reach the worker, which counts them in the prompt and caches them as a
	// prefix, so an application's later questions on one worker find them.
	ts := toolsShape{apps: 2, questions: 3, toolTokens: 64, questionTokens: 16, outputTokens: 4}
	tools, err := startArm(ctx, "", policy{name: "cache_aware", router: newCacheAware}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tools.Close()
	tjobs := toolsWorkload(3, 5, ts) // 0.2 s apart on average: an application's first question is cached before its next
	runArms(ctx, []*arm{tools}, sequences(tjobs), nil)
	cached := 0
	for _, s := range tools.samples {
		if !s.ok || s.prompt != ts.toolTokens+ts.questionTokens {
			t.Fatalf("tools: job %d: ok %t, prompt %d tokens by the worker's count, want %d", s.job, s.ok, s.prompt, ts.toolTokens+ts.questionTokens)
		}
		cached += s.cached
	}
	if len(tools.samples) != len(tjobs) || cached == 0 {
		t.Fatalf("tools: %d samples for %d jobs, %d prompt tokens cached", len(tools.samples), len(tjobs), cached)
	}

	// Sessions: each turn's prompt is the previous prompt, its answer and the new message.
	ss := sessionShape{sessions: 3, turns: 3, firstTokens: 40, messageTokens: 8, outputTokens: 4, thinkTime: time.Millisecond}
	sess, err := startArm(ctx, "", policy{name: "cache_aware", router: newCacheAware}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	sjobs := sessionWorkload(2, 100, ss)
	runArms(ctx, []*arm{sess}, sequences(sjobs), nil)
	if len(sess.samples) != len(sjobs) {
		t.Fatalf("sessions: %d samples for %d jobs", len(sess.samples), len(sjobs))
	}
	// Answers end early, so a turn's prompt grows by the answers the session actually got.
	type turnKey struct{ session, turn int }
	outs := map[turnKey]int{}
	for _, s := range sess.samples {
		outs[turnKey{sjobs[s.job].group, sjobs[s.job].turn}] = s.out
	}
	for _, s := range sess.samples {
		j := sjobs[s.job]
		want := ss.firstTokens
		for k := range j.turn {
			want += outs[turnKey{j.group, k}] + ss.messageTokens
		}
		if !s.ok || s.prompt != want {
			t.Fatalf("session %d turn %d: ok %t, prompt %d tokens, want %d", j.group, j.turn, s.ok, s.prompt, want)
		}
	}
}
