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
// workers weighted 1:2:4 once gave the 2x worker 17 where its weight's share is 9 and its pool holds
// 16, and the hit rate fell to 0.82 of the ideal. Placement is a pure function of the keys seen
// lately, their sizes and the fleet, so Caddy instances that see the same traffic place keys alike.
type Homes struct {
	mu   sync.Mutex
	seen map[uint64]homeKey // by rendezvous key

	placing sync.Mutex
	due     atomic.Int64 // Unix milliseconds of the next placement
	placed  atomic.Pointer[placement]
}

// placement is a placement of keys on workers.
type placement struct {
	// homes holds every key that fitted a worker: its home, and whether the key moved there off its
	// first worker.
	homes   map[uint64]placedHome
	workers []HomeWorker
	// left is each worker's budget left; cutoff, of a worker that took a key, the least score of a key
	// it took: a key scoring more there would have taken its place.
	left, cutoff []float64
	// keys is how many keys each worker is home to, placed there or staying there for want of room.
	keys []int
}

// placedHome is where a placement put a key: id is its home's, kept whether or not the key moved, so
// that Place compares homes without drawing each key's order again.
type placedHome struct {
	id    uint32
	moved bool
}

// Keys is how many of the keys seen lately the latest placement makes w home to.
func (h *Homes) Keys(w Worker) int {
	pl := h.placed.Load()
	if pl == nil {
		return 0
	}
	for j, hw := range pl.workers {
		if hw.Worker.ID == w.ID && w.ID != 0 {
			return pl.keys[j]
		}
	}
	return 0
}

type homeKey struct {
	tokens int64 // what its home caches of it: its shared tokens, else its latest prompt
	last   int64 // Unix milliseconds of its latest request
	// reused says that a request will find it cached: it was sent before, or its shape says it is
	// shared (Key.SharedBlocks). A one-off prompt takes no budget.
	reused bool
	shared bool // its shape says it is shared
}

// HomeKeyTTL is how long, in milliseconds, a key counts towards its home's budget after its latest
// request. Minutes, not seconds: of n Caddy instances each sees a prompt n times less often, and with a
// minute's memory three instances' pictures flickered as prompts came and went from them: one instance
// changed a prompt's home seven times in seventy seconds, a cache miss at each change.
const HomeKeyTTL = 300_000

// MaxHomeKeys bounds the keys a placement weighs: the most recent ones. Between placements at most
// four times as many are noted; a flood of new prompts past that is not.
const MaxHomeKeys = 4096

// PlaceEvery is how often, in milliseconds, the keys are placed again.
const PlaceEvery = 1000

// NewHomes makes an empty placement: every key at its first worker.
func NewHomes() *Homes { return &Homes{seen: make(map[uint64]homeKey)} }

// Note counts a request of key, sent at now (Unix milliseconds), towards its home's budget from its
// second request, or its first if shared. A key that continues a conversation is not noted: it
// follows where its earlier turns are cached.
func (h *Homes) Note(key Key, now int64) {
	tokens, ok := homeTokens(&key)
	if !ok {
		return
	}
	k := key.rendezvousKey()
	h.mu.Lock()
	if _, again := h.seen[k]; again || len(h.seen) < 4*MaxHomeKeys {
		shared := key.SharedBlocks > 0
		h.seen[k] = homeKey{tokens: tokens, last: now, reused: again || shared, shared: shared}
	}
	h.mu.Unlock()
}

// homeTokens is what key's home caches of it, and whether a placement weighs it at all.
func homeTokens(key *Key) (int64, bool) {
	if len(key.Blocks) == 0 || key.Continues || key.Session || key.PromptTokens <= 0 {
		return 0, false
	}
	if key.SharedBlocks > 0 {
		// What its requests share, the same in each: instances that saw different ones weigh it alike.
		return min(key.PromptTokens, int64(key.SharedBlocks)*key.BlockTokens), true
	}
	return key.PromptTokens, true
}

// Of is the worker (its ID) the latest placement moved key to, 0 if it stays at its first. A shared
// key that the placement has not seen (another instance sent its earlier requests) goes where the
// placement would have put it: the first worker in its order with room for it, or that it outscores
// a key of.
func (h *Homes) Of(key Key) uint32 {
	pl := h.placed.Load()
	if pl == nil || len(key.Blocks) == 0 {
		return 0
	}
	tokens, _ := homeTokens(&key)
	return pl.of(key.rendezvousKey(), key.SharedBlocks > 0, tokens)
}

// of is Of for the key whose rendezvous key is k, shared as its shape says, tokens its size in a
// placement (0 when a placement does not weigh it).
func (pl *placement) of(k uint64, shared bool, tokens int64) uint32 {
	if h, ok := pl.placedOrPredicted(k, shared, tokens); ok && h.moved {
		return h.id
	}
	return 0
}

// placedOrPredicted is where this placement put the key k, or would have put it for a shared key it
// did not place (see predict); not ok for another key, which stays at its first worker.
func (pl *placement) placedOrPredicted(k uint64, shared bool, tokens int64) (placedHome, bool) {
	if h, ok := pl.homes[k]; ok {
		return h, true
	}
	if shared && tokens > 0 {
		return pl.predict(k, tokens), true
	}
	return placedHome{}, false
}

// predict is where this placement would have put a shared key it did not place, k its rendezvous key
// and tokens its size: the first worker in its order with room for it, or that it outscores a key of;
// else its first worker.
func (pl *placement) predict(k uint64, tokens int64) placedHome {
	top := orderOf(k, pl.workers)
	for j, r := range top.r[:top.n] {
		w := r.i
		if pl.workers[w].Pool <= 0 || pl.left[w] >= float64(tokens) || r.score() > pl.cutoff[w] {
			return placedHome{id: pl.workers[w].Worker.ID, moved: j > 0}
		}
	}
	return pl.first(&top)
}

