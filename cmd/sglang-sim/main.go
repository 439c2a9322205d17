// Command sglang-sim runs N simulated SGLang workers on consecutive local ports, for demos, end-to-end
// tests and benchmarks of the caddy-sglang load balancer.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "sglang-sim:", err)
		os.Exit(2)
	}
}

type options struct {
	count, basePort, grpcBasePort int
	capacities                    []int64
	decodeSpeed, prefillSpeed     float64
	maxRunning, dpRanks           int
	legacyShape                   bool
	prefixCache, prefillCounters  bool
	finishEarly                   float64
	sglangAdmission               bool
	timing                        sglangsim.Timing
	stepBase, stepPrefillToken    float64
	stepAttention, stepDecodeReq  float64
	stepKVToken                   float64
	speeds                        []float64
	chunkedPrefill                int64
	mixedChunk                    bool
	hostPool                      int64
	hostLoadSpeed                 float64
	apiKey, listen, version       string
	allowRemote                   bool
	statsEvery, shutdownTimeout   time.Duration
}

func parseFlags(args []string, output io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("sglang-sim", flag.ContinueOnError)
	fs.SetOutput(output)
	fs.Usage = func() {
		fmt.Fprintf(output, "Usage: sglang-sim [flags]\n\nRuns simulated SGLang workers; worker i listens on <listen>:<base-port+i>.\n"+
			"Flip faults on a running worker with POST /sim/fault?hang_loads=1&garbage=1&not_found=1&down=5s (reset=1 clears).\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fs.IntVar(&o.count, "count", 3, "number of workers")
	fs.IntVar(&o.basePort, "base-port", 30000, "HTTP port of worker 0; worker i listens on base-port+i")
	fs.IntVar(&o.grpcBasePort, "grpc-base-port", 0, "gRPC port of worker 0 (SglangScheduler.GetLoads); 0 disables gRPC")
	capacity := fs.String("capacity", "65536", "comma list of KV pool sizes (max_total_num_tokens per DP rank) per worker, cycled")
	fs.Float64Var(&o.decodeSpeed, "decode-speed", 200, "decode speed of a request running alone, tokens/s")
	fs.Float64Var(&o.prefillSpeed, "prefill-speed", 8000, "prefill speed per DP rank, prompt tokens/s")
	fs.IntVar(&o.maxRunning, "max-running", 64, "running batch cap per DP rank (max_running_requests)")
	fs.IntVar(&o.dpRanks, "dp-ranks", 1, "data-parallel ranks per worker")
	fs.BoolVar(&o.legacyShape, "legacy-shape", false, "answer /v1/loads in the early-2026 shape (dp_rank_count, aggregate, num_total_reqs)")
	fs.BoolVar(&o.prefixCache, "prefix-cache", true, "keep a prefix cache per DP rank (16-token blocks, LRU); -prefix-cache=false prefills every prompt token")
	fs.BoolVar(&o.prefillCounters, "prefill-counters", true, "send total_prefill_uncached_tokens and total_prefill_busy_us in /v1/loads; false acts as an older SGLang")
	fs.BoolVar(&o.sglangAdmission, "sglang-admission", true, "admit as SGLang does: KV allocated as decoded, admission on a guess of the output to come, requests retracted when it was wrong; -sglang-admission=false: each request reserves its prompt and whole max_tokens")
	fs.TextVar(&o.timing, "timing", sglangsim.TimingLinear, "timing model: linear (prefill a FIFO stream at -prefill-speed, decode at -decode-speed shared by the batch) "+
		"or step (SGLang's forward passes: a prefill chunk or a decode token per running request each, timed by the -step-* costs, "+
		"defaults Llama-3.1-8B-Instruct on one H100 80GB)")
	fs.Float64Var(&o.stepBase, "step-base", 0, "step timing: seconds every forward pass takes (0: 0.006)")
	fs.Float64Var(&o.stepPrefillToken, "step-prefill-token", 0, "step timing: seconds per prompt token a pass prefills (0: 30e-6)")
	fs.Float64Var(&o.stepAttention, "step-attention", 0, "step timing: seconds per prefilled token per token of context it attends to (0: 1e-9)")
	fs.Float64Var(&o.stepDecodeReq, "step-decode-request", 0, "step timing: seconds each decoding request adds to a pass (0: 20e-6)")
	fs.Float64Var(&o.stepKVToken, "step-kv-token", 0, "step timing: seconds per KV token a decoding request reads (0: 49e-9)")
	speed := fs.String("speed", "1", "step timing: comma list of GPU speed factors per worker, cycled; a worker of speed 2 runs each pass in half the time")
	fs.Int64Var(&o.chunkedPrefill, "chunked-prefill-size", 8192, "step timing: prompt tokens one pass prefills at most, as SGLang's --chunked-prefill-size")
	fs.BoolVar(&o.mixedChunk, "mixed-chunk", false, "step timing: decode in the same pass as a prefill chunk, as SGLang's --enable-mixed-chunk; by default a prefill pass stalls decoding")
	fs.Int64Var(&o.hostPool, "host-pool", 0, "host-memory tier of the prefix cache per DP rank, in tokens, as SGLang's --enable-hierarchical-cache: evicted blocks go there and load back rather than prefill (SGLang's default --hicache-ratio 2 is about one -capacity); 0 disables")
	fs.Float64Var(&o.hostLoadSpeed, "host-load-speed", 190000, "tokens/s a prefix loads back from the host tier (25 GB/s over PCIe at 128 KiB a token)")
	fs.Float64Var(&o.finishEarly, "finish-early", 0, "end answers early: each length drawn in [f*max_tokens, max_tokens] from a hash of the request; 0 disables")
	fs.StringVar(&o.apiKey, "api-key", "", "require Authorization: Bearer <key> on load and generate routes")
	fs.StringVar(&o.listen, "listen", "127.0.0.1", "host to listen on")
	fs.BoolVar(&o.allowRemote, "allow-remote", false, "allow a -listen host that is not loopback")
	fs.StringVar(&o.version, "version", "", "SGLang version to report (default \"0.5.0-sim\")")
	fs.DurationVar(&o.statsEvery, "stats", 0, "log every worker's stats at this interval; 0 disables")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 5*time.Second, "on SIGINT/SIGTERM, how long running requests may finish")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var err error
	if o.capacities, err = parseCapacities(*capacity); err != nil {
		return o, err
	}
	if o.speeds, err = parseSpeeds(*speed); err != nil {
		return o, err
	}
	switch {
	case o.count < 1:
		return o, fmt.Errorf("invalid -count %d: want at least 1", o.count)
	case o.basePort < 1 || o.basePort+o.count-1 > 65535:
		return o, fmt.Errorf("invalid -base-port %d: ports %d..%d must be within 1..65535", o.basePort, o.basePort, o.basePort+o.count-1)
	case o.grpcBasePort < 0 || o.grpcBasePort > 0 && o.grpcBasePort+o.count-1 > 65535:
		return o, fmt.Errorf("invalid -grpc-base-port %d", o.grpcBasePort)
	case o.grpcBasePort > 0 && overlap(o.basePort, o.grpcBasePort, o.count):
		return o, fmt.Errorf("-grpc-base-port %d overlaps the HTTP ports %d..%d", o.grpcBasePort, o.basePort, o.basePort+o.count-1)
	case !(o.decodeSpeed > 0):
		return o, fmt.Errorf("invalid -decode-speed %v: want > 0", o.decodeSpeed)
	case !(o.prefillSpeed > 0):
		return o, fmt.Errorf("invalid -prefill-speed %v: want > 0", o.prefillSpeed)
	case o.maxRunning < 1:
		return o, fmt.Errorf("invalid -max-running %d: want at least 1", o.maxRunning)
	case o.dpRanks < 1:
		return o, fmt.Errorf("invalid -dp-ranks %d: want at least 1", o.dpRanks)
	case !(o.finishEarly >= 0 && o.finishEarly < 1):
		return o, fmt.Errorf("invalid -finish-early %v: want a fraction in [0, 1), 0 to disable", o.finishEarly)
	case o.statsEvery < 0:
		return o, fmt.Errorf("invalid -stats %v: want >= 0", o.statsEvery)
	case o.chunkedPrefill < 1:
		return o, fmt.Errorf("invalid -chunked-prefill-size %d: want at least 1", o.chunkedPrefill)
	case o.hostPool < 0:
		return o, fmt.Errorf("invalid -host-pool %d: want >= 0 tokens, 0 to disable", o.hostPool)
	case !(o.hostLoadSpeed > 0) || math.IsInf(o.hostLoadSpeed, 1):
		return o, fmt.Errorf("invalid -host-load-speed %v: want > 0 tokens/s", o.hostLoadSpeed)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{{"step-base", o.stepBase}, {"step-prefill-token", o.stepPrefillToken}, {"step-attention", o.stepAttention},
		{"step-decode-request", o.stepDecodeReq}, {"step-kv-token", o.stepKVToken}} {
		if !(f.v >= 0) || math.IsInf(f.v, 1) {
			return o, fmt.Errorf("invalid -%s %v: want seconds >= 0, 0 for the default", f.name, f.v)
		}
	}
	if !o.allowRemote && !isLoopback(o.listen) {
		return o, fmt.Errorf("-listen %q is not a loopback address: the simulator has no real auth, pass -allow-remote to expose it", o.listen)
	}
	return o, nil
}

func parseCapacities(s string) ([]int64, error) {
	var out []int64
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("invalid -capacity %q: want a comma list of positive token counts", s)
		}
		out = append(out, n)
	}
	return out, nil
}

