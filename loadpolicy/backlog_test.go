package loadpolicy

import (
	"math"
	"sync"
	"testing"
	"time"
)

// A backlog is a queue drained at the prefill speed: the report's queue from its arrival, each prompt
// sent from when it was sent, and a new report starts it again from its own queue.
func TestBacklog(t *testing.T) {
	p := CostParams{PrefillTokensPerSec: 1000}
	at := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	rep := NewReport(time.Unix(100, 0), "", []Rank{worker(1, 1, 2000, 0, 100000, 8, 0)}) // 2 s queued
	var b Backlog
	for _, step := range []struct {
		add       int64   // tokens sent at elapsed, before Ahead is read
		elapsed   float64 // seconds after the report
		wantAhead float64 // seconds
	}{
		{0, 0, 2},      // the report's queue
		{0, 1.5, 0.5},  // drained from its arrival
		{0, 5, 0},      // drained whole
		{3000, 10, 3},  // sent at 10 s: none of it drained by the 10 s before
		{0, 11, 2},     //
		{1000, 11, 3},  // queued behind the rest
		{0, 20, 0},     //
		{500, -1, 2.5}, // a report newer than the clock: as if sent at its arrival, behind its queue
		{0, -0.5, 2.5}, // nothing drains before the report
	} {
		if step.add > 0 {
			if step.elapsed < 0 {
				b = Backlog{}
			}
			b.Add(rep, at(step.elapsed), step.add, &p)
		}
		if got := b.Ahead(rep, at(step.elapsed), &p); math.Abs(got-step.wantAhead) > 2e-6 {
			t.Errorf("sent %d at %v s: %v s ahead, want %v", step.add, step.elapsed, got, step.wantAhead)
		}
	}

	// A new report starts again from its own queue, whatever was sent before it.
	next := NewReport(time.Unix(130, 0), "", []Rank{worker(1, 1, 500, 0, 100000, 8, 0)})
	if got := b.Ahead(next, 0, &p); got != 0.5 {
		t.Errorf("new report: %v s ahead, want its queue's 0.5", got)
	}
	b.Add(next, at(1), 1000, &p)
	if got := b.Ahead(next, at(1), &p); math.Abs(got-1) > 2e-6 {
		t.Errorf("new report, 1000 sent at 1 s: %v s ahead, want 1 (its queue drained)", got)
	}

	// A nil backlog is the report's queue; a report the model cannot price counts nothing.
	if got := (*Backlog)(nil).Ahead(rep, at(0.5), &p); got != 1.5 {
		t.Errorf("nil backlog: %v s ahead, want 1.5", got)
	}
	var none Backlog
	none.Add(NewReport(time.Unix(100, 0), "", nil), 0, 1000, &p)
	if none.state.Load() != 0 {
		t.Error("a report without loads counted a prompt")
	}
}

// Other senders' share of the worker counts each prompt this proxy sends that many times.
func TestBacklogOtherSenders(t *testing.T) {
	rep := NewReport(time.Unix(100, 0), "", []Rank{worker(1, 0, 0, 0, 100000, 8, 0)})
	rep.work.senders = 3
	for _, tt := range []struct {
		others bool
		want   float64
	}{{false, 1}, {true, 3}} {
		p := CostParams{PrefillTokensPerSec: 1000, OtherSenders: tt.others}
		var b Backlog
		b.Add(rep, 0, 1000, &p)
		if got := b.Ahead(rep, 0, &p); math.Abs(got-tt.want) > 2e-6 {
			t.Errorf("OtherSenders %v: %v s ahead, want %v", tt.others, got, tt.want)
		}
	}
}

// Prompts sent at once from many goroutines are all counted.
func TestBacklogConcurrentAdds(t *testing.T) {
	p := CostParams{PrefillTokensPerSec: 1000}
	rep := NewReport(time.Unix(100, 0), "", []Rank{worker(1, 0, 0, 0, 100000, 8, 0)})
	var b Backlog
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				b.Add(rep, time.Second, 10, &p)
			}
		})
	}
	wg.Wait()
	if got := b.Ahead(rep, time.Second, &p); math.Abs(got-8) > 1e-3 {
		t.Errorf("8 x 100 prompts of 10 tokens at 1000 tok/s: %v s ahead, want 8", got)
	}
}
