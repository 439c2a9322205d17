// Package monitor is the polling engine of caddy-sglang: it polls each registered worker endpoint on its
// own schedule and under its own deadline, and publishes the results as immutable snapshots.
package monitor

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// Fetcher fetches one load report from one worker. It must honour ctx's deadline.
type Fetcher interface {
	Fetch(ctx context.Context) (*loadpolicy.Report, error)
}

// Close is called on a Fetcher that also implements io.Closer when its endpoint is removed.
type closer interface{ Close() error }

// Target is one endpoint to poll.
type Target struct {
	Key      string        // identifies the endpoint, e.g. "http://127.0.0.1:30000/v1/loads"
	Fetcher  Fetcher       // how to poll it
	Interval time.Duration // time between polls; must be > 0
	Timeout  time.Duration // deadline of each poll; must be > 0
	State    *State        // where results go; may be shared with other monitors (config reloads)
	// WarmUp asks for the endpoint's first WarmUpPolls polls a tenth of the interval apart, until one
	// fails: what a report measures from its predecessor (speeds from the difference of counters) is
	// then known within one interval of the endpoint's start instead of several.
	WarmUp bool
	// Poke, when set, asks for a poll within a tenth of the interval whenever a value arrives on it,
	// sooner than the next one due: the owner sends (without blocking) when it needs a fresh
	// measurement, such as a speed not yet measured on a worker it just sent a request to.
	Poke <-chan struct{}
	// Published, when set, is called after each result is published to State, before OnResult.
	Published func()
}

// Options tune a Monitor. The zero value is usable.
type Options struct {
	// MaxConcurrent caps the polls in flight at once, so a large fleet cannot open a socket per
	// endpoint in the same instant. Default 64.
	MaxConcurrent int
	// Jitter spreads each wait by up to ± this fraction of the interval. Default 0.1. Waits then end on
	// the nearest 1/10 of the interval (wakeGrid), so the spread comes in steps of 10% of the interval.
	Jitter float64
	// OnResult, when set, is called after every poll with the snapshot before and after it.
	OnResult func(key string, prev, next *Snapshot, took time.Duration)
}

// Monitor runs one poller per registered endpoint once started.
type Monitor struct {
	opts  Options
	sem   chan struct{}
	epoch time.Time // monotonic origin of the wake-up grid

	mu      sync.Mutex
	pollers map[string]*poller
	closed  bool            // by Close: Add refuses
	ctx     context.Context // nil until Start
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// New returns a monitor that polls nothing until Start.
func New(opts Options) *Monitor {
	if opts.MaxConcurrent <= 0 {
		opts.MaxConcurrent = 64
	}
	if opts.Jitter <= 0 {
		opts.Jitter = 0.1
	}
	return &Monitor{opts: opts, sem: make(chan struct{}, opts.MaxConcurrent), epoch: time.Now(), pollers: make(map[string]*poller)}
}

type poller struct {
	target   Target
	interval atomic.Int64 // nanoseconds
	stop     context.CancelFunc
	done     chan struct{}
}

// Add's errors: a key that is registered (one whose Remove has not returned yet, too), and a monitor
// that Close closed, whose poller would never run nor its fetcher be closed.
var (
	ErrRegistered = errors.New("already registered")
	ErrClosed     = errors.New("monitor closed")
)

// Add registers an endpoint. A started monitor polls it at once.
func (m *Monitor) Add(t Target) error {
	if t.Interval <= 0 || t.Timeout <= 0 || t.Fetcher == nil || t.State == nil {
		return fmt.Errorf("endpoint %s: interval %s and timeout %s must be > 0, fetcher and state set", t.Key, t.Interval, t.Timeout)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("endpoint %s: %w", t.Key, ErrClosed)
	}
	if _, ok := m.pollers[t.Key]; ok {
		return fmt.Errorf("endpoint %s: %w", t.Key, ErrRegistered)
	}
	p := &poller{target: t}
	p.interval.Store(int64(t.Interval))
	m.pollers[t.Key] = p
	if m.ctx != nil {
		m.run(p)
	}
	return nil
}

// SetInterval changes an endpoint's polling interval from its next wait on.
func (m *Monitor) SetInterval(key string, d time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p, ok := m.pollers[key]; ok && d > 0 {
		p.interval.Store(int64(d))
	}
}

// Remove stops an endpoint's poller, waits for it, and closes its fetcher.
func (m *Monitor) Remove(key string) {
	m.mu.Lock()
	p, ok := m.pollers[key]
	if !ok {
		m.mu.Unlock()
		return
	}
	delete(m.pollers, key)
	stop, done := p.stop, p.done
	p.stop, p.done = nil, nil
	m.mu.Unlock()
	if stop != nil {
		stop()
		<-done
	}
	closeFetcher(p)
}

// Start starts polling every registered endpoint. It is a no-op on a started monitor.
func (m *Monitor) Start() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ctx != nil {
		return
	}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	for _, p := range m.pollers {
		m.run(p)
	}
}

// Stop stops all pollers and waits for them; the fetchers stay open, and the monitor can be started again.
func (m *Monitor) Stop() {
	m.mu.Lock()
	cancel := m.cancel
	m.ctx, m.cancel = nil, nil
	for _, p := range m.pollers {
		p.stop, p.done = nil, nil
	}
	m.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	m.wg.Wait()
}

