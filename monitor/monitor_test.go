package monitor

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// funcFetcher adapts a function to Fetcher and counts calls.
type funcFetcher struct {
	calls  atomic.Int64
	closed atomic.Bool
	fn     func(ctx context.Context) (*loadpolicy.Report, error)
}

func (f *funcFetcher) Fetch(ctx context.Context) (*loadpolicy.Report, error) {
	f.calls.Add(1)
	return f.fn(ctx)
}

func (f *funcFetcher) Close() error { f.closed.Store(true); return nil }

func okFetcher() *funcFetcher {
	return &funcFetcher{fn: func(context.Context) (*loadpolicy.Report, error) {
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Running: 1, Fields: loadpolicy.FieldRunning}}), nil
	}}
}

func eventually(t *testing.T, within time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestFirstPollAtStartThenOnSchedule(t *testing.T) {
	m := New(Options{})
	f := okFetcher()
	st := new(State)
	if err := m.Add(Target{Key: "a", Fetcher: f, Interval: 20 * time.Millisecond, Timeout: time.Second, State: st}); err != nil {
		t.Fatal(err)
	}
	if f.calls.Load() != 0 || st.Load() != nil {
		t.Fatal("polled before Start")
	}
	m.Start()
	defer m.Close()
	eventually(t, time.Second, func() bool { return st.Load() != nil }, "first poll")
	eventually(t, 2*time.Second, func() bool { return f.calls.Load() >= 5 }, "five polls")
	if snap := st.Load(); snap.Report == nil || snap.OK < 1 || snap.Err != nil {
		t.Fatalf("snapshot = %+v", snap)
	}
}

func TestHungEndpointDelaysNoOther(t *testing.T) {
	m := New(Options{})
	release := make(chan struct{})
	hung := &funcFetcher{fn: func(ctx context.Context) (*loadpolicy.Report, error) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-release:
			return nil, errors.New("released")
		}
	}}
	healthy := okFetcher()
	hungState, healthyState := new(State), new(State)
	_ = m.Add(Target{Key: "hung", Fetcher: hung, Interval: 10 * time.Millisecond, Timeout: time.Hour, State: hungState})
	_ = m.Add(Target{Key: "ok", Fetcher: healthy, Interval: 10 * time.Millisecond, Timeout: time.Hour, State: healthyState})
	m.Start()
	defer m.Close()
	defer close(release)
	eventually(t, 2*time.Second, func() bool { return healthy.calls.Load() >= 10 }, "ten polls of the healthy endpoint")
	if hungState.Load() != nil {
		t.Fatal("the hung poll published a result")
	}
}

func TestDeadlineCutsPollAndKeepsLastReport(t *testing.T) {
	m := New(Options{})
	var hang atomic.Bool
	f := &funcFetcher{fn: func(ctx context.Context) (*loadpolicy.Report, error) {
		if hang.Load() {
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Fields: loadpolicy.FieldRunning}}), nil
	}}
	st := new(State)
	_ = m.Add(Target{Key: "a", Fetcher: f, Interval: 10 * time.Millisecond, Timeout: 20 * time.Millisecond, State: st})
	m.Start()
	defer m.Close()
	eventually(t, time.Second, func() bool { s := st.Load(); return s != nil && s.Report != nil }, "a report")
	good := st.Load().Report
	hang.Store(true)
	eventually(t, 2*time.Second, func() bool { s := st.Load(); return s.Err != nil }, "a timeout error")
	snap := st.Load()
	var te *TimeoutError
	if !errors.As(snap.Err, &te) || !errors.Is(snap.Err, context.DeadlineExceeded) {
		t.Fatalf("error = %v, want a TimeoutError", snap.Err)
	}
	if snap.Report != good {
		t.Fatal("a failed poll dropped the last good report")
	}
	if snap.Fresh(good.Received.Add(time.Second), 500*time.Millisecond) != nil {
		t.Fatal("a report older than stale_after is still fresh")
	}
	if snap.Fresh(good.Received.Add(100*time.Millisecond), 500*time.Millisecond) == nil {
		t.Fatal("a young report is not fresh")
	}
}

