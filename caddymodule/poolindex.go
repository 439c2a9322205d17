package caddymodule

import (
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-sglang/caddy-sglang/affinity"
)

// poolIndex holds the endpoint of each upstream of the reverse proxy's static pool, by position:
// the proxy passes that same slice to Select on every request, so Select finds an upstream's
// endpoint by its index instead of hashing its dial address. Dynamic pools use the map.
type poolIndex struct {
	pool reverseproxy.UpstreamPool
	eps  []*endpoint // nil where the upstream has no endpoint (a placeholder address)
	// slots mirror each eps[i]'s report and staleness, so that Select reads one array in order
	// instead of three pointers per upstream; watched from newPoolIndex to release.
	slots []reportSlot
	// workers are the upstreams' affinity workers, made on first use (affinityCandidates.workerOf).
	workers []workerSlot
	// hostsNoted is set once each endpoint knows its upstream's Host, which the proxy provisions after
	// the policy and keeps for the config's life.
	hostsNoted atomic.Bool
}

func newPoolIndex(pool reverseproxy.UpstreamPool, byDial map[string]*endpoint) *poolIndex {
	x := &poolIndex{pool: pool, eps: make([]*endpoint, len(pool)), slots: make([]reportSlot, len(pool)),
		workers: make([]workerSlot, len(pool))}
	for i, u := range pool {
		if x.eps[i] = byDial[u.Dial]; x.eps[i] != nil {
			x.eps[i].state.watch(&x.slots[i], x.eps[i])
		}
	}
	return x
}

// release stops the slots' updates, once the index is no longer used.
func (x *poolIndex) release() {
	for i, ep := range x.eps {
		if ep != nil {
			ep.state.unwatch(&x.slots[i])
		}
	}
}

// of returns x when pool is the indexed slice itself, else nil.
func (x *poolIndex) of(pool reverseproxy.UpstreamPool) *poolIndex {
	if x == nil || len(pool) == 0 || len(pool) != len(x.pool) || &pool[0] != &x.pool[0] {
		return nil
	}
	return x
}

// noteHosts tells each endpoint its upstream's Host, once: Select then need not on every request.
func (x *poolIndex) noteHosts() {
	if x.hostsNoted.Load() {
		return
	}
	for i, u := range x.pool {
		if x.eps[i] != nil {
			x.eps[i].noteHost(u.Host)
		}
	}
	x.hostsNoted.Store(true)
}

// workerSlot is an upstream's affinity worker, held by value so that Select reads the pool's workers
// in order from one array. ID is stored last: a non-zero ID says Hash is there.
type workerSlot struct {
	id   atomic.Uint32
	hash atomic.Uint64
}

func (s *workerSlot) load() (affinity.Worker, bool) {
	id := s.id.Load()
	return affinity.Worker{ID: id, Hash: s.hash.Load()}, id != 0
}

func (s *workerSlot) store(w affinity.Worker) {
	s.hash.Store(w.Hash)
	s.id.Store(w.ID)
}
