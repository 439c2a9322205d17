package affinity

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"sync/atomic"
)

// Homes moves keys off their first worker in rendezvous order when that worker is home to more
// prompts than its cache holds. Rendezvous spreads a few keys lumpily: 32 shared prefixes over three
// workers weighted 1:2:4 once gave the 2x worker 17 where its weight's share is 9 and its cache holds
// about 15, and its hit rate fell to 0.82 of the ideal. Placement is a pure function of the keys seen lately,
// their sizes and the fleet, so Caddy instances that see the same traffic place keys alike.
type Homes struct {
	mu   sync.Mutex
	seen map[uint64]homeKey // by rendezvous key

	placing sync.Mutex
	due     atomic.Int64 // Unix milliseconds of the next placement
	moved   atomic.Pointer[map[uint64]uint32]
}

type homeKey struct {
	tokens int64 // what its home caches of it: its shared tokens, else its latest prompt
	last   int64 // Unix milliseconds of its latest request
	// reused says that a request will find it cached: it was sent before, or its shape says it is
	// shared (Key.SharedBlocks). A one-off prompt takes no budget.
	reused bool
}

// HomeKeyTTL is how long, in milliseconds, a key counts towards its home's budget after its latest
// request.
const HomeKeyTTL = 60_000

// MaxHomeKeys bounds the keys a placement weighs: the most recent ones.
const MaxHomeKeys = 4096

// PlaceEvery is how often, in milliseconds, the keys are placed again.
const PlaceEvery = 1000

// NewHomes makes an empty placement: every key at its first worker.
func NewHomes() *Homes { return &Homes{seen: make(map[uint64]homeKey)} }

// Note counts a request of key, sent at now (Unix milliseconds), towards its home's budget from its
// second request, or its first if shared. A key that continues a conversation is not noted: it
// follows where its earlier turns are cached.
func (h *Homes) Note(key Key, now int64) {
	if len(key.Blocks) == 0 || key.Continues || key.Session || key.PromptTokens <= 0 {
		return
	}
	k, tokens := key.rendezvousKey(), key.PromptTokens
	if key.SharedBlocks > 0 {
		// What its requests share, the same in each: instances that saw different ones weigh it alike.
		tokens = min(tokens, int64(key.SharedBlocks)*key.BlockTokens)
	}
	h.mu.Lock()
	_, again := h.seen[k]
	h.seen[k] = homeKey{tokens: tokens, last: now, reused: again || key.SharedBlocks > 0}
	h.mu.Unlock()
}

// Of is the worker (its ID) the latest placement moved key to, 0 if it stays at its first.
func (h *Homes) Of(key Key) uint32 {
	m := h.moved.Load()
	if m == nil || len(key.Blocks) == 0 {
		return 0
	}
	return (*m)[key.rendezvousKey()]
}

// Due says whether a placement is due at now (Unix milliseconds), and if so claims it: one caller in
// PlaceEvery gets true.
func (h *Homes) Due(now int64) bool {
	due := h.due.Load()
	return now >= due && h.due.CompareAndSwap(due, now+PlaceEvery)
}

// HomeWorker is a worker as a placement sees it.
type HomeWorker struct {
	Worker Worker
	// Weight is its weight in the rendezvous order (Candidates.Weight).
	Weight float64
	// Budget is how many tokens of the prompts homed there its cache holds (HomeBudget); 0 if unknown,
	// which bounds nothing.
	Budget float64
}

// HomeBudget is how many tokens of the prompts homed on a worker its cache holds: its KV pool (pool
// tokens) less what a full batch (batchCap requests) holds of its own, perRequest tokens each (the
// part of its prompt it shares with none, and its output); at least a quarter of the pool, and three
// quarters where the batch cap is unknown. 0 for an unknown pool.
func HomeBudget(pool, batchCap int64, perRequest float64) float64 {
	if pool <= 0 {
		return 0
	}
	if batchCap <= 0 {
		return 0.75 * float64(pool)
	}
	return max(float64(pool)-float64(batchCap)*max(perRequest, 0), 0.25*float64(pool))
}

