package sglangsim

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// The load model, per DP rank:
//
//   - A KV pool of MaxTotalTokens. A request reserves its whole footprint, prompt + max output tokens,
//     when it is admitted, and releases it when it finishes. Real SGLang grows allocations while it
//     decodes and retracts requests when it guessed wrong; reserving up front keeps the invariant a
//     router relies on: requests queue when token_usage is near 1.
//   - A running batch of at most MaxRunningRequests and a FIFO waiting queue. The head of the queue is
//     admitted as soon as both the pool and the batch have room; nothing overtakes it.
//   - Prefill is one FIFO stream per rank at PrefillTokensPerSec: a long queue of prompts delays every
//     request behind it, which is why queued uncached tokens predict queueing delay. Prefill yields the
//     first output token.
//   - Decode: each request in a batch of n decoding requests gains
//     DecodeTokensPerSec / (1 + (n-1)/16) tokens per second, so a lone request decodes at
//     DecodeTokensPerSec and the rank's total throughput saturates near 16 × DecodeTokensPerSec.
//
// The model advances on a clock tick that runs only while the worker has requests, so an idle worker
// costs no goroutine and no CPU.

const (
	tickEvery = 5 * time.Millisecond
	// batchSlowdown is the batch size at which per-request decode speed has halved.
	batchSlowdown = 16
)

var (
	errClosed  = errors.New("worker is shutting down")
	errAborted = errors.New("request aborted")
)

// requestError is a request the worker refuses, with the HTTP status to answer.
type requestError struct {
	status int
	msg    string
}

func (e *requestError) Error() string { return e.msg }

type reqState uint8

const (
	stateWaiting reqState = iota
	statePrefill
	stateDecode
	stateDone
)

// request is one generation in the model. Fields without a comment are guarded by Worker.mu; the
// handler reads the timestamps only after started or done is closed.
type request struct {
	id             uint64
	prompt, maxOut int64
	rank           *rank

	state       reqState
	prefillLeft float64 // prompt tokens still to prefill
	gen         float64 // output tokens generated, fractional

	enqueued, admitted, firstToken, finished time.Time

	emitted atomic.Int64  // whole output tokens generated so far
	notify  chan struct{} // poked (non-blocking, capacity 1) when emitted grows
	started chan struct{} // closed when prefill has finished
	done    chan struct{} // closed when the request finished or failed
	err     error         // why it failed; written before done is closed
}

func (r *request) need() int64 { return r.prompt + r.maxOut }

func (r *request) poke() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// rank is one data-parallel rank: its pool, batch and queue.
type rank struct {
	id      int
	waiting []*request // FIFO
	running []*request // in admission order, which is also prefill order

	used          int64 // KV tokens reserved by running requests
	waitingPrompt int64 // prompt tokens of queued requests
	peakUsed      int64
	win           window
}

// window keeps decode output and busy time over the last second in 100 ms buckets.
type window struct {
	idx    [windowBuckets]int64 // bucket number + 1; 0 marks an empty slot
	tokens [windowBuckets]float64
	busy   [windowBuckets]float64 // seconds with a non-empty batch
}

const (
	windowBuckets = 10
	bucketLen     = time.Second / windowBuckets
)

func (w *window) add(at time.Duration, tokens, busy float64) {
	b := int64(at/bucketLen) + 1
	s := b % windowBuckets
	if w.idx[s] != b {
		w.idx[s], w.tokens[s], w.busy[s] = b, 0, 0
	}
	w.tokens[s] += tokens
	w.busy[s] += busy
}

// rates returns tokens per second and the busy fraction over the last second.
func (w *window) rates(at time.Duration) (tokensPerSec, busy float64) {
	cur := int64(at/bucketLen) + 1
	for s := range w.idx {
		if b := w.idx[s]; b > cur-windowBuckets && b <= cur {
			tokensPerSec += w.tokens[s]
			busy += w.busy[s]
		}
	}
	return tokensPerSec, math.Min(busy, 1)
}

// Worker is one simulated SGLang server. It is safe for concurrent use.
type Worker struct {
	cfg     Config
	start   time.Time
	faults  Faults
	handler http.Handler
	nextID  atomic.Uint64

	mu       sync.Mutex
	ranks    []*rank
	nextRank int
	looping  bool // the tick goroutine runs
	closed   bool
	last     time.Time // the model's clock: when it last advanced
	served   int64
	failed   int64
}

// New returns a worker with cfg's defaults applied. It starts no goroutine until a request arrives.
func New(cfg Config) *Worker {
	w := &Worker{cfg: cfg.withDefaults(), start: time.Now()}
	w.ranks = make([]*rank, w.cfg.DPRanks)
	for i := range w.ranks {
		w.ranks[i] = &rank{id: i}
	}
	w.handler = w.routes()
	return w
}

