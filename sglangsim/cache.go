package sglangsim

import (
	"encoding/binary"
	"hash/fnv"
	"math/bits"
	"slices"
)

// The prefix cache keys a prompt by chained hashes of fixed-size blocks. A block is cacheBlockTokens
// tokens of the simulator's measure: 64 bytes of prompt text, or 16 input_ids. Block i's hash is the
// 64-bit FNV-1a of the key up to the end of block i, so equal hashes mean equal prefixes and a lookup
// walks a prompt's blocks in order until the first miss. Only whole blocks are cached. A request's
// prompt blocks are cached once it has prefilled them, never the prompt's last token (a request always
// prefills at least one, as SGLang does); when it finishes, the blocks of its answer as a client would
// resend it are cached too (SGLang's radix cache keeps generated tokens), so the next turn of a
// conversation finds its history.
const (
	cacheBlockTokens = 16
	bytesPerToken    = 4
	cacheBlockBytes  = cacheBlockTokens * bytesPerToken
)

// Key kinds keep text and token-id prompts apart: the simulator has no tokenizer to relate them.
const (
	keyText byte = 't'
	keyIDs  byte = 'i'
)

// promptKey is the content a request is keyed by, in the simulator's token measure.
type promptKey struct {
	kind   byte
	bytes  []byte // prompt text, or input_ids at 4 bytes each
	tokens int64  // the key's size in tokens
	// A client resends an answer as answerOpen + text + answerClose after the prompt (a chat's
	// assistant message; plain text for completions). Token ids cannot: their answer has no ids.
	answerOpen, answerClose string
	resent                  bool
}

func textKey(b []byte) promptKey {
	return promptKey{kind: keyText, bytes: b, tokens: promptTokens(len(b)), resent: true}
}

// chatKey is the key of rendered chat messages (see chatRequest.prompt).
func chatKey(b []byte) promptKey {
	k := textKey(b)
	k.answerOpen, k.answerClose = "assistant\x00", "\x00"
	return k
}

func idsKey(ids []int64) promptKey {
	b := make([]byte, 0, len(ids)*bytesPerToken)
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint32(b, uint32(id))
	}
	return promptKey{kind: keyIDs, bytes: b, tokens: int64(len(ids))}
}

// digest is the hash of the whole key.
func (k promptKey) digest() uint64 {
	h := fnv.New64a()
	h.Write([]byte{k.kind})
	h.Write(k.bytes)
	return h.Sum64()
}

// block is one whole block of a prompt: its chained hash and the prompt tokens it stands for.
type block struct {
	hash   uint64
	tokens int64
}

// blocks cuts the key, followed by the answer of output tokens as a client would resend it, into
// blocks for a request of prompt tokens (which may differ from k.tokens when the body overrides the
// size). The key's 16-token block i stands for prompt tokens [16i·prompt/k.tokens, (16i+16)·prompt/
// k.tokens): without an override, 16 tokens. Past the key, 4 bytes are a token, after the prompt's.
// inPrompt are the blocks that end before the prompt's last token; inAnswer the rest, up to the
// answer's last token.
func (k promptKey) blocks(prompt, output int64) (inPrompt, inAnswer []block) {
	text := k.bytes
	if k.resent {
		text = slices.Concat(k.bytes, []byte(k.answerOpen), []byte(filler(0, output)), []byte(k.answerClose))
	}
	h := fnv.New64a()
	h.Write([]byte{k.kind})
	var start int64
	for i := range len(text) / cacheBlockBytes {
		h.Write(text[i*cacheBlockBytes : (i+1)*cacheBlockBytes])
		end := k.tokenAt((i+1)*cacheBlockBytes, prompt)
		if end > prompt+output-1 {
			break
		}
		if end > start { // a block standing for no token would fill the cache for nothing
			b := block{hash: h.Sum64(), tokens: end - start}
			if end <= prompt-1 {
				inPrompt = append(inPrompt, b)
			} else {
				inAnswer = append(inAnswer, b)
			}
		}
		start = end
	}
	return inPrompt, inAnswer
}