func parseSpeeds(s string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || !(v > 0) || math.IsInf(v, 1) {
			return nil, fmt.Errorf("invalid -speed %q: want a comma list of positive factors", s)
		}
		out = append(out, v)
	}
	return out, nil
}

func overlap(a, b, n int) bool { return a < b+n && b < a+n }

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// run starts the workers and serves until ctx ends. ready, when set, receives the servers once all
// listen (for tests).
func run(ctx context.Context, args []string, output io.Writer, ready chan<- []*server) error {
	o, err := parseFlags(args, output)
	if err != nil {
		return err
	}
	logger := log.New(output, "sglang-sim: ", log.LstdFlags)
	servers := make([]*server, o.count)
	for i := range servers {
		w := sglangsim.New(sglangsim.Config{
			Name:                fmt.Sprintf("sim-%d", i),
			MaxTotalTokens:      o.capacities[i%len(o.capacities)],
			DecodeTokensPerSec:  o.decodeSpeed,
			PrefillTokensPerSec: o.prefillSpeed,
			MaxRunningRequests:  o.maxRunning,
			DPRanks:             o.dpRanks,
			LegacyShape:         o.legacyShape,
			DisablePrefixCache:  !o.prefixCache,
			OmitPrefillCounters: !o.prefillCounters,
			FinishEarly:         o.finishEarly,
			SGLangAdmission:     o.sglangAdmission,
			APIKey:              o.apiKey,
			Version:             o.version,

			Timing:               o.timing,
			StepBaseSec:          o.stepBase,
			StepPrefillTokenSec:  o.stepPrefillToken,
			StepAttentionSec:     o.stepAttention,
			StepDecodeRequestSec: o.stepDecodeReq,
			StepKVTokenSec:       o.stepKVToken,
			Speed:                o.speeds[i%len(o.speeds)],
			ChunkedPrefillSize:   o.chunkedPrefill,
			MixedChunk:           o.mixedChunk,
			HostPoolTokens:       o.hostPool,
			HostLoadTokensPerSec: o.hostLoadSpeed,
		})
		s := &server{w: w, log: logger, httpAddr: net.JoinHostPort(o.listen, strconv.Itoa(o.basePort+i))}
		if o.grpcBasePort > 0 {
			s.grpcAddr = net.JoinHostPort(o.listen, strconv.Itoa(o.grpcBasePort+i))
		}
		servers[i] = s
	}
	for i, s := range servers {
		if err := s.start(); err != nil {
			shutdownAll(servers[:i], 0)
			return err
		}
		w := s.w.Config()
		grpcInfo := ""
		if s.grpcAddr != "" {
			grpcInfo = " grpc " + s.grpcAddr
		}
		logger.Printf("worker %s listening on http://%s%s capacity=%d dp_ranks=%d max_running=%d timing=%s %s legacy_shape=%t prefix_cache=%t host_pool=%d finish_early=%g sglang_admission=%t",
			w.Name, s.httpAddr, grpcInfo, w.MaxTotalTokens, w.DPRanks, w.MaxRunningRequests, w.Timing, speedInfo(w), w.LegacyShape,
			!w.DisablePrefixCache, w.HostPoolTokens, w.FinishEarly, w.SGLangAdmission)
		s.w.Faults().OnDown(func(d time.Duration) { go s.bounce(d) })
	}
	if ready != nil {
		ready <- servers
	}

	var tick <-chan time.Time
	if o.statsEvery > 0 {
		t := time.NewTicker(o.statsEvery)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-tick:
			logStats(logger, servers)
		case <-ctx.Done():
			logger.Printf("shutting down")
			shutdownAll(servers, o.shutdownTimeout)
			logStats(logger, servers)
			return nil
		}
	}
}

