package caddymodule_test

import (
	"fmt"
	"net"
	"regexp"
	"runtime"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// 1,000 address changes of a `dynamic a` pool under traffic. Four addresses are live at any time; each
// change starts a worker on a new loopback address, replaces the oldest address in DNS with it, and
// stops the worker that left DNS 8 changes earlier (a pod draining before it exits). The proxy retries
// a failed request on another upstream for up to 2s (lb_try_duration), as a user of dynamic upstreams
// configures it; with that, no request may fail: a live worker could always have served it.
//
// forget_after is shortened to 200ms (and DNS refresh to 10ms) so that the test ends in well under a
// minute; the lifecycle is the same at the defaults, only slower.
func TestDynamicChurn(t *testing.T) {
	const (
		changes     = 1000
		live        = 4
		drain       = 8
		forgetAfter = 200 * time.Millisecond
		refresh     = 10 * time.Millisecond
		every       = 20 * time.Millisecond
	)
	host := func(i int) string { return fmt.Sprintf("127.0.%d.%d", 1+i/250, 2+i%250) }
	d := newDNSServer(t)
	hosts := make([]string, live)
	for i := range hosts {
		hosts[i] = host(i)
	}
	first, port := loopbackWorkers(t, hosts...)
	name := uniqueName("churn")
	d.setA(name, hosts...)
	source := "dynamic " + aBlock(name, port, d.addr, refresh)
	tester := caddytest.NewTester(t)
	tester.InitServer(dynamicCaddyfile("interval 100ms\n\t\tforget_after "+forgetAfter.String(), source, ""), "caddyfile")

	warm := startTraffic(4, 2*time.Millisecond)
	waitWorkers(t, 10*time.Second, "the first addresses polled", polledOK, first...)
	if _, failed := warm.end(); len(failed) > 0 {
		t.Fatalf("warm-up: %d requests failed: %v", len(failed), failed[:min(5, len(failed))])
	}
	goroutinesBefore, heapBefore := settledGoroutines(), heapInUse()

	tr := startTraffic(4, 2*time.Millisecond)
	ring := append([]*testWorker(nil), first...) // live, then draining, oldest first
	polled, started := 0, len(first)
	// Stopped workers are dropped, so that the heap measured is the proxy's, not the test's.
	retire := func(w *testWorker) {
		w.stop()
		if w.loadPolls.Load() > 0 {
			polled++
		}
	}
	defer func() {
		for _, w := range ring {
			w.stop()
		}
	}()
	leftAt := make(map[string]time.Time)
	var maxPollers, maxBound int
	start := time.Now()
	for i := live; i < live+changes; i++ {
		ln, err := net.Listen("tcp", net.JoinHostPort(host(i), fmt.Sprint(port)))
		if err != nil {
			t.Fatal(err)
		}
		ring = append(ring, serveTestWorker(host(i), 0.5, 0, ln))
		started++
		gone := ring[len(ring)-live-1]
		leftAt[gone.addr()] = time.Now()
		names := make([]string, live)
		for j, lw := range ring[len(ring)-live:] {
			names[j] = lw.name
		}
		d.setA(name, names...)
		if len(ring) > live+drain {
			retire(ring[0])
			ring[0] = nil
			ring = ring[1:]
		}
		if i%50 == 0 {
			// Pollers: the live addresses, plus those that left within forget_after and the time a
			// sweep, a DNS refresh and a marking pass may add (and 3s of scheduling delay on a loaded machine).
			n := len(workers(t))
			bound := live
			for _, at := range leftAt {
				if time.Since(at) < forgetAfter+refresh+2*forgetAfter/4+3*time.Second {
					bound++
				}
			}
			if n > bound {
				t.Errorf("change %d: %d pollers, want <= %d (live plus within grace)", i, n, bound)
			}
			maxPollers, maxBound = max(maxPollers, n), max(maxBound, bound)
		}
		time.Sleep(every) // pacing the changes, not synchronisation
	}
	churnTook := time.Since(start)
	// With traffic still flowing, the pollers settle on exactly the live addresses.
	liveAddrs := make(map[string]bool)
	for _, w := range ring[len(ring)-live:] {
		liveAddrs[w.addr()] = true
	}
	eventually(t, 10*time.Second, func() bool {
		v := workers(t)
		if len(v) != live {
			return false
		}
		for addr := range v {
			if !liveAddrs[addr] {
				return false
			}
		}
		return true
	}, "pollers to equal the %d live addresses", live)
	counts, failed := tr.end()
	for _, w := range ring[:len(ring)-live] {
		retire(w)
	}
	ring = ring[len(ring)-live:]
	for _, w := range ring {
		if w.loadPolls.Load() > 0 {
			polled++
		}
	}
	clear(leftAt)
	served := 0
	for _, n := range counts {
		served += n
	}
	if len(failed) > 0 {
		t.Errorf("%d of %d requests failed: %v", len(failed), served+len(failed), failed[:min(5, len(failed))])
	}
	okSeries := regexp.MustCompile(`caddy_sglang_load_polls_total\{endpoint="([^"]+)",[^}]*result="ok"`)
	eventually(t, 5*time.Second, func() bool { return len(okSeries.FindAllString(scrape(t), -1)) == live },
		"polls_total to have ok series for the %d live endpoints only", live)

	// Goroutines: each connection in this process costs up to three (client read and write loops and
	// the server's), and the warm-up and the end may leave a few more idle keep-alive connections
	// between Caddy and the live workers; 30 is that margin, while a leak per change would be 1,000+.
	// Heap: Caddy itself keeps a small entry per dynamic address for an hour (reverseproxy's
	// dynamicHosts), a few hundred bytes each; 4 MiB is that plus noise, while a leaked poller (its
	// HTTP transport, buffers and state) per change would be tens of MiB.
	const goroutineMargin, heapMargin = 30, 4 << 20
	var goroutinesAfter int
	var heapAfter uint64
	back := func() bool {
		goroutinesAfter, heapAfter = settledGoroutines(), heapInUse()
		return goroutinesAfter <= goroutinesBefore+goroutineMargin && heapAfter <= heapBefore+heapMargin
	}
	for deadline := time.Now().Add(15 * time.Second); !back() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond) // polling until the deadline
	}
	defer func() {
		if goroutinesAfter > goroutinesBefore+goroutineMargin || heapAfter > heapBefore+heapMargin {
			t.Errorf("not back to baseline: goroutines %d -> %d (margin %d), heap %d -> %d (margin %d)\n%s",
				goroutinesBefore, goroutinesAfter, goroutineMargin, heapBefore, heapAfter, heapMargin, goroutineDump())
		}
	}()
	t.Logf("churn: %d address changes in %s; pollers max %d (bound %d), at end %d for %d live; goroutines %d before, %d after; "+
		"heap %.1f MiB before, %.1f MiB after; requests %d served, %d failed; %d of %d addresses polled",
		changes, churnTook.Round(time.Millisecond), maxPollers, maxBound, live, live, goroutinesBefore, goroutinesAfter,
		float64(heapBefore)/(1<<20), float64(heapAfter)/(1<<20), served, len(failed), polled, started)
}

// heapInUse is the live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
