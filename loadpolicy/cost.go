package loadpolicy

import (
	"math"
	"time"
)

// The cost model prices placing one request on one worker in seconds: the wait until the worker can
// admit it, its prefill behind the prompts queued ahead, and its decode at the per-request speed of the
// batch it joins. A report is projected forward to the moment of the choice: the worker has drained
// work since (elapsed time x its speeds) and the proxy has sent it requests since, priced by their own
// sizes, and some of the requests have finished (the proxy's live in-flight count says how many).

// Request is the size of the request being placed.
type Request struct {
	// PromptTokens is the prompt's length in tokens (estimated where the body was not read).
	PromptTokens int64
	// OutputTokens is the most the answer may be: max_tokens, or the configured default.
	OutputTokens int64
}

// CostParams are the stand-ins for what a worker does not report, and what the proxy knows of the
// fleet's requests.
type CostParams struct {
	// PrefillTokensPerSec is a worker's prefill speed where its reports do not measure it.
	PrefillTokensPerSec float64
	// PrefillPerRankFloor, when positive, is the least prefill speed per data-parallel rank at which a
	// worker whose prefill is not measured is priced (the fleet's fastest, lately): priced at a slow
	// stand-in, such a worker would get no prompt to prefill, so never be measured.
	PrefillPerRankFloor float64
	// DecodeTokensPerSec is the decode speed of a request alone on a worker not yet measured (fewer
	// than trustedReadings reports caught it decoding): it is priced at no less than this.
	DecodeTokensPerSec float64
	// DecodePerPrefill, when positive, is the fleet's ratio of decode speed alone to prefill speed per
	// rank (see FleetDecode). A worker whose prefill speed is measured is priced from it: at its prefill
	// speed per rank times the ratio until it has readings of its own, and by both after, its own
	// weighing more as they gather. It takes DecodeTokensPerSec's place for such a worker.
	DecodePerPrefill float64
	// DecodeBatchHalving is how many more requests in a batch halve each one's decode speed.
	DecodeBatchHalving float64
	// MeanOutputTokens is the mean OutputTokens of recent requests: the size of the requests a worker
	// runs, whose finishing frees room for the next.
	MeanOutputTokens float64
	// DelayToOthers is how much of the time this request takes from the requests decoding beside it
	// counts in its price: each of its tokens slows every other one in the batch. 0 prices the request
	// alone, so each goes where it finishes first; 1 prices the fleet's total time.
	DelayToOthers float64
	// OtherSenders counts what the proxy sent since a report Report.Senders times over. Off where the
	// proxy's cached-token estimates (affinity) make its uncached tokens sent an undercount that the
	// factor would read as other senders.
	OtherSenders bool
	// ResidualPromptTokens is, of the uncached prompts of recent requests, the mean E[P²] / 2E[P]: the
	// prompt a new one finds being prefilled, on average, when the prefill is busy. Long prompts weigh
	// in it as they do in a queue: 20% of 2,000-token prompts among 200-token ones make it 743.
	ResidualPromptTokens float64
}

// Since is what happened between a report and the choice.
type Since struct {
	// Elapsed is the time since the report; not positive counts as none.
	Elapsed time.Duration
	// Extra is the change of the proxy's in-flight count to the worker since the report: requests
	// sent since minus requests finished since. It may be negative.
	Extra int64
	// Sent counts the requests the proxy sent to the worker since the report, and their sizes.
	Sent, SentPrompt, SentOutput int64
	// SentWeighted is the sum over those requests of output x (prompt + output): their KV tokens
	// weighted by how long they stay, since the requests still running are mostly the long ones.
	SentWeighted int64
	// SentUncached is their prompt tokens that were not cached where they went: prefill work.
	SentUncached int64
	// Backlog is the worker's prefill queue as the proxy projects it (see Backlog); nil: the report's
	// queue alone, drained since.
	Backlog *Backlog
}

// SentTotals are running totals of the requests sent to a worker; a report is stamped with them when
// it arrives, so that the requests sent since are the difference.
type SentTotals struct {
	Requests, PromptTokens, OutputTokens, Weighted, Uncached int64
}

