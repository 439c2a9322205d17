// Command sglang-demo is the one-command demo (`make demo`): it starts three simulated SGLang workers of
// different sizes and Caddy with Caddyfile.example, sends a burst of mixed requests through Caddy,
// prints where they went and how long they took, and stops everything again.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errInterrupted):
		fmt.Fprintln(os.Stderr, "sglang-demo:", err)
		os.Exit(130)
	default:
		fmt.Fprintln(os.Stderr, "sglang-demo:", err)
		os.Exit(1)
	}
}

var errInterrupted = errors.New("interrupted")

// workers is the number of simulated workers: the upstreams of Caddyfile.example.
const workers = 3

// The addresses Caddyfile.example uses, which the port flags move.
const (
	defaultHTTPPort   = 8080
	defaultAdminPort  = 2019
	defaultWorkerPort = 30000
)

type options struct {
	caddy, sim, config              string
	requests, concurrency           int
	longFrac, streamFrac            float64
	seed                            uint64
	httpPort, adminPort, workerPort int
	capacities                      []int
	speeds                          []float64
	readyTimeout, timeout, grace    time.Duration
	affinity                        bool   // turn on affinity prefix in the Caddyfile
	metric                          string // the Caddyfile's sglang_load metric, when set
	sharedPrompts                   int    // system prompts the requests share; 0: none
	sglangAdmission                 bool   // the workers admit as SGLang does
}

