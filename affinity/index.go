package affinity

import (
	"slices"
	"sync"
)

// DefaultMaxBytes is the index's default memory cap: 16 MiB, 524,288 blocks (128 MiB of prompt text
// at BlockBytes a block).
const DefaultMaxBytes = 16 << 20

// Holders is how many workers an index entry remembers per block, the most recent first. A prefix
// hot enough to spill over more workers is still found on the four that had it last.
const Holders = 4

// A block takes one 32-byte entry; a bucket holds ways of them.
const (
	entrySize = 32
	ways      = 4
)

const shardCount = 16

// Worker is a worker as the index and the rendezvous order know it. Make one per upstream with
// Index.Worker and keep it: the zero Worker is no worker.
type Worker struct {
	// ID is the worker's number in this index, from 1.
	ID uint32
	// Hash is the hash of the worker's name, the same in every process: the rendezvous order.
	Hash uint64
}

// Index remembers which workers recently received which blocks, within a memory cap. A block lives
// in a bucket of 4 entries that its hash picks; once the index has grown to its cap, a new block takes
// its bucket's least recently used entry. Recording a block touches one bucket, no list and no probe
// sequence: a least-recently-used list over a hash table cost about 100 ns a block, mostly cache
// misses, and a unique 16 KiB prompt is 64 blocks (a key holds up to 256). It is safe for concurrent use; each block's lookup
// takes the lock of one of 16 shards.
type Index struct {
	shards [shardCount]shard

	mu      sync.Mutex
	workers map[string]uint32
}

// NewIndex makes an index that uses at most about maxBytes (DefaultMaxBytes when <= 0).
func NewIndex(maxBytes int) *Index {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	buckets := max(maxBytes/shardCount/(ways*entrySize), 1)
	x := &Index{workers: make(map[string]uint32)}
	for i := range x.shards {
		x.shards[i].init(buckets)
	}
	return x
}

