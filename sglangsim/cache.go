package sglangsim

import (
	"encoding/binary"
	"hash/fnv"
	"math/bits"
)

// The prefix cache keys a prompt by chained hashes of fixed-size blocks. A block is cacheBlockTokens
// tokens of the simulator's measure: 64 bytes of prompt text, or 16 input_ids. Block i's hash is the
// 64-bit FNV-1a of the key up to the end of block i, so equal hashes mean equal prefixes and a lookup
// walks a prompt's blocks in order until the first miss. Only whole blocks are cached, and never the
// prompt's last token: a request always prefills at least one token, as SGLang does.
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
}

func textKey(b []byte) promptKey { return promptKey{keyText, b, promptTokens(len(b))} }

func idsKey(ids []int64) promptKey {
	b := make([]byte, 0, len(ids)*bytesPerToken)
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint32(b, uint32(id))
	}
	return promptKey{keyIDs, b, int64(len(ids))}
}

// block is one whole block of a prompt: its chained hash and the prompt tokens it stands for.
type block struct {
	hash   uint64
	tokens int64
}

// blocks cuts k into cacheable blocks for a request of prompt tokens (which may differ from k.tokens
// when the body overrides the size). Block i covers key tokens [16i, 16i+16), which stand for prompt
// tokens [16i·prompt/k.tokens, (16i+16)·prompt/k.tokens): without an override each block is 16 tokens.
// It also returns the hash of the whole key.
func (k promptKey) blocks(prompt int64, cache bool) ([]block, uint64) {
	h := fnv.New64a()
	h.Write([]byte{k.kind})
	n := len(k.bytes) / cacheBlockBytes
	var out []block
	if cache && n > 0 && k.tokens > 0 {
		out = make([]block, 0, n)
	}
	var start int64
	for i := range n {
		h.Write(k.bytes[i*cacheBlockBytes : (i+1)*cacheBlockBytes])
		if out == nil {
			continue
		}
		hi, lo := bits.Mul64(uint64(i+1)*cacheBlockTokens, uint64(prompt))
		if hi >= uint64(k.tokens) {
			break // cannot happen: a block never ends past the key
		}
		q, _ := bits.Div64(hi, lo, uint64(k.tokens))
		end := int64(q)
		if end > prompt-1 {
			break
		}
		if end > start { // a block standing for no token would fill the cache for nothing
			out = append(out, block{hash: h.Sum64(), tokens: end - start})
		}
		start = end
	}
	h.Write(k.bytes[n*cacheBlockBytes:])
	return out, h.Sum64()
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
// num_used_tokens), evictable the rest.
type prefixCache struct {
	entries           map[uint64]*cacheEntry
	lru               cacheEntry // sentinel: lru.next is the most recently used evictable entry
	pinned, evictable int64
}

func (c *prefixCache) lazyInit() {
	if c.entries == nil {
		c.entries = make(map[uint64]*cacheEntry)
		c.lru.next, c.lru.prev = &c.lru, &c.lru
	}
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
func (c *prefixCache) evict(n int64) {
	for n > 0 && c.evictable > 0 {
		e := c.lru.prev
		e.prev.next, e.next.prev = e.next, e.prev
		delete(c.entries, e.hash)
		c.evictable -= e.tokens
		n -= e.tokens
	}
}

func (c *prefixCache) tokens() int64 { return c.pinned + c.evictable }
