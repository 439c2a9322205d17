package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

type qualityOptions struct {
	caddy, out, only string
	seeds            []int64
	rates            []float64
	requests         int
	parallel         int   // seeds run at once; 0: as many as keep the offered load near parallelLoad
	fleetPorts       int   // the first port of the fixed plan (fleetPorts); 0: any free ports
	instances        []int // replicas, affinity: instance counts to compare
	// samplesShare of the quality workload's requests ask for samples answers each (n).
	samplesShare float64
	samples      int
	// outputScale multiplies the quality workload's max_tokens.
	outputScale float64
	// independentAnswers draws the quality workload's answer sizes apart from its prompt sizes.
	independentAnswers bool
}

// parallelLoad is the offered load, in requests/s summed over every arm, that the machine carries at about
// 70% of 2 cores (measured: 11 arms at 24 requests/s each); with -parallel 0 seeds of a lighter load run
// side by side up to it, at most maxSeedsAtOnce.
const (
	parallelLoad   = 11 * 24
	maxSeedsAtOnce = 3
)

// affinitySeedsAtOnce is how many seeds the affinity mode runs side by side: one unless -parallel says
// otherwise. Its TTFT ratios are tens of milliseconds against a hundred, and a busy machine's scheduling
// delays, the same for every arm, pull them towards 1: shared prefix at 8/s, TTFT p90 ÷ load alone 0.13
// with one seed of eight arms at a time (the machine 34–68% busy), 0.53 with seeds side by side (71–87%).
func (o qualityOptions) affinitySeedsAtOnce() int {
	return max(o.parallel, 1)
}

func (o qualityOptions) seedsAtOnce(rate float64, arms int) int {
	if o.parallel > 0 {
		return o.parallel
	}
	return max(1, min(maxSeedsAtOnce, int(parallelLoad/(rate*float64(arms)))))
}

// controlPolicy is the quality table's second least_conn.
const controlPolicy = "least_conn again (control)"

// qualityPolicies are the rows of the quality table, each a Caddyfile lb_policy of its own.
func qualityPolicies() []policy {
	return []policy{
		{name: "round_robin", lb: "lb_policy round_robin"},
		{name: "least_conn", lb: "lb_policy least_conn"},
		// A control: its ratios to least_conn are what two equal routers read on the same requests,
		// the floor under which a seed's difference is the machine's, not the policy's.
		{name: controlPolicy, lb: "lb_policy least_conn"},
		{name: "random_choose 2", lb: "lb_policy random_choose 2"},
		sglangLoad("sglang_load power_of_two 10s", 10*time.Second, "metric auto", "choose power_of_two"),
		sglangLoad("sglang_load power_of_two 10s no-inflight", 10*time.Second, "metric auto", "choose power_of_two", "inflight_correction off"),
		sglangLoad("sglang_load power_of_two 1s", time.Second, "metric auto", "choose power_of_two"),
		sglangLoad("sglang_load power_of_two 1s no-inflight", time.Second, "metric auto", "choose power_of_two", "inflight_correction off"),
		sglangLoad("sglang_load least 10s", 10*time.Second, "metric auto", "choose least"),
		sglangLoad("sglang_load least 10s no-inflight", 10*time.Second, "metric auto", "choose least", "inflight_correction off"),
		sglangLoad("sglang_load least 1s", time.Second, "metric auto", "choose least"),
		sglangLoad("sglang_load least 1s no-inflight", time.Second, "metric auto", "choose least", "inflight_correction off"),
		sglangLoad("sglang_load cost 10s", 10*time.Second, "metric cost"),
		sglangLoad("sglang_load cost 10s no-inflight", 10*time.Second, "metric cost", "inflight_correction off"),
		sglangLoad("sglang_load cost 1s", time.Second, "metric cost"),
		// The policy as a user gets it: the cost metric, reading a body only where a worker would
		// refuse the prompt by its Content-Length (none here), so every answer is priced at
		// default_max_tokens.
		sglangLoad("sglang_load default 10s", 10*time.Second),
		sglangLoad("sglang_load default 1s", time.Second),
		// Studies, run when named. The default prices the delay a request brings the others in its
		// batch; "alone" prices the request alone, so each goes where it finishes first.
		study(sglangLoad("sglang_load cost 10s alone", 10*time.Second, "metric cost", "delay_to_others 0")),
		study(sglangLoad("sglang_load cost 1s alone", time.Second, "metric cost", "delay_to_others 0")),
		// The simulated workers halve a request's decode speed at 16 more in the batch; the default
		// assumes 32: how much knowing the fleet's own figure is worth.
		study(sglangLoad("sglang_load cost 10s halving 16", 10*time.Second, "metric cost", "decode_batch_halving 16")),
		study(sglangLoad("sglang_load cost 1s halving 16", time.Second, "metric cost", "decode_batch_halving 16")),
		// The cost metric without reading the body: the prompt from Content-Length, every answer at
		// default_max_tokens. What it keeps of the win is what a default that reads no body would have.
		study(sglangLoad("sglang_load cost 10s unread", 10*time.Second, "metric cost", "read_body off")),
		study(sglangLoad("sglang_load cost 1s unread", time.Second, "metric cost", "read_body off")),
	}
}