// Close stops the monitor and closes every fetcher; Add refuses from then on.
func (m *Monitor) Close() {
	m.Stop()
	m.mu.Lock()
	pollers := m.pollers
	m.pollers = make(map[string]*poller)
	m.closed = true
	m.mu.Unlock()
	for _, p := range pollers {
		closeFetcher(p)
	}
}

// Refresh polls every registered endpoint now, concurrently, and returns when all polls have
// answered or ctx is done. It works on a monitor that is not started, too.
func (m *Monitor) Refresh(ctx context.Context) error {
	m.mu.Lock()
	targets := make([]Target, 0, len(m.pollers))
	for _, p := range m.pollers {
		targets = append(targets, p.target)
	}
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, t := range targets {
		wg.Go(func() { m.poll(ctx, t) })
	}
	wg.Wait()
	return ctx.Err()
}

// run starts p's goroutine; m.mu must be held and m.ctx set.
func (m *Monitor) run(p *poller) {
	ctx, cancel := context.WithCancel(m.ctx)
	p.stop, p.done = cancel, make(chan struct{})
	m.wg.Add(1)
	go func(done chan struct{}) {
		defer m.wg.Done()
		defer close(done)
		m.loop(ctx, p)
	}(p.done)
}

func closeFetcher(p *poller) {
	if c, ok := p.target.Fetcher.(closer); ok {
		_ = c.Close()
	}
}

// failingSlowdown is how many consecutive failures make an endpoint be polled at half rate. Half rate
// and no slower, so an endpoint that comes back is seen at most one interval later than otherwise.
const failingSlowdown = 3

func (m *Monitor) loop(ctx context.Context, p *poller) {
	// One timer per poller, reset for each wait: a fleet of pollers would otherwise make a timer per poll.
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	warming := p.target.WarmUp
	for polls := 1; ; polls++ {
		failures := m.poll(ctx, p.target)
		warming = warming && failures == 0 && polls < WarmUpPolls
		interval := time.Duration(p.interval.Load())
		wait := interval
		if failures >= failingSlowdown {
			wait *= 2
		}
		if warming {
			wait = interval / wakeGrid // one slot of the wake-up grid: jitter would round away
		} else {
			wait = jitter(wait, m.opts.Jitter)
		}
		if !m.wait(ctx, timer, p.target.Poke, m.onGrid(wait, interval/wakeGrid), interval/wakeGrid) {
			return
		}
	}
}

// wait waits d on timer, or until the slot of the grid after a poke if that comes sooner (one sent
// during the poll before counts: that poll may have missed what it asks to measure). It returns false
// when ctx ends first.
func (m *Monitor) wait(ctx context.Context, timer *time.Timer, poke <-chan struct{}, d, grid time.Duration) bool {
	due := time.Now().Add(d)
	timer.Reset(d)
	for {
		select {
		case <-ctx.Done():
			return false
		case <-timer.C:
			return true
		case <-poke:
			soon := m.onGrid(grid, grid)
			if at := time.Now().Add(soon); at.Before(due) {
				due = at
				timer.Reset(soon)
			}
		}
	}
}

// WarmUpPolls is how many polls a Target with WarmUp makes a tenth of the interval apart: its first
// interval.
const WarmUpPolls = wakeGrid

// wakeGrid is how many wake-up slots an interval has. Polls wait until the slot nearest their jittered
// time, so the pollers due in one slot wake together: at 1,000 endpoints and 1s, the process wakes about
// 10 times a second instead of 1,000. Each wake-up costs the scheduler, sysmon, timers and netpoll as
// much as several polls: at 1,000 endpoints and 1s, 50 slots cost about 75 µs of CPU per poll, 10 slots
// about 53 µs, and 5 no less than 10. A slot (100ms at 1s) is as wide as the ±10% jitter, which still
// spreads each endpoint's polls over three slots.
const wakeGrid = 10

// onGrid shortens or stretches a wait of d so that it ends on a multiple of grid since m.epoch. It works
// on the monotonic clock, so a step of the wall clock cannot shift the grid.
func (m *Monitor) onGrid(d, grid time.Duration) time.Duration {
	if grid <= 0 {
		return d
	}
	elapsed := time.Since(m.epoch)
	return max((elapsed+d).Round(grid)-elapsed, 0)
}

func jitter(d time.Duration, frac float64) time.Duration {
	spread := time.Duration(float64(d) * frac)
	if spread <= 0 {
		return d
	}
	return d - spread + rand.N(2*spread+1)
}

// poll runs one poll of t under its deadline and publishes the result. It returns the endpoint's count
// of consecutive failures afterwards.
func (m *Monitor) poll(ctx context.Context, t Target) int {
	select {
	case m.sem <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	defer func() { <-m.sem }()

	pollCtx, cancel := context.WithTimeout(ctx, t.Timeout)
	start := time.Now()
	report, err := t.Fetcher.Fetch(pollCtx)
	took := time.Since(start)
	cancel()
	if ctx.Err() != nil && err != nil {
		return 0 // stopping: a cancelled poll says nothing about the worker
	}
	if err == nil && report == nil {
		err = errors.New("fetcher returned no report")
	}
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		err = &TimeoutError{Timeout: t.Timeout, Err: err}
	}
	prev, next := t.State.publish(report, err, time.Now())
	if t.Published != nil {
		t.Published()
	}
	if m.opts.OnResult != nil {
		m.opts.OnResult(t.Key, prev, next, took)
	}
	return next.Failures
}
