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
//   - A KV pool of MaxTotalTokens. As SGLang, a prompt of the pool less 6 tokens or more is refused and
//     max_tokens is cut to the pool less 2 less the prompt (finish.go). A request reserves its whole
//     footprint, prompt + max_tokens, when it is admitted, and releases it when it finishes: requests
//     queue when token_usage is near 1. With SGLangAdmission it allocates as it decodes, is admitted on
//     SGLang's guess of what the running requests will still use, and may be retracted (admission.go).
//   - A prefix cache (unless DisablePrefixCache) in the same pool, as SGLang's radix cache: a prompt's
//     whole 16-token blocks (cache.go) become cached once the request has prefilled them, and its
//     answer's blocks (as a client would resend it) once the answer is complete. A request
//     holds the cached blocks its prompt starts with from admission to its end; its reservation counts
//     only the uncached rest, so used tokens = private reservations + held blocks, and
//     used + evictable cached tokens <= MaxTotalTokens always. Blocks nobody holds are evictable and
//     go least recently used first when an admission needs room. num_used_tokens and token_usage
//     count used tokens only, as SGLang's do.
//   - With HostPoolTokens, a host-memory tier below the pool (cache.go): evicted blocks move there,
//     and a prompt whose prefix continues there past the pool's blocks loads those blocks back at
//     HostLoadTokensPerSec before it prefills the rest; they count as cached (cache_hit_rate, the
//     response's cached_tokens), as SGLang's hierarchical cache reports them.
//   - A running batch of at most MaxRunningRequests and a FIFO waiting queue. The head of the queue is
//     admitted as soon as both the pool and the batch have room; nothing overtakes it. A queued
//     request's uncached tokens (num_waiting_uncached_tokens) are matched against the cache when it
//     arrives; admission matches again and prefills what is uncached then.
//   - Time, with TimingLinear (the default; TimingStep runs SGLang's forward passes instead, step.go):
//     prefill is one FIFO stream per rank at PrefillTokensPerSec over uncached prompt tokens only: a
//     long queue of prompts delays every request behind it, which is why queued uncached tokens predict
//     queueing delay. total_prefill_uncached_tokens and total_prefill_busy_us count that stream's work
//     and busy time, so their ratio between two polls is PrefillTokensPerSec (less while it loads
//     prefixes from the host tier, which keeps it busy). Prefill yields an output token: the first, or a
//     retracted request's next. The admitted requests behind MaxPrefillTokens of prefill work (with
//     TimingStep, a pass's prefill batch) are reported as SGLang reports the requests its prefill batch
//     has not taken:
//     waiting, their uncached tokens queued, their reservations not used.
//     Decode: each request in a batch of n decoding requests gains
//     DecodeTokensPerSec / (1 + (n-1)/16) tokens per second, so a lone request decodes at
//     DecodeTokensPerSec and the rank's total throughput saturates near 16 × DecodeTokensPerSec.
//   - An answer has max_tokens tokens, or with FinishEarly a length drawn from a hash of the request's
//     content and sizes (finish.go), so a request gets the same length on every worker and every run.
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

// job is what a request asks of the model.
type job struct {
	prompt    int64   // prompt tokens
	maxTokens int64   // the client's output cap, which the KV reservation covers
	output    int64   // output tokens the answer will have: maxTokens, or fewer with FinishEarly
	blocks    []block // the prompt's cacheable blocks, in order
	answer    []block // the blocks after them, cached when the answer is complete
	dpRank    int     // -1: round-robin
}