// SetSince sets s to what happened after a report stamped with o, when the totals are t. In place,
// field by field: the hot path prices every candidate with it, and a struct returned and copied was
// copied in 16-byte moves over 8-byte stores, which the CPU cannot forward: 16 ns of a candidate's price.
func (t *SentTotals) SetSince(s *Since, o *SentTotals, elapsed time.Duration, extra int64) {
	s.Elapsed, s.Extra = elapsed, extra
	if t.Requests >= o.Requests { // else o was stamped by totals that started again (another config's)
		s.Sent, s.SentPrompt, s.SentOutput = t.Requests-o.Requests, t.PromptTokens-o.PromptTokens, t.OutputTokens-o.OutputTokens
		s.SentWeighted, s.SentUncached = t.Weighted-o.Weighted, t.Uncached-o.Uncached
	} else {
		s.Sent, s.SentPrompt, s.SentOutput, s.SentWeighted, s.SentUncached = 0, 0, 0, 0, 0
	}
}

// setScaled sets d to s with what the proxy sent and the change of its in-flight count multiplied by
// f: what the worker received from every sender, when this proxy's requests are 1/f of it. In place,
// as SetSince.
func (s *Since) setScaled(d *Since, f float64) {
	m := func(v int64) int64 { return int64(math.Round(float64(v) * f)) }
	d.Elapsed, d.Extra, d.Sent, d.SentPrompt = s.Elapsed, m(s.Extra), m(s.Sent), m(s.SentPrompt)
	d.SentOutput, d.SentWeighted, d.SentUncached, d.Backlog = m(s.SentOutput), m(s.SentWeighted), m(s.SentUncached), s.Backlog
}

// SGLang's limits on one request, from the pool of the rank it runs on (and the context length, which
// reports do not carry): max_req_len is the pool less one; a prompt of max_req_len - 5 tokens or more
// is refused at once, and max_new_tokens is cut to max_req_len - prompt - 1, so that a request holds at
// most the pool less two. The worker's largest rank is the one that can hold the most. None applies
// where no pool is reported.

// admits reports whether the worker's largest rank takes a prompt of this many tokens at all.
func (w *workload) admits(prompt int64) bool {
	return w.rankPool <= 0 || prompt < w.rankPool-6
}

// admittedOutputTokens is the most output SGLang counts when it admits a request
// (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION).
const admittedOutputTokens = 4096

// heldOutput is the most output a request of an admitted prompt may have there: output, or less where
// SGLang cuts max_new_tokens to what the rank holds.
func (w *workload) heldOutput(prompt, output float64) float64 {
	if w.rankPool <= 0 {
		return output
	}
	return min(output, float64(w.rankPool-2)-prompt)
}

// MaxRequestTokens bounds the tokens a request claims, prompt and output each: past any model's
// context, and small enough that the proxy's sums and products of sizes (a total of squares, output x
// size, blocks x tokens) stay far inside an int64.
const MaxRequestTokens = 1 << 24

// Bounded is req with each size within [0, MaxRequestTokens]: a client's max_tokens or Content-Length
// past that counts for no more.
func (req Request) Bounded() Request {
	req.PromptTokens = min(max(req.PromptTokens, 0), MaxRequestTokens)
	req.OutputTokens = min(max(req.OutputTokens, 0), MaxRequestTokens)
	return req
}

// Held is what of req the worker (nil: one not reported) holds, and whether it takes the request at
// all. A request runs on one rank: SGLang refuses a prompt too long for it, which then holds nothing
// and finishes at once, and cuts the output it may have to what the rank holds (see admits). Otherwise
// it is req, Bounded, its output so cut, so that one absurd size neither overflows the totals sent nor
// weighs in the mean sizes as thousands of requests.
func (r *Report) Held(req Request) (Request, bool) {
	req = req.Bounded()
	if !r.Admits(req.PromptTokens) {
		return Request{}, false
	}
	if r != nil {
		req.OutputTokens = int64(r.work.heldOutput(float64(req.PromptTokens), float64(req.OutputTokens)))
	}
	return req, true
}

// Admits reports whether the worker (nil: one not reported) takes a prompt of this many tokens at all:
// its largest rank does not refuse it (see admits).
func (r *Report) Admits(promptTokens int64) bool {
	return r == nil || r.work.admits(promptTokens)
}