// Config returns the worker's configuration with defaults applied.
func (w *Worker) Config() Config { return w.cfg }

// Faults returns the worker's fault switches.
func (w *Worker) Faults() *Faults { return &w.faults }

// Close stops the model and fails every queued and running request; later requests answer 503.
func (w *Worker) Close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	w.closed = true
	now := time.Now()
	for _, rk := range w.ranks {
		for _, r := range rk.waiting {
			w.fail(r, now, errClosed)
		}
		for _, r := range rk.running {
			w.fail(r, now, errClosed)
		}
		rk.waiting, rk.running, rk.used, rk.waitingPrompt = nil, nil, 0, 0
	}
}

// submit queues a request on a rank (dpRank < 0: round-robin) and starts the clock if it was idle.
func (w *Worker) submit(prompt, maxOut int64, dpRank int) (*request, error) {
	if prompt+maxOut > w.cfg.MaxTotalTokens {
		return nil, &requestError{http.StatusBadRequest, fmt.Sprintf(
			"request needs %d KV tokens (prompt %d + max output %d), more than the pool of %d",
			prompt+maxOut, prompt, maxOut, w.cfg.MaxTotalTokens)}
	}
	if dpRank >= len(w.ranks) {
		return nil, &requestError{http.StatusBadRequest, fmt.Sprintf(
			"data_parallel_rank %d out of range [0, %d)", dpRank, len(w.ranks))}
	}
	r := &request{
		id:      w.nextID.Add(1),
		prompt:  prompt,
		maxOut:  maxOut,
		notify:  make(chan struct{}, 1),
		started: make(chan struct{}),
		done:    make(chan struct{}),
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, &requestError{http.StatusServiceUnavailable, errClosed.Error()}
	}
	if dpRank < 0 {
		dpRank = w.nextRank
		w.nextRank = (w.nextRank + 1) % len(w.ranks)
	}
	now := time.Now()
	rk := w.ranks[dpRank]
	r.rank, r.enqueued = rk, now
	rk.waiting = append(rk.waiting, r)
	rk.waitingPrompt += r.prompt
	if !w.looping {
		w.looping = true
		w.last = now
		go w.loop()
	}
	w.admit(rk, now)
	return r, nil
}

// abort removes a request whose client went away and frees its KV.
func (w *Worker) abort(r *request) {
	w.mu.Lock()
	defer w.mu.Unlock()
	rk := r.rank
	switch r.state {
	case stateDone:
		return
	case stateWaiting:
		for i, q := range rk.waiting {
			if q == r {
				rk.waiting = append(rk.waiting[:i], rk.waiting[i+1:]...)
				break
			}
		}
		rk.waitingPrompt -= r.prompt
	default:
		for i, q := range rk.running {
			if q == r {
				rk.running = append(rk.running[:i], rk.running[i+1:]...)
				break
			}
		}
		rk.used -= r.need()
	}
	w.fail(r, time.Now(), errAborted)
	w.admit(rk, time.Now())
}

func (w *Worker) fail(r *request, now time.Time, err error) {
	if r.state == stateDone {
		return
	}
	r.state, r.err, r.finished = stateDone, err, now
	w.failed++
	close(r.done)
}