// request is one generation in the model. Fields without a comment are guarded by Worker.mu; the
// handler reads the timestamps and cached only after started or done is closed.
type request struct {
	id uint64
	job
	rank *rank

	state        reqState
	prefillLeft  float64 // prompt tokens still to prefill
	loadLeft     float64 // prompt tokens still to load back from the host tier, before prefilling
	gen          float64 // output tokens generated, fractional
	waitUncached int64   // its share of num_waiting_uncached_tokens while queued
	waitPrompt   int64   // its share of the queued prompt tokens while queued
	cached       int64   // prompt tokens the prefix cache covered at admission
	private      int64   // KV tokens reserved (allocated, with SGLangAdmission) for it alone: what its held cache blocks do not cover
	pins         []*cacheEntry

	enqueued, admitted, firstToken, finished time.Time

	emitted atomic.Int64  // whole output tokens generated so far
	notify  chan struct{} // poked (non-blocking, capacity 1) when emitted grows
	started chan struct{} // closed when prefill has finished
	done    chan struct{} // closed when the request finished or failed
	err     error         // why it failed; written before done is closed
}

func newRequest(id uint64, j job) *request {
	return &request{
		id:      id,
		job:     j,
		notify:  make(chan struct{}, 1),
		started: make(chan struct{}),
		done:    make(chan struct{}),
	}
}

func (r *request) poke() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// rank is one data-parallel rank: its pool, cache, batch and queue.
type rank struct {
	id      int
	waiting []*request // FIFO
	running []*request // in admission order, which is also prefill order

	private         int64 // KV tokens reserved by running requests beyond the cache blocks they hold
	cache           prefixCache
	waitingPrompt   int64 // prompt tokens of queued requests
	waitingUncached int64 // of those, the ones the cache did not cover on arrival
	peakUsed        int64
	// SGLang's admission (admission.go): its guess at the share of the running requests' remaining
	// output they will use, and how many requests it has retracted.
	newTokenRatio float64
	retracted     int64

	promptTokens, cachedTokens int64   // over admitted requests
	againTokens                int64   // of their uncached prompt tokens, the ones the cache held once and evicted
	hostLoaded                 int64   // prompt tokens loaded back from the host tier
	prefilled, prefillBusy     float64 // tokens prefilled, seconds the prefill stream was busy
	win                        window
	pass                       passPlan // the forward pass in flight (TimingStep)
}

// used is num_used_tokens: what running requests hold.
func (rk *rank) used() int64 { return rk.private + rk.cache.pinned }

// fitPool evicts the cached blocks that the KV in use leaves no room for in the pool, after an
// admission or a step took KV, and notes the peak use.
func (w *Worker) fitPool(rk *rank) {
	rk.cache.evict(rk.used() + rk.cache.evictable - w.cfg.MaxTotalTokens)
	rk.peakUsed = max(rk.peakUsed, rk.used())
}

// prefixTokens sums the tokens of blocks.
func prefixTokens(blocks []block) int64 {
	var n int64
	for _, b := range blocks {
		n += b.tokens
	}
	return n
}

// window keeps decode output and busy time over the last second in 100 ms buckets.
type window struct {
	idx       [windowBuckets]int64 // bucket number + 1; 0 marks an empty slot
	tokens    [windowBuckets]float64
	busy      [windowBuckets]float64 // seconds with a non-empty batch
	retracted [windowBuckets]int64
}

const (
	windowBuckets = 10
	bucketLen     = time.Second / windowBuckets
)

func (w *window) add(at time.Duration, tokens, busy float64, retracted int64) {
	b := int64(at/bucketLen) + 1
	s := b % windowBuckets
	if w.idx[s] != b {
		w.idx[s], w.tokens[s], w.busy[s], w.retracted[s] = b, 0, 0, 0
	}
	w.tokens[s] += tokens
	w.busy[s] += busy
	w.retracted[s] += retracted
}

// rates returns tokens per second, the busy fraction and the requests retracted over the last second.
func (w *window) rates(at time.Duration) (tokensPerSec, busy float64, retracted int64) {
	cur := int64(at/bucketLen) + 1
	for s := range w.idx {
		if b := w.idx[s]; b > cur-windowBuckets && b <= cur {
			tokensPerSec += w.tokens[s]
			busy += w.busy[s]
			retracted += w.retracted[s]
		}
	}
	return tokensPerSec, math.Min(busy, 1), retracted
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
		w.ranks[i] = &rank{id: i, newTokenRatio: initNewTokenRatio}
		if w.cfg.HostPoolTokens > 0 {
			w.ranks[i].cache.host = newHostTier(w.cfg.HostPoolTokens)
		}
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
		rk.waiting, rk.running, rk.private, rk.waitingPrompt, rk.waitingUncached = nil, nil, 0, 0, 0
		rk.cache = prefixCache{}
	}
}

