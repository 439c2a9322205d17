package affinity

import "math"

// DefaultBalanceFactor bounds how far above the mean load affinity may take a worker, as HAProxy's
// hash-balance-factor does: 1.25 lets a worker carry 25% more than the fleet's mean.
const DefaultBalanceFactor = 1.25

// RendezvousBlocks is how many leading blocks the rendezvous order is drawn from: the first 256 tokens
// (BlockTokens each), so the requests that share a system prompt or a conversation's opening share an
// order.
const RendezvousBlocks = 4

// Key is what a request is routed by.
type Key struct {
	// Blocks are the chained block hashes (Request.Blocks, or HeaderKey's single block).
	Blocks []uint64
	// BlockTokens is how many prompt tokens one block stands for: BlockTokens for a prefix key; for a
	// session key, the request's whole prompt (the session's earlier turns are cached where it went).
	BlockTokens int64
	// PromptTokens caps the cached tokens credited to a worker; 0 for no cap.
	PromptTokens int64
	// PresumedBlocks caps how many leading blocks the rendezvous-first worker is presumed to hold
	// (see Choose); 0 presumes all of them. A small cap keeps a prompt no one shares from leaning on
	// its rendezvous worker by its whole prefill, at the price of replicas agreeing less on where a
	// new shared prefix goes.
	PresumedBlocks int
}

// Candidates are the upstreams a request may go to, as the caller sees them.
type Candidates interface {
	Len() int
	// Worker is candidate i as the index knows it.
	Worker(i int) Worker
	// Load is candidate i's load for the balance bound: a count, such as its requests in flight.
	Load(i int) float64
	// Cost is the time the request would take on candidate i if cachedTokens of its prompt were
	// cached there; not ok for a candidate that must not be chosen (unavailable).
	Cost(i int, cachedTokens int64) (seconds float64, ok bool)
}

// Outcome is how a choice came about, for metrics.
type Outcome uint8

const (
	NoKey    Outcome = iota // the request has no key: load alone chose
	Followed                // the chosen worker was credited with the request's cached tokens
	Yielded                 // the request has a key, but load chose a worker without credit
)

func (o Outcome) String() string {
	switch o {
	case Followed:
		return "followed"
	case Yielded:
		return "yielded"
	}
	return "no_key"
}

// Choice is the chosen candidate (-1 when none can be chosen), how it came about, and the cached tokens
// it was credited with.
type Choice struct {
	Index        int
	Outcome      Outcome
	CachedTokens int64
}

// Choose picks the candidate of least cost, each priced with the tokens of the key cached there. The
// first worker within the bound in the rendezvous order of the key's first RendezvousBlocks blocks is
// presumed to hold the whole key (or Key.PresumedBlocks of it), so Caddy instances that share nothing send a prefix to the same
// worker; the index adds what it knows (a worker that got the prefix when the first was busy, a
// conversation's longer history). On a nil Index the choice is a pure function of the key, the
// candidates' names and their loads and costs.
//
// No worker above factor times the mean load (counting the request being placed; DefaultBalanceFactor
// when factor < 1) gets credit, so a hot prefix spills to the next worker in rendezvous order instead
// of pinning one. Ties go to the rendezvous order. Candidates whose Worker has ID 0 are skipped; the
// load mean is over the others. It allocates nothing.
func (x *Index) Choose(key Key, c Candidates, factor float64) Choice {
	n := c.Len()
	if len(key.Blocks) == 0 || key.BlockTokens <= 0 {
		return leastCost(c, n)
	}
	if factor < 1 {
		factor = DefaultBalanceFactor
	}
	// The bound, as HAProxy computes it: a worker may take the request while its load plus one stays
	// within ceil(factor × mean load after placing it).
	var total float64
	avail := 0
	for i := range n {
		if c.Worker(i).ID != 0 {
			total += c.Load(i)
			avail++
		}
	}
	if avail == 0 {
		return leastCost(c, n)
	}
	bound := math.Ceil(factor * (total + 1) / float64(avail))

	var ids [Holders]uint32
	var depth [Holders]int
	if x != nil {
		ids = x.firstHolders(key.Blocks)
	}
	rkey := key.Blocks[min(len(key.Blocks), RendezvousBlocks)-1]
	// The presumed holder: the first worker in rendezvous order within the bound. The index's holders
	// that may get credit are looked up further.
	presumed, bestScore := -1, uint64(0)
	for i := range n {
		w := c.Worker(i)
		if w.ID == 0 || c.Load(i)+1 > bound {
			continue
		}
		if s := rendezvous(rkey, w.Hash); presumed < 0 || s > bestScore {
			presumed, bestScore = i, s
		}
		for j, id := range ids {
			if id == w.ID && depth[j] == 0 {
				depth[j] = 1 + x.depth(key.Blocks[1:], id)
			}
		}
	}

	best := Choice{Index: -1}
	bestCost, bestHash := math.Inf(1), uint64(0)
	for i := range n {
		w := c.Worker(i)
		if w.ID == 0 {
			continue
		}
		blocks := 0
		if c.Load(i)+1 <= bound {
			if i == presumed {
				blocks = len(key.Blocks)
				if key.PresumedBlocks > 0 {
					blocks = min(blocks, key.PresumedBlocks)
				}
			}
			for j, id := range ids {
				if id == w.ID {
					blocks = max(blocks, depth[j])
				}
			}
		}
		cached := int64(blocks) * key.BlockTokens
		if key.PromptTokens > 0 {
			cached = min(cached, key.PromptTokens)
		}
		cost, ok := c.Cost(i, cached)
		if !ok {
			continue
		}
		// The rendezvous rank breaks ties; it is computed only for them.
		if cost < bestCost || best.Index < 0 {
			best, bestCost, bestHash = Choice{Index: i, CachedTokens: cached}, cost, w.Hash
		} else if cost == bestCost && rendezvous(rkey, w.Hash) > rendezvous(rkey, bestHash) {
			best, bestHash = Choice{Index: i, CachedTokens: cached}, w.Hash
		}
	}
	switch {
	case best.Index < 0:
	case best.CachedTokens > 0:
		best.Outcome = Followed
	default:
		best.Outcome = Yielded
	}
	return best
}

// leastCost is the choice on cost alone.
func leastCost(c Candidates, n int) Choice {
	best, bestCost := Choice{Index: -1}, math.Inf(1)
	for i := range n {
		if c.Worker(i).ID == 0 {
			continue
		}
		if cost, ok := c.Cost(i, 0); ok && (cost < bestCost || best.Index < 0) {
			best.Index, bestCost = i, cost
		}
	}
	return best
}

// rendezvous is the weight of a worker for a key in highest-random-weight hashing.
func rendezvous(key, worker uint64) uint64 { return mix(key, worker) }
