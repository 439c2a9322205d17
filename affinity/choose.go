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

// MaxPriced is how many candidates Choose prices for a key in a larger fleet: the first MaxPriced in
// the key's rendezvous order within the bound, the home first. Pricing is most of Choose's time in a
// large fleet, and a key that spills goes down its own order, so its copies gather on few workers; a
// key's order is a random sample of the fleet, as in the power of d choices.
const MaxPriced = 8

// NearTie is how much more than the best score a key's first worker in its rendezvous order may score
// and still take it: the key's next requests save more there than the difference.
const NearTie = 1.25

// Key is what a request is routed by.
type Key struct {
	// Blocks are the chained block hashes (Request.Blocks, or HeaderKey's single block).
	Blocks []uint64
	// BlockTokens is how many prompt tokens one block stands for: BlockTokens for a prefix key; for a
	// session key, the request's whole prompt (the session's earlier turns are cached where it went).
	BlockTokens int64
	// PromptTokens caps the cached tokens credited to a worker; 0 for no cap.
	PromptTokens int64
	// Session says that the key names a conversation from its first request (a session header): its
	// first request here is compared as its later ones are, by stretch, so that it starts at its home,
	// where they will go and where other instances send it. A prefix key's first request may be a
	// one-off prompt, and is priced in seconds.
	Session bool
	// Continues says that the key is a conversation that has sent before (a session header, or a chat
	// with an answer in its history): once this index knows it, it goes on at the worker holding the
	// most of it, while this index sent its previous request (see PreviousBlocks). A prefix key that
	// continues but is not known here is priced as a new one, as its first turn was, so that it goes
	// where that one most likely went.
	Continues bool
	// SharedBlocks is how many of Blocks the request's shape says are shared (Request.SharedBlocks: a
	// chat's system prompt): they count as known from the key's first request, as if this index had
	// seen them sent. Instances that share nothing then send a system prompt's first request where they
	// send its later ones, its home.
	SharedBlocks int
	// PreviousBlocks is how many of Blocks its previous request sent (Request.PreviousBlocks, for a key
	// that Continues). An index that knows less of the key did not see that request sent: another Caddy
	// instance did, and the worker this index names holds an earlier turn only. Such a key is priced as
	// one this index does not know.
	PreviousBlocks int
	// Home is the worker (its ID) that a placement (Homes) moved the key to, 0 if none: it leads the
	// key's order while within the bound.
	Home uint32
}

// rendezvousKey is what the key's rendezvous order is drawn from: its first RendezvousBlocks blocks,
// and for a conversation that continues behind a shared part at least as long (an application's
// instructions or tools), the first RendezvousBlocks of its own past that part. Drawn from the shared
// part, every conversation of an application had one home; an instance that did not send a turn's
// previous turn sends it there, and under load the instances spilled that home each by its own loads,
// so a conversation moved between workers. Drawn past it, instances agree on each conversation's own
// home: on the agents workload three instances found 0.94 cached where they found 0.91-0.94, as one
// does, with p99 1.46 s where it was 2.64 (results/2026-12-07/affinity-agents.md).
func (k *Key) rendezvousKey() uint64 {
	end := RendezvousBlocks
	if k.Continues && k.SharedBlocks >= RendezvousBlocks {
		end = k.SharedBlocks + RendezvousBlocks
	}
	return k.Blocks[min(len(k.Blocks), end)-1]
}

// Candidates are the upstreams a request may go to, as the caller sees them.
type Candidates interface {
	Len() int
	// Candidate is candidate i: its worker as the index knows it, its load for the balance bound (a
	// count, such as its requests in flight), and its weight, its share of the keys (such as what it
	// serves: batch cap times speed; 1 for all alike). One call for the three: Choose asks for them of
	// every candidate, and a call for each made a choice at 64 candidates a fifth longer.
	Candidate(i int) (w Worker, load, weight float64)
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
	New                     // the key is not known to be shared: load alone chose
)

// Outcomes are the outcomes, in the order of their values.
var Outcomes = [...]Outcome{NoKey, Followed, Yielded, New}

