package affinity

import (
	"sync"

	"github.com/cespare/xxhash/v2"
)

// DefaultMaxBytes is the index's default memory cap: 16 MiB, 349,520 blocks (85 MiB of prompt text
// at BlockBytes a block).
const DefaultMaxBytes = 16 << 20

// Holders is how many workers an index entry remembers per block, the most recent first. A prefix
// hot enough to spill over more workers is still found on the four that had it last.
const Holders = 4

// A block takes 32 bytes in its shard's entries and two 8-byte slots of its hash table, which is at
// most half full: at three quarters, a new block's probe and an evicted one's removal walked clusters
// long enough to cost a third more per block recorded.
const (
	entrySize     = 32
	slotSize      = 8
	slotsPerEntry = 2
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

// Index remembers which workers recently received which blocks, within a memory cap, evicting the
// least recently used block first. It is safe for concurrent use; each block's lookup takes the lock
// of one of 16 shards.
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
	slots := max(maxBytes/shardCount/(slotSize+entrySize/slotsPerEntry), 4)
	x := &Index{workers: make(map[string]uint32)}
	for i := range x.shards {
		x.shards[i].init(slots)
	}
	return x
}

// Worker returns the worker for a name (an upstream's dial address): the same Hash in every process,
// and an ID of its own in this index.
func (x *Index) Worker(name string) Worker {
	if x == nil {
		return Worker{ID: 1, Hash: xxhash.Sum64String(name)} // a nil index tells workers apart by Hash alone
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	id, ok := x.workers[name]
	if !ok {
		id = uint32(len(x.workers) + 1)
		x.workers[name] = id
	}
	return Worker{ID: id, Hash: xxhash.Sum64String(name)}
}

func (x *Index) shard(block uint64) *shard { return &x.shards[block>>60] }

// Record notes that w received the blocks. Only the blocks w did not hold are written, deepest first,
// and the first block is touched: the first block of a prefix is its most recently used, and eviction
// takes a prefix's blocks from the end of what each request added. On a nil Index it does nothing.
func (x *Index) Record(blocks []uint64, w Worker) {
	if x == nil || w.ID == 0 || len(blocks) == 0 {
		return
	}
	held := x.depth(blocks, w.ID)
	for end := len(blocks); end > held; end -= recordBatch {
		x.recordDeepestFirst(blocks[max(held, end-recordBatch):end], w.ID)
	}
	if held > 0 {
		s := x.shard(blocks[0])
		s.mu.Lock()
		s.record(blocks[0], w.ID)
		s.mu.Unlock()
	}
}

// recordBatch is how many blocks recordDeepestFirst sorts on its stack.
const recordBatch = MaxBlocks

// recordDeepestFirst records up to recordBatch blocks, the last first, taking each shard's lock once:
// a new key's blocks fall in every shard, and a lock per block cost more than the records.
func (x *Index) recordDeepestFirst(blocks []uint64, id uint32) {
	var start [shardCount + 1]uint8
	for _, b := range blocks {
		start[b>>60+1]++
	}
	for i := 1; i <= shardCount; i++ {
		start[i] += start[i-1]
	}
	var sorted [recordBatch]uint64 // by shard, and in each shard the last block first
	next := start
	for i := len(blocks) - 1; i >= 0; i-- {
		b := blocks[i]
		sorted[next[b>>60]] = b
		next[b>>60]++
	}
	for i := range shardCount {
		if start[i] == start[i+1] {
			continue
		}
		s := &x.shards[i]
		s.mu.Lock()
		for _, b := range sorted[start[i]:start[i+1]] {
			s.record(b, id)
		}
		s.mu.Unlock()
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
// last miss and the first hit: one lookup for a key sent again whole, a few for a longer one.
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

// known is how many leading blocks of the key this index has seen sent to any worker: 0 for a nil
// index.
func (x *Index) known(blocks []uint64) int {
	if x == nil {
		return 0
	}
	d := 0
	for _, id := range x.firstHolders(blocks) {
		if id != 0 {
			d = max(d, 1+x.depth(blocks[1:], id))
		}
	}
	return d
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
		n += len(s.entries)
		s.mu.Unlock()
	}
	return n
}

// entry is one block. Entries live in their shard's slice and link into its LRU list by position,
// so the index holds no pointers for the garbage collector to trace.
type entry struct {
	hash       uint64
	holders    [Holders]uint32 // most recent first; 0 is free
	prev, next int32
}

func (e *entry) holds(id uint32) bool {
	for _, h := range e.holders {
		if h == id {
			return true
		}
	}
	return false
}

// shard is an LRU set of entries found through an open-addressing hash table (linear probing,
// deletion by backward shift, so no tombstones lengthen the probes as entries come and go). A slot holds
// the entry's position + 1 in the low 32 bits (0: empty) and the low 32 bits of its hash above: its
// home slot, and enough of the hash that a probe rarely reads an entry that is not the one sought.
type shard struct {
	mu        sync.Mutex
	slots     []uint64
	maxSlots  int
	entries   []entry
	head      int32   // most recently used, -1 when empty
	perWorker []int64 // blocks held, by worker ID
}

func (s *shard) init(maxSlots int) {
	s.maxSlots = maxSlots
	s.slots = make([]uint64, min(256, maxSlots))
	s.head = -1
}

func (s *shard) limit() int { return s.maxSlots / slotsPerEntry }

// home is the slot where a probe for a hash starts (multiply and shift: the table's size need not be
// a power of two, so a memory cap is used whole).
func (s *shard) home(hash uint64) int { return int(uint64(uint32(hash)) * uint64(len(s.slots)) >> 32) }

func tag(hash uint64) uint64 { return hash << 32 }

// find returns the slot of hash, or the empty slot where it would go.
func (s *shard) find(hash uint64) (slot int, found bool) {
	t := tag(hash)
	for i := s.home(hash); ; i = s.after(i) {
		v := s.slots[i]
		if v == 0 {
			return i, false
		}
		if v&^(1<<32-1) == t && s.entries[uint32(v)-1].hash == hash {
			return i, true
		}
	}
}

func (s *shard) lookup(hash uint64) (*entry, bool) {
	i, ok := s.find(hash)
	if !ok {
		return nil, false
	}
	return &s.entries[uint32(s.slots[i])-1], true
}

func (s *shard) record(hash uint64, id uint32) {
	slot, ok := s.find(hash)
	var i int32
	if ok {
		if i = int32(uint32(s.slots[slot]) - 1); i != s.head {
			s.unlink(i)
			s.pushFront(i)
		}
	} else {
		i = s.claim()
		s.entries[i] = entry{hash: hash}
		s.pushFront(i)
		s.insert(hash, i)
	}
	e := &s.entries[i]
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

func (s *shard) insert(hash uint64, i int32) {
	if len(s.entries) > len(s.slots)/slotsPerEntry {
		s.grow()
	}
	slot, _ := s.find(hash)
	s.slots[slot] = tag(hash) | uint64(i+1)
}

// grow doubles the table, up to its largest, and puts every entry back.
func (s *shard) grow() {
	s.slots = make([]uint64, min(2*len(s.slots), s.maxSlots))
	for i := range s.entries {
		slot, _ := s.find(s.entries[i].hash)
		s.slots[slot] = tag(s.entries[i].hash) | uint64(i+1)
	}
}

// after is the slot that follows i, wrapping at the end.
func (s *shard) after(i int) int {
	if i++; i == len(s.slots) {
		return 0
	}
	return i
}

// remove empties slot i, shifting back the entries after it that probed past it.
func (s *shard) remove(i int) {
	for j := s.after(i); s.slots[j] != 0; j = s.after(j) {
		home := s.home(s.slots[j] >> 32)
		// The entry at j may fill i unless its home lies cyclically in (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			s.slots[i] = s.slots[j]
			i = j
		}
	}
	s.slots[i] = 0
}

// claim returns a free entry: a new one under the limit, else the least recently used one's.
func (s *shard) claim() int32 {
	if len(s.entries) < s.limit() {
		if len(s.entries) == cap(s.entries) { // grow by doubling, never past the limit
			grown := make([]entry, len(s.entries), min(max(2*cap(s.entries), 64), s.limit()))
			copy(grown, s.entries)
			s.entries = grown
		}
		s.entries = append(s.entries, entry{})
		return int32(len(s.entries) - 1)
	}
	tail := s.entries[s.head].prev
	e := &s.entries[tail]
	for _, h := range e.holders {
		if h != 0 {
			s.count(h, -1)
		}
	}
	slot, _ := s.find(e.hash)
	s.remove(slot)
	s.unlink(tail)
	return tail
}

func (s *shard) count(id uint32, d int64) {
	for int(id) >= len(s.perWorker) {
		s.perWorker = append(s.perWorker, 0)
	}
	s.perWorker[id] += d
}

func (s *shard) pushFront(i int32) {
	e := &s.entries[i]
	if s.head < 0 {
		e.prev, e.next = i, i
	} else {
		h := &s.entries[s.head]
		e.next, e.prev = s.head, h.prev
		s.entries[h.prev].next = i
		h.prev = i
	}
	s.head = i
}

func (s *shard) unlink(i int32) {
	e := &s.entries[i]
	if e.next == i {
		s.head = -1
		return
	}
	s.entries[e.prev].next = e.next
	s.entries[e.next].prev = e.prev
	if s.head == i {
		s.head = e.next
	}
}
