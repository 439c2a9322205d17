package main

import (
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
)

// router is an in-process re-implementation of a published routing algorithm. The bench asks it for a
// worker, sends the request straight to that worker (no proxy: the saving, tens of microseconds, is small
// against second-scale latencies), and tells it when the request ended. Each instance keeps its own state,
// as separate gateway processes would.
type router interface {
	pick(prompt string) int
	done(worker int)
}

// inflight counts the requests one router instance has out per worker: the load both gateway policies use.
type inflight struct {
	mu        sync.Mutex
	load      []int
	processed []int
}

func newInflight(workers int) inflight {
	return inflight{load: make([]int, workers), processed: make([]int, workers)}
}

// minLoad is the least-loaded worker, ties broken by fewer requests processed, then by index.
func (f *inflight) minLoad() int {
	best := 0
	for i := range f.load {
		if f.load[i] < f.load[best] || f.load[i] == f.load[best] && f.processed[i] < f.processed[best] {
			best = i
		}
	}
	return best
}

func (f *inflight) start(w int) { f.load[w]++; f.processed[w]++ }

func (f *inflight) done(w int) {
	f.mu.Lock()
	f.load[w]--
	f.mu.Unlock()
}

// cacheAware re-implements the SGLang gateway's cache_aware policy (sgl-router, now
// lightseekorg/smg model_gateway/src/policies/cache_aware.rs, HTTP path: an approximate tree of the
// characters each worker was sent):
//   - the fleet is imbalanced when max-min in-flight > balanceAbs and max > balanceRel × min: then the
//     least-loaded worker takes the request;
//   - else the prompt is matched in the tree; when matched chars / prompt chars > cacheThreshold the
//     worker that holds the match takes it, otherwise the least-loaded one;
//   - the prompt is then inserted in the tree for the chosen worker.
//
// Left out: the periodic size-bounded eviction (a run's prompts stay far below its cap) and the
// token-usage triggers (off by default).
type cacheAware struct {
	inflight
	tree                       *radixNode
	clock                      int64
	cacheThreshold, balanceRel float64
	balanceAbs                 int
}

// Its Rust defaults.
func newCacheAware(workers int) router {
	return &cacheAware{inflight: newInflight(workers), tree: &radixNode{}, cacheThreshold: 0.5, balanceAbs: 32, balanceRel: 1.1}
}

func (c *cacheAware) pick(prompt string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clock++
	lo, hi := slices.Min(c.load), slices.Max(c.load)
	w := c.minLoad()
	if !(hi-lo > c.balanceAbs && float64(hi) > c.balanceRel*float64(lo)) {
		matched, tenant := c.tree.match(prompt)
		if len(prompt) > 0 && float64(matched)/float64(len(prompt)) > c.cacheThreshold && tenant >= 0 {
			w = tenant
		}
	}
	c.tree.insert(prompt, w, c.clock)
	c.start(w)
	return w
}

// radixNode is a node of a character radix tree; tenants maps each worker that was sent the text up to
// this node to when it last was.
type radixNode struct {
	edge     string
	children map[byte]*radixNode
	tenants  map[int]int64
}

// match returns how many leading characters of s the tree holds and the worker that was sent them most
// recently (-1 when none). A match that ends inside an edge counts its shared characters, as the
// gateway's tree does.
func (n *radixNode) match(s string) (matched, tenant int) {
	tenant = -1
	for len(s) > 0 {
		child := n.children[s[0]]
		if child == nil {
			break
		}
		k := commonPrefix(child.edge, s)
		matched += k
		tenant = child.latest()
		if k < len(child.edge) {
			break
		}
		n, s = child, s[k:]
	}
	return matched, tenant
}

func (n *radixNode) latest() int {
	best, at := -1, int64(-1)
	for w, t := range n.tenants {
		if t > at || t == at && w < best {
			best, at = w, t
		}
	}
	return best
}

// insert adds s for worker w at time now, splitting edges where s leaves them.
func (n *radixNode) insert(s string, w int, now int64) {
	for len(s) > 0 {
		if n.children == nil {
			n.children = map[byte]*radixNode{}
		}
		child := n.children[s[0]]
		if child == nil {
			child = &radixNode{edge: s, tenants: map[int]int64{}}
			n.children[s[0]] = child
			child.tenants[w] = now
			return
		}
		k := commonPrefix(child.edge, s)
		if k < len(child.edge) {
			// Split: the shared part becomes a node holding the old child's tenants.
			mid := &radixNode{edge: child.edge[:k], children: map[byte]*radixNode{}, tenants: map[int]int64{}}
			for t, at := range child.tenants {
				mid.tenants[t] = at
			}
			child.edge = child.edge[k:]
			mid.children[child.edge[0]] = child
			n.children[s[0]] = mid
			child = mid
		}
		child.tenants[w] = now
		n, s = child, s[k:]
	}
}

func commonPrefix(a, b string) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// prefixHash re-implements the SGLang gateway's prefix_hash policy (lightseekorg/smg
// model_gateway/src/policies/prefix_hash.rs): the hash of the prompt's first prefixTokens tokens is
// looked up on a consistent-hash ring (150 virtual nodes per worker); the worker found takes the
// request unless its in-flight count exceeds loadFactor × (total+1)/workers, in which case the
// least-loaded worker within that bound does (or the ring's worker when none is).
type prefixHash struct {
	inflight
	ring       []ringPoint
	prefix     int // bytes: prefixTokens in the simulator's measure
	loadFactor float64
}

type ringPoint struct {
	at     uint64
	worker int
}

const ringVirtualNodes = 150

// newPrefixHash places the workers on the ring by name, so every instance (and every run) builds the same ring.
func newPrefixHash(workers int) router {
	p := &prefixHash{inflight: newInflight(workers), prefix: 256 * bytesPerToken, loadFactor: 1.25}
	for w := range workers {
		for v := range ringVirtualNodes {
			p.ring = append(p.ring, ringPoint{at: hashString(fmt.Sprintf("%s#%d", workerConfig(w).Name, v)), worker: w})
		}
	}
	slices.SortFunc(p.ring, func(a, b ringPoint) int {
		if a.at < b.at {
			return -1
		}
		if a.at > b.at {
			return 1
		}
		return a.worker - b.worker
	})
	return p
}

func hashString(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}

// ringWorker is the worker at or after key's position on the ring.
func (p *prefixHash) ringWorker(key uint64) int {
	i, _ := slices.BinarySearchFunc(p.ring, key, func(r ringPoint, k uint64) int {
		if r.at < k {
			return -1
		}
		if r.at > k {
			return 1
		}
		return 0
	})
	return p.ring[i%len(p.ring)].worker
}

func (p *prefixHash) pick(prompt string) int {
	head := prompt[:min(len(prompt), p.prefix)]
	w := p.ringWorker(hashString(fmt.Sprintf("%016x", hashString(head))))
	p.mu.Lock()
	defer p.mu.Unlock()
	total := 0
	for _, l := range p.load {
		total += l
	}
	bound := p.loadFactor * float64(total+1) / float64(len(p.load))
	if total > 0 && float64(p.load[w]) > bound {
		best := -1
		for i, l := range p.load {
			if float64(l) <= bound && (best < 0 || l < p.load[best]) {
				best = i
			}
		}
		if best >= 0 {
			w = best
		}
	}
	p.start(w)
	return w
}
