package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/trace"
	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// traceRun is one slice replayed through every arm.
type traceRun struct {
	slice          traceSlice
	reqs           []trace.Request // as sent: rebased to the slice and compressed
	stats          trace.Stats     // of the slice in trace time
	longFrom       int             // the slice's p90 prompt: a longer one is "long"
	unlimited, lru float64         // hit rate bounds of the slice
	results        []armResult
	samples        [][]sample // per arm, in the order they ended
	cpu            cpuUse
	// armsStarted is how long the arms took to start, and replayed from the first request sent to the
	// last answer.
	armsStarted, replayed time.Duration
}

func runTrace(ctx context.Context, o traceOptions, stdout, stderr io.Writer) error {
	ps, err := selectPolicies(tracePolicies(), o.only)
	if err != nil {
		return err
	}
	if slices.ContainsFunc(ps, func(p policy) bool { return p.router == nil }) {
		if _, err := os.Stat(o.caddy); err != nil {
			return fmt.Errorf("-caddy %s: %w (run make build first)", o.caddy, err)
		}
	}
	all, format, err := trace.Open(o.path)
	if err != nil {
		return fmt.Errorf("-trace: %w", err)
	}
	cfgs := o.fleet.configs()
	if o.fleetPorts != 0 && len(ps)*len(cfgs) > fleetPortSpan() {
		return fmt.Errorf("%d arms of %d workers: -fleet-ports plans %d ports (0 takes any free ports)", len(ps), len(cfgs), fleetPortSpan())
	}
	mark := markCPU()
	var runs []traceRun
	for _, sl := range o.slices {
		reqs := trace.Slice(all, sl.from, sl.length)
		if len(reqs) == 0 {
			return fmt.Errorf("-trace %s: no requests in the slice %s (the trace's last arrives at %s)", o.path, sl, all[len(all)-1].At)
		}
		run, err := replaySlice(ctx, o, ps, sl, reqs, stderr)
		if err != nil {
			return err
		}
		runs = append(runs, run)
	}
	name := traceResultName(o)
	md := traceMarkdown(o, format, runs, ps, cpuSince(mark), name+".csv")
	if err := writeResult(o.out, name+".md", md); err != nil {
		return err
	}
	if err := writeResult(o.out, name+".csv", traceCSV(o, runs, ps)); err != nil {
		return err
	}
	fmt.Fprint(stdout, traceSummary(o, format, runs, ps, filepath.Join(o.out, time.Now().Format("2006-01-02"), name+".md")))
	return nil
}

// traceResultName names the result files: traces-<trace file>-<slices>.
func traceResultName(o traceOptions) string {
	base := strings.TrimSuffix(filepath.Base(o.path), filepath.Ext(o.path))
	var sl []string
	for _, s := range o.slices {
		sl = append(sl, s.String())
	}
	name := "traces-" + base + "-" + strings.Join(sl, "_")
	if o.speedup != 1 {
		name += fmt.Sprintf("-x%g", o.speedup)
	}
	return name
}

// armStartGrace bounds the start of a slice's arms (Caddy processes, and the first loads of the
// sglang_load rows): with the last request's send time and its timeout, a slice's deadline.
const armStartGrace = 2 * time.Minute

// replaySlice starts every arm, each with its own fleet, sends each the slice's requests at their
// (compressed) trace times whatever the answers, and summarises each arm once every request ended.
func replaySlice(parent context.Context, o traceOptions, ps []policy, sl traceSlice, reqs []trace.Request, stderr io.Writer) (traceRun, error) {
	run := traceRun{slice: sl, stats: trace.Summarize(reqs), unlimited: trace.UnlimitedHitRate(reqs),
		lru: trace.LRUHitRate(reqs, o.fleet.cacheTokens())}
	prompts := make([]int, len(reqs))
	for i, r := range reqs {
		prompts[i] = r.InputTokens
	}
	slices.Sort(prompts)
	run.longFrom = quantile(prompts, 0.9)
	run.reqs = trace.Compress(reqs, o.speedup)
	bodies := make([]string, len(reqs))
	for i, r := range run.reqs {
		bodies[i] = string(traceBody(r, traceSalt, o.maxTokens))
	}
	ctx, cancel := context.WithTimeout(parent, run.reqs[len(run.reqs)-1].At+o.timeout+armStartGrace)
	defer cancel()
	cpu0 := markCPU()
	arms, err := startTraceArms(ctx, o, ps, stderr)
	if err != nil {
		return run, err
	}
	closeArms := func() { // before the CPU is counted: a Caddy's counts once it has exited
		for _, a := range arms {
			a.Close()
		}
		arms = nil
	}
	defer closeArms()
	run.armsStarted = time.Since(cpu0.at)
	polls0 := make([][]int64, len(arms))
	for i, a := range arms {
		polls0[i] = a.fleet.pollCounts()
	}
	begin := replay(ctx, arms, run.reqs, bodies, run.longFrom, o.timeout)
	if err := parent.Err(); err != nil {
		return run, err
	}
	run.replayed = time.Since(begin)
	for i, a := range arms {
		r := summarise(a, ps[i].name, begin, polls0[i])
		for _, c := range a.caddys {
			counts, err := c.routingCounts()
			if err != nil {
				fmt.Fprintf(stderr, "sglang-bench: %s: reading metrics: %v\n", ps[i].name, err)
			}
			r.routing.add(counts)
		}
		if len(a.caddys) > 0 && a.policy.interval > 0 {
			alone, prefill, err := a.caddys[0].speeds(a.fleet.addrs)
			if err != nil {
				fmt.Fprintf(stderr, "sglang-bench: %s: reading speeds: %v\n", ps[i].name, err)
			}
			r.speeds = speedsLine(alone, prefill)
		}
		fmt.Fprintf(stderr, "sglang-bench: trace %s %-34s p50 %6.2fs p99 %6.2fs TTFT mean %6.2fs share %s%s%s%s failed %d %s\n", sl, r.name,
			r.p50, r.p99, r.ttftMean, shares([]armResult{r}), r.cacheLine(), r.routing, r.speeds, r.failed, r.firstFailure)
		run.results = append(run.results, r)
		run.samples = append(run.samples, a.samples)
	}
	closeArms()
	run.cpu = cpuSince(cpu0)
	return run, nil
}

