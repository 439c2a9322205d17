// Command sglang-bench measures the caddy-sglang load balancer through a real Caddy process:
//
//	-mode quality   routing quality: seeded workloads through Caddy to simulated workers of unequal
//	                capacity, per selection policy, on several seeds and two rates, all policies of a
//	                seed at once; writes a Markdown table and an SVG chart
//	-mode replicas  1 against 3 Caddy instances in front of one fleet, at the same total rate
//	-mode affinity  prefix-sharing workloads: cache hit rate, TTFT and latency per policy, with
//	                re-implementations of the SGLang gateway's cache_aware and prefix_hash
//	-mode trace     a slice of a public production trace (Azure 2023 CSV, Mooncake JSONL) replayed at its
//	                own arrival times through every policy, each with its own Caddy and a fleet of simulated
//	                workers of the -fleet spec: latency, TTFT, throughput and prefix-cache hits
//	-mode backend   a fast loopback backend for the proxy-overhead script: small answers, fresh loads
//	-mode monitor   the load monitor polling 1,000 endpoints at 1s: its CPU, and whether one hung
//	                endpoint delays the others' reports
//	-mode overhead  Caddy's CPU time per proxied request, sglang_load against least_conn, at a fixed
//	                request rate in alternating rounds
//	-mode port      prints a free loopback port, for scripts
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "sglang-bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sglang-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	mode := fs.String("mode", "quality", "quality, replicas, affinity, trace, backend, monitor, overhead, port (prints a free loopback port), loadservers and backends (started by monitor and overhead)")
	var q qualityOptions
	fs.StringVar(&q.caddy, "caddy", "bin/caddy", "Caddy binary with the plugin")
	fs.StringVar(&q.out, "out", "results", "results folder; a subfolder per date is created")
	seeds := fs.String("seeds", "1,2,3,4,5", "workload seeds, comma list; every policy runs every seed")
	rates := fs.String("rates", "", "mean arrival rates, requests/s (Poisson), comma list (default: quality 8,24; replicas 24; affinity 4,8)")
	fs.IntVar(&q.requests, "requests", 2000, "requests per policy and seed (affinity: at most this many of each workload)")
	fs.Float64Var(&q.samplesShare, "samples-share", 0, "quality: this share of the requests ask for -samples answers each (n); 0: none")
	fs.Float64Var(&q.outputScale, "output-scale", 1, "quality: max_tokens of every request times this (long answers, as a reasoning model's)")
	fs.BoolVar(&q.independentAnswers, "independent-answers", false, "quality: draw each request's answer size (max_tokens 64 or 512, 20% long) apart from its prompt's, so that only max_tokens tells a long answer; the why tables' long then means a long answer")
	fs.IntVar(&q.samples, "samples", 4, "quality: answers asked for (n) by the -samples-share of requests")
	fs.BoolVar(&sglangAdmission, "sglang-admission", true, "quality, replicas, affinity: the simulated workers admit as SGLang does (KV allocated as decoded, admission on a guess of the output to come, retraction when it was wrong); -sglang-admission=false: each request reserves its prompt and whole max_tokens, as in the results files that do not name their admission")
	fs.IntVar(&q.fleetPorts, "fleet-ports", 20000, "quality, replicas, affinity: the simulated workers listen on fixed loopback ports from this one on (a block per seed and arm, below the ephemeral range), so a rerun draws the same homes for the same prefixes; 0: any free ports")
	fs.IntVar(&q.parallel, "parallel", 0, "seeds run at once; 0: quality and replicas up to 3, as many as keep the offered load (rate × policies × seeds) near 11 × 24 requests/s, affinity 1 (the policies of a seed always run at once)")
	fs.StringVar(&q.only, "policies", "", "comma list of policy names to run (default: all of the mode but its studies); overhead: the studies to run besides its four rows")
	instances := fs.String("instances", "1,3", "replicas, affinity: Caddy (or router) instance counts to compare, comma list")
	var af affinityOptions
	fs.StringVar(&af.workloads, "workloads", "shared-prefix,sessions,unique", "affinity: workloads, comma list (also: agents, chat, tools)")
	fs.IntVar(&af.questions, "questions", defaultSharedPrefix.questions, "affinity: questions per group of the shared-prefix and tools workloads (each group's first finds nothing cached, so more questions run longer past the start)")
	fs.IntVar(&af.questionTokens, "question-tokens", 0, "affinity: tokens of each question of the shared-prefix and tools workloads (0: the shapes' 128)")
	fs.StringVar(&af.option, "affinity-option", "auto", "affinity: run the lb_policy sglang_load { affinity prefix } row: on, off, or auto (when the binary accepts it)")
	var tr traceOptions
	fs.StringVar(&tr.path, "trace", "", "trace: the trace file, Azure 2023 CSV or Mooncake JSONL (e.g. ../shared/traces/mooncake_conversation_first_half.jsonl)")
	from := fs.Duration("from", 0, "trace: where the slice starts, in trace time")
	length := fs.Duration("length", 5*time.Minute, "trace: the slice's length, in trace time; 0: to the end")
	traceSlices := fs.String("slices", "", "trace: several slices, a comma list of FROM+LENGTH (e.g. 0s+5m,10m+5m), replayed one after "+
		"another, each through every row; the report gives medians and ranges over them as over seeds. Overrides -from and -length")
	fs.Float64Var(&tr.speedup, "speedup", 1, "trace: send the slice this many times faster (arrival times divided by it)")
	fleetSpec := fs.String("fleet", defaultTraceFleet, "trace: the simulated workers of every row, groups Nx(key=value,...) joined by +; keys "+
		"pool (KV tokens), prefill and decode (tokens/s), batch (running requests), chunk (prefill batch tokens), timing (linear or step), "+
		"speed (the step model's speed factor), host (host cache tier tokens), hostload (its load speed, tokens/s); unset keys take the simulator's defaults")
	maxTokens := fs.String("max-tokens", "absent", "trace: what the clients send as max_tokens: exact (the traced output length), "+
		"cap:N (N on every request), absent (none); every request also sends answer_tokens, the traced output length")
	fs.DurationVar(&tr.timeout, "trace-timeout", requestTimeout, "trace: each request's timeout; a slice's run is bounded by its "+
		"length ÷ -speedup, plus this, plus 2m for the rows to start")
	addr := fs.String("addr", "127.0.0.1:0", "backend: listen address")
	var m monitorOptions
	fs.IntVar(&m.endpoints, "endpoints", 1000, "monitor: number of endpoints")
	fs.DurationVar(&m.interval, "interval", 1e9, "monitor: polling interval")
	fs.DurationVar(&m.window, "window", 10e9, "monitor: measurement window")
	fs.StringVar(&m.baseline, "baseline", "", "monitor: a second Caddy binary, measured in alternating rounds with -caddy")
	fs.IntVar(&m.rounds, "rounds", 3, "monitor: rounds per Caddy binary (0: only the in-process monitor)")
	var ov overheadOptions
	fs.IntVar(&ov.requests, "overhead-requests", 20000, "overhead: requests per round and policy")
	fs.IntVar(&ov.chunk, "chunk", 1000, "overhead: requests per run; runs alternate between the policies")
	fs.Float64Var(&ov.rate, "req-rate", 2000, "overhead: requests per second, well below saturation")
	fs.IntVar(&ov.backends, "backends", 4, "overhead: loopback backends")
	fs.IntVar(&ov.conns, "conns", 16, "overhead: most requests in flight")
	fs.IntVar(&ov.rounds, "overhead-rounds", 5, "overhead: rounds, each one run per policy")
	bodyBytes := fs.Int("overhead-body", 0, "overhead: the chat request's size in bytes (0: a 72-byte chat)")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of this process to the file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	var err error
	if q.seeds, err = parseInts("seeds", *seeds); err != nil {
		return err
	}
	if *rates != "" {
		if q.rates, err = parseFloats("rates", *rates); err != nil {
			return err
		}
	}
	if q.parallel < 0 {
		return fmt.Errorf("-parallel %d: must not be negative", q.parallel)
	}
	if last := q.fleetPorts + fleetPortSpan() - 1; q.fleetPorts != 0 && (q.fleetPorts < 1024 || last > 65535) {
		return fmt.Errorf("-fleet-ports %d: want 0 or a port from 1024 with %d more after it", q.fleetPorts, last-q.fleetPorts)
	}
	if q.requests < 1 {
		return fmt.Errorf("-requests %d: must be at least 1", q.requests)
	}
	if q.samplesShare < 0 || q.samplesShare > 1 {
		return fmt.Errorf("-samples-share %g: want a share in [0, 1]", q.samplesShare)
	}
	if !(q.outputScale > 0 && q.outputScale <= 64) {
		return fmt.Errorf("-output-scale %g: want a factor in (0, 64]", q.outputScale)
	}
	if q.samples < 1 || q.samples > sglangsim.MaxSamples {
		return fmt.Errorf("-samples %d: want 1 to %d, as the simulator takes", q.samples, sglangsim.MaxSamples)
	}
	ns, err := parseInts("instances", *instances)
	if err != nil {
		return err
	}
	for _, n := range ns {
		if n < 1 {
			return fmt.Errorf("-instances: %d is not a positive count", n)
		}
		q.instances = append(q.instances, int(n))
	}
	switch *mode {
	case "quality":
		if q.rates == nil {
			q.rates = []float64{8, 24}
		}
		return runQuality(ctx, q, stdout, stderr)
	case "replicas":
		if q.rates == nil {
			q.rates = []float64{24}
		}
		return runReplicas(ctx, q, stdout, stderr)
	case "affinity":
		if q.rates == nil {
			q.rates = []float64{4, 8}
		}
		if af.questions < 1 {
			return fmt.Errorf("-questions %d: must be at least 1", af.questions)
		}
		if af.questionTokens < 0 {
			return fmt.Errorf("-question-tokens %d: must be at least 0", af.questionTokens)
		}
		af.qualityOptions = q
		return runAffinity(ctx, af, stdout, stderr)
	case "trace":
		if err := tr.parse(*from, *length, *traceSlices, *fleetSpec, *maxTokens); err != nil {
			return err
		}
		tr.qualityOptions = q
		return runTrace(ctx, tr, stdout, stderr)
	case "backend":
		return runBackend(ctx, *addr, stdout)
	case "monitor":
		m.out, m.caddy = q.out, q.caddy
		if m.rounds == 0 {
			m.caddy = ""
		}
		return runMonitor(ctx, m, stdout, stderr)
	case "overhead":
		ov.caddy, ov.out = q.caddy, q.out
		ov.body = overheadBody(*bodyBytes)
		if ov.policies, err = overheadRows(q.only); err != nil {
			return err
		}
		return runOverhead(ctx, ov, stdout, stderr)
	case "port":
		port, err := freePort()
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, port)
		return nil
	case "loadservers":
		return runLoadServers(ctx, m.endpoints, true, stdout)
	case "backends":
		return runLoadServers(ctx, m.endpoints, false, stdout)
	}
	return fmt.Errorf("unknown -mode %q: want quality, replicas, affinity, trace, backend, monitor or overhead", *mode)
}