// submit queues a request on a rank (j.dpRank < 0: round-robin) and starts the clock if it was idle.
func (w *Worker) submit(j job) (*request, error) {
	if !w.admits(j.prompt) {
		return nil, &requestError{http.StatusBadRequest, fmt.Sprintf(
			"Input length (%d tokens) exceeds the maximum allowed length (%d tokens). Use a shorter input or enable --allow-auto-truncate.",
			j.prompt, w.maxInputTokens())}
	}
	if j.dpRank >= len(w.ranks) {
		return nil, &requestError{http.StatusBadRequest, fmt.Sprintf(
			"data_parallel_rank %d out of range [0, %d)", j.dpRank, len(w.ranks))}
	}
	r := newRequest(w.nextID.Add(1), j)

	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, &requestError{http.StatusServiceUnavailable, errClosed.Error()}
	}
	dpRank := j.dpRank
	if dpRank < 0 {
		dpRank = w.nextRank
		w.nextRank = (w.nextRank + 1) % len(w.ranks)
	}
	now := time.Now()
	rk := w.ranks[dpRank]
	rk.queue(r, now)
	if !w.looping {
		w.looping = true
		w.last = now
		go w.loop()
	}
	w.admit(rk, now)
	return r, nil
}

// queue puts r at the end of the rank's waiting queue, arrived at now.
func (rk *rank) queue(r *request, now time.Time) {
	r.rank, r.enqueued = rk, now
	rk.requeue(r)
}

// requeue puts r at the end of the queue, keeping its arrival time: a retracted request waits there to
// prefill its prompt and the output it had.
func (rk *rank) requeue(r *request) {
	rk.waiting = append(rk.waiting, r)
	rk.counted(r)
}

// counted adds queued r to the rank's queued tokens.
func (rk *rank) counted(r *request) {
	r.waitPrompt = r.extend(0)
	inPool, inHost := rk.cache.prefix(r.blocks)
	r.waitUncached = r.extend(prefixTokens(r.blocks[:inPool+inHost]))
	rk.waitingPrompt += r.waitPrompt
	rk.waitingUncached += r.waitUncached
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
		rk.waitingPrompt -= r.waitPrompt
		rk.waitingUncached -= r.waitUncached
	default:
		for i, q := range rk.running {
			if q == r {
				rk.running = append(rk.running[:i], rk.running[i+1:]...)
				break
			}
		}
		rk.release(r)
	}
	w.fail(r, time.Now(), errAborted)
	w.admit(rk, time.Now())
}

// release gives back a running request's reservation and the cache blocks it holds.
func (rk *rank) release(r *request) {
	rk.private -= r.private
	r.private = 0
	rk.cache.unpin(r.pins)
	r.pins = nil
}

