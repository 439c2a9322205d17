package affinity

import (
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
)

// inBucket makes n block hashes that share a bucket of shard 0 at every table size: the same low
// half (which picks the bucket) and high bits that pick shard 0.
func inBucket(n int, low uint32, salt uint64) []uint64 {
	b := make([]uint64, n)
	for i := range b {
		b[i] = ((salt<<16+uint64(i+1))<<32 | uint64(low)) & (1<<60 - 1)
	}
	return b
}

func TestIndexRecordMatch(t *testing.T) {
	x := NewIndex(0)
	a, b := x.Worker("10.0.0.1:30000"), x.Worker("10.0.0.2:30000")
	if a.ID == b.ID || a.Hash == b.Hash || x.Worker("10.0.0.1:30000") != a {
		t.Fatalf("workers %+v %+v: want distinct, stable", a, b)
	}
	key := []uint64{11, 22, 33, 44}
	x.Record(key[:3], a)
	if got := x.Match(key, a); got != 3 {
		t.Fatalf("match %d, want 3", got)
	}
	if got := x.Match(key, b); got != 0 {
		t.Fatalf("match for a worker that never had it: %d", got)
	}
	if got := x.Match([]uint64{11, 99, 98}, a); got != 1 {
		t.Fatalf("match stops at the first miss: %d, want 1", got)
	}
	if got := x.Match(key, Worker{}); got != 0 {
		t.Fatalf("the zero worker matches %d", got)
	}
	x.Record(key, b)
	if ids := x.firstHolders(key); ids[0] != b.ID || ids[1] != a.ID || x.Match(key, b) != 4 || x.Match(key, a) != 3 {
		t.Fatalf("holders %v, matches %d and %d: want b (4 blocks) then a (3)", ids, x.Match(key, b), x.Match(key, a))
	}
	if x.Blocks(a) != 3 || x.Blocks(b) != 4 || x.Len() != 4 {
		t.Fatalf("blocks a %d b %d, len %d; want 3, 4, 4", x.Blocks(a), x.Blocks(b), x.Len())
	}
}

func TestIndexKeepsTheRecentHolders(t *testing.T) {
	x := NewIndex(0)
	var ws []Worker
	for i := range Holders + 2 {
		ws = append(ws, x.Worker(string(rune('a'+i))))
	}
	block := []uint64{7}
	for _, w := range ws {
		x.Record(block, w)
	}
	x.Record(block, ws[3]) // again: moves to the front, pushes nobody out
	ids := x.firstHolders(block)
	want := [Holders]uint32{ws[3].ID, ws[5].ID, ws[4].ID, ws[2].ID}
	if ids != want {
		t.Fatalf("holders %v, want %v", ids, want)
	}
	for i, w := range ws {
		want := int64(1)
		if i < 2 { // pushed out
			want = 0
		}
		if held := x.Blocks(w); held != want {
			t.Errorf("worker %d holds %d blocks, want %d", i, held, want)
		}
	}
}

// A worker pushed off a prefix's first block but still named deeper gets the whole prefix written
// again: the first block names it, and no block holds it twice.
func TestIndexRecordsAgainPastTheFirstHolders(t *testing.T) {
	x := NewIndex(0)
	var ws []Worker
	for i := range Holders + 1 {
		ws = append(ws, x.Worker(string(rune('a'+i))))
	}
	key := []uint64{101, 102, 103}
	x.Record(key, ws[0])
	for _, w := range ws[1:] {
		x.Record(key[:1], w) // pushes ws[0] off the first block only
	}
	if first := x.firstHolders(key); first[Holders-1] == ws[0].ID || x.Blocks(ws[0]) != 2 {
		t.Fatalf("set-up: holders %v, worker 0 holds %d blocks", first, x.Blocks(ws[0]))
	}
	x.Record(key, ws[0])
	if first := x.firstHolders(key); first[0] != ws[0].ID {
		t.Fatalf("holders %v: want worker 0 first", first)
	}
	if got, held := x.Match(key, ws[0]), x.Blocks(ws[0]); got != 3 || held != 3 {
		t.Fatalf("worker 0 matches %d and holds %d blocks, want 3 and 3", got, held)
	}
}