func parseFlags(args []string, output io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("sglang-demo", flag.ContinueOnError)
	fs.SetOutput(output)
	fs.Usage = func() {
		fmt.Fprintf(output, "Usage: sglang-demo [flags]\n\nStarts %d simulated SGLang workers and Caddy with the given Caddyfile, sends a burst of\n"+
			"requests through Caddy, prints per-worker results and the admin API's view, then stops them all.\n\nFlags:\n", workers)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.caddy, "caddy", "bin/caddy", "Caddy binary with the plugin (go build ./cmd/caddy)")
	fs.StringVar(&o.sim, "sim", "bin/sglang-sim", "simulator binary (go build ./cmd/sglang-sim)")
	fs.StringVar(&o.config, "config", "Caddyfile.example", "Caddyfile to run; its addresses are moved when the port flags differ from it")
	fs.IntVar(&o.requests, "requests", 200, "requests in the burst")
	fs.IntVar(&o.concurrency, "concurrency", 32, "requests in flight at once")
	fs.Float64Var(&o.longFrac, "long", 0.2, "fraction of long requests (thousands of prompt tokens, hundreds of output tokens)")
	fs.Float64Var(&o.streamFrac, "stream", 0.25, "fraction of requests sent with stream: true")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the request mix")
	fs.IntVar(&o.httpPort, "http-port", defaultHTTPPort, "Caddy's HTTP port")
	fs.IntVar(&o.adminPort, "admin-port", defaultAdminPort, "Caddy's admin API port (on localhost)")
	fs.IntVar(&o.workerPort, "worker-port", defaultWorkerPort, fmt.Sprintf("port of worker 0; worker i listens on 127.0.0.1:<worker-port+i>, i < %d", workers))
	capacity := fs.String("capacity", "16384,32768,65536", "KV pool of each worker, in tokens")
	speed := fs.String("decode-speed", "100,200,400", "decode speed of each worker (one request alone), in tokens/s")
	fs.DurationVar(&o.readyTimeout, "ready-timeout", 30*time.Second, "how long the workers and Caddy may take to start")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "deadline of the burst")
	fs.DurationVar(&o.grace, "grace", 5*time.Second, "on shutdown, how long a process may take after SIGTERM before SIGKILL")
	fs.BoolVar(&o.affinity, "affinity", false, "turn on affinity prefix in the Caddyfile's lb_policy sglang_load block (its metric line dropped: affinity prices with the cost metric); requests share 32 system prompts unless -shared-prompts says otherwise")
	fs.StringVar(&o.metric, "metric", "", "set the `metric` of the Caddyfile's lb_policy sglang_load block, e.g. cost (its choose line dropped, so the metric's own default choice applies)")
	fs.BoolVar(&o.sglangAdmission, "sglang-admission", true, "the simulated workers admit as SGLang does (sglang-sim -sglang-admission): KV allocated as decoded, admission on a guess of the output to come, requests retracted when it was wrong, and the table counts the retracted; -sglang-admission=false: each request reserves its prompt and whole max_tokens")
	fs.IntVar(&o.sharedPrompts, "shared-prompts", 0, fmt.Sprintf("requests share one of this many system prompts of %d tokens, sent as text so the workers' prefix caches can hit (0: none)", systemPromptTokens))
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if o.metric != "" {
		if o.affinity {
			return o, fmt.Errorf("-metric %s with -affinity: affinity prices with the cost metric", o.metric)
		}
		if _, err := loadpolicy.ParseMetric(o.metric); err != nil {
			return o, fmt.Errorf("-metric: %w", err)
		}
	}
	if o.affinity && o.sharedPrompts == 0 {
		o.sharedPrompts = 32 // more than a worker's cache holds: load alone would spread and evict them
	}
	var err error
	if o.capacities, err = parseList(*capacity, "-capacity", strconv.Atoi); err != nil {
		return o, err
	}
	if o.speeds, err = parseList(*speed, "-decode-speed", func(s string) (float64, error) { return strconv.ParseFloat(s, 64) }); err != nil {
		return o, err
	}
	validPort := func(p int) bool { return p > 0 && p <= 65535 }
	switch {
	case o.requests < 1:
		return o, fmt.Errorf("invalid -requests %d: want at least 1", o.requests)
	case o.concurrency < 1:
		return o, fmt.Errorf("invalid -concurrency %d: want at least 1", o.concurrency)
	case o.sharedPrompts < 0:
		return o, fmt.Errorf("invalid -shared-prompts %d: want 0 or more", o.sharedPrompts)
	case !(o.longFrac >= 0 && o.longFrac <= 1):
		return o, fmt.Errorf("invalid -long %v: want a fraction in [0, 1]", o.longFrac)
	case !(o.streamFrac >= 0 && o.streamFrac <= 1):
		return o, fmt.Errorf("invalid -stream %v: want a fraction in [0, 1]", o.streamFrac)
	case !validPort(o.httpPort):
		return o, fmt.Errorf("invalid -http-port %d", o.httpPort)
	case !validPort(o.adminPort):
		return o, fmt.Errorf("invalid -admin-port %d", o.adminPort)
	case !validPort(o.workerPort) || !validPort(o.workerPort+workers-1):
		return o, fmt.Errorf("invalid -worker-port %d: ports %d..%d must be within 1..65535", o.workerPort, o.workerPort, o.workerPort+workers-1)
	case o.httpPort == o.adminPort || inWorkerPorts(o, o.httpPort) || inWorkerPorts(o, o.adminPort):
		return o, fmt.Errorf("ports overlap: -http-port %d, -admin-port %d, -worker-port %d..%d", o.httpPort, o.adminPort, o.workerPort, o.workerPort+workers-1)
	case o.readyTimeout <= 0 || o.timeout <= 0 || o.grace <= 0:
		return o, errors.New("-ready-timeout, -timeout and -grace must be > 0")
	}
	for i, s := range o.speeds {
		if !(s > 0) {
			return o, fmt.Errorf("invalid -decode-speed %q: entry %d is not > 0", *speed, i)
		}
	}
	return o, nil
}

func inWorkerPorts(o options, p int) bool { return p >= o.workerPort && p < o.workerPort+workers }

// parseList parses a comma list of exactly one value per worker.
func parseList[T int | float64](s, name string, parse func(string) (T, error)) ([]T, error) {
	fields := strings.Split(s, ",")
	if len(fields) != workers {
		return nil, fmt.Errorf("invalid %s %q: want %d comma-separated values, one per worker", name, s, workers)
	}
	out := make([]T, len(fields))
	for i, f := range fields {
		v, err := parse(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("invalid %s %q: want %d positive numbers", name, s, workers)
		}
		out[i] = v
	}
	return out, nil
}

func (o options) workerAddr(i int) string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(o.workerPort+i))
}