// tokenAt is the request's token count at byte offset n of the key and its answer.
func (k promptKey) tokenAt(n int, prompt int64) int64 {
	if n > len(k.bytes) {
		return prompt + int64(n-len(k.bytes))/bytesPerToken
	}
	// n/4 <= k.tokens, so the quotient is at most prompt and cannot overflow.
	hi, lo := bits.Mul64(uint64(n/bytesPerToken), uint64(prompt))
	q, _ := bits.Div64(hi, lo, uint64(k.tokens))
	return int64(q)
}

// cacheEntry is one cached block. Entries that no running request holds are evictable and sit in the
// LRU list.
type cacheEntry struct {
	hash       uint64
	tokens     int64
	refs       int // running requests holding it
	prev, next *cacheEntry
}

// prefixCache is one rank's cached blocks. pinned counts the tokens of held entries (they are part of
// num_used_tokens), evictable the rest; evicted the tokens evicted so far.
type prefixCache struct {
	entries           map[uint64]*cacheEntry
	lru               cacheEntry // sentinel: lru.next is the most recently used evictable entry
	pinned, evictable int64
	evicted           int64
	// gone holds the blocks evicted and not cached since, up to maxGone of them: a prompt that brings
	// one back is prefilling what the cache once held.
	gone map[uint64]struct{}
	// host is the host-memory tier (Config.HostPoolTokens), where evicted blocks go; nil: none.
	host *hostTier
}

// maxGone bounds the evicted blocks a cache remembers; past it, it forgets them all and starts again.
const maxGone = 1 << 20

func (c *prefixCache) lazyInit() {
	if c.entries == nil {
		c.entries = make(map[uint64]*cacheEntry)
		c.gone = make(map[uint64]struct{})
		c.lru.next, c.lru.prev = &c.lru, &c.lru
	}
}

// goneIn returns the tokens of blocks that the cache held once and evicted.
func (c *prefixCache) goneIn(blocks []block) int64 {
	var n int64
	for _, b := range blocks {
		if _, ok := c.gone[b.hash]; ok {
			n += b.tokens
		}
	}
	return n
}

// prefix returns how many leading blocks are cached in the pool, and how many after those the host
// tier holds, without touching them.
func (c *prefixCache) prefix(blocks []block) (inPool, inHost int) {
	inPool = c.match(blocks)
	return inPool, c.host.match(blocks[inPool:])
}

// match returns how many leading blocks are cached, without touching them.
func (c *prefixCache) match(blocks []block) int {
	for i, b := range blocks {
		if _, ok := c.entries[b.hash]; !ok {
			return i
		}
	}
	return len(blocks)
}

// evictableIn returns the tokens of cached blocks that no request holds: pinning them moves them
// from evictable to used.
func (c *prefixCache) evictableIn(blocks []block) int64 {
	var n int64
	for _, b := range blocks {
		if e := c.entries[b.hash]; e != nil && e.refs == 0 {
			n += e.tokens
		}
	}
	return n
}

// pin holds the cached blocks (all must be cached) and returns their entries, with room for capacity
// more.
func (c *prefixCache) pin(blocks []block, capacity int) []*cacheEntry {
	out := make([]*cacheEntry, 0, capacity)
	for _, b := range blocks {
		e := c.entries[b.hash]
		c.ref(e)
		out = append(out, e)
	}
	return out
}

// insert caches a block that a request just prefilled, held by that request.
func (c *prefixCache) insert(b block) *cacheEntry {
	c.lazyInit()
	if e := c.entries[b.hash]; e != nil {
		c.ref(e)
		return e
	}
	e := &cacheEntry{hash: b.hash, tokens: b.tokens, refs: 1}
	c.entries[b.hash] = e
	delete(c.gone, b.hash)
	c.host.take(b.hash) // a block is in one tier at a time
	c.pinned += e.tokens
	return e
}

