// Package caddymodule is the Caddy glue of caddy-sglang: the sglang_load app that owns the load
// monitor, the sglang_load selection policy, their Caddyfile syntax, admin routes and metrics.
package caddymodule

import (
	"fmt"
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

	interval, timeout, staleAfter time.Duration

	ctx     caddy.Context
	logger  *zap.Logger
	monitor *monitor.Monitor
	events  *caddyevents.App

	mu        sync.Mutex
	endpoints map[string]*endpoint

	// fleetSpeed is the fastest decode speed alone a worker has reported lately.
	fleetSpeed fleetSpeed
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

// Start starts polling. Polling never starts in Provision, so `caddy validate` polls nobody.
func (a *App) Start() error {
	a.monitor.Start()
	return nil
}

// Stop stops polling and waits for the pollers to end.
func (a *App) Stop() error {
	a.monitor.Stop()
	return nil
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
