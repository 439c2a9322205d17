package sglangsim

import (
	"math"
	"math/bits"
)

// plan turns a parsed request into the model's job: its answer's length and its cacheable blocks.
// sample numbers the answers of a request for several (n), 0 for the first.
func (w *Worker) plan(k promptKey, prompt, maxTokens int64, dpRank, sample int) job {
	digest := k.digest()
	if sample > 0 { // another answer to the same prompt: a length of its own
		digest = mix64(digest + uint64(sample))
	}
	j := job{
		prompt:    prompt,
		maxTokens: maxTokens,
		output:    outputLength(w.cfg.FinishEarly, digest, prompt, maxTokens),
		dpRank:    dpRank,
	}
	// A request over the pool is refused by submit; do not hash it into blocks first.
	if !w.cfg.DisablePrefixCache && w.fits(prompt, maxTokens) {
		j.blocks, j.answer = k.blocks(prompt, j.output)
	}
	return j
}

// fits reports whether a request of these sizes fits the pool; not summed, since the sum of two
// sizes a client sent can overflow.
func (w *Worker) fits(prompt, maxTokens int64) bool {
	return prompt <= w.cfg.MaxTotalTokens && maxTokens <= w.cfg.MaxTotalTokens-prompt
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