// caddyfile returns the Caddyfile to run: the given one when the ports are its own, else a copy in dir
// with the addresses moved.
func (o options) caddyfile(dir string) (string, error) {
	b, err := os.ReadFile(o.config)
	if err != nil {
		return "", err
	}
	moves := map[string]string{
		"localhost:" + strconv.Itoa(defaultAdminPort): "localhost:" + strconv.Itoa(o.adminPort),
		":" + strconv.Itoa(defaultHTTPPort):           ":" + strconv.Itoa(o.httpPort),
	}
	for i := range workers {
		moves[net.JoinHostPort("127.0.0.1", strconv.Itoa(defaultWorkerPort+i))] = o.workerAddr(i)
	}
	moved, err := movePorts(string(b), moves)
	if err != nil {
		return "", fmt.Errorf("%s: %w", o.config, err)
	}
	if o.affinity {
		if moved, err = withAffinity(moved); err != nil {
			return "", fmt.Errorf("%s: %w", o.config, err)
		}
	}
	if o.metric != "" {
		if moved, err = withMetric(moved, o.metric); err != nil {
			return "", fmt.Errorf("%s: %w", o.config, err)
		}
	}
	if moved == string(b) {
		return o.config, nil
	}
	// The name starts with "Caddyfile", so caddy picks the Caddyfile adapter as for the example.
	path := filepath.Join(dir, "Caddyfile.demo")
	return path, os.WriteFile(path, []byte(moved), 0o644)
}

// run is the demo. Whatever happens, every process it started has exited when it returns.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	for _, bin := range []string{o.caddy, o.sim} {
		if _, err := os.Stat(bin); err != nil {
			return fmt.Errorf("binary %s: %w (make build creates bin/caddy and bin/sglang-sim)", bin, err)
		}
	}
	dir, err := os.MkdirTemp("", "sglang-demo-")
	if err != nil {
		return err
	}
	defer func() {
		if err == nil || errors.Is(err, errInterrupted) {
			os.RemoveAll(dir)
		} else {
			fmt.Fprintf(stderr, "sglang-demo: logs of the processes are in %s\n", dir)
		}
	}()
	config, err := o.caddyfile(dir)
	if err != nil {
		return err
	}

	var children []*child
	defer func() {
		if len(children) > 0 {
			fmt.Fprintf(stdout, "\nStopped %s\n", strings.Join(stopAll(children, o.grace), ", "))
		}
	}()
	fmt.Fprintf(stdout, "Starting %d simulated SGLang workers and Caddy (caddy run --config %s)\n", workers, config)
	for i := range workers {
		args := []string{"-count", "1", "-base-port", strconv.Itoa(o.workerPort + i),
			"-capacity", strconv.Itoa(o.capacities[i]), "-decode-speed", strconv.FormatFloat(o.speeds[i], 'g', -1, 64)}
		if !o.sglangAdmission {
			args = append(args, "-sglang-admission=false")
		}
		c, err := startChild(fmt.Sprintf("sim-%d", i), dir, o.sim, args...)
		if err != nil {
			return err
		}
		children = append(children, c)
		fmt.Fprintf(stdout, "  worker %s  KV pool %6d tokens  decode %g tokens/s\n", o.workerAddr(i), o.capacities[i], o.speeds[i])
	}
	c, err := startChild("caddy", dir, o.caddy, "run", "--config", config)
	if err != nil {
		return err
	}
	children = append(children, c)

	proxy := "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(o.httpPort))
	admin := "http://" + net.JoinHostPort("localhost", strconv.Itoa(o.adminPort))
	probes := []string{admin + "/config/", proxy + "/health"} // /health goes through Caddy to a worker
	for i := range workers {
		probes = append(probes, "http://"+o.workerAddr(i)+"/health")
	}
	start := time.Now()
	if err := waitReady(ctx, o.readyTimeout, children, probes); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "  caddy  %s -> the 3 workers, admin API %s; all ready in %.1fs\n\n", proxy, admin, time.Since(start).Seconds())

	specs := plan(o.requests, o.longFrac, o.streamFrac, o.sharedPrompts, o.seed)
	var long, streamed int
	for _, s := range specs {
		long += b2i(s.long)
		streamed += b2i(s.stream)
	}
	url := proxy + "/v1/chat/completions"
	fmt.Fprintf(stdout, "Sending %d requests to %s, %d at a time: %d short, %d long, %d streamed\n",
		len(specs), url, o.concurrency, len(specs)-long, long, streamed)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: o.concurrency}}
	defer client.CloseIdleConnections()
	bctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	bar := newProgressBar(stdout, isTerminal(stdout), len(specs))
	// The admin API is most telling while the workers are busy: take its view when half are answered.
	midway := make(chan string, 1)
	var once sync.Once
	started := time.Now()
	progress := func(done, failed int) {
		if ctx.Err() != nil {
			return // an interrupt fails the requests in flight: not news
		}
		bar.update(done, failed)
		if 2*done >= len(specs) {
			once.Do(func() {
				go func() {
					var b strings.Builder
					fmt.Fprintf(&b, "Admin API, %.1fs into the burst (%d of %d answered):\n", time.Since(started).Seconds(), done, len(specs))
					printAdmin(ctx, &b, client, admin)
					midway <- b.String()
				}()
			})
		}
	}
	results := burst(bctx, client, url, specs, o.concurrency, progress)
	bar.finish()
	elapsed := time.Since(started)
	if ctx.Err() != nil {
		fmt.Fprintln(stdout, "Interrupted: stopping Caddy and the workers")
		return errInterrupted
	}

	rows := make([]*workerRow, workers)
	byAddr := make(map[string]*workerRow)
	for i := range rows {
		rows[i] = &workerRow{addr: o.workerAddr(i), capacity: o.capacities[i], decode: o.speeds[i]}
		byAddr[rows[i].addr] = rows[i]
		_, rows[i].statsErr = getJSON(ctx, client, "http://"+rows[i].addr+"/sim/stats", &rows[i].stats)
	}
	var unknown, failed int
	var firstErr error
	failedAt := make(map[string]int) // by the worker that answered
	for _, r := range results {
		if r.err != nil {
			failed++
			failedAt[r.upstream]++
			if firstErr == nil {
				firstErr = r.err
			}
			continue
		}
		row := byAddr[r.upstream]
		if row == nil {
			unknown++
			continue
		}
		row.requests++
		row.long += b2i(r.long)
		row.latencies = append(row.latencies, r.latency)
	}
	fmt.Fprintf(stdout, "\n%d ok, %d failed in %.1fs (latency: from sending the request to the last token)\n\n",
		len(results)-failed, failed, elapsed.Seconds())
	if failed > 0 {
		var where []string
		rest := failed
		for _, r := range rows {
			if n := failedAt[r.addr]; n > 0 {
				where = append(where, fmt.Sprintf("%d answered by %s", n, r.addr))
				rest -= n
			}
		}
		if rest > 0 {
			where = append(where, fmt.Sprintf("%d with no worker's answer", rest))
		}
		fmt.Fprintf(stdout, "failed: %s\n\n", strings.Join(where, ", "))
	}
	printTable(stdout, rows, unknown, o.sglangAdmission)
	fmt.Fprintln(stdout)
	fmt.Fprint(stdout, <-midway)
	if failed > 0 {
		return fmt.Errorf("%d of %d requests failed; the first: %w", failed, len(results), firstErr)
	}
	if ctx.Err() != nil {
		return errInterrupted
	}
	return nil
}

