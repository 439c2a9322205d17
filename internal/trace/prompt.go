package trace

import "slices"

// BytesPerToken is the simulator's measure of text: a prompt of n tokens is 4n bytes.
const BytesPerToken = 4

// A block's text is a tag (7 characters and a space) and then words of three lowercase letters and a
// space, so every word is 4 bytes (one token in the simulator's measure, and about one in a real
// tokenizer's). The tag's first 4 characters encode the low 24 bits of the block's id through a
// bijection, so the texts of two ids that differ there differ from their first byte on: a prefix cache
// finds no common prefix between them, as between the traced blocks. The rest comes from a generator
// seeded by the whole id and the salt.
const tagAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

// words are common English words of three letters: a real tokenizer makes about one token of each.
var words = [64]string{
	"the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was", "one",
	"our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old", "see", "two",
	"way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use", "big", "end", "far",
	"few", "got", "set", "try", "why", "ask", "own", "run", "sea", "sun", "top", "red", "map", "law",
	"job", "key", "art", "air", "age", "act", "car", "cup",
}

// Domain constants keep the texts of ids and of lines (prompts without ids) apart for the same salt.
const (
	idDomain   = 0x6a09e667f3bcc908
	lineDomain = 0xbb67ae8584caa73b
)

// PromptText is the request's prompt as text of exactly InputTokens tokens in the simulator's measure
// (4 bytes of text per token, so 512 tokens are 2048 bytes). With HashIDs: block i is the text that id
// HashIDs[i] always gives (deterministic from the id and salt; two ids that differ in their low 24 bits
// differ from their first bytes), the last block cut to the remainder of InputTokens. Without ids: text
// unique from its first token, from the salt and the request's Line (blocks past the last id, if a
// request has too few, are made the same way). Text is plain printable ASCII words, safe to embed in a
// JSON string as it is.
func PromptText(r Request, salt uint64) string {
	return string(AppendPromptText(nil, r, salt))
}

// AppendPromptText is PromptText appending into dst.
func AppendPromptText(dst []byte, r Request, salt uint64) []byte {
	if r.InputTokens <= 0 {
		return dst
	}
	dst = slices.Grow(dst, r.InputTokens*BytesPerToken)
	idKey, lineKey := mix64(salt^idDomain), mix64(salt^lineDomain)
	for i := range blocks(r.InputTokens) {
		n := blockTokens(r.InputTokens, i) * BytesPerToken
		if i < len(r.HashIDs) {
			id := uint64(r.HashIDs[i])
			dst = appendBlock(dst, n, bijection24(id, idKey), mix64(id^idKey))
		} else {
			// Block 0's tag is the line's own (mix64(0) = 0), so prompts of different lines differ from their
			// first byte; later blocks' keys are scrambled by the block's index, not shifted by it, lest
			// line l's block 1 begin as line l+1's block 0.
			seed := mix64(uint64(r.Line) ^ lineKey)
			dst = appendBlock(dst, n, bijection24(uint64(r.Line), lineKey^mix64(uint64(i))), mix64(seed+uint64(i)))
		}
	}
	return dst
}

// appendBlock appends the first n bytes (n <= BlockTokens*BytesPerToken) of the block of the given tag and seed.
func appendBlock(dst []byte, n int, tag uint32, seed uint64) []byte {
	start := len(dst)
	// The tag: 4 characters of the 24-bit tag, 3 of the seed, a space.
	var t [8]byte
	for j := range 4 {
		t[j] = tagAlphabet[tag>>(18-6*j)&63]
	}
	for j := range 3 {
		t[4+j] = tagAlphabet[seed>>(6*j)&63]
	}
	t[7] = ' '
	dst = append(dst, t[:]...)
	state := seed
	for len(dst)-start < n {
		v := splitmix64(&state)
		for k := 0; k < 10 && len(dst)-start < n; k++ { // 10 words of 6 bits from each 64-bit value
			dst = append(dst, words[v&63]...)
			dst = append(dst, ' ')
			v >>= 6
		}
	}
	return dst[:start+n]
}

// bijection24 maps the low 24 bits of x one to one onto 24 bits, scrambled by key: adding, multiplying
// by an odd number and xor-shifting right are each invertible modulo 2^24.
func bijection24(x, key uint64) uint32 {
	const mask = 1<<24 - 1
	v := (x + key) & mask
	v = v * 0x9e3779 & mask // odd
	v ^= v >> 12
	v = v * 0x85ebcb & mask // odd
	v ^= v >> 11
	return uint32(v)
}

// splitmix64 is Steele, Lea and Flood's generator: it steps *state and returns the next value.
func splitmix64(state *uint64) uint64 {
	*state += 0x9e3779b97f4a7c15
	return mix64(*state)
}

// mix64 is splitmix64's finaliser, a bijection of 64 bits.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}
