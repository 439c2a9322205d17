package loadpolicy

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkChoose measures the choosers alone, on candidates that are already in memory.
func BenchmarkChoose(b *testing.B) {
	for _, n := range []int{4, 64, 1024} {
		cands := make([]Candidate, n)
		for i := range cands {
			used := int64(1000 + (i*7919)%60000)
			cands[i] = Candidate{Signals: NewReport(time.Now(), "", []Rank{rank(int64(1+i%40), int64(i%5),
				int64(i%5)*700, used, 65536, float64(used)/65536, 800)}).Signals(), Inflight: int64(i % 3)}
		}
		at := func(i int) (Candidate, bool) { return cands[i], true }
		for _, choice := range []Choice{PowerOfTwo, Least} {
			b.Run(fmt.Sprintf("n=%d/%s", n, choice), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if i, _ := Choose(choice, MetricAuto, n, at, rand.IntN); i < 0 {
						b.Fatal("nothing chosen")
					}
				}
			})
		}
	}
}
