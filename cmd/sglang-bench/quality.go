package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

type qualityOptions struct {
	caddy, out, only string
	seed             int64
	rate             float64
	duration         time.Duration
}

// The fleet: three workers of 1x, 2x and 4x the base capacity. Capacity scales the KV pool, the
// running batch, and the decode and prefill speeds, as a bigger GPU (or more of them) would.
var workerScales = []float64{1, 2, 4}

func workerConfig(i int) sglangsim.Config {
	k := workerScales[i]
	return sglangsim.Config{
		Name:                fmt.Sprintf("w%d-%gx", i, k),
		MaxTotalTokens:      int64(16384 * k),
		MaxRunningRequests:  int(16 * k),
		DecodeTokensPerSec:  100 * k,
		PrefillTokensPerSec: 4000 * k,
	}
}

// The workload: 80% short requests, 20% long ones (prompt and output); 30% of each are streamed.
const (
	shortPrompt, shortOutput = 200, 64
	longPrompt, longOutput   = 2000, 512
	longShare, streamShare   = 0.2, 0.3
	requestTimeout           = 120 * time.Second
)

type job struct {
	at           time.Duration // arrival, from the start of the run
	long, stream bool
}

// workload is the seeded arrival schedule every policy gets: Poisson arrivals at rate for d.
func workload(seed int64, rate float64, d time.Duration) []job {
	rnd := rand.New(rand.NewPCG(uint64(seed), 0x5eed))
	var jobs []job
	for at := time.Duration(0); ; {
		at += time.Duration(rnd.ExpFloat64() / rate * float64(time.Second))
		if at >= d {
			return jobs
		}
		jobs = append(jobs, job{at: at, long: rnd.Float64() < longShare, stream: rnd.Float64() < streamShare})
	}
}

// policy is one lb_policy configuration under test.
type policy struct {
	name     string
	lb       string        // the lb_policy line and block
	interval time.Duration // sglang_load polling interval; 0 for Caddy's own policies
}

func policies() []policy {
	ps := []policy{
		{name: "round_robin", lb: "lb_policy round_robin"},
		{name: "least_conn", lb: "lb_policy least_conn"},
		{name: "random_choose 2", lb: "lb_policy random_choose 2"},
	}
	for _, choose := range []string{"power_of_two", "least"} {
		for _, iv := range []time.Duration{10 * time.Second, time.Second} {
			for _, corr := range []bool{true, false} {
				name := fmt.Sprintf("sglang_load %s %s", choose, iv)
				block := "choose " + choose
				if !corr {
					name += " no-inflight"
					block += "\n\t\t\tinflight_correction off"
				}
				ps = append(ps, policy{name: name, lb: "lb_policy sglang_load {\n\t\t\t" + block + "\n\t\t}", interval: iv})
			}
		}
	}
	return ps
}

// sample is one request's outcome.
type sample struct {
	ok            bool
	stream        bool
	worker        string
	latency, ttft time.Duration
	queue         float64 // seconds, from the simulator's header
	end           time.Time
}

// result is one policy's summary.
type result struct {
	policy                   policy
	requests, failed         int
	throughput, tokensPerSec float64 // completed requests/s and output tokens/s over the run
	p50, p90, p99            time.Duration
	ttft50, ttft99           time.Duration
	queueMean, queue99       float64
	share                    []float64 // per worker, of completed requests
}

func runQuality(ctx context.Context, o qualityOptions, stdout, stderr io.Writer) error {
	if _, err := os.Stat(o.caddy); err != nil {
		return fmt.Errorf("-caddy %s: %w (run make build first)", o.caddy, err)
	}
	jobs := workload(o.seed, o.rate, o.duration)
	var results []result
	for _, p := range policies() {
		if o.only != "" && !slices.Contains(strings.Split(o.only, ","), p.name) {
			continue
		}
		fmt.Fprintf(stderr, "sglang-bench: %-40s ", p.name)
		start := time.Now()
		res, err := runPolicy(ctx, o, p, jobs)
		if err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
		fmt.Fprintf(stderr, "p50 %6.2fs p99 %6.2fs failed %d (%s)\n", res.p50.Seconds(), res.p99.Seconds(), res.failed,
			time.Since(start).Round(time.Second))
		results = append(results, res)
	}
	md := qualityMarkdown(o, jobs, results)
	if err := writeResult(o.out, "quality.md", md); err != nil {
		return err
	}
	if err := writeResult(o.out, "quality.svg", qualitySVG(results)); err != nil {
		return err
	}
	fmt.Fprint(stdout, md)
	return nil
}

