package sglangsim

import (
	"sync"
	"sync/atomic"
	"time"
)

// Faults are switches that make a worker misbehave the way real workers do, for tests and demos. The
// zero value is a healthy worker; every method is safe for concurrent use.
type Faults struct {
	garbage   atomic.Bool
	notFound  atomic.Bool
	downUntil atomic.Int64 // unix nanoseconds; 0 when up
	hung      atomic.Int64 // load requests blocked by HangLoads right now

	mu     sync.Mutex
	hang   chan struct{} // non-nil while load endpoints hang; closed to release them
	onDown []func(time.Duration)
}

// SetHangLoads makes the load endpoints (HTTP and gRPC) hang until it is switched off again, which
// releases them to answer normally, or until the request's context ends.
func (f *Faults) SetHangLoads(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case on && f.hang == nil:
		f.hang = make(chan struct{})
	case !on && f.hang != nil:
		close(f.hang)
		f.hang = nil
	}
}

// HangLoads reports whether the load endpoints hang.
func (f *Faults) HangLoads() bool { return f.hangChan() != nil }

// hangChan returns the channel a load request waits on, or nil when it should not wait.
func (f *Faults) hangChan() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hang == nil {
		return nil
	}
	return f.hang
}

// SetGarbageLoads makes the load endpoints answer 200 with a body that is not JSON (gRPC: Internal).
func (f *Faults) SetGarbageLoads(on bool) { f.garbage.Store(on) }

// GarbageLoads reports whether the load endpoints answer garbage.
func (f *Faults) GarbageLoads() bool { return f.garbage.Load() }

// SetNotFoundLoads makes /v1/loads answer 404 (gRPC GetLoads: Unimplemented), like SGLang images that
// predate it; /get_load and /metrics keep working.
func (f *Faults) SetNotFoundLoads(on bool) { f.notFound.Store(on) }

// NotFoundLoads reports whether /v1/loads answers 404.
func (f *Faults) NotFoundLoads() bool { return f.notFound.Load() }

// Down makes every route except /sim/ answer 503 (gRPC: Unavailable) for d, and calls the OnDown hooks
// so that a server can also close its listeners. d <= 0 brings the worker back up.
func (f *Faults) Down(d time.Duration) {
	if d <= 0 {
		f.downUntil.Store(0)
	} else {
		f.downUntil.Store(time.Now().Add(d).UnixNano())
	}
	f.mu.Lock()
	hooks := append([]func(time.Duration){}, f.onDown...)
	f.mu.Unlock()
	for _, h := range hooks {
		h(d)
	}
}

// IsDown reports whether the worker is within a Down period.
func (f *Faults) IsDown() bool {
	u := f.downUntil.Load()
	return u != 0 && time.Now().UnixNano() < u
}

// OnDown registers a hook that Down calls with its duration; it must not block.
func (f *Faults) OnDown(hook func(time.Duration)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.onDown = append(f.onDown, hook)
}

// Reset switches every fault off and releases hung load requests.
func (f *Faults) Reset() {
	f.SetHangLoads(false)
	f.SetGarbageLoads(false)
	f.SetNotFoundLoads(false)
	f.downUntil.Store(0)
}

// FaultState is a snapshot of the switches, as /sim/fault reports it.
type FaultState struct {
	HangLoads     bool   `json:"hang_loads"`
	GarbageLoads  bool   `json:"garbage"`
	NotFoundLoads bool   `json:"not_found"`
	DownFor       string `json:"down_for,omitempty"` // remaining down time
	Hung          int64  `json:"hung"`               // load requests hanging right now
}

// State returns the current switches.
func (f *Faults) State() FaultState {
	s := FaultState{
		HangLoads:     f.HangLoads(),
		GarbageLoads:  f.GarbageLoads(),
		NotFoundLoads: f.NotFoundLoads(),
		Hung:          f.hung.Load(),
	}
	if f.IsDown() {
		s.DownFor = time.Until(time.Unix(0, f.downUntil.Load())).Round(time.Millisecond).String()
	}
	return s
}
