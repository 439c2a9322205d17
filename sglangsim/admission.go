package sglangsim

import (
	"cmp"
	"slices"
)

// SGLang's admission (Config.SGLangAdmission), with the defaults of its scheduler's settings
// (SGLANG_INIT_NEW_TOKEN_RATIO, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
// SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, SGLANG_RETRACT_DECODE_STEPS):
//
//   - a request allocates KV for its uncached prompt when admitted, then one token per token decoded;
//   - it is admitted when its uncached prompt, plus its output up to clipMaxNewTokens, fits in what
//     the pool has left after every running request's remaining output (up to clipMaxNewTokens)
//     times new_token_ratio: a guess at the share of it they will still use;
//   - new_token_ratio starts at initNewTokenRatio, falls to minNewTokenRatio over
//     newTokenRatioDecaySteps decode steps, and is reset when the rank is idle;
//   - when the pool has no room for the next token of every decoding request, the running requests
//     with the fewest output tokens (the longest prompt first among equals) are retracted until the
//     rest have room for retractDecodeSteps steps: their KV is freed, they go to the back of the
//     queue in the order they were retracted (SGLang's _add_request_to_queue appends, and its default
//     fcfs policy does not reorder the queue), and when admitted again they prefill their prompt and
//     the output they had, which yields their next token.
//     new_token_ratio is then set to what the requests left have used of their max_tokens, with
//     retractDecodeSteps more each.
const (
	initNewTokenRatio       = 0.7
	minNewTokenRatio        = initNewTokenRatio * 0.14
	newTokenRatioDecaySteps = 600
	clipMaxNewTokens        = 4096
	retractDecodeSteps      = 20
)

// outputLeft is the output r may still decode, as SGLang's estimate counts it.
func (r *request) outputLeft() int64 {
	return min(max(r.maxTokens-r.emitted.Load(), 0), clipMaxNewTokens)
}

// extend is the tokens r prefills when admitted with cached of them in the cache: its prompt and,
// when it was retracted, the output it had.
func (r *request) extend(cached int64) int64 { return r.prompt + r.emitted.Load() - cached }

// admission is the KV a request takes when admitted with cached prompt tokens and holding hit, and
// whether the rank's pool lets it in now.
func (w *Worker) admission(rk *rank, r *request, hit []block, cached int64) (private int64, ok bool) {
	extend := r.extend(cached)
	// Holding the hit blocks turns their evictable tokens into used ones.
	taken := rk.used() + rk.cache.evictableIn(hit)
	if !w.cfg.SGLangAdmission {
		private = extend + r.maxTokens
		return private, taken+private <= w.cfg.MaxTotalTokens
	}
	var promised float64
	for _, q := range rk.running {
		promised += float64(q.outputLeft()) * rk.newTokenRatio
	}
	need := float64(extend+r.outputLeft()) + promised
	return extend, float64(taken)+need < float64(w.cfg.MaxTotalTokens)
}

// grow allocates KV for tokens r decoded, under SGLang's admission; the reservation covers them
// otherwise.
func (w *Worker) grow(rk *rank, r *request, tokens int64) {
	if w.cfg.SGLangAdmission && tokens > 0 {
		r.private += tokens
		rk.private += tokens
	}
}

// decodeRoom is how many more tokens the rank's decoding requests may allocate this step under
// SGLang's admission, after retracting requests when they would not fit; decodeStep says how many
// tokens each decoding request gains this step in a batch of n. Without SGLang's admission the
// reservations cover every token and the room is unbounded (-1).
func (w *Worker) decodeRoom(rk *rank, decodeStep func(r *request, n int) int64) int64 {
	if !w.cfg.SGLangAdmission {
		return -1
	}
	var decoding []*request
	for _, r := range rk.running {
		if r.state == stateDecode {
			decoding = append(decoding, r)
		}
	}
	// SGLang checks before each decode step that the pool holds the next token of every decoding
	// request (check_decode_mem). A tick may be a fraction of a step and cross no token; asking for
	// none then would let a pool filled exactly stall every request, with none retracted.
	need := func() (tokens int64) {
		for _, r := range decoding {
			tokens += max(decodeStep(r, len(decoding)), 1)
		}
		return tokens
	}
	free := func() int64 { return w.cfg.MaxTotalTokens - rk.used() } // evictable blocks count as free
	if len(decoding) == 0 || free() >= need() {
		return free()
	}
	// Retracted first, from the end: the fewest output tokens, the longest prompt among equals.
	slices.SortStableFunc(decoding, func(a, b *request) int {
		if c := cmp.Compare(b.emitted.Load(), a.emitted.Load()); c != 0 {
			return c
		}
		return cmp.Compare(a.prompt, b.prompt)
	})
	var retracted []*request
	for len(decoding) > 1 && (free() < need() || free() < int64(retractDecodeSteps*len(decoding))) {
		r := decoding[len(decoding)-1]
		decoding = decoding[:len(decoding)-1]
		rk.release(r)
		r.state, r.prefillLeft = stateWaiting, 0
		retracted = append(retracted, r)
	}
	rk.running = slices.DeleteFunc(rk.running, func(r *request) bool { return slices.Contains(retracted, r) })
	for _, r := range retracted {
		rk.requeue(r)
	}
	rk.retracted += int64(len(retracted))
	var used, asked int64
	for _, r := range decoding {
		used += r.emitted.Load()
		asked += r.maxTokens
	}
	if asked > 0 {
		rk.newTokenRatio = min(1, float64(used+retractDecodeSteps*int64(len(decoding)))/float64(asked))
	}
	return free()
}

// decayNewTokenRatio lowers the rank's estimate after steps decode steps without a retraction.
func (rk *rank) decayNewTokenRatio(steps float64) {
	rk.newTokenRatio = max(rk.newTokenRatio-steps*(initNewTokenRatio-minNewTokenRatio)/newTokenRatioDecaySteps, minNewTokenRatio)
}