func (o Outcome) String() string {
	switch o {
	case Followed:
		return "followed"
	case Yielded:
		return "yielded"
	case New:
		return "new"
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

// Choose picks a candidate for a request by its key, its load and the cost model.
//
// A key this index has not seen sent anywhere at least half as deep as its prompt (the share the
// SGLang gateway's cache_threshold asks for; its SharedBlocks count as seen) is New: it is priced in
// seconds, each worker within the bound credited with what the index saw sent to it (see below) and
// its home with at least the first RendezvousBlocks blocks, so prompts that share nothing are routed
// on load. A new Session key is compared by stretch, as a known key is: the
// conversation starts at its home unless load says otherwise.
//
// A key known to be shared goes where it is cached unless load says otherwise. Every worker within the
// bound is credited with the blocks of the key the index saw sent to it; the key's home, the first
// worker within the bound in the weighted rendezvous order of the key's first RendezvousBlocks blocks
// (a worker's share of keys in proportion to the weight Candidate gives, so each does its share of the
// work), or the worker a placement moved the key to (Key.Home, see Homes) while that one is within the
// bound, is credited besides with the blocks the request's shape says are shared (Key.SharedBlocks, a
// chat's system prompt), so that Caddy instances that share nothing send a system prompt's requests
// to one worker. Where the index knows a worker within the bound that holds more of the key than its
// home, that worker takes the home's place: a conversation's first turn, priced as a one-off prompt,
// may have gone anywhere, and its next turns follow it. A conversation whose previous turn this index
// did not send (it knows less of the key than Key.PreviousBlocks) is priced as one it has not seen:
// another instance sent that turn. Candidates are compared by stretch, Cost over Alone: a slow
// worker that is not loaded keeps its keys (in seconds the fastest worker would win them all and its
// cache could not hold them), and a cache hit on a busy worker loses to a miss on an idle one.
//
// A near tie goes to the key's order: the first candidate within the bound, in rendezvous order, whose
// score (seconds for a new key, stretch for the others) is at most NearTie times the best takes the
// request, so that a new key starts where its next requests will go and where other instances, which
// have not seen it, send it too. Exact ties go to the rendezvous order.
//
// The bound: a worker is within it while its load plus this request stays within factor times the
// mean load (counting the request; DefaultBalanceFactor when factor < 1), rounded up as HAProxy's
// hash-balance-factor does, or within the mean plus BalanceSlack, whichever is more. A hot prefix
// spills to the next worker in rendezvous order instead of pinning one. Candidates whose Worker has
// ID 0 are skipped; the load mean is over the others. Past MaxPriced candidates, only the key's first
// MaxPriced within the bound are priced. It allocates nothing.
func (x *Index) Choose(key Key, c Candidates, factor float64) Choice {
	n := c.Len()
	if len(key.Blocks) == 0 || key.BlockTokens <= 0 {
		return leastCost(c, n)
	}
	if factor < 1 {
		factor = DefaultBalanceFactor
	}
	// The bound is not weighted: a faster worker given more keys finishes them sooner, so its count
	// in flight stays near a slower one's. The key's order is drawn in the same pass as the loads,
	// from every available candidate, and drawn again from those within the bound only when one of
	// the first it found is not.
	rkey := key.rendezvousKey()
	var top rendezvousTop
	var total float64
	avail := 0
	for i := range n {
		w, load, weight := c.Candidate(i)
		if w.ID == 0 {
			continue
		}
		total += load
		avail++
		top.consider(i, rkey, w, load, weight)
	}
	mean := (total + 1) / float64(max(avail, 1))
	bound := math.Ceil(max(factor*mean, mean+BalanceSlack))
	if !top.within(bound) {
		top = rendezvousTop{}
		for i := range n {
			if w, load, weight := c.Candidate(i); w.ID != 0 && load+1 <= bound {
				top.consider(i, rkey, w, load, weight)
			}
		}
	}
	// order is the first MaxPriced candidates within the bound in the key's weighted rendezvous order
	// (see uniform); the home is the first.
	var order [MaxPriced]int
	k := top.n
	for j := range k {
		order[j] = top.r[j].i
	}
	home := -1
	if k > 0 {
		home = order[0]
	}
	if key.Home != 0 {
		k, home = lead(c, n, &order, k, home, key.Home, bound)
	}

	known, holder := x.known(key.Blocks)
	if key.Continues && known < key.PreviousBlocks {
		// Another instance sent the conversation's previous turn: the worker this index names holds an
		// earlier one, and following it would split the conversation from where the others send it.
		known, holder = 0, 0
	}
	// The home is credited with the blocks the request's shape says are shared (a chat's system
	// prompt), which it gets whoever sent them; every worker within the bound with what the index saw it
	// sent of the key. Credited with all the index knew of the key, a home drawn from what every
	// conversation begins with (a system prompt sent as text) was home to every conversation, and
	// their turns went where it spilled them, not where their earlier turns were cached.
	cached := key.tokens(min(key.SharedBlocks, len(key.Blocks)))
	shared := max(cached, key.tokens(known)) > 0 && 2*max(cached, key.tokens(known)) >= key.PromptTokens
	if shared && holder != 0 && (home < 0 || x.Match(key.Blocks, workerAt(c, home)) < known) {
		// A key goes on where most of it is cached: not its home when its first request, priced as
		// a one-off prompt, went elsewhere.
		k, home = lead(c, n, &order, k, home, holder, bound)
	}
	if !shared {
		// A new key leans on its home by the blocks the order is drawn from, so that a near tie
		// goes where the key's next requests will.
		cached = max(cached, key.tokens(RendezvousBlocks))
	}
	// Where another instance sent the conversation's previous turn, what this index saw sent is older.
	ownCredit := !(key.Continues && known == 0 && key.PreviousBlocks > 0)
	creditOf := func(i int) int64 {
		var credit int64
		if ownCredit {
			credit = x.heldTokens(key, workerAt(c, i), c, i, bound)
		}
		if i == home {
			credit = max(credit, cached)
		}
		return credit
	}

	// A small fleet is priced whole; a larger one in the key's order.
	priced := n
	if n > MaxPriced {
		priced = k
	}
	best := Choice{Index: -1}
	bestScore, bestHash := math.Inf(1), uint64(0)
	// scoreAt holds the priced candidates' scores, by index in a small fleet and by place in the key's
	// order in a larger one, for the near tie.
	var scoreAt [MaxPriced]float64
	for j := range priced {
		i := j
		if n > MaxPriced {
			i = order[j]
		}
		scoreAt[j] = math.Inf(1)
		w := workerAt(c, i)
		if w.ID == 0 {
			continue
		}
		credit := creditOf(i)
		score, ok := c.Cost(i, credit)
		if !ok {
			continue
		}
		if shared || key.Session {
			if alone := c.Alone(i); alone > 0 && !math.IsInf(alone, 0) {
				score /= alone // stretch
			}
		}
		scoreAt[j] = score
		// The rendezvous rank breaks ties; it is computed only for them.
		if score < bestScore || best.Index < 0 {
			best, bestScore, bestHash = Choice{Index: i, CachedTokens: credit}, score, w.Hash
		} else if score == bestScore && rendezvous(rkey, w.Hash) > rendezvous(rkey, bestHash) {
			best, bestHash = Choice{Index: i, CachedTokens: credit}, w.Hash
		}
	}
	if best.Index >= 0 {
		if i := nearTie(order[:k], &scoreAt, n > MaxPriced, bestScore); i >= 0 && i != best.Index {
			best.Index, best.CachedTokens = i, creditOf(i)
		}
	}
	switch {
	case best.Index < 0:
	case !shared:
		best.Outcome, best.CachedTokens = New, 0
	case best.CachedTokens > 0:
		best.Outcome = Followed
	default:
		best.Outcome = Yielded
	}
	return best
}

// tokens is the prompt tokens of the key's first blocks, at most its prompt's.
func (k *Key) tokens(blocks int) int64 {
	t := int64(blocks) * k.BlockTokens
	if k.PromptTokens > 0 {
		t = min(t, k.PromptTokens)
	}
	return max(t, 0)
}

// heldTokens is the key's prompt tokens that the index saw sent to w, candidate i, while it is within
// the bound: a worker past it takes the key only on load, as a miss.
func (x *Index) heldTokens(key Key, w Worker, c Candidates, i int, bound float64) int64 {
	if _, load, _ := c.Candidate(i); load+1 > bound {
		return 0
	}
	return key.tokens(x.Match(key.Blocks, w))
}

// lead puts the candidate whose worker is id first in order, when it is within the bound: the key's
// home from then on. It returns order's length and the home, which stays home otherwise.
func lead(c Candidates, n int, order *[MaxPriced]int, k, home int, id uint32, bound float64) (int, int) {
	at, load := -1, 0.0
	for i := range n {
		if w, l, _ := c.Candidate(i); w.ID == id {
			at, load = i, l
			break
		}
	}
	if at < 0 || at == home || load+1 > bound {
		return k, home
	}
	j := 0
	for j < k && order[j] != at {
		j++
	}
	if j == k {
		k = min(k+1, MaxPriced)
		j = k - 1
	}
	copy(order[1:j+1], order[:j])
	order[0] = at
	return k, at
}

// ranked is a candidate offered for a key's weighted rendezvous order.
type ranked struct {
	i            int
	load, weight float64
	u            float64
	key          float64 // what the order sorts by, the higher the earlier: see rendezvousTop
}

// score is the candidate's weighted rendezvous score, weight / -ln(u): the higher, the earlier in the
// key's order.
func (r *ranked) score() float64 { return r.weight / -math.Log(r.u) }

// rendezvousTop keeps the first MaxPriced candidates offered in the key's order, weight / -ln(u) the
// higher the earlier; of equal rank, the one offered first. While every candidate offered has one
// weight it sorts them by u, which orders them as their scores do, without a logarithm.
type rendezvousTop struct {
	n       int
	weight  float64 // the weight of every candidate offered, while !byScore; 0 before the first
	byScore bool
	r       [MaxPriced]ranked
}

func (t *rendezvousTop) offer(c ranked) {
	if c.weight != t.weight && !t.byScore {
		t.weighed(c.weight)
	}
	c.key = c.u
	if t.byScore {
		// weight/(1-u) bounds the score from above (-ln u >= 1-u): most candidates are turned away
		// without a logarithm.
		if t.n == MaxPriced && c.weight/(1-c.u) <= t.r[MaxPriced-1].key {
			return
		}
		c.key = c.score()
	}
	if t.n < MaxPriced {
		t.n++
	} else if c.key <= t.r[MaxPriced-1].key {
		return
	}
	j := t.n - 1
	for ; j > 0 && t.r[j-1].key < c.key; j-- {
		t.r[j] = t.r[j-1]
	}
	t.r[j] = c
}

// consider offers candidate i, worker w, for the key rkey's order: one piece of code for Choose's order
// and a placement's.
func (t *rendezvousTop) consider(i int, rkey uint64, w Worker, load, weight float64) {
	if weight, u := positive(weight), uniform(rkey, w.Hash); !t.turnsAway(weight, u) {
		t.offer(ranked{i: i, load: load, weight: weight, u: u})
	}
}

// turnsAway says that offer would turn away a candidate of weight and u, without offering it: most
// candidates of a large fleet of one weight.
func (t *rendezvousTop) turnsAway(weight, u float64) bool {
	return t.n == MaxPriced && !t.byScore && weight == t.weight && u <= t.r[MaxPriced-1].key
}

// weighed notes the first weight offered, or a second one: from then on candidates sort by score.
func (t *rendezvousTop) weighed(w float64) {
	if t.weight == 0 {
		t.weight = w
		return
	}
	t.byScore = true
	for j := range t.n {
		t.r[j].key = t.r[j].score()
	}
}

// within says whether every candidate kept is within the bound.
func (t *rendezvousTop) within(bound float64) bool {
	for _, r := range t.r[:t.n] {
		if r.load+1 > bound {
			return false
		}
	}
	return true
}

// nearTie is the first candidate in the key's order whose score is at most NearTie times the best,
// -1 if none: a key goes where its next requests will, and where other Caddy instances, from the same
// reports, send it too. scores are by place in order when byPlace, else by index.
func nearTie(order []int, scores *[MaxPriced]float64, byPlace bool, best float64) int {
	for j, i := range order {
		s := scores[j]
		if !byPlace {
			s = scores[i] // a small fleet: i < MaxPriced
		}
		if s <= best*NearTie {
			return i
		}
	}
	return -1
}

// leastCost is the choice on cost alone.
func leastCost(c Candidates, n int) Choice {
	best, bestCost := Choice{Index: -1}, math.Inf(1)
	for i := range n {
		if workerAt(c, i).ID == 0 {
			continue
		}
		if cost, ok := c.Cost(i, 0); ok && (cost < bestCost || best.Index < 0) {
			best.Index, bestCost = i, cost
		}
	}
	return best
}

// workerAt is candidate i's worker.
func workerAt(c Candidates, i int) Worker {
	w, _, _ := c.Candidate(i)
	return w
}

// rendezvous is the weight of a worker for a key in highest-random-weight hashing.
func rendezvous(key, worker uint64) uint64 { return mix(key, worker) }

// uniform is the rendezvous weight of a worker for a key as a number uniform in (0, 1). For workers
// of different weights, the highest weight / -ln(uniform) wins each key with probability weight over
// the sum of the weights (the logarithmic method of Schindelhauer and Schomaker); a weight that is not
// positive counts as 1.
func uniform(key, worker uint64) float64 {
	return (float64(rendezvous(key, worker)>>11) + 0.5) / (1 << 53)
}

// positive is a weight, 1 where it is not positive.
func positive(weight float64) float64 {
	if weight > 0 {
		return weight
	}
	return 1
}
