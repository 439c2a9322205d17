package affinity

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// homeFleet is three workers weighted 1:2:4, the benchmark's fleet, whose budgets hold the given
// tokens (0: pool unknown).
func homeFleet(x *Index, budgets ...float64) []HomeWorker {
	ws := make([]HomeWorker, len(budgets))
	for i := range ws {
		ws[i] = HomeWorker{Worker: x.Worker(fmt.Sprintf("127.0.0.1:%d", 20390+i)), Weight: float64(int(16) << i),
			Pool: int64(math.Ceil(budgets[i] / HomeShare))}
	}
	return ws
}

// score is a key's weighted rendezvous score on a worker: the higher, the earlier in its order.
func score(key Key, w HomeWorker) float64 {
	return w.Weight / -math.Log(uniform(key.rendezvousKey(), w.Worker.Hash))
}

// byScore is the workers in the key's order, the first first.
func byScore(key Key, ws []HomeWorker) []int {
	order := []int{}
	for i := range ws {
		order = append(order, i)
	}
	for i := range order { // a handful of workers: sort by selection
		for j := i + 1; j < len(order); j++ {
			if score(key, ws[order[j]]) > score(key, ws[order[i]]) {
				order[i], order[j] = order[j], order[i]
			}
		}
	}
	return order
}

// sharedPrefixKeys is n system prompts of tokens each (a whole number of blocks).
func sharedPrefixKeys(n int, tokens int64) []Key {
	keys := make([]Key, n)
	for i := range keys {
		blocks := int(tokens / BlockTokens)
		keys[i] = prefixKey(uint64(1000+i), blocks)
		keys[i].SharedBlocks = blocks
	}
	return keys
}

// Place counts the keys whose home it changed: none on the first placement or when nothing changed,
// the keys a shrunken budget moves off their first worker, and the same keys when they come back.
func TestPlaceCountsTheHomesItChanges(t *testing.T) {
	x := NewIndex(0)
	const tokens = 2176.0
	keys := sharedPrefixKeys(64, tokens)
	h := NewHomes()
	for _, k := range keys {
		h.Note(k, 0)
	}
	unbounded, tight := homeFleet(x, 0, 0, 0), homeFleet(x, 2*tokens, 0, 0)
	for _, step := range []struct {
		name    string
		workers []HomeWorker
		want    func() int
	}{
		{"first placement", unbounded, func() int { return 0 }},
		{"the same fleet again", unbounded, func() int { return 0 }},
		{"worker 0 holds two keys", tight, func() int { return movedOff(h, keys) }},
		{"the same again", tight, func() int { return 0 }},
	} {
		got := h.Place(step.workers, 0)
		if want := step.want(); got != want {
			t.Errorf("%s: %d homes changed, want %d", step.name, got, want)
		}
	}
	moved := movedOff(h, keys)
	if moved == 0 {
		t.Fatal("no key moved off worker 0: the test needs some")
	}
	if got := h.Place(unbounded, 0); got != moved {
		t.Errorf("worker 0 unbounded again: %d homes changed, want the %d that come back", got, moved)
	}
}

// Place's count is the keys whose home, as Of says, the placement changed: over placements that see
// more keys each time (one an instance had not seen goes where Of predicted), on fleets whose budgets
// change.
func TestPlaceCountsWhatOfSays(t *testing.T) {
	x := NewIndex(0)
	const tokens = 2176.0
	keys := sharedPrefixKeys(48, tokens)
	rng := rand.New(rand.NewPCG(7, 7))
	h := NewHomes()
	ws := homeFleet(x, 3*tokens, 6*tokens, 0)
	homeOf := func(k Key) uint32 { // Of's home as a worker ID: 0 is the first in the key's order
		if id := h.Of(k); id != 0 {
			return id
		}
		return ws[byScore(k, ws)[0]].Worker.ID
	}
	total := 0
	for round := range 12 {
		for _, k := range keys[:min(len(keys), 4*(round+1))] {
			h.Note(k, int64(round))
		}
		before := make([]uint32, len(keys))
		for i, k := range keys {
			before[i] = homeOf(k)
		}
		if round%3 == 2 { // a budget changes
			ws = homeFleet(x, float64(1+rng.IntN(4))*tokens, float64(2+rng.IntN(6))*tokens, 0)
		}
		got := h.Place(ws, int64(round))
		want := 0
		for i, k := range keys[:min(len(keys), 4*(round+1))] {
			if round > 0 && homeOf(k) != before[i] {
				want++
			}
		}
		if got != want {
			t.Errorf("round %d: Place counted %d homes changed, Of says %d", round, got, want)
		}
		total += got
	}
	if total == 0 {
		t.Error("no placement changed a home: the test needs some")
	}
}