// startTraceArms starts an arm per policy, each on its own fleet of the -fleet spec, all at once; a start
// that fails is tried once more on a fresh fleet and fresh Caddy processes.
func startTraceArms(ctx context.Context, o traceOptions, ps []policy, stderr io.Writer) ([]*arm, error) {
	cfgs := o.fleet.configs()
	arms := make([]*arm, len(ps))
	errs := make([]error, len(ps))
	var wg sync.WaitGroup
	for i, p := range ps {
		var ports []int
		if o.fleetPorts != 0 {
			for w := range cfgs {
				ports = append(ports, o.fleetPorts+i*len(cfgs)+w)
			}
		}
		wg.Go(func() {
			for try := range 2 {
				var f *fleet
				if f, errs[i] = startFleetOf(cfgs, ports); errs[i] == nil {
					arms[i], errs[i] = startArmOn(ctx, o.caddy, p, 1, f)
				}
				if errs[i] == nil || ctx.Err() != nil {
					return
				}
				if try == 0 {
					fmt.Fprintf(stderr, "sglang-bench: starting %s again: %v\n", p.name, errs[i])
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			for _, a := range arms {
				if a != nil {
					a.Close()
				}
			}
			return nil, fmt.Errorf("%s: %w", ps[i].name, err)
		}
	}
	return arms, nil
}

// replay sends request i's body to every arm at reqs[i].At from the start, open loop: whatever the
// answers of the earlier ones, each with its own timeout. It returns when every request has ended,
// with the moment it started. KV use is sampled on every fleet meanwhile.
func replay(ctx context.Context, arms []*arm, reqs []trace.Request, bodies []string, longFrom int, timeout time.Duration) time.Time {
	kvCtx, stopKV := context.WithCancel(ctx)
	defer stopKV()
	for _, a := range arms {
		go a.fleet.sampleKV(kvCtx, 200*time.Millisecond)
	}
	var wg sync.WaitGroup
	begin := time.Now()
	for i, r := range reqs {
		if d := time.Until(begin.Add(r.At)); d > 0 {
			select {
			case <-time.After(d): // the trace's arrival schedule, not synchronisation
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		for _, a := range arms {
			wg.Go(func() {
				s := a.sendTrace(ctx, i, bodies[i], r.InputTokens > longFrom, timeout)
				a.mu.Lock()
				a.samples = append(a.samples, s)
				a.mu.Unlock()
			})
		}
	}
	wg.Wait()
	return begin
}

// sendTrace sends request i's body through the arm, streamed, and measures it.
func (a *arm) sendTrace(ctx context.Context, i int, body string, long bool, timeout time.Duration) sample {
	s := sample{job: i, long: long, stream: true, worker: -1}
	url := ""
	if len(a.routers) > 0 {
		r := a.routers[0]
		w := r.pick(body) // the prompt leads the body: a prefix router matches on it as on the prompt
		defer r.done(w)
		url = "http://" + a.fleet.addrs[w]
	} else {
		url = a.caddys[0].SiteURL
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		s.failure = err.Error()
		return s
	}
	req.Header.Set("Content-Type", "application/json")
	s.start = time.Now()
	resp, err := a.client.Do(req)
	if err != nil {
		s.failure = err.Error()
		if errors.Is(err, context.DeadlineExceeded) {
			s.failure = fmt.Sprintf("no answer within %s: %v", timeout, err)
		}
		return s
	}
	defer resp.Body.Close()
	s.worker = a.fleet.index(resp.Header.Get(sglangsim.HeaderWorker))
	s.readAnswer(resp, true, false)
	return s
}
