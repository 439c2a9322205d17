package affinity

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// fleet is a set of candidates priced as the cost model prices them, in a simplified form: the
// queue ahead, then this request's uncached prefill.
type fleet struct {
	workers  []Worker
	inflight []float64
	queue    []float64 // seconds of work queued ahead
	down     []bool
	prompt   int64
	prefill  float64 // tokens per second
	priced   []int   // the candidates Cost was asked for, in order, when not nil
}

func newFleet(x *Index, n int) *fleet {
	f := &fleet{inflight: make([]float64, n), queue: make([]float64, n), down: make([]bool, n), prompt: 4096, prefill: 8192}
	for i := range n {
		f.workers = append(f.workers, x.Worker(fmt.Sprintf("10.0.0.%d:30000", i+1)))
	}
	return f
}

func (f *fleet) Len() int                                   { return len(f.workers) }
func (f *fleet) Candidate(i int) (Worker, float64, float64) { return f.workers[i], f.inflight[i], 1 }
func (f *fleet) Alone(int) float64                          { return float64(f.prompt) / f.prefill }
func (f *fleet) Cost(i int, cached int64) (float64, bool) {
	if f.priced != nil {
		f.priced = append(f.priced, i)
	}
	if f.down[i] {
		return 0, false
	}
	return f.queue[i] + float64(f.prompt-cached)/f.prefill, true
}

func prefixKey(id uint64, blocks int) Key {
	b := make([]uint64, blocks)
	for i := range b {
		b[i] = rendezvous(rendezvous(id, 0x5eed), uint64(i)+1) // distinct, well spread
	}
	return Key{Blocks: b, BlockTokens: BlockTokens, PromptTokens: int64(blocks) * BlockTokens}
}

func TestChooseFollowsTheHolder(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 4)
	key := prefixKey(1, 32)
	first := x.Choose(key, f, 0)
	if first.Index < 0 || first.Outcome != New || first.CachedTokens != 0 {
		t.Fatalf("new prefix: %+v; want a choice on load, new", first)
	}
	x.Record(key.Blocks, f.workers[first.Index])
	for i := range f.queue { // the holder is a little busier than the rest
		f.queue[i] = 0.1
	}
	f.queue[first.Index] = 0.2
	again := x.Choose(key, f, 0)
	if again.Index != first.Index || again.Outcome != Followed || again.CachedTokens != 32*BlockTokens {
		t.Fatalf("same prefix: %+v, want %d followed with 32 blocks cached", again, first.Index)
	}
	// Known 2 blocks deep of a 4096-token prompt: less than half of it, so load alone chooses.
	x.Record(prefixKey(99, 2).Blocks, f.workers[0])
	long := prefixKey(99, 32)
	long.PromptTokens = 4096
	if got := x.Choose(long, f, 0); got.Outcome != New || got.CachedTokens != 0 {
		t.Fatalf("a prefix known 2 blocks deep: %+v, want new", got)
	}
}

// A conversation whose first turn went to a worker other than its home continues there, where its
// cache is, in a small fleet and in one larger than MaxPriced, whether or not it is said to be one (a
// chat with an answer in its history, or a prompt that merely starts as an earlier one); a holder over
// the balance bound is not followed.
func TestChooseConversationFollowsItsCache(t *testing.T) {
	for _, n := range []int{4, 64} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			x := NewIndex(0)
			f := newFleet(x, n)
			var first Key
			for id := uint64(1); ; id++ { // a first turn whose home is not worker 0
				if first = prefixKey(id, 16); x.Choose(first, f, 0).Index != 0 {
					break
				}
			}
			x.Record(first.Blocks, f.workers[0]) // went to worker 0 all the same
			next := nextTurn(first, 24)
			next.Continues = false // not said to be a conversation
			if got := x.Choose(next, f, 0); got.Index != 0 || got.Outcome != Followed || got.CachedTokens != 16*BlockTokens {
				t.Fatalf("not said to be a conversation: %+v, want worker 0 followed with 16 blocks cached", got)
			}
			next.Continues = true
			if got := x.Choose(next, f, 0); got.Index != 0 || got.Outcome != Followed || got.CachedTokens != 16*BlockTokens {
				t.Fatalf("a conversation: %+v, want worker 0 followed with 16 blocks cached", got)
			}
			f.inflight[0] = 100 // far over the bound
			if got := x.Choose(next, f, 0); got.Index == 0 || got.Index < 0 {
				t.Fatalf("a conversation whose worker is over the bound: %+v, want another worker", got)
			}
		})
	}
}