// hold caches blocks a request has computed; they move from its reservation to the blocks it holds,
// so the pool's use does not grow.
func (rk *rank) hold(r *request, blocks []block) {
	for _, b := range blocks {
		r.pins = append(r.pins, rk.cache.insert(b))
		r.private -= b.tokens
		rk.private -= b.tokens
	}
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
	if w.cfg.Timing == TimingStep {
		w.runSteps(rk, now, at, dt)
		return
	}
	if len(rk.running) == 0 {
		rk.newTokenRatio = initNewTokenRatio // idle: SGLang starts its guess again
		w.admit(rk, now)
		return
	}
	// room is the KV tokens decoding may still allocate this step; -1: no bound.
	retractedBefore := rk.retracted
	room := w.decodeRoom(rk, func(r *request, batch int) int64 {
		return int64(math.Min(r.gen+w.cfg.decodeSpeed(batch)*dt, float64(r.output))) - r.emitted.Load()
	})
	retracted := rk.retracted - retractedBefore
	decoding := 0
	for _, r := range rk.running {
		if r.state == stateDecode {
			decoding++
		}
	}
	var speed float64
	if decoding > 0 {
		speed = w.cfg.decodeSpeed(decoding)
	}
	prefillSpeed := w.cfg.PrefillTokensPerSec
	budget := dt * prefillSpeed
	var prefilled, loading float64 // tokens prefilled, seconds loading from the host tier
	em := &emitter{w: w, rk: rk, room: room}
	for _, r := range rk.running {
		switch r.state {
		case statePrefill:
			if r.loadLeft > 0 { // the stream loads a prefix back from the host tier first
				secs := math.Min(budget/prefillSpeed, r.loadLeft/w.cfg.HostLoadTokensPerSec)
				if r.loadLeft -= secs * w.cfg.HostLoadTokensPerSec; r.loadLeft < 1e-9 {
					r.loadLeft = 0
				}
				budget -= secs * prefillSpeed
				loading += secs
				if r.loadLeft > 0 {
					continue
				}
			}
			use := math.Min(budget, r.prefillLeft)
			r.prefillLeft -= use
			budget -= use
			prefilled += use
			if r.prefillLeft <= 0 {
				w.prefilled(rk, r, now, em)
			}
		case stateDecode:
			em.to(r, math.Min(r.gen+speed*dt, float64(r.output)))
		}
	}
	w.finishDone(rk, now)
	if decoding > 0 && retracted == 0 {
		rk.decayNewTokenRatio(speed * dt)
	}
	w.fitPool(rk) // decoding allocated KV (SGLangAdmission)
	rk.prefilled += prefilled
	rk.prefillBusy += prefilled/prefillSpeed + loading
	rk.win.add(at, float64(em.produced), dt, retracted)
	w.admit(rk, now)
}

// emitter records the output tokens requests of a rank generate in one step, within the KV room the
// pool has left for them (room < 0: no bound), and counts them.
type emitter struct {
	w        *Worker
	rk       *rank
	room     int64
	produced int64
}

// emitter returns an emitter with the room the rank's pool has now.
func (w *Worker) emitter(rk *rank) *emitter {
	room := int64(-1)
	if w.cfg.SGLangAdmission {
		room = max(w.cfg.MaxTotalTokens-rk.used(), 0)
	}
	return &emitter{w: w, rk: rk, room: room}
}

// to records r's output reaching gen tokens, within the room left.
func (e *emitter) to(r *request, gen float64) {
	if e.room >= 0 {
		gen = math.Min(gen, float64(r.emitted.Load()+e.room))
	}
	r.gen = gen
	if n, old := int64(r.gen), r.emitted.Load(); n > old {
		r.emitted.Store(n)
		e.produced += n - old
		e.w.grow(e.rk, r, n-old)
		if e.room >= 0 {
			e.room -= n - old
		}
		r.poke()
	}
}

// prefilled moves r, whose prefill ended at now, to decoding: its prompt's blocks are cached, and the
// prefill yields a token: the first, or, back from a retraction, the next one.
func (w *Worker) prefilled(rk *rank, r *request, now time.Time, em *emitter) {
	rk.hold(r, r.blocks[len(r.pins):])
	r.state = stateDecode
	first := r.firstToken.IsZero()
	if first {
		r.firstToken = now
	}
	if next := r.emitted.Load() + 1; next <= r.output {
		em.to(r, float64(next))
	}
	if first {
		close(r.started)
		r.poke()
	}
}

// finishDone ends the running requests that have all their output, at now: their answer's blocks are
// cached and their KV released.
func (w *Worker) finishDone(rk *rank, now time.Time) {
	kept := rk.running[:0]
	for _, r := range rk.running {
		if r.state == stateDecode && r.emitted.Load() >= r.output {
			rk.hold(r, r.answer)
			rk.release(r)
			r.state, r.finished = stateDone, now
			w.served++
			close(r.done)
			continue
		}
		kept = append(kept, r)
	}
	clear(rk.running[len(kept):])
	rk.running = kept
}

