package caddymodule

import (
	"net/http"
	"slices"
	"sync/atomic"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
)

// counterVec is a counter by the values of one label that Select counts in on every core without
// sharing a cache line: each request counts in one of counterShards pairs of lines, picked by a hash of
// the request's address, and a scrape sums them. A prometheus counter is one word that every core's
// Select wrote: with two cores selecting at once, it made the default policy's Select 3× least_conn's.
type counterVec struct {
	desc   *prometheus.Desc
	values []string
	counts []shardedCount // by the index of the value in values
}

// newCounterVec is a counterVec named name in this package's namespace, with help, for the label's
// values; each value's count exists at 0 from the start.
func newCounterVec(name, help, label string, values []string) *counterVec {
	return &counterVec{
		desc:   prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, name), help, []string{label}, nil),
		values: values,
		counts: make([]shardedCount, len(values)),
	}
}

// count is the count of the label's value, which must be one of the vector's.
func (v *counterVec) count(value string) *shardedCount {
	i := slices.Index(v.values, value)
	if i < 0 {
		panic("counter " + v.desc.String() + ": no value " + value)
	}
	return &v.counts[i]
}

func (v *counterVec) Describe(ch chan<- *prometheus.Desc) { ch <- v.desc }

func (v *counterVec) Collect(ch chan<- prometheus.Metric) {
	for i := range v.counts {
		ch <- prometheus.MustNewConstMetric(v.desc, prometheus.CounterValue, float64(v.counts[i].value()), v.values[i])
	}
}

// counterShards is how many pairs of cache lines a count is spread over.
const (
	counterShardBits = 4
	counterShards    = 1 << counterShardBits
)

// shardedCount is one value's count, spread over cache lines.
type shardedCount struct {
	shards [counterShards]struct {
		n atomic.Uint64
		_ [120]byte // the rest of two 64-byte lines: CPUs fetch lines in adjacent pairs
	}
}

// Inc counts r. Requests being selected for at once are different allocations, so their addresses
// spread them over the lines; a random pick cost more than an uncontended add (55.8 ns a Select against
// 48.0).
func (c *shardedCount) Inc(r *http.Request) {
	// Fibonacci hashing: the top bits of the address times 2^64/φ. Requests at one offset of different
	// spans (each core allocates from its own) differ in their high bits only, and the product mixes
	// every bit into the top ones.
	c.shards[uint64(uintptr(unsafe.Pointer(r)))*0x9e3779b97f4a7c15>>(64-counterShardBits)].n.Add(1)
}

func (c *shardedCount) value() uint64 {
	var sum uint64
	for i := range c.shards {
		sum += c.shards[i].n.Load()
	}
	return sum
}

var _ prometheus.Collector = (*counterVec)(nil)