// Add counts one more request sent, cached of whose prompt tokens were cached where it went.
func (t *SentTotals) Add(req Request, cached int64) {
	t.Requests++
	t.PromptTokens += req.PromptTokens
	t.OutputTokens += req.OutputTokens
	t.Weighted += req.OutputTokens * (req.PromptTokens + req.OutputTokens)
	t.Uncached += max(req.PromptTokens-max(cached, 0), 0)
}

// workload is what the cost model reads of a report, derived once when the report is built.
type workload struct {
	requests int64 // running + waiting
	waiting  int64 // queued requests
	tokens   int64 // KV tokens held by running requests plus the queued prompt tokens
	queued   int64 // queued prompt tokens the prefix cache misses
	capacity int64 // KV pool tokens, 0 when unknown
	rankPool int64 // the largest rank's KV pool tokens, the most one request holds; 0 when unknown
	maxBatch int64 // running-request cap, 0 when unknown
	ranks    int64 // data-parallel ranks: a request prefills on one of them
	// genSum and batchSum sum the decode readings of the worker's recent reports, each weighed by half
	// for every decodeMemory of measured time since: the output tokens/s it reported, and the running
	// requests it counted, each counted as the share of a lone request's speed it gets in that batch
	// (at referenceHalving). Their ratio is the decode speed of a request alone, 0 when never measured.
	// A ratio of sums, not a mean of ratios: gen_throughput is the output of a window over which the
	// batch changed, and one reading's ratio to the count at the poll is far off either way (a batch
	// that emptied just before the poll reads several times the speed, one that just started a tenth).
	genSum, batchSum float64
	alone            float64
	// runningSum and readingsSum sum, weighed as genSum, the running counts of those readings and how
	// many there were: their ratio is the batch at which the speed alone was read, from which a halving
	// other than referenceHalving carries it back (see aloneSpeed).
	runningSum, readingsSum float64
	// readings counts the reports, up to trustedReadings, that caught the worker decoding.
	readings int
	// readGen and readBatch are this report's own reading, as added to genSum and batchSum: what it
	// adds to the fleet's (see FleetDecode).
	readGen, readBatch float64
	prefill            float64 // measured prefill speed of the whole worker, tokens/s; 0 when never measured
	prefillOK          bool    // prefill was measured from the worker's counters (by this report or an earlier one)
	// prefillWindowed says that prefill was measured between two reports, not over the worker's life
	// (Report.LifetimePrefillPerRank, which prices a worker from its first report until then).
	prefillWindowed bool
	// prefillBusy is the fraction of the time between the last two reports that the worker's prefill
	// was busy, from its counters; 0 when not measured.
	prefillBusy float64
	// receivedSum and sentSum sum, over recent reports (each weighed by half for every decodeMemory
	// since), the uncached prompt tokens the worker prefilled between two reports and those this proxy
	// sent it in the same time. Their ratio, senders, is how much more the worker receives than this
	// proxy sends: other proxies' requests, and a prompt's tokens as the worker counts them against
	// this proxy's estimate. At least 1 (a prefix cache makes the worker prefill less than was sent).
	receivedSum, sentSum float64
	senders              float64
	has                  bool // the report carries the counts the model needs
	sampled              bool // the report carried a decode reading
	// readsDecode and readsPrefill say that the report carries what measures the worker's speeds:
	// gen_throughput, and the prefill counters.
	readsDecode, readsPrefill bool
}

// addDecodeReading adds a report's throughput and running count to the sums, and reports whether the
// report carried a reading: a worker idle over the whole window says nothing of its speed.
func (w *workload) addDecodeReading(throughput float64, running int64) bool {
	if throughput <= 0 && running <= 0 {
		return false
	}
	w.readGen = max(throughput, 0)
	w.genSum += w.readGen
	if running > 0 {
		w.readBatch = float64(running) / (1 + float64(running-1)/referenceHalving)
		w.batchSum += w.readBatch
		w.runningSum += float64(running)
		w.readingsSum++
		w.readings++
	}
	w.setAlone()
	return true
}

