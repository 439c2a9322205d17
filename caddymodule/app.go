// Package caddymodule is the Caddy glue of caddy-sglang: the sglang_load app that owns the load
// monitor, the sglang_load selection policy, their Caddyfile syntax, admin routes and metrics.
package caddymodule

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"go.uber.org/zap"

	"github.com/caddy-sglang/caddy-sglang/monitor"
)

func init() {
	caddy.RegisterModule(new(App))
}

// Defaults of the app's options.
const (
	DefaultInterval   = 10 * time.Second
	maxDefaultTimeout = 5 * time.Second
	staleIntervals    = 3
)

// App is the sglang_load app: it polls the load of every SGLang worker that an sglang_load selection
// policy names, and holds the latest reports for the policies to read. A config that uses the policy
// without configuring the app gets one with the defaults.
type App struct {
	// How often each worker's load is polled. Default: 10s. Must be > 0.
	Interval *caddy.Duration `json:"interval,omitempty"`

	// The deadline of each poll. Default: the smaller of 5s and the interval. Must be > 0.
	Timeout *caddy.Duration `json:"timeout,omitempty"`

	// A report older than this is ignored and the policy falls back. Default: 3 times the polling
	// interval of the worker's group. Must be > 0.
	StaleAfter *caddy.Duration `json:"stale_after,omitempty"`

	// The most polls in flight at once, over all workers. Default: 64. Must be >= 1: 0 is an error,
	// as in the Caddyfile, not "no limit".
	MaxConcurrentPolls *int `json:"max_concurrent_polls,omitempty"`

	// How long an upstream address of a dynamic pool (`dynamic a`, `srv`, `multi`, ...) keeps being
	// polled once the pools the proxy offers the policy no longer hold it; then its poller stops and it
	// leaves the admin view and the metrics, and if it comes back it is polled again at once. Time
	// without traffic does not count: an idle proxy keeps polling the addresses it last saw. Static
	// upstreams are never forgotten. Default: 2 times stale_after of the address's group. Must be > 0.
	ForgetAfter *caddy.Duration `json:"forget_after,omitempty"`

	interval, timeout, staleAfter, forgetAfter time.Duration

	ctx     caddy.Context
	logger  *zap.Logger
	monitor *monitor.Monitor
	events  *caddyevents.App

	mu        sync.Mutex
	endpoints map[string]*endpoint
	sweepers  map[*Policy]struct{} // policies with dynamic upstreams to forget
	stopSweep context.CancelFunc
	sweepDone chan struct{}
}

// CaddyModule returns the Caddy module information.
func (*App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "sglang_load",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision applies the defaults and checks the options.
func (a *App) Provision(ctx caddy.Context) error {
	a.ctx = ctx
	a.logger = ctx.Logger()
	if err := a.resolveDurations(); err != nil {
		return err
	}
	maxPolls := 0 // the monitor's default
	if a.MaxConcurrentPolls != nil {
		if maxPolls = *a.MaxConcurrentPolls; maxPolls < 1 {
			return fmt.Errorf("max_concurrent_polls: must be >= 1, got %d", maxPolls)
		}
	}
	eventsApp, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("getting events app: %w", err)
	}
	a.events = eventsApp.(*caddyevents.App)
	a.endpoints = make(map[string]*endpoint)
	a.sweepers = make(map[*Policy]struct{})
	if err := a.registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	a.monitor = monitor.New(monitor.Options{MaxConcurrent: maxPolls, OnResult: a.onPollResult})
	return nil
}