// Place places the keys seen within HomeKeyTTL of now on workers: in order of their rendezvous scores,
// highest first over every key and worker, a key goes to the worker where it scores highest among
// those whose budget still holds its prompt. A key that fits none of its first MaxPriced workers stays
// at its first, as does every key when no worker's budget is known.
func (h *Homes) Place(workers []HomeWorker, now int64) {
	h.placing.Lock()
	defer h.placing.Unlock()
	keys := h.recent(now)
	moved := place(keys, workers)
	h.moved.Store(&moved)
}

type placedKey struct {
	key    uint64
	tokens int64
}

// recent is the reused keys among the MaxHomeKeys most recent seen within HomeKeyTTL of now; it
// forgets the others.
func (h *Homes) recent(now int64) []placedKey {
	h.mu.Lock()
	defer h.mu.Unlock()
	type aged struct {
		placedKey
		homeKey
	}
	all := make([]aged, 0, len(h.seen))
	for k, v := range h.seen {
		if now-v.last > HomeKeyTTL {
			delete(h.seen, k)
			continue
		}
		all = append(all, aged{placedKey{k, v.tokens}, v})
	}
	if len(all) > MaxHomeKeys {
		slices.SortFunc(all, func(a, b aged) int { return cmp.Compare(b.last, a.last) })
		for _, a := range all[MaxHomeKeys:] {
			delete(h.seen, a.key)
		}
		all = all[:MaxHomeKeys]
	}
	keys := make([]placedKey, 0, len(all))
	for _, a := range all {
		if a.reused {
			keys = append(keys, a.placedKey)
		}
	}
	return keys
}

// place is Place's placement of keys: the keys moved off their first worker, by the ID of the worker
// they moved to.
func place(keys []placedKey, workers []HomeWorker) map[uint64]uint32 {
	moved := make(map[uint64]uint32)
	budget := make([]float64, len(workers))
	known := false
	for j, w := range workers {
		if w.Worker.ID != 0 && w.Budget > 0 {
			budget[j], known = w.Budget, true
		}
	}
	if !known || len(keys) == 0 {
		return moved
	}
	// Each key offers its first MaxPriced workers, as Choose's order has them.
	type offer struct {
		key, worker int
		score       float64
	}
	offers := make([]offer, 0, len(keys)*min(len(workers), MaxPriced))
	first := make([]int, len(keys))
	for i, k := range keys {
		var top rendezvousTop
		for j, w := range workers {
			if w.Worker.ID == 0 {
				continue
			}
			if weight, u := positive(w.Weight), uniform(k.key, w.Worker.Hash); !top.turnsAway(weight, u) {
				top.offer(ranked{i: j, weight: weight, u: u})
			}
		}
		first[i] = -1
		if top.n > 0 {
			first[i] = top.r[0].i
		}
		for _, r := range top.r[:top.n] {
			// The score itself: the order compares workers of one weight by u alone.
			offers = append(offers, offer{key: i, worker: r.i, score: r.weight / -math.Log(r.u)})
		}
	}
	slices.SortFunc(offers, func(a, b offer) int {
		if c := cmp.Compare(b.score, a.score); c != 0 {
			return c
		}
		return cmp.Or(cmp.Compare(keys[a.key].key, keys[b.key].key), cmp.Compare(a.worker, b.worker))
	})
	placed := make([]bool, len(keys))
	for _, o := range offers {
		tokens := float64(keys[o.key].tokens)
		if placed[o.key] || workers[o.worker].Budget > 0 && budget[o.worker] < tokens {
			continue
		}
		placed[o.key] = true
		budget[o.worker] -= tokens
		if o.worker != first[o.key] {
			moved[keys[o.key].key] = workers[o.worker].Worker.ID
		}
	}
	return moved
}