func (c *prefixCache) ref(e *cacheEntry) {
	if e.refs == 0 {
		e.prev.next, e.next.prev = e.next, e.prev
		e.prev, e.next = nil, nil
		c.evictable -= e.tokens
		c.pinned += e.tokens
	}
	e.refs++
}

// unpin releases a request's entries. They go to the front of the LRU list deepest first, so a prefix
// is always more recent than its extensions and eviction takes leaves before the blocks they hang on.
func (c *prefixCache) unpin(pins []*cacheEntry) {
	for i := len(pins) - 1; i >= 0; i-- {
		e := pins[i]
		if e.refs--; e.refs > 0 {
			continue
		}
		c.pinned -= e.tokens
		c.evictable += e.tokens
		e.prev, e.next = &c.lru, c.lru.next
		c.lru.next.prev = e
		c.lru.next = e
	}
}

// evict drops least recently used evictable entries until at least n tokens are freed or none is left.
// They go to the host tier, if there is one, and what it has no room for is gone.
func (c *prefixCache) evict(n int64) {
	for n > 0 && c.evictable > 0 {
		e := c.lru.prev
		e.prev.next, e.next.prev = e.next, e.prev
		delete(c.entries, e.hash)
		c.evictable -= e.tokens
		c.evicted += e.tokens
		n -= e.tokens
		e.prev, e.next = nil, nil
		if c.host != nil {
			c.host.put(e, c.forget)
		} else {
			c.forget(e)
		}
	}
}

// forget notes a block that left the last tier: a prompt that brings it back prefills it again.
func (c *prefixCache) forget(e *cacheEntry) {
	if len(c.gone) >= maxGone {
		clear(c.gone)
	}
	c.gone[e.hash] = struct{}{}
}

// hostTier is a rank's host-memory tier of the prefix cache, as SGLang's hierarchical cache keeps in
// host memory: the blocks evicted from the KV pool, least recently evicted first out when it is
// full. A block in it is in no other tier: loading it back moves it to the pool.
type hostTier struct {
	capacity, tokens int64
	entries          map[uint64]*cacheEntry
	lru              cacheEntry // sentinel: lru.next is the latest block in
}

func newHostTier(capacity int64) *hostTier {
	h := &hostTier{capacity: capacity, entries: make(map[uint64]*cacheEntry)}
	h.lru.next, h.lru.prev = &h.lru, &h.lru
	return h
}

// put takes an evicted block, dropping the oldest ones to gone while it holds more than its capacity.
func (h *hostTier) put(e *cacheEntry, gone func(*cacheEntry)) {
	e.refs = 0
	e.prev, e.next = &h.lru, h.lru.next
	h.lru.next.prev = e
	h.lru.next = e
	h.entries[e.hash] = e
	h.tokens += e.tokens
	for h.tokens > h.capacity {
		old := h.lru.prev
		h.unlink(old)
		gone(old)
	}
}

func (h *hostTier) unlink(e *cacheEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	delete(h.entries, e.hash)
	h.tokens -= e.tokens
}

// match returns how many leading blocks the tier holds, without touching them.
func (h *hostTier) match(blocks []block) int {
	if h == nil {
		return 0
	}
	for i, b := range blocks {
		if h.entries[b.hash] == nil {
			return i
		}
	}
	return len(blocks)
}

// take removes a block from the tier, if it is there.
func (h *hostTier) take(hash uint64) {
	if h == nil {
		return
	}
	if e := h.entries[hash]; e != nil {
		h.unlink(e)
	}
}

// size is the tokens the tier holds.
func (h *hostTier) size() int64 {
	if h == nil {
		return 0
	}
	return h.tokens
}

func (c *prefixCache) tokens() int64 { return c.pinned + c.evictable }