// nextTurn is the key of a conversation's next turn, blocks long: prev's blocks (the previous turn),
// then an answer and a new message.
func nextTurn(prev Key, blocks int) Key {
	k := prefixKey(0, blocks)
	copy(k.Blocks, prev.Blocks)
	k.Continues, k.PreviousBlocks = true, len(prev.Blocks)
	return k
}

// Of Caddy instances that share nothing, only the one that sent a conversation's previous turn follows
// where it went; the others price the conversation as one they have not seen, as its first turn was,
// and do not follow an earlier turn to a worker the conversation has left.
func TestChooseConversationFollowsOnlyItsPreviousTurn(t *testing.T) {
	for _, n := range []int{4, 64} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			var xs [3]*Index
			var fs [3]*fleet
			for i := range xs {
				xs[i] = NewIndex(0)
				fs[i] = newFleet(xs[i], n)
			}
			a, b, c := 0, 1, 2
			var first, second Key
			home := 0
			for id := uint64(1); home == 0; id++ { // a conversation that a new key's lean sends to a worker other than 0
				first = prefixKey(id, 16)
				second = nextTurn(first, 24)
				got := xs[b].Choose(second, fs[b], 0)
				if got.Outcome != New {
					t.Fatalf("a second turn this instance has not seen: %+v, want it priced as new", got)
				}
				home = got.Index
			}
			xs[a].Record(first.Blocks, fs[a].workers[0]) // instance a sent the first turn to worker 0
			if got := xs[a].Choose(second, fs[a], 0); got.Index != 0 || got.Outcome != Followed || got.CachedTokens != 16*BlockTokens {
				t.Fatalf("second turn at the instance that sent the first: %+v, want worker 0 followed", got)
			}
			xs[b].Record(second.Blocks, fs[b].workers[home]) // instance b sent the second turn elsewhere
			third := nextTurn(second, 32)
			if got := xs[b].Choose(third, fs[b], 0); got.Index != home || got.Outcome != Followed || got.CachedTokens != 24*BlockTokens {
				t.Fatalf("third turn at the instance that sent the second: %+v, want %d followed with it cached", got, home)
			}
			for _, i := range []int{a, c} {
				if got := xs[i].Choose(third, fs[i], 0); got.Index != home || got.Outcome != New {
					t.Fatalf("third turn at instance %d, which did not send the second: %+v, want it priced as new (at %d)", i, got, home)
				}
			}
		})
	}
}

func TestChooseLargeFleetPricesTheKeysOrder(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 64)
	f.priced = make([]int, 0, 64)
	rng := rand.New(rand.NewPCG(3, 4))
	chosen := map[int]int{}
	for r := range 3000 {
		for i := range f.queue {
			f.queue[i], f.inflight[i] = rng.Float64()*0.1, float64(rng.IntN(6))
		}
		key := prefixKey(uint64(rng.IntN(1000)), 1+rng.IntN(24))
		f.priced = f.priced[:0]
		got := x.Choose(key, f, 0)
		if len(f.priced) > MaxPriced+1 || !slices.Contains(f.priced, got.Index) {
			t.Fatalf("request %d: chose %d after pricing %v; want at most %d priced, the choice among them", r, got.Index, f.priced, MaxPriced+1)
		}
		chosen[got.Index]++
		x.Record(key.Blocks, f.workers[got.Index])
	}
	if len(chosen) != len(f.workers) {
		t.Fatalf("%d of %d workers chosen over 1000 keys: %v", len(chosen), len(f.workers), chosen)
	}
}