// first is the first worker of a key's order top, as a home it stays at (the zero placedHome when the
// order is empty).
func (pl *placement) first(top *rendezvousTop) placedHome {
	if top.n == 0 {
		return placedHome{}
	}
	return placedHome{id: pl.workers[top.r[0].i].Worker.ID}
}

// orderOf is the first MaxPriced workers in key's weighted rendezvous order.
func orderOf(key uint64, workers []HomeWorker) rendezvousTop {
	var top rendezvousTop
	for j, w := range workers {
		if w.Worker.ID == 0 {
			continue
		}
		top.consider(j, key, w.Worker, 0, w.Weight)
	}
	return top
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
	// Weight is its weight in the rendezvous order (the weight Candidates.Candidate gives).
	Weight float64
	// Pool is its KV pool in tokens, 0 if unknown: the prompts homed there fill at most HomeShare of
	// it. An unknown pool bounds nothing.
	Pool int64
}

// HomeShare is the share of a worker's KV pool that the prompts homed there may fill; the rest is for
// what its running requests hold of their own. It is fixed, not estimated from the mean request
// sizes that each instance measures for itself: budgets that moved with those means put the keys at
// the edge of a budget on different workers in different instances. At 5/8, a 16,384-token pool homes
// five 2,048-token system prompts and keeps room for 16 requests of 384 tokens of their own.
const HomeShare = 0.625

// Place places the keys seen within HomeKeyTTL of now on workers: in order of their rendezvous scores,
// highest first over every key and worker, a key goes to the worker where it scores highest among
// those whose budget still holds its prompt. A key that fits none of its first MaxPriced workers stays
// at its first, as does every key when no worker's pool is known. It returns how many of the keys it
// places have another home than the placement before gave them (or would have, for a key it had not
// seen; see Of): each is prefilled again where it goes.
func (h *Homes) Place(workers []HomeWorker, now int64) int {
	h.placing.Lock()
	defer h.placing.Unlock()
	keys := h.recent(now)
	next := place(keys, workers)
	prev := h.placed.Swap(next)
	if prev == nil {
		return 0
	}
	n := 0
	for _, k := range keys {
		if prev.home(k) != next.home(k) {
			n++
		}
	}
	return n
}

// home is the worker (its ID) that this placement makes k's home, as Of says: where it placed k, or
// would have put it, else k's first worker in rendezvous order. A key's order is drawn once.
func (pl *placement) home(k placedKey) uint32 {
	if h, ok := pl.placedOrPredicted(k.key, k.shared, k.tokens); ok {
		return h.id
	}
	top := orderOf(k.key, pl.workers)
	return pl.first(&top).id
}

type placedKey struct {
	key    uint64
	tokens int64
	shared bool
}

// recent is the reused keys among the MaxHomeKeys most recent seen within HomeKeyTTL of now; it
// forgets the others.
func (h *Homes) recent(now int64) []placedKey {
	h.mu.Lock()
	defer h.mu.Unlock()
	type aged struct {
		key uint64
		homeKey
	}
	all := make([]aged, 0, len(h.seen))
	for k, v := range h.seen {
		if now-v.last > HomeKeyTTL {
			delete(h.seen, k)
			continue
		}
		all = append(all, aged{k, v})
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
			keys = append(keys, placedKey{a.key, a.tokens, a.shared})
		}
	}
	return keys
}

// place is Place's placement of keys on workers.
func place(keys []placedKey, workers []HomeWorker) *placement {
	pl := &placement{homes: make(map[uint64]placedHome, len(keys)), workers: workers,
		left: make([]float64, len(workers)), cutoff: make([]float64, len(workers)), keys: make([]int, len(workers))}
	for j, w := range workers {
		if w.Worker.ID != 0 && w.Pool > 0 {
			pl.left[j] = HomeShare * float64(w.Pool)
		}
	}
	// Each key offers its first MaxPriced workers, as Choose's order has them.
	type offer struct {
		key, worker int
		score       float64
	}
	offers := make([]offer, 0, len(keys)*min(len(workers), MaxPriced))
	first := make([]int, len(keys))
	for i, k := range keys {
		top := orderOf(k.key, workers)
		first[i] = -1
		if top.n > 0 {
			first[i] = top.r[0].i
		}
		for _, r := range top.r[:top.n] {
			// The score itself: the order compares workers of one weight by u alone.
			offers = append(offers, offer{key: i, worker: r.i, score: r.score()})
		}
	}
	slices.SortFunc(offers, func(a, b offer) int {
		if c := cmp.Compare(b.score, a.score); c != 0 {
			return c
		}
		return cmp.Or(cmp.Compare(keys[a.key].key, keys[b.key].key), cmp.Compare(a.worker, b.worker))
	})
	placed := make([]bool, len(keys))
	least := make([]float64, len(workers)) // the least score each worker took
	for _, o := range offers {
		k := keys[o.key]
		if placed[o.key] {
			continue
		}
		if workers[o.worker].Pool > 0 && pl.left[o.worker] < float64(k.tokens) {
			continue
		}
		placed[o.key] = true
		pl.keys[o.worker]++
		pl.left[o.worker] -= float64(k.tokens)
		least[o.worker] = o.score
		pl.homes[k.key] = placedHome{id: workers[o.worker].Worker.ID, moved: o.worker != first[o.key]}
	}
	for i, ok := range placed {
		if !ok && first[i] >= 0 {
			pl.keys[first[i]]++
		}
	}
	for j := range workers {
		// A worker filled to the last key it took, turning none away, is full all the same.
		pl.cutoff[j] = math.Inf(1)
		if least[j] > 0 {
			pl.cutoff[j] = least[j]
		}
	}
	return pl
}
