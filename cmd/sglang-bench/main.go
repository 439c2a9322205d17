// Command sglang-bench measures the caddy-sglang load balancer through a real Caddy process:
//
//	-mode quality   routing quality: a seeded workload through Caddy to simulated workers of unequal
//	                capacity, once per selection policy; writes a Markdown table and an SVG chart
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
	mode := fs.String("mode", "quality", "quality, backend, monitor, overhead, port (prints a free loopback port), loadservers (started by monitor)")
	var q qualityOptions
	fs.StringVar(&q.caddy, "caddy", "bin/caddy", "Caddy binary with the plugin")
	fs.StringVar(&q.out, "out", "results", "results folder; a subfolder per date is created")
	fs.Int64Var(&q.seed, "seed", 1, "workload seed")
	fs.Float64Var(&q.rate, "rate", 24, "mean arrival rate, requests/s (Poisson)")
	fs.DurationVar(&q.duration, "duration", 15e9, "how long requests arrive, per policy")
	fs.StringVar(&q.only, "policies", "", "comma list of policy names to run (default: all)")
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
	switch *mode {
	case "quality":
		return runQuality(ctx, q, stdout, stderr)
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
	return fmt.Errorf("unknown -mode %q: want quality, backend, monitor or overhead", *mode)
}
