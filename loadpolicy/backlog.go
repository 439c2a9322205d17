package loadpolicy

import (
	"math"
	"sync/atomic"
	"time"
)

// Backlog projects a worker's prefill queue between two reports, as a queue of work drained at the
// worker's prefill speed: the queue the report saw, from when it arrived, and each uncached prompt this
// proxy sent since, from when it was sent. A prompt sent late in a long interval is still ahead of the
// next request, where draining every prompt sent since the report from the report's arrival counted
// capacity spent before the prompt existed: at a 10 s interval, half a minute of 12k-token prompts
// sent to one worker read as no queue at all.
//
// It is the time at which the worker's prefill would be done with everything queued, kept in one
// word: microseconds after the report's arrival, beside a tag of the report it counts from. A report
// other than the tagged one starts the projection again from its own queue. The zero value is ready;
// it is safe for concurrent use and allocates nothing.
type Backlog struct {
	state atomic.Uint64
}

const (
	backlogTagBits = 24
	backlogUSBits  = 64 - backlogTagBits
	backlogUSMax   = 1<<backlogUSBits - 1 // about 12.7 days
)

// backlogTag tells the report a backlog counts from: its arrival's microsecond, modulo 2^24 (16.7 s).
// Two reports of one worker are an interval apart, never a multiple of 16.7 s to the microsecond.
func backlogTag(r *Report) uint64 {
	return uint64(r.Received.UnixMicro()) & (1<<backlogTagBits - 1)
}

// until is, for state (b's), the seconds after r's arrival at which the worker's prefill is done with
// what is queued: from the state where it counts from r, else from r's own queue.
func (b *Backlog) until(state uint64, r *Report, p *CostParams) float64 {
	if state != 0 && state>>backlogUSBits == backlogTag(r) { // 0: the zero value, which counts from none
		return float64(state&backlogUSMax) / 1e6
	}
	return float64(r.work.queued) / r.work.prefillSpeed(p)
}

// Ahead is the seconds of prefill queued on the worker of report r, elapsed after r arrived. A nil
// Backlog counts r's queue alone.
func (b *Backlog) Ahead(r *Report, elapsed time.Duration, p *CostParams) float64 {
	var state uint64
	if b != nil {
		state = b.state.Load()
	}
	return atLeast(b.until(state, r, p)-max(elapsed, 0).Seconds(), 0)
}

// Add counts an uncached prompt of tokens sent to the worker of report r, elapsed after r arrived:
// other senders' counted too where p says so (see CostParams.OtherSenders). A report the cost model
// cannot price (see Priced) counts nothing.
func (b *Backlog) Add(r *Report, elapsed time.Duration, tokens int64, p *CostParams) {
	if tokens <= 0 || r == nil || !r.work.has {
		return
	}
	work := float64(tokens)
	if p.OtherSenders && r.work.senders > 1 {
		work *= r.work.senders
	}
	seconds := work / r.work.prefillSpeed(p)
	at := max(elapsed, 0).Seconds()
	tag := backlogTag(r) << backlogUSBits
	for {
		old := b.state.Load()
		until := max(b.until(old, r, p), at) + seconds
		us := uint64(min(math.Ceil(until*1e6), backlogUSMax)) // at least 1: seconds > 0
		if b.state.CompareAndSwap(old, tag|us) {
			return
		}
	}
}