// runPolicy runs the workload through a fresh Caddy and a fresh fleet, so no policy inherits queues.
func runPolicy(ctx context.Context, o qualityOptions, p policy, jobs []job) (result, error) {
	var addrs []string
	for i := range workerScales {
		w := sglangsim.New(workerConfig(i))
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return result{}, err
		}
		srv := &http.Server{Handler: w.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		defer func() {
			w.Close()
			_ = srv.Close()
		}()
		addrs = append(addrs, ln.Addr().String())
	}
	global := ""
	if p.interval > 0 {
		global = fmt.Sprintf("\tsglang_load {\n\t\tinterval %s\n\t}\n", p.interval)
	}
	cf := func(admin string, port int) string {
		return fmt.Sprintf("{\n\tadmin %s\n\tauto_https off\n\tpersist_config off\n%s}\nhttp://127.0.0.1:%d {\n\treverse_proxy %s {\n\t\t%s\n\t}\n}\n",
			admin, global, port, strings.Join(addrs, " "), p.lb)
	}
	c, err := startCaddy(ctx, o.caddy, cf, io.Discard)
	if err != nil {
		return result{}, err
	}
	defer c.Stop()
	if p.interval > 0 {
		if err := c.waitFresh(ctx, len(addrs)); err != nil {
			return result{}, fmt.Errorf("waiting for the first loads: %w", err)
		}
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}}
	defer client.CloseIdleConnections()
	samples := make([]sample, len(jobs))
	var wg sync.WaitGroup
	begin := time.Now()
	for i, j := range jobs {
		if d := time.Until(begin.Add(j.at)); d > 0 {
			select {
			case <-time.After(d): // the arrival schedule itself, not synchronisation
			case <-ctx.Done():
				wg.Wait()
				return result{}, ctx.Err()
			}
		}
		wg.Go(func() { samples[i] = send(ctx, client, c.SiteURL, j) })
	}
	wg.Wait()
	return summarise(p, jobs, samples, begin), nil
}

// send runs one request and measures it.
func send(ctx context.Context, client *http.Client, site string, j job) sample {
	prompt, out := shortPrompt, shortOutput
	if j.long {
		prompt, out = longPrompt, longOutput
	}
	body := fmt.Sprintf(`{"model":"bench","messages":[{"role":"user","content":"hi"}],"prompt_tokens":%d,"max_tokens":%d,"stream":%t}`,
		prompt, out, j.stream)
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, site+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return sample{}
	}
	req.Header.Set("Content-Type", "application/json")
	s := sample{stream: j.stream}
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return s
	}
	defer resp.Body.Close()
	s.worker = resp.Header.Get(sglangsim.HeaderWorker)
	s.queue, _ = strconv.ParseFloat(resp.Header.Get(sglangsim.HeaderQueueTime), 64)
	if j.stream {
		// The simulator sends the first chunk when prefill ends: the first data line is the first token.
		r := bufio.NewReader(resp.Body)
		for {
			line, err := r.ReadBytes('\n')
			if s.ttft == 0 && bytes.HasPrefix(line, []byte("data: ")) {
				s.ttft = time.Since(start)
			}
			if err != nil {
				if !errors.Is(err, io.EOF) {
					return s
				}
				break
			}
		}
	} else if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return s
	}
	s.end = time.Now()
	s.latency = s.end.Sub(start)
	s.ok = resp.StatusCode == http.StatusOK
	return s
}

func summarise(p policy, jobs []job, samples []sample, begin time.Time) result {
	r := result{policy: p, requests: len(samples), share: make([]float64, len(workerScales))}
	var lat, ttft []time.Duration
	var queue []float64
	var last time.Time
	var tokens int
	for i, s := range samples {
		if !s.ok {
			r.failed++
			continue
		}
		lat = append(lat, s.latency)
		queue = append(queue, s.queue)
		if s.stream {
			ttft = append(ttft, s.ttft)
		}
		if s.end.After(last) {
			last = s.end
		}
		if jobs[i].long {
			tokens += longOutput
		} else {
			tokens += shortOutput
		}
		for w := range workerScales {
			if s.worker == workerConfig(w).Name {
				r.share[w]++
			}
		}
	}
	ok := float64(len(lat))
	if ok > 0 {
		span := last.Sub(begin).Seconds()
		r.throughput, r.tokensPerSec = ok/span, float64(tokens)/span
		for w := range r.share {
			r.share[w] /= ok
		}
	}
	slices.Sort(lat)
	slices.Sort(ttft)
	slices.Sort(queue)
	r.p50, r.p90, r.p99 = quantile(lat, 0.5), quantile(lat, 0.9), quantile(lat, 0.99)
	r.ttft50, r.ttft99 = quantile(ttft, 0.5), quantile(ttft, 0.99)
	r.queue99 = quantile(queue, 0.99)
	for _, q := range queue {
		r.queueMean += q / ok
	}
	return r
}

// quantile is the nearest-rank quantile of sorted values; zero when there are none.
func quantile[T any](sorted []T, q float64) T {
	var zero T
	if len(sorted) == 0 {
		return zero
	}
	i := int(q*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