func TestChooseSwampedHolderLosesToIdle(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 4)
	key := Key{Blocks: prefixKey(2, 64).Blocks, BlockTokens: BlockTokens, PromptTokens: 4096}
	x.Record(key.Blocks, f.workers[x.Choose(key, f, 0).Index])
	holder := x.Choose(key, f, 0).Index // the key's home
	f.queue[holder] = 5                 // the prefill it saves is 0.5 s
	got := x.Choose(key, f, 0)
	if got.Index == holder || got.Index < 0 || got.Outcome != Yielded || got.CachedTokens != 0 {
		t.Fatalf("swamped holder: %+v; want another worker, yielded", got)
	}
}

func TestChooseNeverPicksUnavailable(t *testing.T) {
	x := NewIndex(0)
	rng := rand.New(rand.NewPCG(7, 8))
	f := newFleet(x, 8)
	for round := range 2000 {
		for i := range f.down {
			f.down[i] = rng.IntN(3) == 0
			f.queue[i] = rng.Float64()
			f.inflight[i] = float64(rng.IntN(10))
		}
		key := prefixKey(uint64(rng.IntN(20)), 1+rng.IntN(10))
		key.Continues = round%4 == 1 // a conversation follows its holder, never to one down
		if round%2 == 0 {
			key = Key{}
		}
		got := x.Choose(key, f, 0)
		allDown := true
		for _, d := range f.down {
			allDown = allDown && d
		}
		switch {
		case allDown && got.Index != -1:
			t.Fatalf("round %d: all down, chose %d", round, got.Index)
		case !allDown && (got.Index < 0 || f.down[got.Index]):
			t.Fatalf("round %d: chose %d, down %v", round, got.Index, f.down)
		}
		if got.Index >= 0 {
			x.Record(key.Blocks, f.workers[got.Index])
		}
	}
}

// TestChooseBoundHoldsUnderZipf routes a skewed key mix over a fleet whose requests finish at random:
// no choice through affinity may take a worker over the bound, and the hottest key must spread.
func TestChooseBoundHoldsUnderZipf(t *testing.T) {
	const n, requests, factor = 8, 20000, 1.25
	x := NewIndex(0)
	f := newFleet(x, n)
	rng := rand.New(rand.NewPCG(9, 10))
	zipf := rand.NewZipf(rand.New(rand.NewPCG(11, 12)), 1.2, 1, 999)
	var running [][2]int // worker, requests left to live
	hot := map[int]int{}
	for r := range requests {
		// Requests finish at random: a busy proxy keeps about 8 per worker in flight.
		for i := 0; i < len(running); {
			if running[i][1]--; running[i][1] <= 0 {
				f.inflight[running[i][0]]--
				running[i] = running[len(running)-1]
				running = running[:len(running)-1]
				continue
			}
			i++
		}
		k := zipf.Uint64()
		key := prefixKey(k, 16)
		key.Continues = r%2 == 1 // a conversation follows its holder only within the bound
		var total float64
		for _, l := range f.inflight {
			total += l
		}
		mean := (total + 1) / n
		bound := math.Ceil(max(factor*mean, mean+BalanceSlack))
		got := x.Choose(key, f, factor)
		if got.Index < 0 {
			t.Fatal("no choice")
		}
		if got.Outcome == Followed && f.inflight[got.Index]+1 > bound {
			t.Fatalf("request %d: followed the key to a worker with %v in flight, bound %v", r, f.inflight[got.Index], bound)
		}
		x.Record(key.Blocks, f.workers[got.Index])
		f.inflight[got.Index]++
		running = append(running, [2]int{got.Index, 1 + rng.IntN(2*n*8)})
		if k == 0 {
			hot[got.Index]++
		}
	}
	if len(hot) < 2 {
		t.Fatalf("the hottest key went to %d worker(s): %v; it must spill", len(hot), hot)
	}
	t.Logf("hottest key's requests by worker: %v", hot)
}