func (w *workload) setAlone() {
	if w.batchSum > 0 {
		w.alone = w.genSum / w.batchSum
	}
}

// referenceHalving is the batch halving at which reports' decode readings are carried to a batch of one,
// and decodeMemory the half-life of a reading's weight: in time, not in polls, so that a worker polled
// every second does not forget in a few seconds what a slower poll would keep for a minute.
const (
	referenceHalving = 32
	decodeMemory     = time.Minute
)

// trustedReadings is how many reports must catch a worker decoding before its speed alone is what they
// read. A few readings can be far too low: gen_throughput is the mean of a window in which the batch
// the report counts may have run only a moment (a request that started 0.1 s before a poll reads a
// tenth of its speed). Priced that slow, a worker gets nothing more to measure; until then it is priced
// at no less than a worker not yet measured.
const trustedReadings = 3

// maxPrefillBusy caps the prefill's busy fraction in the queueing term, so that a saturated worker's
// wait is large but finite: its queued tokens price the rest.
const maxPrefillBusy = 0.95

// minPrefillBusy is the least prefill time between two polls that measures a speed: below it the
// counters' rounding dominates.
const minPrefillBusy = 20 * time.Millisecond

func deriveWorkload(r *Report) workload {
	w := workload{ranks: int64(len(r.Ranks))}
	all := Field(0xffff)
	for i := range r.Ranks {
		all &= r.Ranks[i].Fields
	}
	if len(r.Ranks) == 0 || all&(FieldRunning|FieldWaiting) != FieldRunning|FieldWaiting {
		return w
	}
	w.has = true
	w.requests, w.waiting = r.Running+r.Waiting, r.Waiting
	if all&FieldWaitingUncachedTokens != 0 {
		w.queued = r.WaitingUncachedTokens
	}
	if all&FieldUsedTokens != 0 {
		w.tokens = r.UsedTokens
	}
	w.tokens += w.queued
	if all&FieldMaxTotalTokens != 0 {
		w.capacity = r.MaxTotalTokens
		for i := range r.Ranks {
			w.rankPool = max(w.rankPool, r.Ranks[i].MaxTotalTokens)
		}
	}
	if all&FieldMaxRunning != 0 {
		w.maxBatch = r.MaxRunning
	}
	if all&FieldGenThroughput != 0 {
		w.readsDecode = true
		w.sampled = w.addDecodeReading(r.GenThroughput, r.Running)
	}
	w.readsPrefill = all&FieldPrefillCounters != 0
	if r.LifetimePrefillPerRank > 0 {
		// A worker that prefilled before this proxy first polled it (a proxy started or scaled out in
		// front of a running fleet) is priced at its speed from its first report, not at the stand-in.
		w.prefill, w.prefillOK = r.LifetimePrefillPerRank*float64(w.ranks), true
	}
	return w
}

// Follow carries forward, from the worker's previous report, what this one cannot measure alone: the
// prefill speed (the difference of the cumulative prefill counters between the two) and the decode
// readings of its recent reports. Call it once, before the report is published.
func (r *Report) Follow(prev *Report) {
	if prev == nil || !r.work.has {
		return
	}
	r.work.readings = min(r.work.readings+prev.work.readings, trustedReadings)
	gap := r.Received.Sub(prev.Received)
	// Only a reading ages the earlier ones. A worker idle between readings has the speed it had: sums
	// aged while it stood idle would let its next reading, however far off, decide its speed alone.
	kept := 1.0
	if r.work.sampled {
		kept = keptAfter(gap)
	}
	r.work.genSum += prev.work.genSum * kept
	r.work.batchSum += prev.work.batchSum * kept
	r.work.runningSum += prev.work.runningSum * kept
	r.work.readingsSum += prev.work.readingsSum * kept
	r.work.setAlone()
	if prev.work.prefillWindowed || !r.work.prefillOK {
		// A speed measured between two reports is the recent one: it stands until the next such
		// measurement. Before one, this report's lifetime speed is the newest.
		r.work.prefill, r.work.prefillOK, r.work.prefillWindowed = prev.work.prefill, prev.work.prefillOK, prev.work.prefillWindowed
	}
	if len(prev.Ranks) != len(r.Ranks) {
		return
	}
	var tokens, busyUS int64
	for i := range r.Ranks {
		a, b := &prev.Ranks[i], &r.Ranks[i]
		if !a.Has(FieldPrefillCounters) || !b.Has(FieldPrefillCounters) {
			return
		}
		dt, db := b.PrefillUncachedTokens-a.PrefillUncachedTokens, b.PrefillBusyUS-a.PrefillBusyUS
		if dt < 0 || db < 0 {
			return // a restarted worker: its counters began again
		}
		tokens, busyUS = tokens+dt, busyUS+db
	}
	r.work.followSenders(&prev.work, float64(tokens), r.Sent.Uncached-prev.Sent.Uncached, r.Sent.Requests > 0, gap)
	if gap > 0 {
		r.work.prefillBusy = min(float64(busyUS)/1e6/gap.Seconds()/float64(len(r.Ranks)), 1)
	}
	perRank, ok := prefillPerRank(tokens, busyUS)
	if !ok {
		return
	}
	r.work.prefill = perRank * float64(len(r.Ranks)) // the worker has ranks of them
	r.work.prefillOK, r.work.prefillWindowed = true, true
}

