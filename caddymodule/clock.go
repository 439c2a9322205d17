package caddymodule

import (
	"sync/atomic"
	"time"
)

// Select runs on every proxied request and must judge whether each report is stale. On some
// virtualised hosts time.Now costs as much as a whole least_conn selection, so Select reads a clock
// that a goroutine advances every clockTick instead. Staleness is measured in multiples of the poll
// interval, which a clockTick of error does not change. The goroutine runs only while Select is
// called: it stops after clockIdle without a reader, and the next reader starts it again.
const (
	clockTick = 5 * time.Millisecond
	clockIdle = time.Second
)

type coarseClock struct {
	now     atomic.Pointer[time.Time]
	running atomic.Bool
	read    atomic.Bool // set by readers, cleared by the ticker: a tick without readers counts as idle
}

var clock coarseClock

// Now returns the time of the last tick, or time.Now when the ticker is not running.
func (c *coarseClock) Now() time.Time {
	if !c.running.Load() {
		now := time.Now()
		if c.running.CompareAndSwap(false, true) {
			c.now.Store(&now)
			c.read.Store(true)
			go c.run()
		}
		return now
	}
	if !c.read.Load() {
		c.read.Store(true) // written once per tick at most, so readers do not contend on the line
	}
	return *c.now.Load()
}

func (c *coarseClock) run() {
	t := time.NewTicker(clockTick)
	defer t.Stop()
	idle := 0
	for range t.C {
		now := time.Now()
		c.now.Store(&now)
		if c.read.Swap(false) {
			idle = 0
			continue
		}
		if idle++; time.Duration(idle)*clockTick >= clockIdle {
			c.running.Store(false)
			return
		}
	}
}
