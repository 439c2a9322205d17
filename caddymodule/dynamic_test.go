package caddymodule_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/miekg/dns"

	"github.com/caddy-sglang/caddy-sglang/caddymodule"
)

// dnsServer is an authoritative DNS server on loopback whose A records a test changes while
// Caddy's dynamic upstreams resolve through it (the `resolvers` option).
type dnsServer struct {
	addr string
	srv  *dns.Server

	mu sync.Mutex
	a  map[string][]net.IP // by FQDN
}

func newDNSServer(t *testing.T) *dnsServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &dnsServer{addr: pc.LocalAddr().String(), a: make(map[string][]net.IP)}
	started := make(chan struct{})
	s.srv = &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(s.serve), NotifyStartedFunc: func() { close(started) }}
	go func() { _ = s.srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = s.srv.Shutdown() })
	return s
}

// setA makes name resolve to the addresses.
func (s *dnsServer) setA(name string, ips ...string) {
	parsed := make([]net.IP, len(ips))
	for i, ip := range ips {
		parsed[i] = net.ParseIP(ip).To4()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.a[dns.Fqdn(name)] = parsed
}

func (s *dnsServer) serve(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	m.Authoritative = true
	s.mu.Lock()
	for _, q := range r.Question {
		hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Rrtype: q.Qtype}
		switch q.Qtype {
		case dns.TypeA:
			for _, ip := range s.a[q.Name] {
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: ip})
			}
		}
		if _, ok := s.a[q.Name]; !ok {
			m.Rcode = dns.RcodeNameError
		}
	}
	s.mu.Unlock()
	_ = w.WriteMsg(m)
}

// dnsNames makes DNS names no other test uses: Caddy caches lookups per name in the process.
var dnsNames atomic.Int64

func uniqueName(kind string) string {
	return fmt.Sprintf("%s%d.sglang.test", kind, dnsNames.Add(1))
}