// prefillPerRank is one rank's prefill speed, tokens/s, from the tokens prefilled in busyUS
// microseconds of prefill summed over ranks; not ok below minPrefillBusy.
func prefillPerRank(tokens, busyUS int64) (float64, bool) {
	if time.Duration(busyUS)*time.Microsecond < minPrefillBusy {
		return 0, false
	}
	return float64(tokens) / (float64(busyUS) / 1e6), true
}

// keptSince is the weight that sums last aged at *last keep at a reading received at: what keptAfter
// keeps over the time between, 1 for the first reading and for one no newer. It moves *last to at.
func keptSince(last *time.Time, at time.Time) float64 {
	if !at.After(*last) {
		return 1
	}
	kept := 1.0
	if !last.IsZero() {
		kept = keptAfter(at.Sub(*last))
	}
	*last = at
	return kept
}

// keptAfter is the weight a sum keeps after gap: half for every decodeMemory, all of it for no time
// (or a clock that stepped back).
func keptAfter(gap time.Duration) float64 {
	if gap <= 0 {
		return 1
	}
	return math.Exp2(-gap.Seconds() / decodeMemory.Seconds())
}

// followSenders adds the tokens the worker prefilled and those this proxy sent it (uncached) between
// the report before (prev) and this one, gap apart, to prev's sums; counting says this proxy has
// counted what it sends the worker.
func (w *workload) followSenders(prev *workload, received float64, sent int64, counting bool, gap time.Duration) {
	kept := keptAfter(gap)
	w.receivedSum, w.sentSum, w.senders = prev.receivedSum*kept, prev.sentSum*kept, prev.senders
	// Totals that began again (another config's) say nothing, nor do windows before this proxy counted
	// anything it sent: a policy that does not count (the signal metrics) would have the worker's tokens
	// read as other senders (a reload to the cost metric read 2.6 with one Caddy for a minute after). A
	// window it sent nothing in counts: the others' share of a worker it rarely uses is in such windows.
	if sent < 0 || !counting {
		return
	}
	w.receivedSum += received
	w.sentSum += float64(sent)
	if w.sentSum > 0 {
		w.senders = min(max(w.receivedSum/w.sentSum, 1), maxSenders)
	}
}

// maxSenders bounds the factor by which the model counts the requests sent since a report.
const maxSenders = 64

// othersShare is the share of the worker's prefill work that other senders send it: 0 where this proxy
// is the only one, the share is not measured, or p does not count other senders.
func (w *workload) othersShare(p *CostParams) float64 {
	if !p.OtherSenders || w.senders <= 1 {
		return 0
	}
	return 1 - 1/w.senders
}

// Senders is how much more work the worker received than this proxy sent it, lately (at least 1; 0
// when not measured): the model counts the requests sent since a report that many times.
func (r *Report) Senders() float64 { return r.work.senders }

// DecodeAloneTokensPerSec is the decode speed of a request alone on the worker that its recent reports
// support, 0 when none measured one.
func (r *Report) DecodeAloneTokensPerSec() float64 { return r.work.alone }

