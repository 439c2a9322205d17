package caddymodule

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// switchFetcher answers with a fresh one-rank report, or with err while it is set.
type switchFetcher struct{ err atomic.Pointer[error] }

func (f *switchFetcher) Fetch(context.Context) (*loadpolicy.Report, error) {
	if err := f.err.Load(); err != nil {
		return nil, *err
	}
	return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Running: 1, MaxRunning: 48,
		PrefillUncachedTokens: 8000, PrefillBusyUS: 1e6,
		Fields: loadpolicy.FieldRunning | loadpolicy.FieldMaxRunning | loadpolicy.FieldPrefillCounters}}), nil
}

// The static pool's slots must tell what endpoint.fresh tells, and its report's batch cap and prefill
// speed while it is fresh, after every change of what it reads: a poll's report, the unreachable flag,
// the staleness; for an index of a new config that shares the old config's state and sees its polls;
// and no longer once released.
func TestSlotsFollowFresh(t *testing.T) {
	const key = "http://slot.test:1"
	a := &App{logger: zap.NewNop(), endpoints: map[string]*endpoint{}}
	state := new(sharedState)
	t.Cleanup(func() { deletePollCounters(key) }) // the series are global: tests that count them follow
	newEP := func() *endpoint {
		ep := &endpoint{key: key, state: state, series: newPollSeries(key, transportHTTP)}
		ep.setInterval(a, time.Second)
		return ep
	}
	old, cur := newEP(), newEP()
	a.endpoints[old.key] = old // the old config polls; the new one only reads
	f := new(switchFetcher)
	m := monitor.New(monitor.Options{OnResult: a.onPollResult})
	defer m.Close()
	if err := m.Add(monitor.Target{Key: old.key, Fetcher: f, Interval: time.Hour, Timeout: time.Second,
		State: &state.State, Published: state.refresh}); err != nil {
		t.Fatal(err)
	}
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "slot.test:1"}}
	x := newPoolIndex(pool, map[string]*endpoint{"slot.test:1": cur})
	poll := func(err error) {
		t.Helper()
		if err == nil {
			f.err.Store(nil)
		} else {
			f.err.Store(&err)
		}
		if err := m.Refresh(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	check := func(step string, wantFresh bool) {
		t.Helper()
		now := time.Now()
		for _, at := range []time.Time{now, now.Add(2 * time.Second), now.Add(time.Minute)} {
			got, want := x.slots[0].fresh(at), cur.fresh(at)
			if got != want {
				t.Errorf("%s, at +%s: slot %p, endpoint.fresh %p", step, at.Sub(now).Round(time.Second), got, want)
			}
			wantCap, wantSpeed := int64(0), 0.0
			if want != nil {
				wantCap, wantSpeed = want.MaxRunning, want.LifetimePrefillPerRank
			}
			if c, speed := x.slots[0].capacity(at.UnixNano()); c != wantCap || speed != wantSpeed {
				t.Errorf("%s, at +%s: slot's batch cap %d and prefill speed %g, want %d and %g",
					step, at.Sub(now).Round(time.Second), c, speed, wantCap, wantSpeed)
			}
		}
		if got := cur.fresh(now) != nil; got != wantFresh {
			t.Errorf("%s: fresh = %v, want %v", step, got, wantFresh)
		}
	}
	check("before the first poll", false)
	poll(nil)
	check("after a report", true)
	poll(errors.New("connection refused"))
	check("while unreachable", false)
	poll(nil)
	check("reachable again", true)
	cur.setInterval(a, 100*time.Millisecond) // stale after 300ms: +2s is now stale
	check("with a shorter staleness", true)

	x.release()
	if n := len(state.watchers); n != 0 {
		t.Fatalf("%d watchers after release, want 0", n)
	}
	before := x.slots[0].rep.Load()
	poll(nil)
	if x.slots[0].rep.Load() != before {
		t.Error("a released slot was written")
	}
}
