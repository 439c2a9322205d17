package loadpolicy

import (
	"math"
	"testing"
	"time"
)

// Workers that decode 600 tokens/s between reports 10 s apart while sent 20 requests each: answers of
// 300 tokens. Nothing is said before 32 requests are counted, and a worker with other senders received
// that many times the requests.
func TestFleetOutput(t *testing.T) {
	report := func(at int64, gen float64, sent int64) *Report {
		r := NewReport(time.Unix(at, 0), "", []Rank{worker(4, 0, 0, 1000, 100000, 64, gen)})
		r.Sent = SentTotals{Requests: sent}
		return r
	}
	var f FleetOutput
	a0, a1 := report(0, 600, 0), report(10, 600, 20)
	f.Add(a1, a0)
	if got := f.Mean(); got != 0 {
		t.Errorf("after 20 requests: mean %v, want 0 (not enough)", got)
	}
	b0, b1 := report(0, 500, 100), report(10, 700, 120) // decoded (500+700)/2 x 10
	f.Add(b1, b0)
	if got, want := f.Mean(), 12000.0/40; math.Abs(got-want) > 1e-9 {
		t.Errorf("mean %v, want %v", got, want)
	}
	// Totals that began again, a proxy that counts nothing, and a report without throughput add nothing.
	f.Add(report(20, 600, 5), b1)
	f.Add(report(20, 600, 0), report(10, 600, 0))
	f.Add(NewReport(time.Unix(20, 0), "", []Rank{{Running: 1, Fields: FieldRunning | FieldWaiting}}), a1)
	if got, want := f.Mean(), 12000.0/40; math.Abs(got-want) > 1e-9 {
		t.Errorf("after reports that say nothing: mean %v, want %v", got, want)
	}
	// Two senders: the worker got twice the requests this proxy sent it.
	var g FleetOutput
	c1 := report(10, 800, 40)
	c1.work.senders = 2
	g.Add(c1, report(0, 800, 0))
	if got := g.Mean(); math.Abs(got-100) > 1e-9 {
		t.Errorf("two senders: mean %v, want 8000/80 = 100", got)
	}
}
