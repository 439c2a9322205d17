package main

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

func TestRadixTree(t *testing.T) {
	root := &radixNode{}
	root.insert("hello world", 0, 1)
	root.insert("hello there", 1, 2)
	root.insert("goodbye", 2, 3)
	for _, c := range []struct {
		s       string
		matched int
		tenant  int
	}{
		{"hello world!", 11, 0},
		{"hello there", 11, 1},
		{"hello", 5, 1}, // both were sent "hello": the more recent one
		{"help", 3, 1},  // ends inside an edge: its shared characters count
		{"good", 4, 2},
		{"xyz", 0, -1},
		{"", 0, -1},
	} {
		m, w := root.match(c.s)
		if m != c.matched || w != c.tenant {
			t.Errorf("match(%q) = %d, %d; want %d, %d", c.s, m, w, c.matched, c.tenant)
		}
	}
	root.insert("hello", 0, 4)
	if _, w := root.match("hello"); w != 0 {
		t.Errorf("after worker 0 was sent hello again, match gives %d", w)
	}
	if m, w := root.match("hello there"); m != 11 || w != 1 {
		t.Errorf("splitting kept the deeper node's tenant? got %d, %d", m, w)
	}
}

func TestCacheAwareFollowsPrefixUntilImbalanced(t *testing.T) {
	r := newCacheAware(3).(*cacheAware)
	p := strings.Repeat("shared system prompt ", 20)
	// In-flight loads [k, 0, 0]: balanced while k−0 ≤ 32 (balance_abs_threshold), so the prompt follows its
	// tree match to worker 0 thirty-three times; then the fleet is imbalanced and the least loaded takes it.
	for i := range 33 {
		if w := r.pick(p); w != 0 {
			t.Fatalf("pick %d went to %d, want 0", i, w)
		}
	}
	if w := r.pick(p); w != 1 {
		t.Fatalf("pick 34 (loads 33/0/0) went to %d, want the least loaded, 1", w)
	}
	// A prompt matching less than cache_threshold of its characters goes to the least loaded: worker 2.
	if w := r.pick("different " + strings.Repeat("x", len(p))); w != 2 {
		t.Fatalf("a new prompt went to %d, want 2", w)
	}
	for range 33 {
		r.done(0)
	}
	if r.load[0] != 0 || r.load[1] != 1 || r.load[2] != 1 {
		t.Fatalf("loads %v after the done calls", r.load)
	}
}

func TestCacheAwareMatchRate(t *testing.T) {
	r := newCacheAware(2).(*cacheAware)
	base := strings.Repeat("a", 100)
	if w := r.pick(base); w != 0 {
		t.Fatalf("first pick %d", w)
	}
	r.done(0)
	r.load[0] = 5 // worker 0 busier, still balanced
	// 100 of 199 characters matched: 0.503 > 0.5 follows the match.
	if w := r.pick(base + strings.Repeat("b", 99)); w != 0 {
		t.Fatalf("match rate above the threshold went to %d", w)
	}
	// 100 of 200: exactly 0.5 is not above the threshold: the least loaded.
	if w := r.pick(base + strings.Repeat("c", 100)); w != 1 {
		t.Fatalf("match rate at the threshold went to %d", w)
	}
}

func TestPrefixHashKeysOnTheHead(t *testing.T) {
	a, b := newPrefixHash(3).(*prefixHash), newPrefixHash(3).(*prefixHash)
	head := strings.Repeat("abcd", 256) // 256 tokens
	for i := range 50 {
		key := fmt.Sprintf("%04d", i) + head
		wa := a.pick(key + "tail one")
		a.done(wa)
		wb := b.pick(key + "another tail, longer")
		b.done(wb)
		if wa != wb {
			t.Fatalf("key %d: instances disagree (%d, %d) on prompts with the same first 256 tokens", i, wa, wb)
		}
	}
}

func TestPrefixHashRingSpreadsKeys(t *testing.T) {
	p := newPrefixHash(3).(*prefixHash)
	count := make([]int, 3)
	rnd := rand.New(rand.NewPCG(1, 2))
	const n = 3000
	for range n {
		count[p.ringWorker(rnd.Uint64())]++
	}
	for w, c := range count {
		if c < n/5 || c > n/2 {
			t.Fatalf("worker %d got %d of %d keys: the ring is lopsided (%v)", w, c, n, count)
		}
	}
}

func TestPrefixHashLoadBound(t *testing.T) {
	p := newPrefixHash(3).(*prefixHash)
	// One hot key, nothing finishing: no worker may exceed 1.25 × the mean (total+1)/3 by more than the
	// request that crossed it.
	for i := range 300 {
		p.pick("hot key")
		total := 0
		for _, l := range p.load {
			total += l
		}
		for w, l := range p.load {
			if float64(l) > 1.25*float64(total+1)/3+1 {
				t.Fatalf("after %d picks worker %d has %d of %d in flight", i+1, w, l, total)
			}
		}
	}
}