// PrefillTokensPerSec is the worker's measured prefill speed, and whether it was measured: between two
// reports, else over the worker's life (LifetimePrefillPerRank).
func (r *Report) PrefillTokensPerSec() (float64, bool) { return r.work.prefill, r.work.prefillOK }

// PrefillPerRankTokensPerSec is PrefillTokensPerSec on one data-parallel rank, where a request prefills.
func (r *Report) PrefillPerRankTokensPerSec() (float64, bool) {
	return r.work.prefillPerRank(), r.work.prefillOK
}

// Priced reports whether the report carries what the cost model needs: running and waiting counts.
func (r *Report) Priced() bool { return r != nil && r.work.has }

// Measured reports whether the cost model prices the worker by speeds its own reports measured, for a
// request that decodes or, with decodes false, one that only prefills: its decode speed alone once
// trustedReadings reports caught it decoding, its prefill speed once two reports' counters differ by a
// prefill; a speed its reports do not carry, or the request does not need, counts as measured. Until
// then it is priced at the stand-ins, which may make a slow worker look as fast as the fastest.
func (r *Report) Measured(decodes bool) bool {
	w := &r.work
	return (!decodes || w.readings >= trustedReadings || !w.readsDecode) && (w.prefillOK || !w.readsPrefill)
}

