package sglangsim

import (
	"math"
	"time"
)

// The step model (Config.Timing = TimingStep), per DP rank, as SGLang's scheduler loop runs it:
//
//   - The rank runs one forward pass after another while it has running requests. A pass is planned
//     when the last one ends, from the batch as it is then, and takes effect when it ends: requests
//     admitted meanwhile wait for the next one, as they wait for SGLang's next batch.
//   - A pass prefills or decodes. While any admitted request has prompt left to prefill, the pass is a
//     prefill batch: the requests in admission order, up to ChunkedPrefillSize (and MaxPrefillTokens)
//     uncached tokens in all, the last one cut to what is left (a chunk; its rest goes in the next
//     pass). Decoding stalls meanwhile: SGLang's default scheduler runs a new prefill batch before the
//     running batch whenever it can form one, and a chunked request's next chunk always can. Otherwise
//     the pass decodes one token of every decoding request. With MixedChunk the decode batch rides
//     in the prefill pass too, as SGLang's --enable-mixed-chunk, and the chunk is smaller by one token
//     per decoding request.
//   - A pass takes StepBaseSec, plus StepPrefillTokenSec × the tokens it prefills, plus
//     StepAttentionSec × Σ chunk × (context + chunk/2) over its chunks, plus StepDecodeRequestSec × the
//     requests it decodes, plus StepKVTokenSec × the KV tokens they read, all divided by Speed; a
//     chunk's context is the tokens of its request already in the KV cache (cached or prefilled
//     by earlier chunks) and a decoding request reads its prompt and output so far. A prompt's prefix
//     loaded back from the host tier loads during the pass that prefills its first chunk, layer by
//     layer beside the compute as SGLang's load_back does, so the pass takes at least the load's
//     time at HostLoadTokensPerSec.
//   - The pass that prefills a prompt's last chunk yields its first token (or a retracted request's
//     next); total_prefill_uncached_tokens counts the tokens prefilled and total_prefill_busy_us the
//     time of the passes that prefilled, so their ratio is the prefill speed the worker shows.
//     gen_throughput counts the tokens decoded as the passes end; utilization the time a pass ran.
//
// The defaults are Llama-3.1-8B-Instruct in bf16 on one H100 80GB SXM (docs/simulator.md):
//
//   - 8.03e9 parameters, 2 FLOPs each per token: 16 GFLOP a token at 989 TFLOP/s dense bf16 and about
//     55% of it in prefill: 30 µs a token (StepPrefillTokenSec);
//   - attention, 4 × 32 layers × 4096 dims = 0.52 MFLOP per token per token of context, at the same
//     rate: 1 ns (StepAttentionSec);
//   - weights 16.1 GB read once a pass at 2.7 TB/s (80% of HBM3's 3.35 TB/s): 6 ms (StepBaseSec);
//   - KV cache 32 layers × 8 KV heads × 128 dims × (K, V) × 2 bytes = 128 KiB a token at 2.7 TB/s:
//     49 ns (StepKVTokenSec);
//   - 20 µs per decoding request for the rest of its work (sampling, activations; StepDecodeRequestSec).
//
// So a lone request decodes at about 165 tokens/s (6.1 ms a token, as SGLang and vLLM report at batch 1
// on an H100), a prompt of 8192 tokens prefills in 0.285 s (28,700 tokens/s), and 32 requests at 8k
// context each decode in 19.5 ms steps (51 tokens/s each).
const (
	defaultStepBaseSec          = 0.006
	defaultStepPrefillTokenSec  = 30e-6
	defaultStepAttentionSec     = 1e-9
	defaultStepDecodeRequestSec = 20e-6
	defaultStepKVTokenSec       = 49e-9
	defaultHostLoadTokensPerSec = 190000
)

// stepWork is what one forward pass computes.
type stepWork struct {
	prefill   float64 // prompt tokens prefilled
	attention float64 // Σ over prefilled chunks of chunk × (context before it + chunk/2)
	decodes   int     // decoding requests, one token each
	kv        float64 // KV tokens the decoding requests read
	load      float64 // tokens loaded back from the host tier
}

// chunk adds a prefill chunk of tokens whose request has context tokens in the KV cache before it.
func (s *stepWork) chunk(tokens, context float64) {
	s.prefill += tokens
	s.attention += tokens * (context + tokens/2)
}

// stepSeconds is how long a forward pass of work takes on this worker.
func (c *Config) stepSeconds(s stepWork) float64 {
	compute := c.StepBaseSec + c.StepPrefillTokenSec*s.prefill + c.StepAttentionSec*s.attention +
		c.StepDecodeRequestSec*float64(s.decodes) + c.StepKVTokenSec*s.kv
	return math.Max(compute/c.Speed, s.load/c.HostLoadTokensPerSec)
}