// movedOff is how many of keys the latest placement moved off their first worker.
func movedOff(h *Homes, keys []Key) int {
	n := 0
	for _, k := range keys {
		if h.Of(k) != 0 {
			n++
		}
	}
	return n
}

// A worker whose budget holds two of the keys that rank it first keeps the two that score highest
// there; each other one moves to its second worker, whose budget is unbounded (pool unknown); keys
// that rank another worker first stay where they are.
func TestPlaceMovesTheLowestScoringKeysOffAFullWorker(t *testing.T) {
	x := NewIndex(0)
	const tokens = 2176.0
	ws := homeFleet(x, 2*tokens, 0, 0) // worker 0 holds two keys
	keys := sharedPrefixKeys(64, tokens)
	h := NewHomes()
	var atFirst []Key // keys that rank worker 0 first
	for _, k := range keys {
		h.Note(k, 0)
		if byScore(k, ws)[0] == 0 {
			atFirst = append(atFirst, k)
		}
	}
	if len(atFirst) < 4 {
		t.Fatalf("%d keys rank worker 0 first; the test needs at least 4", len(atFirst))
	}
	h.Place(ws, 0)
	// The two highest scores at worker 0 among the keys that rank it first.
	var top [2]float64
	for _, k := range atFirst {
		if s := score(k, ws[0]); s > top[0] {
			top[1], top[0] = top[0], s
		} else if s > top[1] {
			top[1] = s
		}
	}
	if got := h.Keys(ws[0].Worker); got != 2 {
		t.Errorf("worker 0 home to %d keys, want the 2 its budget holds", got)
	}
	if got := h.Keys(ws[0].Worker) + h.Keys(ws[1].Worker) + h.Keys(ws[2].Worker); got != len(keys) {
		t.Errorf("the workers are home to %d keys in all, want %d", got, len(keys))
	}
	for _, k := range keys {
		order := byScore(k, ws)
		got := h.Of(k)
		switch {
		case order[0] != 0 && got != 0:
			t.Errorf("key ranking worker %d first moved to worker ID %d", order[0], got)
		case order[0] == 0 && score(k, ws[0]) >= top[1] && got != 0:
			t.Errorf("one of the two best keys at worker 0 moved to worker ID %d", got)
		case order[0] == 0 && score(k, ws[0]) < top[1] && got != ws[order[1]].Worker.ID:
			t.Errorf("key over worker 0's budget placed at worker ID %d, want its second, ID %d", got, ws[order[1]].Worker.ID)
		}
	}
}

// Placement is a function of the keys and the fleet: instances that saw the keys in other orders
// and at other times within the TTL place them alike.
func TestPlaceIsOrderFree(t *testing.T) {
	x := NewIndex(0)
	ws := homeFleet(x, 12288, 24576, 49152)
	keys := sharedPrefixKeys(48, 2176)
	placements := make([]*Homes, 3)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range placements {
		placements[i] = NewHomes()
		for _, j := range rng.Perm(len(keys)) {
			placements[i].Note(keys[j], int64(rng.IntN(HomeKeyTTL/2)))
		}
		placements[i].Place(ws, HomeKeyTTL/2)
	}
	moved := 0
	for _, k := range keys {
		want := placements[0].Of(k)
		if want != 0 {
			moved++
		}
		for i, p := range placements[1:] {
			if got := p.Of(k); got != want {
				t.Errorf("instance %d placed a key at worker ID %d, instance 0 at %d", i+1, got, want)
			}
		}
	}
	if moved == 0 {
		t.Fatal("48 keys of 2,176 tokens on budgets of 12k, 24k and 48k moved none: the test places nothing")
	}
}

