package caddymodule

import (
	"sync"
	"testing"
)

// Concurrent updates each take effect: a plain load and store lost the ones that came between.
func TestAtomicFloatUpdateLosesNothing(t *testing.T) {
	const writers, each = 8, 2000
	var f atomicFloat
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			for range each {
				f.update(func(old float64) float64 { return old + 1 })
			}
		})
	}
	wg.Wait()
	if got := f.Load(); got != writers*each {
		t.Fatalf("after %d updates of +1 the value is %v", writers*each, got)
	}
}