// Cost is the time, in seconds, that req would take on the worker if placed there now: since says what
// happened after the report, cached is how many of its prompt tokens the worker already holds. It
// returns +Inf for a report the model cannot price (see Priced), and for a request whose prompt the
// worker refuses (see admits); an output past what the worker lets the request have holds KV as cut.
func (r *Report) Cost(req Request, cached int64, since *Since, p *CostParams) float64 {
	w := &r.work
	if !w.has {
		return math.Inf(1)
	}
	if p.OtherSenders && w.senders > 1 {
		var scaled Since
		since.setScaled(&scaled, w.senders)
		since = &scaled
	}
	meanOut := atLeast(p.MeanOutputTokens, 1)
	prompt := float64(max(req.PromptTokens, 0))
	if !w.admits(req.PromptTokens) {
		return math.Inf(1) // refused there: any worker that admits it goes first
	}
	out := float64(max(req.OutputTokens, 1))
	// SGLang cuts an output longer than the rank holds, and reserves it so. Its decode is priced at the
	// length asked for, as anywhere: a worker that would cut the answer short is no faster for it.
	held := w.heldOutput(prompt, out)

	// Requests on the worker now. Of those in the report, the oldest finish first: every request that
	// finished since is taken from them before any sent since.
	sent := max(since.Sent, 0)
	now := max(w.requests+since.Extra, 0)
	finished := max(sent-since.Extra, 0)
	finishedOld := min(finished, w.requests)
	oldLeft := w.requests - finishedOld
	newLeft := min(max(now-oldLeft, 0), sent)
	present := oldLeft + newLeft
	// Their KV tokens. Every request sent finishes once, so the requests that finish are, on the whole,
	// of the mean size sent: the reported ones lose that much each. The requests sent since that are
	// left are mostly the long ones: a request stays in proportion to its output, so their mean size is
	// the output-weighted mean of the sizes sent (at most what was sent).
	sentTokens := float64(max(since.SentPrompt+since.SentOutput, 0))
	oldTokens := float64(w.tokens) + float64(w.waiting)*meanOut
	var tokens float64
	switch {
	case oldLeft == 0:
	case finishedOld > 0:
		meanSize := oldTokens / float64(w.requests)
		if sent > 0 {
			meanSize = sentTokens / float64(sent)
		}
		tokens = atLeast(oldTokens-float64(finishedOld)*meanSize, 0)
	default:
		tokens = oldTokens
	}
	switch {
	case newLeft == sent:
		tokens += sentTokens
	case newLeft > 0 && since.SentOutput > 0:
		tokens += min(float64(newLeft)*float64(since.SentWeighted)/float64(since.SentOutput), sentTokens)
	}

	// The batch this request joins, and the per-request decode speed there: a decode step reads the
	// weights once for the whole batch and each request's KV, so per-request speed falls slowly with the
	// batch, halving at DecodeBatchHalving more requests. A measured throughput gives the speed at the
	// measured batch; the model carries it to the batch this request joins. slowdown is the factor by
	// which a request's speed in that batch is below its speed alone.
	batch := present + 1
	if w.maxBatch > 0 {
		batch = min(batch, w.maxBatch)
	}
	invHalving := 1 / atLeast(p.DecodeBatchHalving, 1)
	alone := w.aloneSpeed(p)
	slowdown := 1 + float64(batch-1)*invHalving
	secondsPerToken := slowdown / alone // per request, in the batch it joins
	decode := out * secondsPerToken
	// Each token this request decodes makes the batch's step longer by invHalving/alone seconds for
	// every other request in it.
	decode += p.DelayToOthers * float64(batch-1) * out * invHalving / alone

	// Admission: a full KV pool or batch admits the request only as running ones finish. A finishing
	// request frees its tokens after meanOut output tokens; the batch produces batch/secondsPerToken
	// tokens a second, so it frees a request every meanOut x secondsPerToken / batch seconds.
	// SGLang admits a request for its prompt and at most admittedOutputTokens of its output; the rest
	// it allocates as the request decodes.
	var wait float64
	finishEvery := meanOut * secondsPerToken / float64(batch)
	if w.capacity > 0 {
		admitted := prompt + min(held, admittedOutputTokens)
		if over := tokens + admitted - float64(w.capacity); over > 0 {
			perPresent := admitted
			if present > 0 {
				perPresent = tokens / float64(present)
			}
			wait = over / perPresent * finishEvery
		}
	}
	if w.maxBatch > 0 {
		if over := present + 1 - w.maxBatch; over > 0 {
			wait = max(wait, float64(over)*finishEvery)
		}
	}

	// Prefill: the prompts queued ahead (the report's queue and what the proxy sent since, as the
	// Backlog projects them), at most those of the requests still there, since a request that finished
	// was prefilled; then this prompt's uncached part on one rank.
	invSpeed := 1 / w.prefillSpeed(p)
	there := float64(w.queued)
	if sent > 0 {
		there += float64(max(since.SentUncached, 0)) * float64(newLeft) / float64(sent)
	}
	ahead := min(since.Backlog.Ahead(r, since.Elapsed, p), there*invSpeed)
	// Other senders' prompts arrive at random, unseen until the next report: a prefill they keep busy a
	// fraction u of the time keeps a new prompt waiting u/(1-u) residual prompts (Pollaczek-Khinchine).
	// This proxy's own prompts are in the backlog: counted here too, a busy worker's stale fraction
	// outweighed its queue for a whole interval, and every request went to whichever read idlest.
	onRank := atLeast(prompt-float64(max(cached, 0)), 0)
	if u := min(w.prefillBusy*w.othersShare(p), maxPrefillBusy); u > 0 {
		onRank += u / (1 - u) * atLeast(p.ResidualPromptTokens, 0)
	}
	prefill := ahead + onRank*float64(max(w.ranks, 1))*invSpeed

	return wait + prefill + decode
}

// AloneCost is the time, in seconds, that req would take on the worker idle with none of its prompt
// cached: the yardstick that Cost is measured against when workers of different speeds are compared by
// how much their load and cache stretch a request. +Inf for a report the model cannot price.
func (r *Report) AloneCost(req Request, p *CostParams) float64 {
	w := &r.work
	if !w.has {
		return math.Inf(1)
	}
	prompt := float64(max(req.PromptTokens, 0)) * float64(max(w.ranks, 1))
	out := float64(max(req.OutputTokens, 1))
	return prompt/w.prefillSpeed(p) + out/w.aloneSpeed(p)
}

