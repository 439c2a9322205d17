package caddymodule

import (
	"context"
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// UpstreamsForTest is n healthy upstreams dialled at 10.0.0.1:30000 on, built the way Caddy's own
// selection policy tests build theirs: for this package's tests and benchmarks.
func UpstreamsForTest(n int) reverseproxy.UpstreamPool {
	pool := make(reverseproxy.UpstreamPool, n)
	for i := range pool {
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("10.0.%d.%d:30000", (i+1)/256, (i+1)%256)}
	}
	return pool
}

// fixedFetcher answers every poll with the same report.
type fixedFetcher struct{ rep *loadpolicy.Report }

func (f fixedFetcher) Fetch(context.Context) (*loadpolicy.Report, error) { return f.rep, nil }

// ProvisionWithReports leaves p, configured with its options, as Provision would over pool, without
// a running Caddy: every upstream has an endpoint whose state holds report(i), published through one
// real poll of a monitor that is never started.
func ProvisionWithReports(p *Policy, pool reverseproxy.UpstreamPool, report func(i int) *loadpolicy.Report) error {
	p.logger = zap.NewNop()
	if err := p.parseOptions(); err != nil {
		return err
	}
	p.makeAffinityIndex()
	p.fallback = reverseproxy.LeastConnSelection{}
	m := monitor.New(monitor.Options{})
	defer m.Close()
	eps := make(map[string]*endpoint, len(pool))
	for i, u := range pool {
		spec := p.spec
		spec.address = u.Dial
		ep := &endpoint{key: spec.key(), spec: spec, state: new(sharedState), refs: 1}
		ep.interval.Store(int64(DefaultInterval))
		ep.staleness.Store(int64(time.Hour))
		err := m.Add(monitor.Target{Key: ep.key, Fetcher: fixedFetcher{report(i)}, Interval: time.Hour,
			Timeout: time.Second, State: &ep.state.State, Published: ep.state.refresh})
		if err != nil {
			return err
		}
		eps[u.Dial] = ep
	}
	if err := m.Refresh(context.Background()); err != nil {
		return err
	}
	for dial, ep := range eps {
		if ep.fresh(time.Now()) == nil {
			return fmt.Errorf("upstream %s: no fresh report after the poll", dial)
		}
	}
	p.endpoints.Store(&eps)
	p.index.Store(newPoolIndex(pool, eps))
	return nil
}