func TestStopWaitsAndRemoveCloses(t *testing.T) {
	m := New(Options{})
	f := okFetcher()
	st := new(State)
	_ = m.Add(Target{Key: "a", Fetcher: f, Interval: 5 * time.Millisecond, Timeout: time.Second, State: st})
	if err := m.Add(Target{Key: "a", Fetcher: f, Interval: 5 * time.Millisecond, Timeout: time.Second, State: st}); !errors.Is(err, ErrRegistered) {
		t.Fatalf("a duplicate key: error %v, want ErrRegistered", err)
	}
	m.Start()
	eventually(t, time.Second, func() bool { return f.calls.Load() >= 3 }, "polls")
	m.Stop()
	after := f.calls.Load()
	// Stop waited for the poller: nothing polls any more. A restart resumes.
	m.Start()
	eventually(t, time.Second, func() bool { return f.calls.Load() > after }, "polls after restart")
	m.Remove("a")
	if !f.closed.Load() {
		t.Fatal("Remove did not close the fetcher")
	}
	stopped := f.calls.Load()
	m.Stop()
	if f.calls.Load() != stopped {
		t.Fatal("polled after Remove")
	}
	m.Close()
	if err := m.Add(Target{Key: "b", Fetcher: okFetcher(), Interval: time.Second, Timeout: time.Second, State: new(State)}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add after Close: error %v, want ErrClosed", err)
	}
}

func TestConcurrencyCap(t *testing.T) {
	const limit = 3
	m := New(Options{MaxConcurrent: limit})
	var inFlight, peak atomic.Int64
	release := make(chan struct{})
	for i := range 20 {
		f := &funcFetcher{fn: func(ctx context.Context) (*loadpolicy.Report, error) {
			n := inFlight.Add(1)
			for {
				p := peak.Load()
				if n <= p || peak.CompareAndSwap(p, n) {
					break
				}
			}
			defer inFlight.Add(-1)
			select {
			case <-release:
			case <-ctx.Done():
			}
			return nil, errors.New("done")
		}}
		_ = m.Add(Target{Key: fmt.Sprint(i), Fetcher: f, Interval: time.Millisecond, Timeout: time.Hour, State: new(State)})
	}
	m.Start()
	eventually(t, time.Second, func() bool { return inFlight.Load() == limit }, "the cap to fill")
	close(release)
	m.Close()
	if peak.Load() > limit {
		t.Fatalf("peak concurrent polls = %d, cap %d", peak.Load(), limit)
	}
}

func TestRefreshPollsNow(t *testing.T) {
	m := New(Options{})
	f := okFetcher()
	st := new(State)
	_ = m.Add(Target{Key: "a", Fetcher: f, Interval: time.Hour, Timeout: time.Second, State: st})
	if err := m.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st.Load() == nil || st.Load().OK != 1 {
		t.Fatalf("after Refresh: %+v", st.Load())
	}
}

func TestFailingEndpointSlowsDownAndRecovers(t *testing.T) {
	var fail atomic.Bool
	fail.Store(true)
	f := &funcFetcher{fn: func(context.Context) (*loadpolicy.Report, error) {
		if fail.Load() {
			return nil, errors.New("refused")
		}
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Fields: loadpolicy.FieldRunning}}), nil
	}}
	m := New(Options{})
	st := new(State)
	_ = m.Add(Target{Key: "a", Fetcher: f, Interval: 10 * time.Millisecond, Timeout: time.Second, State: st})
	m.Start()
	defer m.Close()
	eventually(t, time.Second, func() bool { s := st.Load(); return s != nil && s.Failures >= failingSlowdown+1 }, "failures")
	if s := st.Load(); s.Failed != uint64(s.Failures) || s.OK != 0 {
		t.Fatalf("counters = %+v", s)
	}
	fail.Store(false)
	eventually(t, time.Second, func() bool { s := st.Load(); return s.Err == nil && s.Report != nil }, "recovery")
	if s := st.Load(); s.Failures != 0 || s.OK != 1 {
		t.Fatalf("after recovery = %+v", s)
	}
}

// Waits end on the wake-up grid: moved by at most half a slot, never negative.
func TestWaitsLandOnTheGrid(t *testing.T) {
	m := New(Options{})
	const grid = 20 * time.Millisecond
	for _, d := range []time.Duration{0, time.Millisecond, 7 * time.Millisecond, 900 * time.Millisecond, 1234567 * time.Microsecond} {
		got := m.onGrid(d, grid)
		if got < 0 || got-d > grid/2 || d-got > grid/2 {
			t.Errorf("onGrid(%s, %s) = %s, want within %s of it and >= 0", d, grid, got, grid/2)
		}
	}
	if got := m.onGrid(time.Second, 0); got != time.Second {
		t.Errorf("onGrid with no grid = %s, want the wait unchanged", got)
	}
}