// resolveDurations validates the configured durations and applies their defaults, in one place.
func (a *App) resolveDurations() error {
	positive := func(name string, d *caddy.Duration) (time.Duration, error) {
		if d == nil {
			return 0, nil
		}
		if *d <= 0 {
			return 0, fmt.Errorf("%s: must be > 0, got %s", name, time.Duration(*d))
		}
		return time.Duration(*d), nil
	}
	var err error
	if a.interval, err = positive("interval", a.Interval); err != nil {
		return err
	}
	if a.timeout, err = positive("timeout", a.Timeout); err != nil {
		return err
	}
	if a.staleAfter, err = positive("stale_after", a.StaleAfter); err != nil {
		return err
	}
	if a.forgetAfter, err = positive("forget_after", a.ForgetAfter); err != nil {
		return err
	}
	if a.interval == 0 {
		a.interval = DefaultInterval
	}
	return nil
}

// timeoutFor is the poll deadline for a group polled every interval.
func (a *App) timeoutFor(interval time.Duration) time.Duration {
	if a.timeout > 0 {
		return a.timeout
	}
	return min(maxDefaultTimeout, interval)
}

// staleAfterFor is how old a report of a group polled every interval may get.
func (a *App) staleAfterFor(interval time.Duration) time.Duration {
	if a.staleAfter > 0 {
		return a.staleAfter
	}
	return staleIntervals * interval
}

// forgetAfterFor is how long a dynamic upstream of a group polled every interval is kept unseen.
func (a *App) forgetAfterFor(interval time.Duration) time.Duration {
	if a.forgetAfter > 0 {
		return a.forgetAfter
	}
	return forgetStaleAfters * a.staleAfterFor(interval)
}

// forgetStaleAfters is the default forget_after in multiples of stale_after: an address gone from DNS
// is kept long enough that a lookup failing for a moment does not lose its report.
const forgetStaleAfters = 2

// Start starts polling and forgetting departed dynamic upstreams. Polling never starts in Provision,
// so `caddy validate` polls nobody.
func (a *App) Start() error {
	a.monitor.Start()
	ctx, cancel := context.WithCancel(context.Background())
	a.stopSweep, a.sweepDone = cancel, make(chan struct{})
	go a.sweepLoop(ctx, a.sweepTick(), a.sweepDone)
	return nil
}

// Stop stops polling and waits for the pollers to end.
func (a *App) Stop() error {
	if a.stopSweep != nil {
		a.stopSweep()
		<-a.sweepDone
		a.stopSweep = nil
	}
	a.monitor.Stop()
	return nil
}

// Bounds of the sweep period, a quarter of the shortest forget_after: often enough that an address is
// forgotten within 1.25 forget_after, and a sweep is a walk over the dynamic addresses only.
const (
	minSweepTick = 10 * time.Millisecond
	maxSweepTick = time.Second
)

func (a *App) sweepTick() time.Duration {
	tick := maxSweepTick
	for _, p := range a.sweeperList() {
		tick = min(tick, p.forgetAfter/4)
	}
	return max(tick, minSweepTick)
}

// sweepLoop forgets, every tick, the dynamic upstreams that no policy has seen for its forget_after.
func (a *App) sweepLoop(ctx context.Context, tick time.Duration, done chan struct{}) {
	defer close(done)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			for _, p := range a.sweeperList() {
				p.sweep(now)
			}
		}
	}
}

func (a *App) addSweeper(p *Policy) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.sweepers[p] = struct{}{}
}

func (a *App) removeSweeper(p *Policy) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.sweepers, p)
}

func (a *App) sweeperList() []*Policy {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Collect(maps.Keys(a.sweepers))
}

// Cleanup releases what Provision and the policies' registrations hold.
func (a *App) Cleanup() error {
	if a.monitor == nil {
		return nil // Provision failed before there was anything to release
	}
	a.monitor.Close()
	a.mu.Lock()
	defer a.mu.Unlock()
	for key := range a.endpoints {
		releaseState(key)
		delete(a.endpoints, key)
	}
	return nil
}

// onPollResult observes every poll: metrics, logs and events (observe.go).
func (a *App) onPollResult(key string, prev, next *monitor.Snapshot, took time.Duration) {
	a.observePoll(key, prev, next, took)
}

// Interface guards.
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)