func TestChooseHotPrefixSpillsInRendezvousOrder(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 6)
	key := prefixKey(3, 8)
	rkey := key.Blocks[RendezvousBlocks-1]
	order := make([]int, 0, 6)
	for range 6 { // the rendezvous order, by hand
		best := -1
		for i, w := range f.workers {
			if !contains(order, i) && (best < 0 || rendezvous(rkey, w.Hash) > rendezvous(rkey, f.workers[best].Hash)) {
				best = i
			}
		}
		order = append(order, best)
	}
	// The key went to the first worker once; now that worker is over the bound (the mean plus
	// BalanceSlack, rounded up): the key goes to the second in order, where nothing of it is cached yet.
	x.Record(key.Blocks, f.workers[order[0]])
	f.inflight[order[0]] = BalanceSlack + 2
	got := x.Choose(key, f, 1.25)
	if got.Index != order[1] || got.Outcome != Yielded || got.CachedTokens != 0 {
		t.Fatalf("chose %+v, want the second in rendezvous order %d, yielded (order %v)", got, order[1], order)
	}
	// Sent there, it has two holders; the second, within the bound, is followed.
	x.Record(key.Blocks, f.workers[order[1]])
	if got := x.Choose(key, f, 1.25); got.Index != order[1] || got.Outcome != Followed || got.CachedTokens != 8*BlockTokens {
		t.Fatalf("again: %+v, want %d followed with 8 blocks cached", got, order[1])
	}
}

func contains(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// TestChoosersAgree runs three choosers that share nothing, as three Caddy instances would be, each
// listing the upstreams in its own order: without an index they choose the same worker for every
// request. With an index each learns only from the requests it served; they agree on every key none
// of them has seen, and the log shows how often they agree overall (a disagreement is between two
// workers that both got the prefix).
func TestChoosersAgree(t *testing.T) {
	const n, requests = 8, 3000
	for _, indexed := range []bool{false, true} {
		t.Run(fmt.Sprintf("index=%t", indexed), func(t *testing.T) {
			var xs [3]*Index
			var fs [3]*fleet
			var perms [3][]int // perms[j][i]: replica j's candidate for fleet worker i
			for j := range xs {
				if indexed {
					xs[j] = NewIndex(0)
				}
				fs[j] = newFleet(xs[j], n)
				perms[j] = rand.New(rand.NewPCG(uint64(j), 1)).Perm(n)
				workers := make([]Worker, n)
				for i, p := range perms[j] {
					workers[p] = fs[j].workers[i]
				}
				fs[j].workers = workers
			}
			rng := rand.New(rand.NewPCG(13, 14))
			agreed := 0
			seen := map[uint64]bool{}
			for r := range requests {
				for i := range n {
					q, l := rng.Float64()*0.2, float64(rng.IntN(6))
					for j, f := range fs {
						f.queue[perms[j][i]], f.inflight[perms[j][i]] = q, l
					}
				}
				id := uint64(rng.IntN(2000))
				key := prefixKey(id, 1+rng.IntN(24))
				var chosen [3]uint64 // by worker name's hash
				for j := range xs {
					c := xs[j].Choose(key, fs[j], 0)
					chosen[j] = fs[j].workers[c.Index].Hash
				}
				same := chosen[0] == chosen[1] && chosen[1] == chosen[2]
				if same {
					agreed++
				} else if !indexed || !seen[id] {
					t.Fatalf("request %d (key seen before: %t): choices differ: %x", r, seen[id], chosen)
				}
				seen[id] = true
				who := rng.IntN(3) // only the instance that served the request learns from it
				c := xs[who].Choose(key, fs[who], 0)
				xs[who].Record(key.Blocks, fs[who].workers[c.Index])
			}
			t.Logf("agreed on %d of %d requests", agreed, requests)
			// Each instance learns only what it served, so a key one of them has seen may split
			// them; on most requests they must still agree, or a rule has split the instances.
			if agreed < requests*85/100 {
				t.Fatalf("agreed on %d of %d requests, want at least 85%%", agreed, requests)
			}
		})
	}
}

func TestChooseNoKey(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 4)
	f.queue = []float64{0.3, 0.1, 0.2, 0.4}
	if got := x.Choose(Key{}, f, 0); got.Index != 1 || got.Outcome != NoKey || got.CachedTokens != 0 {
		t.Fatalf("no key: %+v, want the cheapest (1), no_key", got)
	}
}

func TestChooseSessionKey(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 4)
	key := Key{Blocks: HeaderKey("session-42", make([]uint64, 0, 1)), BlockTokens: 4096, PromptTokens: 4096}
	first := x.Choose(key, f, 0)
	if first.Outcome != New {
		t.Fatalf("first turn: %+v, want new", first)
	}
	x.Record(key.Blocks, f.workers[first.Index])
	f.queue[first.Index] = 0.3 // busier, but less than the prompt's prefill (0.5 s)
	if got := x.Choose(key, f, 0); got.Index != first.Index || got.Outcome != Followed || got.CachedTokens != 4096 {
		t.Fatalf("session: %+v, want %d with the whole prompt cached", got, first.Index)
	}
}