// admit moves requests from the head of the queue into the batch while the pool and the cap allow,
// evicting unheld cache blocks to make room.
func (w *Worker) admit(rk *rank, now time.Time) {
	for len(rk.waiting) > 0 && len(rk.running) < w.cfg.MaxRunningRequests {
		r := rk.waiting[0]
		inPool, inHost := rk.cache.prefix(r.blocks)
		hit, fromHost := r.blocks[:inPool], r.blocks[inPool:inPool+inHost]
		cached := prefixTokens(hit)
		// The blocks from the host tier need room in the pool, as the uncached rest does.
		private, ok := w.admission(rk, r, hit, cached)
		if !ok {
			return
		}
		rk.waiting[0] = nil
		rk.waiting = rk.waiting[1:]
		rk.waitingPrompt -= r.waitPrompt
		rk.waitingUncached -= r.waitUncached
		r.pins = rk.cache.pin(hit, len(r.blocks)+len(r.answer))
		r.private = private
		rk.private += private
		// They move to the pool now, held by r, and count as cached; r loads them before it prefills.
		rk.hold(r, fromHost)
		loaded := prefixTokens(fromHost)
		rk.hostLoaded += loaded
		cached += loaded
		w.fitPool(rk)
		r.state, r.prefillLeft, r.loadLeft = statePrefill, float64(r.extend(cached)), float64(loaded)
		if r.admitted.IsZero() { // a retracted request is counted once, when first admitted
			r.cached, r.admitted = cached, now
			rk.promptTokens += r.prompt
			rk.cachedTokens += cached
			rk.againTokens += rk.cache.goneIn(r.blocks[inPool+inHost:])
		}
		rk.running = append(rk.running, r)
	}
	if len(rk.waiting) == 0 {
		rk.waiting = nil // let the backing array go
	}
}

// RankLoad is one DP rank's load, as every load endpoint reports it.
type RankLoad struct {
	DPRank                int
	Running               int     // num_running_reqs: decoding, and in the prefill batch
	Waiting               int     // num_waiting_reqs: queued, and admitted behind a prefill batch
	WaitingUncachedTokens int64   // num_waiting_uncached_tokens: queued prompt tokens the cache did not cover
	UsedTokens            int64   // num_used_tokens: KV tokens held by running requests
	TotalTokens           int64   // num_total_tokens: used + queued prompt tokens
	MaxTotalTokens        int64   // max_total_num_tokens: pool capacity
	MaxRunning            int     // max_running_requests
	TokenUsage            float64 // used / capacity, 4 decimals
	GenThroughput         float64 // output tokens/s over the last second, 2 decimals
	CacheHitRate          float64 // cached / prompt tokens over every admitted request, 4 decimals
	Utilization           float64 // fraction of the last second with a non-empty batch, 4 decimals
	Retracted             int64   // queues.retracted: requests retracted over the last second (SGLangAdmission)
	CacheTokens           int64   // tokens in the prefix cache, held or evictable (not on the wire)
	HostCacheTokens       int64   // tokens in the prefix cache's host tier (not on the wire)
	PrefillUncachedTokens int64   // total_prefill_uncached_tokens: prompt tokens prefilled since start
	PrefillBusyMicros     int64   // total_prefill_busy_us: microseconds the prefill stream was busy
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
		tput, busy, retracted := rk.win.rates(at)
		q := rk.prefillQueue(w.cfg.prefillBatch())
		used := rk.used() - q.private
		var hitRate float64
		if rk.promptTokens > 0 {
			hitRate = round(float64(rk.cachedTokens)/float64(rk.promptTokens), 4)
		}
		out[i] = RankLoad{
			DPRank:                rk.id,
			Running:               len(rk.running) - q.requests,
			Waiting:               len(rk.waiting) + q.requests,
			WaitingUncachedTokens: rk.waitingUncached + q.uncached,
			UsedTokens:            used,
			TotalTokens:           used + rk.waitingPrompt + q.prompt,
			MaxTotalTokens:        w.cfg.MaxTotalTokens,
			MaxRunning:            w.cfg.MaxRunningRequests,
			TokenUsage:            round(float64(used)/float64(w.cfg.MaxTotalTokens), 4),
			GenThroughput:         round(tput, 2),
			CacheHitRate:          hitRate,
			Utilization:           round(busy, 4),
			Retracted:             retracted,
			CacheTokens:           rk.cache.tokens(),
			HostCacheTokens:       rk.cache.host.size(),
			PrefillUncachedTokens: int64(math.Round(rk.prefilled)),
			PrefillBusyMicros:     int64(math.Round(rk.prefillBusy * 1e6)),
		}
	}
	return out
}