// loop advances the model every tick while there is work, and exits when the worker is idle.
func (w *Worker) loop() {
	t := time.NewTicker(tickEvery)
	defer t.Stop()
	for range t.C {
		w.mu.Lock()
		w.step(time.Now())
		if w.idleLocked() {
			w.looping = false
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
	}
}

func (w *Worker) idleLocked() bool {
	for _, rk := range w.ranks {
		if len(rk.waiting) > 0 || len(rk.running) > 0 {
			return false
		}
	}
	return true
}

// step advances every rank from w.last to now.
func (w *Worker) step(now time.Time) {
	dt := now.Sub(w.last).Seconds()
	w.last = now
	if dt <= 0 {
		return
	}
	// A stalled process (suspended laptop, debugger) should not finish every request at once.
	dt = math.Min(dt, 1)
	at := now.Sub(w.start)
	for _, rk := range w.ranks {
		w.stepRank(rk, now, at, dt)
	}
}

func (w *Worker) stepRank(rk *rank, now time.Time, at time.Duration, dt float64) {
	if len(rk.running) == 0 {
		w.admit(rk, now)
		return
	}
	decoding := 0
	for _, r := range rk.running {
		if r.state == stateDecode {
			decoding++
		}
	}
	var speed float64
	if decoding > 0 {
		speed = w.cfg.DecodeTokensPerSec / (1 + float64(decoding-1)/batchSlowdown)
	}
	budget := dt * w.cfg.PrefillTokensPerSec
	var produced int64
	kept := rk.running[:0]
	for _, r := range rk.running {
		switch r.state {
		case statePrefill:
			use := math.Min(budget, r.prefillLeft)
			r.prefillLeft -= use
			budget -= use
			if r.prefillLeft <= 0 {
				r.state, r.firstToken = stateDecode, now
				if r.maxOut > 0 {
					r.gen = 1
					r.emitted.Store(1)
					produced++
				}
				close(r.started)
				r.poke()
			}
		case stateDecode:
			r.gen = math.Min(r.gen+speed*dt, float64(r.maxOut))
			if e, old := int64(r.gen), r.emitted.Load(); e > old {
				r.emitted.Store(e)
				produced += e - old
				r.poke()
			}
		}
		if r.state == stateDecode && r.emitted.Load() >= r.maxOut {
			rk.used -= r.need()
			r.state, r.finished = stateDone, now
			w.served++
			close(r.done)
			continue
		}
		kept = append(kept, r)
	}
	clear(rk.running[len(kept):])
	rk.running = kept
	rk.win.add(at, float64(produced), dt)
	w.admit(rk, now)
}

// admit moves requests from the head of the queue into the batch while the pool and the cap allow.
func (w *Worker) admit(rk *rank, now time.Time) {
	for len(rk.waiting) > 0 && len(rk.running) < w.cfg.MaxRunningRequests {
		r := rk.waiting[0]
		if rk.used+r.need() > w.cfg.MaxTotalTokens {
			return
		}
		rk.waiting[0] = nil
		rk.waiting = rk.waiting[1:]
		rk.waitingPrompt -= r.prompt
		rk.used += r.need()
		rk.peakUsed = max(rk.peakUsed, rk.used)
		r.state, r.admitted, r.prefillLeft = statePrefill, now, float64(r.prompt)
		rk.running = append(rk.running, r)
	}
	if len(rk.waiting) == 0 {
		rk.waiting = nil // let the backing array go
	}
}

// RankLoad is one DP rank's load, as every load endpoint reports it.
type RankLoad struct {
	DPRank                int
	Running               int     // num_running_reqs: admitted requests, prefilling or decoding
	Waiting               int     // num_waiting_reqs
	WaitingUncachedTokens int64   // num_waiting_uncached_tokens: queued prompt tokens (no prefix cache)
	UsedTokens            int64   // num_used_tokens: KV tokens reserved by running requests
	TotalTokens           int64   // num_total_tokens: used + queued prompt tokens
	MaxTotalTokens        int64   // max_total_num_tokens: pool capacity
	MaxRunning            int     // max_running_requests
	TokenUsage            float64 // used / capacity, 4 decimals
	GenThroughput         float64 // output tokens/s over the last second, 2 decimals
	CacheHitRate          float64 // always 0: the simulator has no prefix cache
	Utilization           float64 // fraction of the last second with a non-empty batch, 4 decimals
}

// Loads returns the current load of every DP rank.
func (w *Worker) Loads() []RankLoad {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.loadsLocked(time.Now())
}

func (w *Worker) loadsLocked(now time.Time) []RankLoad {
	at := now.Sub(w.start)
	out := make([]RankLoad, len(w.ranks))
	for i, rk := range w.ranks {
		tput, busy := rk.win.rates(at)
		out[i] = RankLoad{
			DPRank:                rk.id,
			Running:               len(rk.running),
			Waiting:               len(rk.waiting),
			WaitingUncachedTokens: rk.waitingPrompt,
			UsedTokens:            rk.used,
			TotalTokens:           rk.used + rk.waitingPrompt,
			MaxTotalTokens:        w.cfg.MaxTotalTokens,
			MaxRunning:            w.cfg.MaxRunningRequests,
			TokenUsage:            round(float64(rk.used)/float64(w.cfg.MaxTotalTokens), 4),
			GenThroughput:         round(tput, 2),
			Utilization:           round(busy, 4),
		}
	}
	return out
}

func round(x float64, decimals int) float64 {
	p := math.Pow10(decimals)
	return math.Round(x*p) / p
}

// Stats summarises what a worker has done, for demos and benchmarks.
type Stats struct {
	Name           string
	Served         int64   // requests that finished generating
	Failed         int64   // requests aborted by their client or by Close
	PeakUsedTokens int64   // highest num_used_tokens of any rank
	PeakTokenUsage float64 // PeakUsedTokens / capacity
	Loads          []RankLoad
}

// Stats returns the worker's counters and current loads.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := Stats{Name: w.cfg.Name, Served: w.served, Failed: w.failed, Loads: w.loadsLocked(time.Now())}
	for _, rk := range w.ranks {
		s.PeakUsedTokens = max(s.PeakUsedTokens, rk.peakUsed)
	}
	s.PeakTokenUsage = round(float64(s.PeakUsedTokens)/float64(w.cfg.MaxTotalTokens), 4)
	return s
}