// Stop and Remove end a poll in flight at once, not at its deadline, and the cut poll counts as no
// failure of the worker.
func TestStopAndRemoveCutThePollInFlight(t *testing.T) {
	for _, how := range []string{"Stop", "Remove"} {
		t.Run(how, func(t *testing.T) {
			m := New(Options{})
			started := make(chan struct{}, 1)
			f := &funcFetcher{fn: func(ctx context.Context) (*loadpolicy.Report, error) {
				started <- struct{}{}
				<-ctx.Done()
				return nil, ctx.Err()
			}}
			st := new(State)
			if err := m.Add(Target{Key: "a", Fetcher: f, Interval: time.Hour, Timeout: time.Hour, State: st}); err != nil {
				t.Fatal(err)
			}
			m.Start()
			<-started
			stopped := make(chan struct{})
			go func() {
				defer close(stopped)
				if how == "Stop" {
					m.Stop()
				} else {
					m.Remove("a")
				}
			}()
			select {
			case <-stopped:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s waited for the poll's hour-long deadline", how)
			}
			if snap := st.Load(); snap != nil {
				t.Errorf("the cut poll was published: %+v", snap)
			}
		})
	}
}

// A new endpoint with WarmUp makes its first WarmUpPolls polls a tenth of the interval apart, then
// settles to the interval; a failed poll ends the warm-up, and without WarmUp there is none.
func TestWarmUpPollsThenInterval(t *testing.T) {
	const interval = 500 * time.Millisecond
	for _, tc := range []struct {
		name   string
		warmUp bool
		failAt int // the poll (1-based) that fails; 0 for none
		quick  int // polls that come a tenth of the interval apart, counting the first
	}{
		{"warm-up", true, 0, WarmUpPolls},
		{"no warm-up", false, 0, 1},
		{"failure ends it", true, 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			polls := make(chan time.Time, 64)
			var n atomic.Int64
			f := &funcFetcher{fn: func(context.Context) (*loadpolicy.Report, error) {
				polls <- time.Now()
				if int(n.Add(1)) == tc.failAt {
					return nil, errors.New("refused")
				}
				return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Fields: loadpolicy.FieldRunning}}), nil
			}}
			m := New(Options{})
			if err := m.Add(Target{Key: "a", Fetcher: f, Interval: interval, Timeout: time.Second, State: new(State), WarmUp: tc.warmUp}); err != nil {
				t.Fatal(err)
			}
			m.Start()
			defer m.Close()
			next := func() time.Time {
				select {
				case at := <-polls:
					return at
				case <-time.After(5 * time.Second):
					t.Fatal("no poll within 5s")
					return time.Time{}
				}
			}
			first := next()
			last := first
			for range tc.quick - 1 {
				last = next()
			}
			// At the interval these polls would take (quick - 1) × 0.9 intervals at least.
			if took := last.Sub(first); tc.quick > 1 && took > time.Duration(tc.quick-1)*interval/2 {
				t.Errorf("%d polls took %s, want a tenth of the interval apart", tc.quick, took)
			}
			// Then the interval: no sooner than its jitter (10%) and grid rounding (half a slot) allow.
			if gap := next().Sub(last); gap < interval*8/10 {
				t.Errorf("poll %d came %s after the one before, want about the interval %s", tc.quick+1, gap, interval)
			}
		})
	}
}

// A poke brings the next poll forward to the grid slot after it; then the interval again.
func TestPokePollsSooner(t *testing.T) {
	const interval = 2 * time.Second
	polls := make(chan time.Time, 64)
	f := &funcFetcher{fn: func(context.Context) (*loadpolicy.Report, error) {
		polls <- time.Now()
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Fields: loadpolicy.FieldRunning}}), nil
	}}
	poke := make(chan struct{}, 1)
	m := New(Options{})
	if err := m.Add(Target{Key: "a", Fetcher: f, Interval: interval, Timeout: time.Second, State: new(State), Poke: poke}); err != nil {
		t.Fatal(err)
	}
	m.Start()
	defer m.Close()
	next := func(within time.Duration) time.Time {
		select {
		case at := <-polls:
			return at
		case <-time.After(within):
			t.Fatalf("no poll within %s", within)
			return time.Time{}
		}
	}
	first := next(5 * time.Second)
	poked := time.Now()
	poke <- struct{}{}
	// The slot after the poke: at most one and a half slots (0.3 s) away, where the interval would be
	// at least 1.8 s after the first poll.
	if at := next(5 * time.Second); at.Sub(poked) > 3*interval/wakeGrid/2+50*time.Millisecond {
		t.Fatalf("poked poll came %s after the poke, %s after the first", at.Sub(poked), at.Sub(first))
	}
	select {
	case at := <-polls:
		t.Fatalf("another poll %s after the poke", at.Sub(poked))
	case <-time.After(interval / 2):
	}
}