// study marks p as a study row (see policy.study).
func study(p policy) policy {
	p.study = true
	return p
}

// selectPolicies keeps the policies named in the comma list only (all but the studies when it is empty).
func selectPolicies(ps []policy, only string) ([]policy, error) {
	if only == "" {
		return slices.DeleteFunc(slices.Clone(ps), func(p policy) bool { return p.study }), nil
	}
	var out []policy
	for _, name := range strings.Split(only, ",") {
		i := slices.IndexFunc(ps, func(p policy) bool { return p.name == strings.TrimSpace(name) })
		if i < 0 {
			return nil, fmt.Errorf("-policies: unknown policy %q", name)
		}
		out = append(out, ps[i])
	}
	return out, nil
}

// armResult is one policy's figures on one seed.
type armResult struct {
	name                        string
	instances                   int
	requests, failed            int
	p50, p90, p99               float64 // end-to-end latency, s
	ttftMean, ttft50, ttft90    float64 // streamed requests, s
	ttft99                      float64
	tokPerSec, reqPerSec        float64 // completed, over the run
	queueMean                   float64
	share                       []float64     // of completed requests, per worker
	hit, ideal                  float64       // cached / prompt tokens: the fleet's, and one unlimited cache's
	evicted, again              float64       // cached tokens the fleet evicted, and prompt tokens it prefilled again after evicting them, / prompt tokens
	kvMean, kvPeak, pollsPerSec []float64     // per worker
	retracted                   float64       // requests retracted by the workers (-sglang-admission), / requests
	seconds                     float64       // the run's length, over which pollsPerSec counts
	routing                     routingCounts // summed over the arm's Caddy instances, from start to end
	speeds                      string        // the speeds the first Caddy instance holds per worker at the end
	tail                        []sample      // the slowest 1% of completed requests
	middle                      []sample      // the 5% of completed requests around the median
	firstFailure                string
}

// cacheLine is the arm's prefix cache figures for a log line, where a prompt found any cached: a
// workload of unique prompts caches nothing worth showing.
func (r armResult) cacheLine() string {
	if r.hit == 0 {
		return ""
	}
	return fmt.Sprintf(" hit %.3f evicted %.3f again %.3f", r.hit, r.evicted, r.again)
}

// armSpec is one arm of a run: a policy and its instance count.
type armSpec struct {
	p policy
	n int
}

// label names an arm in tables: the policy, and its instance count when it is not 1.
func (s armSpec) label() string {
	if s.n == 1 {
		return s.p.name
	}
	return fmt.Sprintf("%s ×%d", s.p.name, s.n)
}

func singleInstance(ps []policy) []armSpec {
	specs := make([]armSpec, len(ps))
	for i, p := range ps {
		specs[i] = armSpec{p, 1}
	}
	return specs
}

// runSeed starts every arm, sends them jobs at the same moments, and returns their figures in order.
// sent is called once every job has gone out (or the arms failed to start).
func runSeed(ctx context.Context, caddy string, specs []armSpec, jobs []job, sent func(), ports func(arm int) []int) ([]armResult, error) {
	var once sync.Once
	defer once.Do(sent)
	arms := make([]*arm, len(specs))
	errs := make([]error, len(specs))
	var wg sync.WaitGroup
	for i, s := range specs {
		wg.Go(func() {
			// One more try with a fresh fleet and fresh Caddy processes: on a machine this busy a start can
			// fail for reasons that have nothing to do with the policy.
			for try := range 2 {
				if arms[i], errs[i] = startArm(ctx, caddy, s.p, s.n, ports(i)); errs[i] == nil || ctx.Err() != nil {
					return
				}
				if try == 0 {
					fmt.Fprintf(os.Stderr, "sglang-bench: starting %s again: %v\n", s.label(), errs[i])
				}
			}
		})
	}
	wg.Wait()
	defer func() {
		for _, a := range arms {
			if a != nil {
				a.Close()
			}
		}
	}()
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("%s: %w", specs[i].label(), err)
		}
	}
	polls0 := make([][]int64, len(arms))
	for i, a := range arms {
		polls0[i] = a.fleet.pollCounts()
	}
	begin := runArms(ctx, arms, sequences(jobs), func() { once.Do(sent) })
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	rs := make([]armResult, len(arms))
	for i, a := range arms {
		rs[i] = summarise(a, specs[i].label(), begin, polls0[i])
		for _, c := range a.caddys {
			counts, err := c.routingCounts()
			if err != nil {
				fmt.Fprintf(os.Stderr, "sglang-bench: %s: reading metrics: %v\n", specs[i].label(), err)
			}
			rs[i].routing.add(counts)
		}
		if len(a.caddys) > 0 && a.policy.interval > 0 { // an arm of sglang_load
			alone, prefill, err := a.caddys[0].speeds(a.fleet.addrs)
			if err != nil {
				fmt.Fprintf(os.Stderr, "sglang-bench: %s: reading speeds: %v\n", specs[i].label(), err)
			}
			rs[i].speeds = speedsLine(alone, prefill)
		}
	}
	return rs, nil
}