func TestIndexEvictsLeastRecentlyUsed(t *testing.T) {
	x := NewIndex(64 << 10)
	w := x.Worker("w")
	old := inBucket(ways, 7, 1)
	for _, b := range old { // one by one: each its own prefix
		x.Record([]uint64{b}, w)
	}
	for _, b := range old[:2] { // used again: now the most recent
		x.Record([]uint64{b}, w)
	}
	fresh := inBucket(ways-2, 7, 2)
	for _, b := range fresh {
		x.Record([]uint64{b}, w)
	}
	for i, b := range old {
		if got, want := x.Match([]uint64{b}, w), btoi(i < 2); got != want {
			t.Fatalf("old block %d: match %d, want %d (only the 2 used again survive)", i, got, want)
		}
	}
	for i, b := range fresh {
		if x.Match([]uint64{b}, w) != 1 {
			t.Fatalf("fresh block %d evicted", i)
		}
	}
	if x.Len() != ways || x.Blocks(w) != ways {
		t.Fatalf("len %d, worker blocks %d; want a bucket's %d", x.Len(), x.Blocks(w), ways)
	}
}

// TestIndexGrowsBeforeEvicting fills buckets past their ways while the table is below its cap: it
// grows instead, and nothing is lost until the index is full.
func TestIndexGrowsBeforeEvicting(t *testing.T) {
	x := NewIndex(64 << 10)
	w := x.Worker("w")
	s := &x.shards[0]
	rng := rand.New(rand.NewPCG(1, 2))
	var blocks []uint64
	for len(s.buckets) < s.maxBuckets {
		b := rng.Uint64() & (1<<60 - 1)
		blocks = append(blocks, b)
		x.Record([]uint64{b}, w)
	}
	for i, b := range blocks {
		if x.Match([]uint64{b}, w) != 1 {
			t.Fatalf("block %d of %d lost while the table grew to %d buckets", i, len(blocks), len(s.buckets))
		}
	}
	if x.Len() != len(blocks) || x.Blocks(w) != int64(len(blocks)) {
		t.Fatalf("len %d, worker blocks %d; want %d", x.Len(), x.Blocks(w), len(blocks))
	}
}