// loopbackWorkers starts a worker on each address 127.0.x.y, all on one port, as `dynamic a` gives
// upstreams that differ by address only. It returns them and the port.
func loopbackWorkers(t *testing.T, hosts ...string) ([]*testWorker, int) {
	t.Helper()
	for attempt := 0; attempt < 20; attempt++ {
		ln, err := net.Listen("tcp", net.JoinHostPort(hosts[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{ln}
		for _, h := range hosts[1:] {
			l, err := net.Listen("tcp", net.JoinHostPort(h, fmt.Sprint(port)))
			if err != nil {
				break
			}
			lns = append(lns, l)
		}
		if len(lns) < len(hosts) {
			for _, l := range lns {
				l.Close()
			}
			continue // the port was taken on another address: try another
		}
		ws := make([]*testWorker, len(hosts))
		for i, l := range lns {
			ws[i] = startTestWorker(t, hosts[i], 0.5, 0, l)
		}
		return ws, port
	}
	t.Fatalf("no port free on all of %v", hosts)
	return nil, 0
}

// dynamicCaddyfile proxies to the dynamic upstream source, retrying a failed request on another
// upstream for up to 2s as a user of dynamic upstreams would (a pod may go between lookup and dial).
func dynamicCaddyfile(global, source, policy string) string {
	return fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	sglang_load {
		%s
	}
}
http://127.0.0.1:9080 {
	reverse_proxy {
		%s
		lb_policy sglang_load {
			%s
		}
		lb_try_duration 2s
		lb_try_interval 10ms
	}
}
`, global, source, policy)
}

func aSource(name string, port int, resolver string) string {
	return "dynamic " + aBlock(name, port, resolver, 50*time.Millisecond)
}

func aBlock(name string, port int, resolver string, refresh time.Duration) string {
	return fmt.Sprintf("a {\n\t\t\tname %s\n\t\t\tport %d\n\t\t\trefresh %s\n\t\t\tresolvers %s\n\t\t}", name, port, refresh, resolver)
}

// traffic sends GETs through Caddy from conc goroutines until stop is closed, and counts the
// answers by worker and the failures.
type traffic struct {
	stop   chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	counts map[string]int
	failed []string
	client *http.Client
	once   sync.Once
}

func startTraffic(conc int, pause time.Duration) *traffic {
	tr := &traffic{stop: make(chan struct{}), counts: make(map[string]int),
		client: &http.Client{Timeout: 10 * time.Second}}
	for range conc {
		tr.wg.Go(func() {
			for {
				select {
				case <-tr.stop:
					return
				default:
				}
				resp, err := tr.client.Get(proxyURL)
				tr.mu.Lock()
				switch {
				case err != nil:
					tr.failed = append(tr.failed, err.Error())
				case resp.StatusCode != http.StatusOK:
					tr.failed = append(tr.failed, resp.Status)
				default:
					tr.counts[resp.Header.Get("X-Worker")]++
				}
				tr.mu.Unlock()
				if resp != nil {
					resp.Body.Close()
				}
				if pause > 0 {
					time.Sleep(pause) // pacing the load, not synchronisation
				}
			}
		})
	}
	return tr
}

func (tr *traffic) end() (map[string]int, []string) {
	tr.once.Do(func() {
		close(tr.stop)
		tr.wg.Wait()
		tr.client.CloseIdleConnections()
	})
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.counts, tr.failed
}

func (tr *traffic) served(name string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.counts[name]
}

// waitGone waits until the admin view no longer holds the address.
func waitGone(t *testing.T, within time.Duration, addr string) {
	t.Helper()
	eventually(t, within, func() bool { _, ok := workers(t)[addr]; return !ok }, "%s to leave the admin view", addr)
}

// A `dynamic a` pool follows DNS: a new address is polled at once and routed to by load; one gone
// from DNS stops being polled after forget_after and leaves the admin view and the metrics; one that
// comes back is polled again.
func TestDynamicAFollowsDNS(t *testing.T) {
	d := newDNSServer(t)
	ws, port := loopbackWorkers(t, "127.0.0.2", "127.0.0.3", "127.0.0.4")
	w2, w3, w4 := ws[0], ws[1], ws[2]
	w2.setLoad(0.9, 20)
	w3.setLoad(0.5, 5)
	w4.setLoad(0.05, 0)
	name := uniqueName("a")
	d.setA(name, "127.0.0.2", "127.0.0.3")

	const interval = 300 * time.Millisecond
	tester := caddytest.NewTester(t)
	tester.InitServer(dynamicCaddyfile("interval 300ms\n\t\tforget_after 1s", aSource(name, port, d.addr), "choose least"), "caddyfile")
	tr := startTraffic(2, 5*time.Millisecond)
	defer tr.end()
	waitWorkers(t, 5*time.Second, "both DNS addresses polled", polledOK, w2, w3)
	eventually(t, 5*time.Second, func() bool { return tr.served("127.0.0.3") > 20 }, "requests on the less loaded address")

	// A new, idle address: polled at once (well within the 10 intervals a slow start would take) and
	// then given the traffic.
	d.setA(name, "127.0.0.2", "127.0.0.3", "127.0.0.4")
	appeared := time.Now()
	waitWorkers(t, 5*time.Second, "the new address polled", polledOK, w4)
	if took := time.Since(appeared); took > 2*time.Second {
		t.Errorf("new address first polled %s after it appeared in DNS", took)
	}
	eventually(t, 5*time.Second, func() bool { return tr.served("127.0.0.4") > 20 }, "requests on the new idle address")

	// 127.0.0.2 leaves DNS: forgotten within forget_after plus a sweep, a DNS refresh and a marking pass.
	d.setA(name, "127.0.0.3", "127.0.0.4")
	left := time.Now()
	gone := w2.addr()
	waitGone(t, 5*time.Second, gone)
	if took := time.Since(left); took < time.Second {
		t.Errorf("%s forgotten %s after it left DNS, before forget_after (1s)", gone, took)
	}
	// Its series go with it from the view, an instant after.
	eventually(t, 5*time.Second, func() bool { return !strings.Contains(scrape(t), fmt.Sprintf("endpoint=%q", "http://"+gone)) },
		"the metrics to drop the series of the forgotten %s", gone)
	polls := w2.loadPolls.Load()
	// Five intervals past forget_after: the wait is a clock, not a condition, so its deadline is loose.
	eventually(t, 10*time.Second, func() bool { return time.Since(left) > 5*interval+time.Second }, "time to pass")
	if n := w2.loadPolls.Load() - polls; n > 1 { // one poll may have been in flight
		t.Errorf("forgotten address polled %d more times", n)
	}

	// It comes back: polled again at once.
	d.setA(name, "127.0.0.2", "127.0.0.3", "127.0.0.4")
	waitPolls(t, 1, w2)
	waitWorkers(t, 5*time.Second, "the returned address polled", polledOK, w2)
	if _, failed := tr.end(); len(failed) > 0 {
		t.Errorf("%d requests failed: %v", len(failed), failed[:min(5, len(failed))])
	}
}

// Without traffic the policy sees no pools, and keeps polling what it last saw.
func TestDynamicIdleProxyKeepsPolling(t *testing.T) {
	d := newDNSServer(t)
	ws, port := loopbackWorkers(t, "127.0.0.5", "127.0.0.6")
	name := uniqueName("idle")
	d.setA(name, "127.0.0.5", "127.0.0.6")
	tester := caddytest.NewTester(t)
	tester.InitServer(dynamicCaddyfile("interval 100ms\n\t\tforget_after 300ms", aSource(name, port, d.addr), ""), "caddyfile")
	sendRequests(t, proxyURL, 5)
	waitWorkers(t, 5*time.Second, "both polled", polledOK, ws...)
	waitPolls(t, 15, ws...) // 1.5s without traffic: five times forget_after
	if v := workers(t); len(v) != 2 {
		t.Errorf("admin view after idle time: %d workers, want 2", len(v))
	}
}

// Select over a dynamic pool (a new slice per request, as dynamic sources give) marks its upstreams
// seen without allocating.
func TestSelectOnDynamicPoolAllocatesNothing(t *testing.T) {
	pool := caddymodule.UpstreamsForTest(64)
	p := &caddymodule.Policy{}
	if err := caddymodule.ProvisionWithReports(p, pool, benchReport); err != nil {
		t.Fatal(err)
	}
	dynamic := slices.Clone(pool) // not the indexed slice: endpoints found by dial address
	req := httptest.NewRequest("GET", "/", nil)
	if allocs := testing.AllocsPerRun(1000, func() { p.Select(dynamic, req, nil) }); allocs != 0 {
		t.Errorf("Select on a dynamic pool: %v allocations, want 0", allocs)
	}
}

// `dynamic multi` joins two A sources: every address of both is monitored, the least loaded of all
// takes the traffic, and an address leaving one source is forgotten.
func TestDynamicMultiJoinsSources(t *testing.T) {
	d := newDNSServer(t)
	ws, port := loopbackWorkers(t, "127.0.0.7", "127.0.0.8", "127.0.0.9")
	ws[0].setLoad(0.8, 10)
	ws[1].setLoad(0.6, 4)
	ws[2].setLoad(0.1, 0)
	aName, bName := uniqueName("multia"), uniqueName("multib")
	d.setA(aName, "127.0.0.7", "127.0.0.8")
	d.setA(bName, "127.0.0.9")
	source := "dynamic multi {\n\t\t\t" + aBlock(aName, port, d.addr, 50*time.Millisecond) + "\n\t\t\t" +
		aBlock(bName, port, d.addr, 50*time.Millisecond) + "\n\t\t}"
	tester := caddytest.NewTester(t)
	tester.InitServer(dynamicCaddyfile("interval 200ms\n\t\tforget_after 500ms", source, "choose least"), "caddyfile")
	tr := startTraffic(2, 5*time.Millisecond)
	defer tr.end()
	waitWorkers(t, 5*time.Second, "the addresses of both sources polled", polledOK, ws...)
	eventually(t, 5*time.Second, func() bool { return tr.served("127.0.0.9") > 20 }, "requests on the second source's idle worker")

	d.setA(aName, "127.0.0.8")
	waitGone(t, 5*time.Second, ws[0].addr())
	if v := workers(t); len(v) != 2 {
		t.Errorf("admin view: %d workers, want the 2 left in DNS", len(v))
	}
	if _, failed := tr.end(); len(failed) > 0 {
		t.Errorf("%d requests failed: %v", len(failed), failed[:min(5, len(failed))])
	}
}