// BenchmarkChoose prices a choice and its Record with 64-block (16 KiB) keys: "hit" repeats 256
// prefixes the index holds, "conversation" 256 conversations that went to one worker, "new" sends a
// prefix never seen each time (the index full, evicting), "nokey" is the same candidates on cost
// alone, the yardstick.
func BenchmarkChoose(b *testing.B) {
	seen := uint64(0)
	unseen := prefixKey(0, MaxBlocks)
	nextUnseen := func() Key { // a key of its own each call, written over the last one
		seen++
		for i := range unseen.Blocks {
			unseen.Blocks[i] = rendezvous(rendezvous(1<<40+seen, 0x5eed), uint64(i)+1)
		}
		return unseen
	}
	for _, n := range []int{4, 64} {
		x := NewIndex(0)
		f := newFleet(x, n)
		for i := range n {
			f.queue[i] = float64(i%5) * 0.01
		}
		// Fill the index, a quarter over its cap: "new" measures it evicting, not growing.
		for range DefaultMaxBytes / entrySize * 5 / 4 / MaxBlocks {
			key := nextUnseen()
			x.Record(key.Blocks, f.workers[x.Choose(key, f, 0).Index])
		}
		keys := make([]Key, 256)
		for i := range keys {
			keys[i] = prefixKey(uint64(i), MaxBlocks)
			x.Record(keys[i].Blocks, f.workers[x.Choose(keys[i], f, 0).Index])
		}
		// Conversations held by worker 0, most of them away from their home: each one looks for its holder.
		talks := make([]Key, 256)
		for i := range talks {
			talks[i] = prefixKey(uint64(1<<20+i), MaxBlocks)
			talks[i].Continues = true
			x.Record(talks[i].Blocks, f.workers[0])
		}
		for _, bc := range []struct {
			name string
			key  func(i int) Key
		}{
			{"hit", func(i int) Key { return keys[i%len(keys)] }},
			{"conversation", func(i int) Key { return talks[i%len(talks)] }},
			{"new", func(int) Key { return nextUnseen() }},
			{"nokey", func(int) Key { return Key{} }},
		} {
			b.Run(fmt.Sprintf("%s-%d", bc.name, n), func(b *testing.B) {
				b.ReportAllocs()
				cpu := startCPU()
				i := 0
				for b.Loop() {
					key := bc.key(i)
					c := x.Choose(key, f, 0)
					x.Record(key.Blocks, f.workers[c.Index])
					i++
				}
				cpu.report(b)
			})
		}
	}
}

// speedFleet is an idle fleet of workers of different speeds: a request prefills and decodes speed
// times faster on a worker of speed speed, after the queue ahead.
type speedFleet struct {
	fleet
	speed []float64
}

func (f *speedFleet) Alone(i int) float64 { return (float64(f.prompt)/f.prefill + 1) / f.speed[i] }
func (f *speedFleet) Cost(i int, cached int64) (float64, bool) {
	return f.queue[i] + (float64(f.prompt-cached)/f.prefill+1)/f.speed[i], true
}

// A conversation's first request starts at its home, where its later ones will go, although a faster
// worker would finish it first; a prefix key's first request may be a one-off, and goes to the faster.
// A swamped home still loses it.
func TestChooseNewSessionStartsAtHome(t *testing.T) {
	x := NewIndex(0)
	f := &speedFleet{fleet: *newFleet(x, 3), speed: []float64{1, 4, 4}}
	// A session whose home is the slow worker 0.
	var key Key
	for id := range 1000 {
		blocks := HeaderKey(fmt.Sprint("session-", id), nil)
		home, best := -1, 0.0
		for i, w := range f.workers {
			if s := 1 / -math.Log(uniform(blocks[0], w.Hash)); s > best {
				home, best = i, s
			}
		}
		if home == 0 {
			key = Key{Blocks: blocks, BlockTokens: f.prompt, PromptTokens: f.prompt, Session: true}
			break
		}
	}
	if key.Blocks == nil {
		t.Fatal("no session of 1000 has its home on worker 0")
	}
	if got := x.Choose(key, f, 0); got.Index != 0 || got.Outcome != New {
		t.Errorf("new session: %+v; want its home 0, new", got)
	}
	oneOff := key
	oneOff.Session = false
	if got := x.Choose(oneOff, f, 0); got.Index == 0 || got.Outcome != New {
		t.Errorf("new prefix key with the same home: %+v; want a faster worker, new", got)
	}
	f.queue[0] = 10
	if got := x.Choose(key, f, 0); got.Index == 0 {
		t.Errorf("new session with its home swamped: %+v; want another worker", got)
	}
}

