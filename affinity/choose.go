package affinity

import "math"

// DefaultBalanceFactor bounds how far above the mean load affinity may take a worker, as HAProxy's
// hash-balance-factor does: 1.25 lets a worker carry 25% more than the fleet's mean.
const DefaultBalanceFactor = 1.25

// BalanceSlack is how many requests above the mean load the bound always allows. At a few requests in
// flight per worker, factor × mean is within the noise of arrivals, and a bound that tight spills
// prefixes that no worker is short of room for, each spill a prefill and a cached copy elsewhere. The
// SGLang gateway's cache_aware policy allows an imbalance of 32 (balance_abs_threshold).
const BalanceSlack = 8

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
	// Weight is candidate i's share of the keys, such as its batch or KV capacity; 1 for all alike.
	Weight(i int) float64
	// Cost is the time the request would take on candidate i if cachedTokens of its prompt were
	// cached there; not ok for a candidate that must not be chosen (unavailable).
	Cost(i int, cachedTokens int64) (seconds float64, ok bool)
	// Alone is the time the request would take on candidate i idle, with nothing cached: what Cost is
	// measured against, so that a slow worker holding the prefix is compared with a fast one by how
	// much each stretches the request, not by their speeds.
	Alone(i int) float64
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

// Choose picks, for a request with a key, the candidate that its load and cache stretch it least on:
// the least Cost over Alone, each priced with the tokens of the key cached there. A key's home is the
// first worker within the bound in the weighted rendezvous order of its first RendezvousBlocks blocks
// (a worker's share of keys in proportion to its Weight, so each worker's cache holds what fits there);
// it is presumed to hold the whole key (or Key.PresumedBlocks of it, deepened by what the index knows),
// so Caddy instances that share nothing send a prefix to the same worker. Only the home is credited:
// crediting every holder the index names would keep a prefix that went elsewhere once on two workers,
// and the fastest would collect copies of all of them. The choice is a pure function of the key, the
// candidates' names, weights, loads and costs, and (only where PresumedBlocks caps the presumption) the
// index.
//
// Comparing stretch rather than seconds keeps a prefix on its home when the home is slower but not
// loaded: in seconds a fast worker would win every key, and its cache could not hold them all. No worker
// above the bound (factor times the mean load, counting the request being placed, or the mean plus
// BalanceSlack, whichever is more; DefaultBalanceFactor when factor < 1) is home, so a hot prefix
// spills to the next worker instead of pinning one. Ties go to the rendezvous order. Candidates whose Worker has ID 0 are skipped; the load mean is over the others.
// A request without a key goes where it costs the least seconds. It allocates nothing.
func (x *Index) Choose(key Key, c Candidates, factor float64) Choice {
	n := c.Len()
	if len(key.Blocks) == 0 || key.BlockTokens <= 0 {
		return leastCost(c, n)
	}
	if factor < 1 {
		factor = DefaultBalanceFactor
	}
	// The bound, as HAProxy computes it: a worker may take the request while its load plus one stays
	// within ceil(factor × the mean load after placing it), but never tighter than the mean plus
	// BalanceSlack. It is not weighted: a faster worker given more keys finishes them sooner, so its
	// count in flight stays near a slower one's.
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
	mean := (total + 1) / float64(avail)
	bound := math.Ceil(max(factor*mean, mean+BalanceSlack))
	within := func(i int) bool { return c.Load(i)+1 <= bound }

	rkey := key.Blocks[min(len(key.Blocks), RendezvousBlocks)-1]
	// The home: the first worker in weighted rendezvous order within the bound.
	home, bestScore := -1, 0.0
	for i := range n {
		if w := c.Worker(i); w.ID != 0 && within(i) {
			if s := weightedRendezvous(rkey, w.Hash, c.Weight(i)); home < 0 || s > bestScore {
				home, bestScore = i, s
			}
		}
	}
	homeBlocks := len(key.Blocks)
	if key.PresumedBlocks > 0 && key.PresumedBlocks < homeBlocks {
		homeBlocks = key.PresumedBlocks
		if x != nil && home >= 0 {
			homeBlocks = max(homeBlocks, x.Match(key.Blocks, c.Worker(home)))
		}
	}

	best := Choice{Index: -1}
	bestStretch, bestHash := math.Inf(1), uint64(0)
	for i := range n {
		w := c.Worker(i)
		if w.ID == 0 {
			continue
		}
		blocks := 0
		if i == home {
			blocks = homeBlocks
		}
		cached := int64(blocks) * key.BlockTokens
		if key.PromptTokens > 0 {
			cached = min(cached, key.PromptTokens)
		}
		cost, ok := c.Cost(i, cached)
		if !ok {
			continue
		}
		stretch := cost
		if alone := c.Alone(i); alone > 0 && !math.IsInf(alone, 0) {
			stretch = cost / alone
		}
		// The rendezvous rank breaks ties; it is computed only for them.
		if stretch < bestStretch || best.Index < 0 {
			best, bestStretch, bestHash = Choice{Index: i, CachedTokens: cached}, stretch, w.Hash
		} else if stretch == bestStretch && rendezvous(rkey, w.Hash) > rendezvous(rkey, bestHash) {
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

// weightedRendezvous is rendezvous for workers of different weights: the highest score wins each key
// with probability weight over the sum of the weights (the logarithmic method of Schindelhauer and
// Schomaker). A weight that is not positive counts as 1.
func weightedRendezvous(key, worker uint64, weight float64) float64 {
	u := (float64(rendezvous(key, worker)>>11) + 0.5) / (1 << 53) // uniform in (0, 1)
	return -positive(weight) / math.Log(u)
}

// positive is a weight, 1 where it is not positive.
func positive(weight float64) float64 {
	if weight > 0 {
		return weight
	}
	return 1
}