func summarise(a *arm, name string, begin time.Time, polls0 []int64) armResult {
	r := armResult{name: name, instances: a.instances(), requests: len(a.samples), share: make([]float64, len(a.fleet.polls))}
	var ttft []float64
	var ok []sample
	var last time.Time
	var tokens, prompt, cached int
	for _, s := range a.samples {
		if !s.ok {
			if r.failed == 0 {
				r.firstFailure = s.failure
			}
			r.failed++
			continue
		}
		ok = append(ok, s)
		r.queueMean += s.queue
		if s.stream {
			ttft = append(ttft, s.ttft.Seconds())
		}
		last = maxTime(last, s.end)
		tokens += s.out
		prompt += s.prompt
		cached += s.cached
		if s.worker >= 0 {
			r.share[s.worker]++
		}
	}
	if n := float64(len(ok)); n > 0 {
		span := last.Sub(begin).Seconds()
		r.reqPerSec, r.tokPerSec = n/span, float64(tokens)/span
		r.queueMean /= n
		for w := range r.share {
			r.share[w] /= n
		}
	}
	if prompt > 0 {
		r.hit = float64(cached) / float64(prompt)
		evicted, again := a.fleet.eviction()
		r.evicted, r.again = float64(evicted)/float64(prompt), float64(again)/float64(prompt)
	}
	r.ideal = a.ideal.rate()
	slices.SortFunc(ok, func(a, b sample) int { return cmp.Compare(a.latency, b.latency) })
	slices.Sort(ttft)
	r.p50, r.p90, r.p99 = quantile(ok, 0.5).latency.Seconds(), quantile(ok, 0.9).latency.Seconds(), quantile(ok, 0.99).latency.Seconds()
	r.ttftMean, r.ttft50, r.ttft90, r.ttft99 = mean(ttft), quantile(ttft, 0.5), quantile(ttft, 0.9), quantile(ttft, 0.99)
	r.kvMean, r.kvPeak = a.fleet.kv()
	r.retracted = float64(a.fleet.retracted()) / float64(max(r.requests, 1))
	r.seconds = time.Since(begin).Seconds()
	for i, p := range a.fleet.pollCounts() {
		r.pollsPerSec = append(r.pollsPerSec, float64(p-polls0[i])/r.seconds)
	}
	r.tail, r.middle = band(ok, 1, 0.01), band(ok, 0.5, 0.05)
	return r
}

