package sglangsim

import (
	"math"
	"math/bits"
)

// plan turns a parsed request into the model's job: its answer's length and its cacheable blocks.
// sample numbers the answers of a request for several (n), 0 for the first; answer, when positive, is
// the answer's length (answer_tokens), cut to the output the request may have.
func (w *Worker) plan(k promptKey, prompt, maxTokens, answer int64, dpRank, sample int) job {
	digest := k.digest()
	if sample > 0 { // another answer to the same prompt: a length of its own
		digest = mix64(digest + uint64(sample))
	}
	// The answer's length is drawn from the client's max_tokens, then cut where SGLang cuts it: a
	// model's answer does not know the pool.
	capped := w.maxNewTokens(prompt, maxTokens)
	j := job{
		prompt:    prompt,
		maxTokens: capped,
		output:    min(outputLength(w.cfg.FinishEarly, digest, prompt, maxTokens), capped),
		dpRank:    dpRank,
	}
	if answer > 0 {
		j.output = min(answer, capped)
	}
	// A prompt too long is refused by submit; do not hash it into blocks first.
	if !w.cfg.DisablePrefixCache && w.admits(prompt) {
		j.blocks, j.answer = k.blocks(prompt, j.output)
	}
	return j
}

// SGLang's limits on one request, from its rank's pool (the simulator has no context length):
// max_req_len is the pool less one; a prompt of max_req_len - 5 tokens or more is refused, and
// max_new_tokens is cut to max_req_len - prompt - 1.
func (w *Worker) maxReqLen() int64 { return w.cfg.MaxTotalTokens - 1 }

// maxInputTokens is the least prompt SGLang refuses (its max_req_input_len).
func (w *Worker) maxInputTokens() int64 { return w.maxReqLen() - 5 }

// admits reports whether a prompt of this many tokens is taken at all.
func (w *Worker) admits(prompt int64) bool { return prompt < w.maxInputTokens() }

// maxNewTokens is the output a request may have: the client's max_tokens, cut to what the rank holds
// beside the prompt. Not past maxTokens where the prompt is refused.
func (w *Worker) maxNewTokens(prompt, maxTokens int64) int64 {
	if !w.admits(prompt) {
		return maxTokens
	}
	return min(maxTokens, w.maxReqLen()-prompt-1)
}

// outputLength is the length of an answer: maxTokens, or with low in (0, 1) a length in
// [max(1, ceil(low × maxTokens)), maxTokens], uniform over the hash of the prompt (digest) and the sizes.
func outputLength(low float64, digest uint64, prompt, maxTokens int64) int64 {
	if low <= 0 || low >= 1 || maxTokens <= 1 {
		return maxTokens
	}
	h := mix64(mix64(digest^uint64(prompt)) ^ uint64(maxTokens))
	lo := max(1, int64(math.Ceil(low*float64(maxTokens))))
	span, _ := bits.Mul64(h, uint64(maxTokens-lo+1)) // floor(h/2^64 × count): in [0, count)
	return lo + int64(span)
}

// mix64 is SplitMix64's finaliser: FNV's low bits alone are poorly spread.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}