// A system prompt's first request starts at its home on every instance, each with an index of its own
// that has seen nothing; a prompt whose shared part is under half of it is a new key, priced in seconds.
func TestChooseSystemPromptStartsAtHome(t *testing.T) {
	x := NewIndex(0)
	f := &speedFleet{fleet: *newFleet(x, 3), speed: []float64{1, 4, 4}}
	var key Key
	for id := range uint64(1000) {
		if k := prefixKey(id, 64); firstInOrder(k, f.workers) == 0 { // the slow worker
			key = k
			break
		}
	}
	if key.Blocks == nil {
		t.Fatal("no key of 1000 has its home on worker 0")
	}
	key.SharedBlocks = 60
	for instance := range 3 {
		xi := NewIndex(0)
		fi := &speedFleet{fleet: *newFleet(xi, 3), speed: f.speed}
		if got := xi.Choose(key, fi, 0); got.Index != 0 || got.Outcome != Followed || got.CachedTokens != 60*BlockTokens {
			t.Errorf("instance %d: system prompt's first request: %+v; want its home 0, followed, %d tokens", instance, got, 60*BlockTokens)
		}
	}
	for _, shared := range []int{0, 31} {
		k := key
		k.SharedBlocks = shared
		if got := x.Choose(k, f, 0); got.Index == 0 || got.Outcome != New {
			t.Errorf("%d of 64 blocks shared: %+v; want a faster worker, new", shared, got)
		}
	}
	f.queue[0] = 10
	if got := x.Choose(key, f, 0); got.Index == 0 {
		t.Errorf("system prompt with its home swamped: %+v; want another worker", got)
	}
}

// firstInOrder is the key's first worker in the rendezvous order of equal weights.
func firstInOrder(key Key, ws []Worker) int {
	rkey := key.Blocks[min(len(key.Blocks), RendezvousBlocks)-1]
	first, best := -1, 0.0
	for i, w := range ws {
		if u := uniform(rkey, w.Hash); u > best {
			first, best = i, u
		}
	}
	return first
}

// A new prefix key goes to the first worker in its order while that costs at most NearTie times the
// least, so that its next requests, from any instance, find it there; past that, to the least.
func TestChooseNewKeyTakesANearTieInItsOrder(t *testing.T) {
	for _, n := range []int{3, MaxPriced + 4} { // a small fleet priced whole, a larger one in the key's order
		x := NewIndex(0)
		f := newFleet(x, n)
		key := prefixKey(7, 8)
		home := firstInOrder(key, f.workers)
		lean := float64(f.prompt-RendezvousBlocks*BlockTokens) / f.prefill // the home's cost, idle
		least := float64(f.prompt) / f.prefill                             // every other worker's, idle
		for _, c := range []struct {
			times float64
			want  string
		}{{1.2, "home"}, {1.3, "other"}} {
			f.queue[home] = c.times*least - lean
			got := x.Choose(key, f, 0)
			if (got.Index == home) != (c.want == "home") || got.Outcome != New {
				t.Errorf("%d workers, home at %.1f× the least cost: chose %d (home %d), %v; want %s, new", n, c.times, got.Index, home, got.Outcome, c.want)
			}
		}
	}
}

