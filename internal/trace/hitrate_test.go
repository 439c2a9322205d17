package trace

import (
	"math"
	"testing"
)

func TestHitRate(t *testing.T) {
	req := func(in int, ids ...int64) Request { return Request{InputTokens: in, HashIDs: ids} }
	tests := []struct {
		name     string
		reqs     []Request
		capacity int64 // tokens; math.MaxInt64 for UnlimitedHitRate
		hit, all int64 // the hand-computed hit and total prompt tokens
	}{
		{
			// [0,1] misses; [0,1,2] hits 0 and 1 (1024); [0,3] hits 0 (512) and stops at 3; the last
			// [0,1,2] hits all three, its partial block 2 by its own 76 tokens.
			name:     "unlimited",
			reqs:     []Request{req(1024, 0, 1), req(1300, 0, 1, 2), req(600, 0, 3), req(1100, 0, 1, 2)},
			capacity: math.MaxInt64,
			hit:      1024 + 512 + 1100, all: 1024 + 1300 + 600 + 1100,
		},
		{
			// Hits stop at the first miss even where later ids are cached: [5,1] hits nothing.
			name:     "prefix only",
			reqs:     []Request{req(1024, 0, 1), req(1024, 5, 1)},
			capacity: math.MaxInt64,
			hit:      0, all: 2048,
		},
		{
			name:     "no ids never hit",
			reqs:     []Request{{InputTokens: 100}, {InputTokens: 100}},
			capacity: math.MaxInt64,
			hit:      0, all: 200,
		},
		{
			name:     "no tokens",
			reqs:     []Request{req(0), {}},
			capacity: math.MaxInt64,
		},
		{
			// 3 blocks of room. [0,1] inserts 1 then 0 (0 most recent); [2] adds 2; [3] evicts 1,
			// the least recent: {3,2,0}. [0,1] hits 0 (512), misses 1, inserts 1 evicting 0, then 0
			// evicting 2: {0,1,3}. [2] misses, evicts 3. [0,1] hits both (1024). [3] misses.
			name:     "LRU order",
			reqs:     []Request{req(1024, 0, 1), req(512, 2), req(512, 3), req(1024, 0, 1), req(512, 2), req(1024, 0, 1), req(512, 3)},
			capacity: 3 * 512,
			hit:      512 + 1024, all: 1024 + 512 + 512 + 1024 + 512 + 1024 + 512,
		},
		{
			// 2 blocks of room and a prompt of 3: its tail is evicted, its head kept, so it hits 2 blocks
			// the second time (inserting head first would keep 1 and 2, and hit nothing).
			name:     "LRU keeps the head",
			reqs:     []Request{req(1536, 0, 1, 2), req(1536, 0, 1, 2)},
			capacity: 2 * 512,
			hit:      1024, all: 3072,
		},
		{
			// Partial blocks take their own tokens of room: 300+200 fill 500. Block 2 (512) is larger
			// than the whole cache: it is not inserted and evicts nothing, so 0 and 1 hit again.
			name:     "block larger than the cache",
			reqs:     []Request{req(300, 0), req(200, 1), req(512, 2), req(300, 0), req(200, 1)},
			capacity: 500,
			hit:      300 + 200, all: 300 + 200 + 512 + 300 + 200,
		},
		{
			name:     "no room",
			reqs:     []Request{req(1024, 0, 1), req(1024, 0, 1)},
			capacity: 0,
			hit:      0, all: 2048,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var want float64
			if tt.all > 0 {
				want = float64(tt.hit) / float64(tt.all)
			}
			got := LRUHitRate(tt.reqs, tt.capacity)
			if tt.capacity == math.MaxInt64 {
				got = UnlimitedHitRate(tt.reqs)
			}
			if got != want {
				t.Errorf("hit rate %.6f, want %d/%d = %.6f", got, tt.hit, tt.all, want)
			}
		})
	}
}