// waitReady polls every probe until all answer 200, a child exits, or the timeout passes.
func waitReady(ctx context.Context, timeout time.Duration, children []*child, probes []string) error {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	defer client.CloseIdleConnections()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	pending := probes
	for {
		for _, c := range children {
			if c.exited() {
				return fmt.Errorf("%s exited before the demo was ready (%v); its log ends:\n%s", c.name, c.err, c.tail(10))
			}
		}
		var still []string
		for _, p := range pending {
			req, err := http.NewRequestWithContext(rctx, http.MethodGet, p, nil)
			if err != nil {
				return err
			}
			resp, err := client.Do(req)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			if err != nil || resp.StatusCode != http.StatusOK {
				still = append(still, p)
			}
		}
		if pending = still; len(pending) == 0 {
			return nil
		}
		select {
		case <-tick.C:
		case <-rctx.Done():
			if ctx.Err() != nil {
				return errInterrupted
			}
			return fmt.Errorf("not ready after %v: no 200 from %s", timeout, strings.Join(pending, ", "))
		}
	}
}

// stopAll stops Caddy first, so that no request reaches a stopping worker, then the workers together.
// It returns each process's name and exit state, in that order.
func stopAll(children []*child, grace time.Duration) []string {
	var first, rest []*child
	for _, c := range children {
		if c.name == "caddy" {
			first = append(first, c)
		} else {
			rest = append(rest, c)
		}
	}
	for _, c := range first {
		c.stop(grace)
	}
	var wg sync.WaitGroup
	for _, c := range rest {
		wg.Go(func() { c.stop(grace) })
	}
	wg.Wait()
	var states []string
	for _, c := range append(first, rest...) {
		states = append(states, fmt.Sprintf("%s (%v)", c.name, c.cmd.ProcessState))
	}
	return states
}

// isTerminal reports whether w is a character device, where \r redraws the progress bar in place.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