// Within budget every key stays first; so does every key when no pool is known, and a key that fits
// in no worker's budget.
func TestPlaceKeepsKeysFirstWithRoomOrNoPools(t *testing.T) {
	x := NewIndex(0)
	for _, c := range []struct {
		name    string
		budgets []float64
		tokens  int64
	}{
		{"room for all", []float64{1 << 20, 1 << 21, 1 << 22}, 2176},
		{"no budget known", []float64{0, 0, 0}, 2176},
		{"fits nowhere", []float64{1000, 2000, 4000}, 8192},
	} {
		h := NewHomes()
		keys := sharedPrefixKeys(32, c.tokens)
		for _, k := range keys {
			h.Note(k, 0)
		}
		h.Place(homeFleet(x, c.budgets...), 0)
		for _, k := range keys {
			if got := h.Of(k); got != 0 {
				t.Errorf("%s: a key moved to worker ID %d", c.name, got)
			}
		}
		ws := homeFleet(x, c.budgets...)
		if n := h.Keys(ws[0].Worker) + h.Keys(ws[1].Worker) + h.Keys(ws[2].Worker); n != len(keys) {
			t.Errorf("%s: the workers are home to %d keys in all, want %d", c.name, n, len(keys))
		}
	}
}

// A key counts towards its home's budget for HomeKeyTTL after its latest request, from its first if
// shared, else from its second; keys that continue a conversation or name a session are not counted:
// they follow their cache.
func TestHomesCountRecentSharedKeysOnly(t *testing.T) {
	x := NewIndex(0)
	const tokens = 2176.0
	ws := homeFleet(x, tokens, 0, 0) // worker 0 holds one key
	keys := sharedPrefixKeys(64, tokens)
	var first []Key
	for _, k := range keys {
		if byScore(k, ws)[0] == 0 {
			first = append(first, k)
		}
	}
	if len(first) < 2 {
		t.Fatalf("%d keys rank worker 0 first; the test needs 2", len(first))
	}
	a, b := first[0], first[1]
	movedOf := func(h *Homes) int { return movedOff(h, []Key{a, b}) }
	h := NewHomes()
	h.Note(a, 0)
	h.Note(b, 0)
	h.Place(ws, HomeKeyTTL)
	if got := movedOf(h); got != 1 {
		t.Fatalf("two keys on a worker holding one: %d moved, want 1", got)
	}
	h.Place(ws, HomeKeyTTL+1)
	if got := movedOf(h); got != 0 {
		t.Errorf("keys past their TTL: %d moved, want 0", got)
	}
	h = NewHomes()
	conv, session := a, b
	conv.Continues = true
	session.Session = true
	h.Note(conv, 0)
	h.Note(session, 0)
	h.Place(ws, 0)
	if got := movedOf(h); got != 0 {
		t.Errorf("a conversation and a session noted: %d moved, want 0", got)
	}
	// A shared prompt counts what its requests share, however long the question after it.
	h = NewHomes()
	longA, longB := a, b
	longA.PromptTokens, longB.PromptTokens = 3*tokens, 3*tokens
	h.Note(longA, 0)
	h.Note(longB, 0)
	h.Place(homeFleet(x, 2*tokens, 0, 0), 0)
	if got := movedOf(h); got != 0 {
		t.Errorf("two shared prompts with long questions on a worker holding both: %d moved, want 0", got)
	}
	// Prompts whose shape says nothing of sharing count from their second request.
	h = NewHomes()
	a.SharedBlocks, b.SharedBlocks = 0, 0
	h.Note(a, 0)
	h.Note(b, 0)
	h.Place(ws, 0)
	if got := movedOf(h); got != 0 {
		t.Errorf("two one-off prompts: %d moved, want 0", got)
	}
	h.Note(a, 1)
	h.Note(b, 1)
	h.Place(ws, 1)
	if got := movedOf(h); got != 1 {
		t.Errorf("two prompts sent twice on a worker holding one: %d moved, want 1", got)
	}
}