// aloneSpeed is the decode speed of one request in a batch of its own, tokens/s. The readings were
// carried to a batch of one at referenceHalving; a worker said to halve at another batch is carried
// back from the batch they were read at by its own halving, so that a speed read at batch b prices
// a request at batch b as read: at 16, a 4x simulated worker read at about 20 running is 400 tok/s
// alone, not the 260 that 32 makes of it.
func (w *workload) aloneSpeed(p *CostParams) float64 {
	alone := w.alone
	// A worker not yet measured decodes at no less than the fleet's speed for its prefill speed, where
	// both are known, else the stand-in.
	unmeasured := p.DecodeTokensPerSec
	if prior := w.fleetSpeed(p); prior > 0 {
		// The fleet's ratio counts as fleetReadings lone requests read at it: a worker caught decoding
		// a few times is priced mostly by it, one busy for a minute by its own readings.
		alone = (w.genSum + fleetReadings*prior) / (w.batchSum + fleetReadings)
		unmeasured = prior
	}
	if h := p.DecodeBatchHalving; h > 0 && h != referenceHalving && w.readingsSum > 0 {
		extra := w.runningSum/w.readingsSum - 1
		alone *= (1 + extra/atLeast(h, 1)) / (1 + extra/referenceHalving)
	}
	if w.readings < trustedReadings {
		alone = max(alone, unmeasured)
	}
	return atLeast(alone, 1e-3)
}

// fleetSpeed is the worker's prefill speed per rank times the fleet's ratio of decode to prefill, 0
// where either is unknown.
func (w *workload) fleetSpeed(p *CostParams) float64 {
	if w.prefillOK && p.DecodePerPrefill > 0 {
		return w.prefillPerRank() * p.DecodePerPrefill
	}
	return 0
}

// prefillPerRank is the worker's measured prefill speed on one data-parallel rank, where a request
// prefills.
func (w *workload) prefillPerRank() float64 { return w.prefill / float64(max(w.ranks, 1)) }

// fleetReadings is how many readings of a lone request the fleet's decode to prefill ratio counts for
// in a worker's speed alone. A worker busy with a batch of 20, polled every 10 s, holds some 115 in
// its sums; one at a light load, a handful.
const fleetReadings = 16

// FleetDecode pools the decode readings of a policy's workers into one ratio of decode speed alone to
// prefill speed per rank. Workers serving one model on different hardware differ in both speeds
// together. A worker's prefill speed, from its cumulative counters, reads true after one request; its
// decode readings, a throughput window against the batch at the poll, are each far off and few where
// it is rarely sent to (at 4 requests/s a simulated 2x worker read 6 to 289 tok/s alone against 200
// over five runs), and Caddy instances that price it from their own few readings disagree on where
// a request goes. A ratio of sums over every worker's recent readings: the output tokens/s they read
// over their batches (in lone requests' worth, as a worker's own sums count them), each batch weighed
// by the prefill speed per rank of the worker that read it. A reading weighs half for every
// decodeMemory of readings since. The zero value is ready; it is not safe for concurrent use.
type FleetDecode struct {
	gen, batchPrefill float64
	last              time.Time
}

// Add adds the report's own decode reading, when it has one and its worker's prefill speed is measured.
func (f *FleetDecode) Add(r *Report) {
	w := &r.work
	if !w.sampled || !w.prefillOK || w.prefill <= 0 {
		return
	}
	kept := keptSince(&f.last, r.Received)
	f.gen, f.batchPrefill = f.gen*kept, f.batchPrefill*kept
	f.gen += w.readGen
	f.batchPrefill += w.readBatch * w.prefillPerRank()
}

// PerPrefill is the fleet's decode speed alone over prefill speed per rank, 0 before a reading.
func (f *FleetDecode) PerPrefill() float64 {
	if f.batchPrefill <= 0 {
		return 0
	}
	return f.gen / f.batchPrefill
}

// prefillSpeed is the worker's prefill speed, tokens/s: measured, else the stand-in.
func (w *workload) prefillSpeed(p *CostParams) float64 {
	if w.prefillOK {
		return atLeast(w.prefill, 1)
	}
	speed := p.PrefillTokensPerSec
	if floor := p.PrefillPerRankFloor * float64(w.ranks); floor > speed { // ranks >= 1 where Cost prices
		speed = floor
	}
	return atLeast(speed, 1)
}

// atLeast is max(v, lo) for values that are never NaN, without math.Max's NaN and signed-zero care.
func atLeast(v, lo float64) float64 {
	if v < lo {
		return lo
	}
	return v
}