// band is the share of samples (at least one) whose latencies rank around quantile q (as quantile
// ranks it), of samples sorted by latency: q 1 is the slowest, q 0.5 those around the median.
func band(sorted []sample, q, share float64) []sample {
	n := min(len(sorted), max(1, int(math.Ceil(share*float64(len(sorted))))))
	at := int(q*float64(len(sorted))+0.5) - 1
	from := min(max(at-(n-1)/2, 0), len(sorted)-n)
	return slices.Clone(sorted[from : from+n])
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// seedResults is, per policy in order, its figures on every seed in order.
type seedResults struct {
	seeds    []int64
	policies []string
	byPolicy [][]armResult
	workers  []string // the fleet's worker labels; nil: the quality fleet's (workerLabels)
}

// runSeeds runs every seed (parallel of them at once) and gathers the results per policy.
func runSeeds(ctx context.Context, caddy string, specs []armSpec, parallel, portBase int, seeds []int64, jobsOf func(seed int64) []job,
	stderr io.Writer, label string) (seedResults, error) {
	if portBase != 0 {
		if len(specs) > maxPortArms {
			return seedResults{}, fmt.Errorf("%d arms: -fleet-ports plans for at most %d (0 takes any free ports)", len(specs), maxPortArms)
		}
		seen := map[int]int64{}
		for _, s := range seeds {
			if other, ok := seen[portSeed(s)]; ok {
				return seedResults{}, fmt.Errorf("seeds %d and %d would share fleet ports (-fleet-ports plans by seed modulo %d; 0 takes any free ports)", other, s, maxPortSeeds)
			}
			seen[portSeed(s)] = s
		}
	}
	out := seedResults{seeds: seeds, byPolicy: make([][]armResult, len(specs))}
	for _, s := range specs {
		out.policies = append(out.policies, s.label())
	}
	// Batches overlap: the next starts when the previous has sent its last request, while the slowest
	// policies (an overloaded round_robin) still drain their queues.
	perSeed := make([][]armResult, len(seeds))
	errs := make([]error, len(seeds))
	var wg sync.WaitGroup
	for from := 0; from < len(seeds); from += parallel {
		batch := seeds[from:min(from+parallel, len(seeds))]
		var sent sync.WaitGroup
		for k, seed := range batch {
			i := from + k
			sent.Add(1)
			wg.Go(func() {
				start := time.Now()
				perSeed[i], errs[i] = runSeed(ctx, caddy, specs, jobsOf(seed), sent.Done, func(arm int) []int { return fleetPorts(portBase, seed, arm) })
				for _, r := range perSeed[i] {
					fmt.Fprintf(stderr, "sglang-bench: %s seed %d %-42s p50 %6.2fs p99 %6.2fs share %s%s%s%s failed %d %s\n", label, seed, r.name, r.p50, r.p99,
						shares([]armResult{r}), r.cacheLine(), r.routing, r.speeds, r.failed, r.firstFailure)
				}
				fmt.Fprintf(stderr, "sglang-bench: %s seed %d done in %s\n", label, seed, time.Since(start).Round(time.Second))
			})
		}
		sent.Wait()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return out, err
	}
	for i := range specs {
		for _, rs := range perSeed {
			out.byPolicy[i] = append(out.byPolicy[i], rs[i])
		}
	}
	return out, nil
}

func runQuality(ctx context.Context, o qualityOptions, stdout, stderr io.Writer) error {
	if _, err := os.Stat(o.caddy); err != nil {
		return fmt.Errorf("-caddy %s: %w (run make build first)", o.caddy, err)
	}
	ps, err := selectPolicies(qualityPolicies(), o.only)
	if err != nil {
		return err
	}
	mark := markCPU()
	var runs []qualityRun
	for _, rate := range o.rates {
		cpu0 := markCPU()
		res, err := runSeeds(ctx, o.caddy, singleInstance(ps), o.seedsAtOnce(rate, len(ps)), o.fleetPorts, o.seeds,
			func(seed int64) []job {
				jobs := withSamples(qualityWorkload(seed, rate, o.requests), seed, o.samplesShare, o.samples)
				if o.independentAnswers {
					jobs = withIndependentAnswers(jobs, seed)
				}
				return withOutputScale(jobs, o.outputScale)
			}, stderr, fmt.Sprintf("%g/s", rate))
		if err != nil {
			return err
		}
		runs = append(runs, qualityRun{rate: rate, res: res, cpu: cpuSince(cpu0)})
	}
	md := qualityMarkdown(o, runs, cpuSince(mark))
	if err := writeResult(o.out, "quality.md", md); err != nil {
		return err
	}
	if err := writeResult(o.out, "quality.svg", qualitySVG(runs[len(runs)-1].res)); err != nil {
		return err
	}
	fmt.Fprint(stdout, md)
	return nil
}

type qualityRun struct {
	rate float64
	res  seedResults
	cpu  cpuUse
}

// parseList parses a comma list of numbers for flag name.
func parseList[T int64 | float64](name, s string, parse func(string) (T, error)) ([]T, error) {
	var out []T
	for _, f := range strings.Split(s, ",") {
		v, err := parse(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("-%s: %q is not a number", name, f)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-%s: empty list", name)
	}
	return out, nil
}

func parseInts(name, s string) ([]int64, error) {
	return parseList(name, s, func(f string) (int64, error) { return strconv.ParseInt(f, 10, 64) })
}

func parseFloats(name, s string) ([]float64, error) {
	return parseList(name, s, func(f string) (float64, error) {
		v, err := strconv.ParseFloat(f, 64)
		if err == nil && v <= 0 {
			return 0, errors.New("not positive")
		}
		return v, err
	})
}