// passPlan is the forward pass in flight on a rank.
type passPlan struct {
	left     float64 // seconds until it ends; 0: none in flight
	seconds  float64 // its whole time
	decode   bool    // it decodes a token of every decoding request
	retracts bool    // planning it retracted requests (SGLangAdmission)
	chunks   []passChunk
}

// passChunk is a request's prefill in the pass in flight.
type passChunk struct {
	r      *request
	tokens float64
}

// prefillBatch is how many uncached tokens one prefill pass takes.
func (c *Config) prefillBatch() int64 {
	if c.Timing == TimingStep {
		return min(c.ChunkedPrefillSize, c.MaxPrefillTokens)
	}
	return c.MaxPrefillTokens
}

// runSteps advances a rank by dt seconds of forward passes ending at now: it ends the pass in flight
// when its time is up, plans the next from the batch as it is then, and so on; a pass longer than dt
// carries over to the next call.
func (w *Worker) runSteps(rk *rank, now time.Time, at time.Duration, dt float64) {
	p := &rk.pass
	if len(rk.running) == 0 {
		p.left = 0 // its requests left (aborted)
		rk.newTokenRatio = initNewTokenRatio
		w.admit(rk, now)
	}
	left := dt       // seconds of this call not yet run
	var idle float64 // of them, the seconds before a pass's first request arrived
	var produced, retracted int64
	for left > 0 {
		if p.left <= 0 {
			before := rk.retracted
			if !w.planPass(rk) {
				break
			}
			retracted += rk.retracted - before
			if !p.decode {
				// A pass that decodes nothing starts when its first request arrived, if the rank
				// was idle until then.
				first := p.chunks[0].r.admitted
				for _, c := range p.chunks[1:] {
					if c.r.admitted.Before(first) {
						first = c.r.admitted
					}
				}
				if waited := now.Sub(first).Seconds(); waited < left {
					idle += left - max(waited, 0)
					left = max(waited, 0)
				}
			}
		}
		if p.left > left {
			p.left -= left
			left = 0
			break
		}
		left -= p.left
		p.left = 0
		end := now.Add(-time.Duration(left * float64(time.Second)))
		produced += w.endPass(rk, end)
		w.admit(rk, end)
	}
	rk.win.add(at, float64(produced), dt-left-idle, retracted)
}

// planPass plans the rank's next forward pass from its batch; false when there is nothing to run.
func (w *Worker) planPass(rk *rank) bool {
	p := &rk.pass
	prefilling, decoding := false, 0
	for _, r := range rk.running {
		switch r.state {
		case statePrefill:
			prefilling = true
		case stateDecode:
			decoding++
		}
	}
	p.decode = decoding > 0 && (!prefilling || w.cfg.MixedChunk)
	p.retracts = false
	var work stepWork
	if p.decode {
		before := rk.retracted
		w.decodeRoom(rk, func(*request, int) int64 { return 1 })
		p.retracts = rk.retracted > before
		for _, r := range rk.running {
			if r.state == stateDecode {
				work.decodes++
				work.kv += float64(r.prompt + r.emitted.Load())
			}
		}
		p.decode = work.decodes > 0
	}
	budget := float64(w.cfg.prefillBatch())
	if p.decode {
		budget -= float64(work.decodes) // SGLang's mixed chunk leaves a token of room per decode
	}
	for _, r := range rk.running {
		if budget <= 0 {
			break
		}
		if r.state != statePrefill {
			continue
		}
		tokens := math.Min(budget, r.prefillLeft)
		budget -= tokens
		work.chunk(tokens, float64(r.prompt+r.emitted.Load())-r.prefillLeft)
		work.load += r.loadLeft
		p.chunks = append(p.chunks, passChunk{r, tokens})
	}
	if !p.decode && len(p.chunks) == 0 {
		return false
	}
	p.seconds = w.cfg.stepSeconds(work)
	p.left = p.seconds
	return true
}

// endPass applies the pass in flight, ending at end, and returns the output tokens it produced.
func (w *Worker) endPass(rk *rank, end time.Time) int64 {
	p := &rk.pass
	em := w.emitter(rk)
	if p.decode {
		for _, r := range rk.running {
			if r.state == stateDecode {
				em.to(r, math.Min(r.gen+1, float64(r.output)))
			}
		}
		if !p.retracts {
			rk.decayNewTokenRatio(1)
		}
	}
	for _, c := range p.chunks {
		r := c.r
		if r.state != statePrefill { // aborted while the pass ran
			continue
		}
		r.loadLeft = 0
		r.prefillLeft -= c.tokens
		rk.prefilled += c.tokens
		if r.prefillLeft <= 0 {
			w.prefilled(rk, r, end, em)
		}
	}
	if len(p.chunks) > 0 {
		rk.prefillBusy += p.seconds
	}
	clear(p.chunks)
	p.chunks = p.chunks[:0]
	w.finishDone(rk, end)
	w.fitPool(rk) // decoding allocated KV (SGLangAdmission)
	return em.produced
}
