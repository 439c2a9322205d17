package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// The fleet: three workers of 1x, 2x and 4x the base capacity. Capacity scales the KV pool, the
// running batch, and the decode and prefill speeds, as a bigger GPU (or more of them) would.
var workerScales = []float64{1, 2, 4}

func workerConfig(i int) sglangsim.Config {
	k := workerScales[i]
	c := sglangsim.Config{
		Name:                fmt.Sprintf("w%d-%gx", i, k),
		MaxTotalTokens:      int64(16384 * k),
		MaxRunningRequests:  int(16 * k),
		DecodeTokensPerSec:  100 * k,
		PrefillTokensPerSec: 4000 * k,
	}
	benchSimOptions(&c)
	return c
}

// benchSimOptions sets the simulator options every benchmark fleet runs with: answers end early, their
// real length drawn from the request content between 0.3x and 1x max_tokens, so no policy is judged on
// perfect foresight; the prefix cache stays on (its default): the quality workload's prompts are unique
// from their first token; SGLang's admission unless -sglang-admission=false.
func benchSimOptions(c *sglangsim.Config) {
	c.FinishEarly = 0.3
	c.SGLangAdmission = sglangAdmission
}

// sglangAdmission runs every fleet with the simulator's SGLang admission (-sglang-admission, on by
// default): KV allocated as it is decoded, admission on a guess, retraction when the guess was wrong.
// Off, each request reserves its prompt and whole max_tokens.
var sglangAdmission bool

// fleet is one set of simulated workers on loopback, with what the bench measures on them from outside
// the wire: load polls per worker, and KV use sampled while a run is on.
type fleet struct {
	workers []*sglangsim.Worker
	addrs   []string // host:port
	servers []*http.Server
	polls   []atomic.Int64 // GET /v1/loads answered, per worker

	mu     sync.Mutex
	kvSum  []float64
	kvPeak []float64
	kvN    int
}

// A worker's place in a key's rendezvous order follows from its address, so the ports of a fleet decide
// which worker is home to which prefix: with ports taken at random, every run draws the homes again, and
// a fleet that drew many homes onto its slowest worker does not come back when the run is repeated.
// fleetPorts fixes them: from base, a block per seed (its value modulo maxPortSeeds) and arm (its place
// in the run's list of arms), one port per worker. Below Linux's ephemeral range (32768 on), where Caddy's
// own ports and the client's are taken.
const (
	maxPortSeeds = 64
	maxPortArms  = 32
)

func fleetPorts(base int, seed int64, arm int) []int {
	if base == 0 {
		return nil
	}
	first := base + (portSeed(seed)*maxPortArms+arm)*len(workerScales)
	ports := make([]int, len(workerScales))
	for i := range ports {
		ports[i] = first + i
	}
	return ports
}

// fleetPortSpan is how many ports the plan takes from its base: a block per seed and arm.
func fleetPortSpan() int { return maxPortSeeds * maxPortArms * len(workerScales) }

// portSeed is a seed's block in the plan.
func portSeed(seed int64) int { return int((seed%maxPortSeeds + maxPortSeeds) % maxPortSeeds) }

// startFleet starts the workers on the given loopback ports, one per worker of workerScales, or on any
// free ports when ports is nil.
func startFleet(ports []int) (*fleet, error) {
	cfgs := make([]sglangsim.Config, len(workerScales))
	for i := range cfgs {
		cfgs[i] = workerConfig(i)
	}
	return startFleetOf(cfgs, ports)
}

// startFleetOf starts a worker per config on the given loopback ports, one each, or on any free ports
// when ports is nil.
func startFleetOf(cfgs []sglangsim.Config, ports []int) (*fleet, error) {
	f := &fleet{polls: make([]atomic.Int64, len(cfgs)), kvSum: make([]float64, len(cfgs)),
		kvPeak: make([]float64, len(cfgs))}
	for i, cfg := range cfgs {
		w := sglangsim.New(cfg)
		addr := "127.0.0.1:0"
		if ports != nil {
			addr = fmt.Sprintf("127.0.0.1:%d", ports[i])
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			f.Close()
			if ports != nil {
				err = fmt.Errorf("%w (-fleet-ports fixes the simulated workers' ports; 0 takes any free ones)", err)
			}
			return nil, err
		}
		polls := &f.polls[i]
		h := w.Handler()
		srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/loads" {
				polls.Add(1)
			}
			h.ServeHTTP(rw, r)
		})}
		go func() { _ = srv.Serve(ln) }()
		f.workers = append(f.workers, w)
		f.servers = append(f.servers, srv)
		f.addrs = append(f.addrs, ln.Addr().String())
	}
	return f, nil
}

func (f *fleet) Close() {
	for i := range f.workers {
		f.workers[i].Close()
		_ = f.servers[i].Close()
	}
}

// workerIndex maps a worker name from a response header to its index; -1 when unknown.
func workerIndex(name string) int {
	for i := range workerScales {
		if workerConfig(i).Name == name {
			return i
		}
	}
	return -1
}

// sampleKV records each worker's KV use (the highest token_usage of its ranks) every period until ctx ends.
func (f *fleet) sampleKV(ctx context.Context, period time.Duration) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		f.mu.Lock()
		for i, w := range f.workers {
			var u float64
			for _, l := range w.Loads() {
				u = max(u, l.TokenUsage)
			}
			f.kvSum[i] += u
			f.kvPeak[i] = max(f.kvPeak[i], u)
		}
		f.kvN++
		f.mu.Unlock()
	}
}

// kv returns each worker's mean and peak KV use over the samples taken.
func (f *fleet) kv() (meanUse, peak []float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	meanUse = make([]float64, len(f.kvSum))
	for i, s := range f.kvSum {
		if f.kvN > 0 {
			meanUse[i] = s / float64(f.kvN)
		}
	}
	return meanUse, append([]float64(nil), f.kvPeak...)
}

// eviction is the cached tokens the workers evicted to make room, and the prompt tokens they prefilled
// again after evicting them, over the fleet.
func (f *fleet) eviction() (evicted, again int64) {
	for _, w := range f.workers {
		s := w.Stats()
		evicted, again = evicted+s.EvictedTokens, again+s.PrefilledAgainTokens
	}
	return evicted, again
}

// retracted is the requests the fleet's workers retracted, to prefill them again later.
func (f *fleet) retracted() (n int64) {
	for _, w := range f.workers {
		n += w.Stats().Retracted
	}
	return n
}

// pollCounts is each worker's count of load polls answered so far.
func (f *fleet) pollCounts() []int64 {
	c := make([]int64, len(f.polls))
	for i := range f.polls {
		c[i] = f.polls[i].Load()
	}
	return c
}