// Worker returns the worker for a name (an upstream's dial address): the same Hash in every process,
// and an ID of its own in this index.
func (x *Index) Worker(name string) Worker {
	if x == nil {
		return Worker{ID: 1, Hash: wyhashString(name, 0)} // a nil index tells workers apart by Hash alone
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	id, ok := x.workers[name]
	if !ok {
		id = uint32(len(x.workers) + 1)
		x.workers[name] = id
	}
	return Worker{ID: id, Hash: wyhashString(name, 0)}
}

func (x *Index) shard(block uint64) *shard { return &x.shards[block>>60] }

// Record notes that w received the blocks. Only the blocks w did not hold (all, where the first block
// does not name w) are written, deepest first, and the first block is touched: the first block of a
// prefix is its most recently used, and where a prefix's blocks share a bucket, eviction takes them
// from the end of what each request added. On a nil Index it does nothing.
func (x *Index) Record(blocks []uint64, w Worker) {
	if x == nil || w.ID == 0 || len(blocks) == 0 {
		return
	}
	held := 0
	if first := x.firstHolders(blocks); slices.Contains(first[:], w.ID) {
		// Where the first block does not name w, every block is written: a new prompt's without the
		// misses of the buckets depth would probe first, and what w may still hold deeper again.
		held = x.depth(blocks, w.ID)
	}
	if held < len(blocks) {
		x.recordDeepestFirst(blocks[held:], w.ID)
	}
	if held > 0 {
		s := x.shard(blocks[0])
		s.mu.Lock()
		s.record(blocks[0], w.ID)
		s.mu.Unlock()
	}
}

// recordDeepestFirst records the blocks, the last first. A new key's blocks fall in every shard and
// each in a bucket of its own that is rarely in the cache: it takes the locks of their shards
// together (in shard order, the only order in which the index takes more than one) and reads every
// bucket before it writes any, so that their cache misses overlap instead of coming one per block.
// Recording a unique 16 KiB prompt holds the locks for a few microseconds.
func (x *Index) recordDeepestFirst(blocks []uint64, id uint32) {
	var locked uint32
	for _, b := range blocks {
		locked |= 1 << (b >> 60)
	}
	for i := range shardCount {
		if locked&(1<<i) != 0 {
			x.shards[i].mu.Lock()
		}
	}
	var sum uint64
	for _, h := range blocks {
		b := x.shard(h).bucketOf(h)
		sum += b[0].used + b[ways-1].used
	}
	x.shard(blocks[0]).touched = sum // keeps the loads
	for i := len(blocks) - 1; i >= 0; i-- {
		x.shard(blocks[i]).record(blocks[i], id)
	}
	for i := range shardCount {
		if locked&(1<<i) != 0 {
			x.shards[i].mu.Unlock()
		}
	}
}

// Match returns how many leading blocks w holds.
func (x *Index) Match(blocks []uint64, w Worker) int {
	if x == nil || w.ID == 0 {
		return 0
	}
	return x.depth(blocks, w.ID)
}

// depth returns how many leading blocks id holds: one past the deepest block it holds, since a chained
// block stands for its whole prefix (a worker that got block k got blocks 0 to k, whatever the index
// has evicted of them since). It probes from the end at doubling distances, then bisects between the
// last miss and the first hit: one lookup for a key sent again whole, a few for a longer one. Where
// the index has evicted blocks between two it holds, the bisection can stop short of the deepest:
// depth may say less than a worker got, never more.
func (x *Index) depth(blocks []uint64, id uint32) int {
	miss := len(blocks) // blocks[miss] is not held; len(blocks): past the end
	for step := 1; ; step *= 2 {
		hit := max(len(blocks)-step, 0)
		if hit >= miss {
			return 0
		}
		if !x.holds(blocks[hit], id) {
			miss = hit
			continue
		}
		for miss-hit > 1 {
			mid := int(uint(hit+miss) >> 1)
			if x.holds(blocks[mid], id) {
				hit = mid
			} else {
				miss = mid
			}
		}
		return hit + 1
	}
}

func (x *Index) holds(block uint64, id uint32) bool {
	s := x.shard(block)
	s.mu.Lock()
	e, ok := s.lookup(block)
	held := ok && e.holds(id)
	s.mu.Unlock()
	return held
}

// known is how many leading blocks of the key this index has seen sent to any worker, and the worker
// that holds that many (of several, the one that got the key's first block most recently): 0 and 0
// for a nil index.
func (x *Index) known(blocks []uint64) (depth int, holder uint32) {
	if x == nil {
		return 0, 0
	}
	for _, id := range x.firstHolders(blocks) {
		if id == 0 {
			continue
		}
		if d := 1 + x.depth(blocks[1:], id); d > depth {
			depth, holder = d, id
		}
	}
	return depth, holder
}

// firstHolders returns the workers that hold the first block, the most recent first.
func (x *Index) firstHolders(blocks []uint64) (ids [Holders]uint32) {
	if len(blocks) == 0 {
		return ids
	}
	s := x.shard(blocks[0])
	s.mu.Lock()
	if e, ok := s.lookup(blocks[0]); ok {
		ids = e.holders
	}
	s.mu.Unlock()
	return ids
}

// Blocks returns how many blocks the index holds for w, for the admin view.
func (x *Index) Blocks(w Worker) int64 {
	var n int64
	for i := range x.shards {
		s := &x.shards[i]
		s.mu.Lock()
		if int(w.ID) < len(s.perWorker) {
			n += s.perWorker[w.ID]
		}
		s.mu.Unlock()
	}
	return n
}

// Len returns how many blocks the index holds.
func (x *Index) Len() int {
	n := 0
	for i := range x.shards {
		s := &x.shards[i]
		s.mu.Lock()
		n += s.len
		s.mu.Unlock()
	}
	return n
}

// entry is one block.
type entry struct {
	hash    uint64
	holders [Holders]uint32 // most recent first; 0 is free, and an entry with no holder is empty
	used    uint64          // its shard's clock when last recorded
}

func (e *entry) holds(id uint32) bool {
	for _, h := range e.holders {
		if h == id {
			return true
		}
	}
	return false
}

type bucket [ways]entry

// shard is a set-associative table of entries: a block lives in the bucket its hash picks. The table
// starts small and doubles, up to maxBuckets, when a new block finds its bucket full; at its largest,
// a new block replaces the least recently used entry of its bucket.
type shard struct {
	mu         sync.Mutex
	buckets    []bucket
	maxBuckets int
	clock      uint64
	len        int
	perWorker  []int64 // blocks held, by worker ID
	touched    uint64  // what recordDeepestFirst read ahead, kept so that its loads are not dropped
}

func (s *shard) init(maxBuckets int) {
	s.maxBuckets = maxBuckets
	s.buckets = make([]bucket, min(16, maxBuckets))
}

// limit is how many blocks the shard holds at most.
func (s *shard) limit() int { return s.maxBuckets * ways }

// bucketOf picks a block's bucket by multiply and shift of its hash's low half (the high bits pick
// the shard): the table's size need not be a power of two, so a memory cap is used whole, and a
// bucket's blocks split between two when the table doubles.
func (s *shard) bucketOf(hash uint64) *bucket {
	return &s.buckets[uint64(uint32(hash))*uint64(len(s.buckets))>>32]
}

func (s *shard) lookup(hash uint64) (*entry, bool) {
	b := s.bucketOf(hash)
	for i := range b {
		if b[i].hash == hash && b[i].holders[0] != 0 {
			return &b[i], true
		}
	}
	return nil, false
}

func (s *shard) record(hash uint64, id uint32) {
	s.clock++
	e := s.entryFor(hash)
	if e.holders[0] == 0 || e.hash != hash {
		s.evict(e)
		*e = entry{hash: hash}
		s.len++
	}
	e.used = s.clock
	pos := Holders - 1 // where id is, or the oldest holder it pushes out
	for j, h := range e.holders {
		if h == id {
			pos = j
			break
		}
	}
	if e.holders[pos] != id {
		if old := e.holders[pos]; old != 0 {
			s.count(old, -1)
		}
		s.count(id, 1)
	}
	copy(e.holders[1:pos+1], e.holders[:pos])
	e.holders[0] = id
}

// entryFor returns hash's entry, else its bucket's victim: an empty entry, else (growing the table
// first while the bucket is full and the table is not at its largest) the least recently used.
func (s *shard) entryFor(hash uint64) *entry {
	if e, ok := s.lookup(hash); ok {
		return e
	}
	v := s.bucketOf(hash).victim()
	if v.holders[0] != 0 && len(s.buckets) < s.maxBuckets {
		s.grow()
		return s.entryFor(hash)
	}
	return v
}

// victim is the entry a new block takes: the first empty one, else the least recently used.
func (b *bucket) victim() *entry {
	v := &b[0]
	for i := range b {
		e := &b[i]
		if e.holders[0] == 0 {
			return e
		}
		if e.used < v.used {
			v = e
		}
	}
	return v
}

// evict empties e, if it holds a block.
func (s *shard) evict(e *entry) {
	if e.holders[0] == 0 {
		return
	}
	for _, h := range e.holders {
		if h != 0 {
			s.count(h, -1)
		}
	}
	*e = entry{}
	s.len--
}

// grow doubles the table, up to its largest, and puts every entry back in its new bucket. A bucket of
// the doubled table takes the entries of one old bucket at most, but the last step, to a size short
// of double, can crowd one: its least recently used entries are evicted.
func (s *shard) grow() {
	old := s.buckets
	s.buckets = make([]bucket, min(2*len(old), s.maxBuckets))
	for i := range old {
		for j := range old[i] {
			e := &old[i][j]
			if e.holders[0] == 0 {
				continue
			}
			v := s.bucketOf(e.hash).victim()
			if v.holders[0] != 0 { // crowded: keep the more recent
				if v.used > e.used {
					s.evict(e)
					continue
				}
				s.evict(v)
			}
			*v = *e
		}
	}
}

func (s *shard) count(id uint32, d int64) {
	for int(id) >= len(s.perWorker) {
		s.perWorker = append(s.perWorker, 0)
	}
	s.perWorker[id] += d
}