// queuedPrefill is what a rank reports of the admitted requests that wait for the prefill stream.
type queuedPrefill struct {
	requests                  int
	uncached, prompt, private int64
}

// prefillQueue sums the admitted requests that wait for the prefill stream behind batch uncached
// tokens (the first always counts as prefilling, as a chunked prefill takes a longer prompt). SGLang
// keeps such requests in its waiting queue until a prefill batch takes them, holding no KV: they count
// as waiting, their uncached tokens as queued, and their reservations not as used.
func (rk *rank) prefillQueue(batch int64) queuedPrefill {
	var q queuedPrefill
	var ahead int64
	for _, r := range rk.running {
		if r.state != statePrefill {
			continue
		}
		left := int64(math.Ceil(r.prefillLeft))
		if ahead == 0 || ahead+left <= batch {
			ahead += max(left, 1) // in the batch being prefilled: running
			continue
		}
		ahead = batch + 1 // later requests wait, even one that would fit
		q.requests++
		q.uncached += left
		q.prompt += r.prompt
		q.private += r.private
	}
	return q
}

func round(x float64, decimals int) float64 {
	p := math.Pow10(decimals)
	return math.Round(x*p) / p
}

// Stats summarises what a worker has done, for demos and benchmarks.
type Stats struct {
	Name            string
	Served          int64   // requests that finished generating
	Failed          int64   // requests aborted by their client or by Close
	PeakUsedTokens  int64   // highest num_used_tokens of any rank
	PeakTokenUsage  float64 // PeakUsedTokens / capacity
	PromptTokens    int64   // prompt tokens of admitted requests, over all ranks
	CachedTokens    int64   // of those, the ones the prefix cache covered
	PrefilledTokens int64   // prompt tokens prefilled so far (uncached ones)
	EvictedTokens   int64   // cached tokens evicted to make room, over all ranks
	// PrefilledAgainTokens are the prompt tokens of admitted requests that the cache held once and had
	// evicted: the hit rate that eviction cost.
	PrefilledAgainTokens int64
	// Retracted counts the requests taken out of the running batch to be prefilled again later, over
	// all ranks; only with SGLangAdmission.
	Retracted int64
	// HostLoadedTokens are the prompt tokens of admitted requests loaded back from the host tier
	// (HostPoolTokens), over all ranks; they count in CachedTokens.
	HostLoadedTokens int64
	Loads            []RankLoad
}

// Stats returns the worker's counters and current loads.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := Stats{Name: w.cfg.Name, Served: w.served, Failed: w.failed, Loads: w.loadsLocked(time.Now())}
	for i, rk := range w.ranks {
		s.PeakUsedTokens = max(s.PeakUsedTokens, rk.peakUsed)
		s.PromptTokens += rk.promptTokens
		s.CachedTokens += rk.cachedTokens
		s.PrefilledTokens += s.Loads[i].PrefillUncachedTokens
		s.EvictedTokens += rk.cache.evicted
		s.PrefilledAgainTokens += rk.againTokens
		s.Retracted += rk.retracted
		s.HostLoadedTokens += rk.hostLoaded
	}
	s.PeakTokenUsage = round(float64(s.PeakUsedTokens)/float64(w.cfg.MaxTotalTokens), 4)
	return s
}