// speedInfo names the speeds the worker's timing model runs at.
func speedInfo(c sglangsim.Config) string {
	if c.Timing == sglangsim.TimingStep {
		return fmt.Sprintf("speed=%g chunked_prefill=%d mixed_chunk=%t", c.Speed, c.ChunkedPrefillSize, c.MixedChunk)
	}
	return fmt.Sprintf("decode=%g tok/s prefill=%g tok/s", c.DecodeTokensPerSec, c.PrefillTokensPerSec)
}

func logStats(logger *log.Logger, servers []*server) {
	for _, s := range servers {
		st := s.w.Stats()
		var running, waiting int
		var used int64
		for _, l := range st.Loads {
			running += l.Running
			waiting += l.Waiting
			used += l.UsedTokens
		}
		logger.Printf("worker %s served=%d failed=%d running=%d waiting=%d used_tokens=%d peak_token_usage=%.4f prompt_tokens=%d cached_tokens=%d prefilled_tokens=%d",
			st.Name, st.Served, st.Failed, running, waiting, used, st.PeakTokenUsage, st.PromptTokens, st.CachedTokens, st.PrefilledTokens)
	}
}

// shutdownAll stops the workers in parallel: listeners close at once, running requests get up to
// timeout to finish, then the rest are failed and their connections closed.
func shutdownAll(servers []*server, timeout time.Duration) {
	var wg sync.WaitGroup
	for _, s := range servers {
		wg.Go(func() { s.shutdown(timeout) })
	}
	wg.Wait()
}
