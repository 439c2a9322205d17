package trace

import (
	"container/list"
	"math"
)

// UnlimitedHitRate is the share of prompt tokens that one prefix cache that never evicts, seeing every
// request in arrival order, could serve: whole 512-token blocks in order up to the first id it has not
// seen, the last (partial) block counted by its own tokens. Requests without ids never hit. It is 0 for
// a trace without prompt tokens.
func UnlimitedHitRate(reqs []Request) float64 {
	return LRUHitRate(reqs, math.MaxInt64)
}

// LRUHitRate is UnlimitedHitRate for one cache of capacityTokens tokens that evicts the least recently
// used blocks first. A request's blocks are inserted or touched after it is looked up, its last block
// first and its first block last: a prefix cache evicts a prompt's tail before its head (a head
// without its tail still hits; a tail without its head never does), as SGLang's radix tree evicts leaves
// first.
func LRUHitRate(reqs []Request, capacityTokens int64) float64 {
	c := lruCache{capacity: capacityTokens, entries: make(map[int64]*list.Element)}
	var hit, total int64
	for _, r := range reqs {
		n := min(blocks(r.InputTokens), len(r.HashIDs))
		for i := range n {
			if _, ok := c.entries[r.HashIDs[i]]; !ok {
				break
			}
			hit += int64(blockTokens(r.InputTokens, i))
		}
		for i := n - 1; i >= 0; i-- {
			c.touch(r.HashIDs[i], int64(blockTokens(r.InputTokens, i)))
		}
		total += int64(max(0, r.InputTokens))
	}
	if total == 0 {
		return 0
	}
	return float64(hit) / float64(total)
}

// lruCache is a set of block ids of a bounded total of tokens, the most recently used at the front.
type lruCache struct {
	capacity, used int64
	entries        map[int64]*list.Element
	order          list.List // of *lruEntry
}

type lruEntry struct {
	id     int64
	tokens int64
}

// touch marks the block id most recently used, inserting it (as tokens tokens) if absent and evicting
// the least recently used blocks to make room. A block larger than the whole cache is not inserted.
func (c *lruCache) touch(id, tokens int64) {
	if e, ok := c.entries[id]; ok {
		c.order.MoveToFront(e)
		return
	}
	if tokens > c.capacity {
		return
	}
	for c.used > c.capacity-tokens {
		last := c.order.Back()
		old := c.order.Remove(last).(*lruEntry)
		delete(c.entries, old.id)
		c.used -= old.tokens
	}
	c.entries[id] = c.order.PushFront(&lruEntry{id: id, tokens: tokens})
	c.used += tokens
}