// Choose sends a key the placement moved to the worker it names, while that worker is within the
// bound; past it, the key goes back to its order.
func TestChooseFollowsThePlacedHome(t *testing.T) {
	x := NewIndex(0)
	f := newFleet(x, 3)
	key := prefixKey(11, 8)
	first := firstInOrder(key, f.workers)
	placed := (first + 1) % 3
	key.Home = f.workers[placed].ID
	if got := x.Choose(key, f, 0); got.Index != placed {
		t.Fatalf("placed at %d (first in order %d): chose %d", placed, first, got.Index)
	}
	f.inflight[placed] = 40 // far over the mean plus BalanceSlack
	if got := x.Choose(key, f, 0); got.Index == placed {
		t.Errorf("placed worker over the bound: chose it")
	}
}

// An instance that has not seen a shared key places it where one that saw it does: each key, left out
// of a placement of the others, is sent where the placement of all of them put it.
func TestPlaceOfAnUnseenKey(t *testing.T) {
	x := NewIndex(0)
	// Room for 20, 20 and 10 of the 40 keys: about 23 draw the 4x worker first, and its budget moves
	// some, whatever the workers' hashes.
	ws := homeFleet(x, 40960, 40960, 20480)
	keys := sharedPrefixKeys(40, 2048)
	all := NewHomes()
	for _, k := range keys {
		all.Note(k, 0)
	}
	all.Place(ws, 0)
	moved := 0
	for i, k := range keys {
		others := NewHomes()
		for j, o := range keys {
			if j != i {
				others.Note(o, 0)
			}
		}
		others.Place(ws, 0)
		want := all.Of(k)
		if want != 0 {
			moved++
		}
		if got := others.Of(k); got != want {
			t.Errorf("key %d unseen: placed at worker ID %d, where all placed it at %d", i, got, want)
		}
	}
	if moved == 0 {
		t.Fatal("no key moved: the test places nothing")
	}
}

// A worker filled to its last key, turning none away, is full all the same: a key it has not seen that
// outscores a key placed there is placed there, as a placement that saw it places it. The placement
// once took such a worker for one with room, and sent the key down its order.
func TestPlaceOfAnUnseenKeyOnAWorkerFilledExactly(t *testing.T) {
	const tokens = 2048
	x := NewIndex(0)
	ws := homeFleet(x, 2*tokens, 0) // w0 holds two keys; w1 any number

	// Keys whose first worker is w0: the two it takes, and one more, unseen, that outscores one of them.
	var keys, firsts []Key
	for i := uint64(0); len(firsts) < 3; i++ {
		k := prefixKey(2000+i, tokens/BlockTokens)
		k.SharedBlocks = len(k.Blocks)
		if byScore(k, ws)[0] == 0 {
			firsts = append(firsts, k)
		} else if len(keys) < 8 {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(firsts, func(a, b Key) int { return cmp.Compare(score(b, ws[0]), score(a, ws[0])) })
	unseen := firsts[0]
	keys = append(keys, firsts[1:]...)

	others, all := NewHomes(), NewHomes()
	for _, k := range keys {
		others.Note(k, 0)
		all.Note(k, 0)
	}
	all.Note(unseen, 0)
	others.Place(ws, 0)
	all.Place(ws, 0)
	if got, want := others.Of(unseen), all.Of(unseen); got != want || want != 0 {
		t.Errorf("unseen key: placed at worker ID %d, where all placed it at %d (0: its first, w0)", got, want)
	}
}

// Between placements at most 4 × MaxHomeKeys keys are noted, and a placement keeps the MaxHomeKeys
// most recent.
func TestHomesBoundTheKeysNoted(t *testing.T) {
	h := NewHomes()
	for i := range 4*MaxHomeKeys + 100 {
		h.Note(prefixKey(uint64(i), 4), int64(i))
	}
	if got := len(h.seen); got != 4*MaxHomeKeys {
		t.Fatalf("%d keys noted of %d, want %d", got, 4*MaxHomeKeys+100, 4*MaxHomeKeys)
	}
	h.Place(homeFleet(NewIndex(0), 1<<20, 1<<20, 1<<20), 4*MaxHomeKeys)
	if got := len(h.seen); got != MaxHomeKeys {
		t.Fatalf("%d keys kept by a placement, want %d", got, MaxHomeKeys)
	}
	for k, v := range h.seen {
		if v.last < 3*MaxHomeKeys {
			t.Fatalf("kept key %x noted at %d, not among the %d most recent", k, v.last, MaxHomeKeys)
		}
	}
}