// TestIndexGrowsToACapShortOfDouble: a cap of 24 buckets a shard makes the last growth 16 -> 24, where a
// bucket can receive more blocks than it holds; the counts stay right through it and the evictions
// after.
func TestIndexGrowsToACapShortOfDouble(t *testing.T) {
	x := NewIndex(shardCount * 24 * ways * entrySize)
	if got := x.shards[0].maxBuckets; got != 24 {
		t.Fatalf("%d buckets a shard, want 24", got)
	}
	w := []Worker{x.Worker("a"), x.Worker("b")}
	rng := rand.New(rand.NewPCG(5, 6))
	key := make([]uint64, 8)
	for range 2 * shardCount * x.shards[0].limit() / len(key) {
		for i := range key {
			key[i] = rng.Uint64()
		}
		x.Record(key, w[rng.IntN(2)])
		if x.Match(key, w[0]) != len(key) && x.Match(key, w[1]) != len(key) {
			t.Fatal("a key just recorded does not match")
		}
	}
	if len(x.shards[0].buckets) != 24 || x.Len() > shardCount*x.shards[0].limit() {
		t.Fatalf("%d buckets, %d blocks", len(x.shards[0].buckets), x.Len())
	}
	checkCounts(t, x)
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestIndexEvictsFromThePrefixEnd records a key whose blocks share a bucket: it is written deepest
// first, so newer blocks evict its end and what survives is a prefix.
func TestIndexEvictsFromThePrefixEnd(t *testing.T) {
	x := NewIndex(64 << 10)
	w := x.Worker("w")
	key := inBucket(ways, 9, 1)
	x.Record(key, w)
	for i, b := range inBucket(2, 9, 2) {
		x.Record([]uint64{b}, w)
		if d := x.Match(key, w); d != ways-1-i {
			t.Fatalf("after %d newer blocks: depth %d, want %d", i+1, d, ways-1-i)
		}
	}
}

// TestIndexConversationKeepsItsDepth records a conversation's first turn, then its second, which
// extends it, and evicts blocks one by one (filling each one's bucket with newer blocks): a deeper
// block held means the worker got the whole prefix up to it, whichever earlier blocks the index has
// dropped.
func TestIndexConversationKeepsItsDepth(t *testing.T) {
	x := NewIndex(64 << 10)
	w := x.Worker("w")
	s := &x.shards[0]
	key := make([]uint64, 20)
	lows := make([]uint32, len(key))
	for i := range key {
		lows[i] = uint32(uint64(2*i+1) << 32 / uint64(2*s.maxBuckets)) // bucket i at the table's largest
		key[i] = inBucket(1, lows[i], 100)[0]
	}
	x.Record(key[:10], w)
	x.Record(key[:20], w)
	salt := uint64(1)
	evict := func(blocks ...int) {
		for _, i := range blocks {
			salt++
			for _, b := range inBucket(ways, lows[i], salt) {
				x.Record([]uint64{b}, w)
			}
			if x.Match(key[i:i+1], w) != 0 {
				t.Fatalf("block %d not evicted", i)
			}
		}
	}
	evict(9, 8, 7, 6, 5, 4, 3, 2, 1)
	if d := x.Match(key, w); d != 20 {
		t.Fatalf("turn 1's blocks evicted: depth %d, want 20", d)
	}
	evict(19, 18, 17, 16, 15)
	if d := x.Match(key, w); d != 15 {
		t.Fatalf("the end of turn 2 evicted: depth %d, want 15", d)
	}
	if d := x.Match(key[:12], w); d != 12 {
		t.Fatalf("a shorter key: depth %d, want 12", d)
	}
}

func TestIndexMemory(t *testing.T) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	x := NewIndex(DefaultMaxBytes)
	rng := rand.New(rand.NewPCG(3, 4))
	w := []Worker{x.Worker("a"), x.Worker("b")}
	blocks := make([]uint64, 64)
	capacity := shardCount * x.shards[0].limit()
	for range capacity * 5 / 4 / len(blocks) { // a quarter over: evicting
		for i := range blocks {
			blocks[i] = rng.Uint64()
		}
		x.Record(blocks, w[rng.IntN(2)])
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	used := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d blocks in %.1f MiB: %.0f bytes each", x.Len(), float64(used)/(1<<20), float64(used)/float64(x.Len()))
	if used > DefaultMaxBytes*21/20 {
		t.Fatalf("index uses %d bytes, cap %d", used, DefaultMaxBytes)
	}
	// A quarter over the cap, random blocks fill their buckets unevenly: at 5 blocks a bucket on
	// average, about 89% of the entries hold one.
	if x.Len() < capacity*85/100 || x.Len() > capacity {
		t.Fatalf("index holds %d blocks, want 85%% to 100%% of %d", x.Len(), capacity)
	}
	checkCounts(t, x)
	runtime.KeepAlive(x)
}

func TestIndexConcurrent(t *testing.T) {
	x := NewIndex(1 << 20)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			w := x.Worker(string(rune('a' + g)))
			rng := rand.New(rand.NewPCG(uint64(g), 5))
			key := make([]uint64, 16)
			for range 2000 {
				for i := range key {
					key[i] = rng.Uint64N(5000) * 0x9e3779b97f4a7c15
				}
				x.Record(key, w)
				if x.Match(key, w) == 0 {
					t.Error("a key just recorded does not match")
					return
				}
				x.firstHolders(key)
			}
		})
	}
	wg.Wait()
	var sum int64
	for g := range 4 {
		sum += x.Blocks(x.Worker(string(rune('a' + g))))
	}
	if sum == 0 || sum > int64(x.Len())*Holders {
		t.Fatalf("per-worker blocks sum to %d for %d entries", sum, x.Len())
	}
	checkCounts(t, x)
}

// checkCounts compares the counts the index keeps, of blocks and of blocks per worker, with its
// entries: growing and evicting must keep them in step.
func checkCounts(t *testing.T, x *Index) {
	t.Helper()
	for i := range x.shards {
		s := &x.shards[i]
		held, perWorker := 0, make([]int64, len(s.perWorker))
		for _, b := range s.buckets {
			for _, e := range b {
				if e.holders[0] == 0 {
					continue
				}
				held++
				for _, id := range e.holders {
					if id != 0 {
						perWorker[id]++
					}
				}
			}
		}
		if held != s.len {
			t.Fatalf("shard %d: %d entries hold a block, its count says %d", i, held, s.len)
		}
		for id, n := range perWorker {
			if n != s.perWorker[id] {
				t.Fatalf("shard %d: worker %d holds %d blocks, its count says %d", i, id, n, s.perWorker[id])
			}
		}
	}
}

// BenchmarkRecordNewKey records a 64-block key that no worker has sent before into a full index of the
// default size: a unique 16 KiB prompt, each of whose blocks evicts one.
func BenchmarkRecordNewKey(b *testing.B) {
	x := NewIndex(DefaultMaxBytes)
	w := x.Worker("a")
	key := make([]uint64, MaxBlocks)
	var seq uint64
	newKey := func() {
		seq++
		h := mix(seedText, seq)
		for i := range key {
			h = mix(h, uint64(i))
			key[i] = h
		}
	}
	for range shardCount * x.shards[0].limit() * 5 / 4 / len(key) { // full: a quarter over its cap
		newKey()
		x.Record(key, w)
	}
	for b.Loop() {
		newKey()
		x.Record(key, w)
	}
}