// The order Choose keeps is the first MaxPriced of every candidate sorted by weight / -ln(u), of equal
// scores the first offered, whatever the weights: one weight (compared without a logarithm), a few,
// or all different.
func TestRendezvousTopIsTheOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	weightsOf := []func() float64{
		func() float64 { return 64 },
		func() float64 { return float64(int(1) << rng.IntN(3)) },
		func() float64 { return 1 + 100*rng.Float64() },
	}
	for trial := range 3000 {
		weight := weightsOf[trial%len(weightsOf)]
		n := 1 + rng.IntN(40)
		key := rng.Uint64()
		all := make([]ranked, n)
		var top rendezvousTop
		for i := range all {
			all[i] = ranked{i: i, weight: weight(), u: uniform(key, rng.Uint64())}
			top.offer(all[i])
		}
		slices.SortStableFunc(all, func(a, b ranked) int {
			return cmp.Compare(b.weight/-math.Log(b.u), a.weight/-math.Log(a.u))
		})
		want := all[:min(n, MaxPriced)]
		if top.n != len(want) {
			t.Fatalf("trial %d: kept %d of %d, want %d", trial, top.n, n, len(want))
		}
		for j := range want {
			if top.r[j].i != want[j].i {
				t.Fatalf("trial %d (%d candidates): place %d is %d, want %d", trial, n, j, top.r[j].i, want[j].i)
			}
		}
	}
}

// A conversation that continues behind a shared part of at least RendezvousBlocks (an application's
// instructions or tools) draws its order from its own first blocks past that part; a first turn, a
// one-off prompt, and a conversation behind a shorter shared part draw it from the key's first blocks.
func TestRendezvousKeyOfAConversation(t *testing.T) {
	shared := []uint64{1, 2, 3, 4, 5, 6}
	a := append(append([]uint64(nil), shared...), 11, 12, 13, 14, 15)
	b := append(append([]uint64(nil), shared...), 21, 22, 23, 24, 25)
	for _, c := range []struct {
		name   string
		key    Key
		want   uint64
		sameAB bool
	}{
		{"continues behind 6 shared blocks", Key{Blocks: a, Continues: true, SharedBlocks: 6}, 14, false},
		{"first turn behind 6 shared blocks", Key{Blocks: a, SharedBlocks: 6}, 4, true},
		{"continues behind 2 shared blocks", Key{Blocks: a, Continues: true, SharedBlocks: 2}, 4, true},
		{"continues, its own part shorter than 4 blocks", Key{Blocks: a[:8], Continues: true, SharedBlocks: 6}, 12, false},
	} {
		if got := c.key.rendezvousKey(); got != c.want {
			t.Errorf("%s: rendezvous key %d, want %d", c.name, got, c.want)
		}
		other := c.key
		other.Blocks = b[:len(c.key.Blocks)]
		if same := other.rendezvousKey() == c.key.rendezvousKey(); same != c.sameAB {
			t.Errorf("%s: two conversations share their rendezvous key: %v, want %v", c.name, same, c.sameAB)
		}
	}
}

// Conversations whose prompts all begin with one system prompt sent as text (a trace's first block,
// 8 of ours) have one rendezvous home: each next turn still goes where its earlier turns are cached,
// spread over the fleet as their first turns were, not to that home.
func TestChooseConversationsBehindACommonPrefix(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 4)
	common := prefixKey(7, 8)
	turn := func(id uint64, blocks int) Key {
		k := prefixKey(id, blocks)
		copy(k.Blocks, common.Blocks)
		for i := 8; i < blocks; i++ { // chained: what follows the common part is the conversation's own
			k.Blocks[i] = rendezvous(k.Blocks[i-1], id<<8|uint64(i))
		}
		return k
	}
	const conversations = 40
	firstAt := make([]int, conversations)
	for c := range conversations {
		firstAt[c] = c % 4 // first turns spread on load
		x.Record(turn(uint64(c+1), 24).Blocks, f.workers[firstAt[c]])
	}
	for c := range conversations {
		next := turn(uint64(c+1), 40)
		copy(next.Blocks[:24], turn(uint64(c+1), 24).Blocks)
		got := x.Choose(next, f, 0)
		if got.Index != firstAt[c] || got.Outcome != Followed || got.CachedTokens != 24*BlockTokens {
			t.Fatalf("conversation %d: %+v, want worker %d followed with 24 blocks cached", c, got, firstAt[c])
		}
	}
}
