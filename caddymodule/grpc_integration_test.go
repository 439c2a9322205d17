package caddymodule_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// simWorker is a simulated SGLang worker serving SglangScheduler on its own gRPC port and its HTTP
// routes on another. Its version string is its name, so a GetLoads answer proxied through Caddy names
// the worker that served it.
type simWorker struct {
	name    string
	sim     *sglangsim.Worker
	grpc    string // host:port of the gRPC server
	http    string // base URL of the HTTP routes
	polls   atomic.Int64
	proxied atomic.Int64
	conns   atomic.Int64 // gRPC connections open right now
}

// newSimWorker starts a simulated worker whose requests never finish decoding, so that a load put on
// it stays until the test ends. tlsCert, when set, makes its gRPC port serve TLS.
func newSimWorker(t *testing.T, name string, tlsCert *tls.Certificate) *simWorker {
	t.Helper()
	w := &simWorker{name: name, sim: sglangsim.New(sglangsim.Config{
		Name: name, Version: name, MaxTotalTokens: 1000, PrefillTokensPerSec: 1e7, DecodeTokensPerSec: 0.001,
	})}
	opts := []grpc.ServerOption{grpc.UnaryInterceptor(w.count), grpc.StatsHandler(connCounter{&w.conns})}
	if tlsCert != nil {
		opts = append(opts, grpc.Creds(credentials.NewServerTLSFromCert(tlsCert)))
	}
	gs := grpc.NewServer(opts...)
	w.sim.RegisterGRPC(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	w.grpc = lis.Addr().String()
	go func() { _ = gs.Serve(lis) }()
	hs := httptest.NewServer(w.sim.Handler())
	w.http = hs.URL
	t.Cleanup(func() {
		w.sim.Close() // fails the never-ending requests, so that the servers can stop
		hs.Close()
		gs.Stop()
	})
	return w
}

// count tells the load monitor's polls from calls proxied through Caddy, which add X-Forwarded-For.
func (w *simWorker) count(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if len(md.Get("x-forwarded-for")) > 0 {
		w.proxied.Add(1)
	} else {
		w.polls.Add(1)
	}
	return h(ctx, req)
}

// load puts running requests on the worker through its HTTP generate route: each holds 400 of the 1000
// KV tokens until the worker closes.
func (w *simWorker) load(t *testing.T, running int) {
	t.Helper()
	for range running {
		go func() {
			body := `{"text":"x","prompt_tokens":300,"sampling_params":{"max_new_tokens":100}}`
			resp, err := http.Post(w.http+"/generate", "application/json", strings.NewReader(body))
			if err == nil {
				resp.Body.Close()
			}
		}()
	}
	eventually(t, 10*time.Second, func() bool { return w.sim.Loads()[0].Running == running },
		"%s running %d requests", w.name, running)
}

// waitGRPCPolls waits until every worker has answered at least n more load polls.
func waitGRPCPolls(t *testing.T, n int64, workers ...*simWorker) {
	t.Helper()
	start := make([]int64, len(workers))
	for i, w := range workers {
		start[i] = w.polls.Load()
	}
	eventually(t, 10*time.Second, func() bool {
		for i, w := range workers {
			if w.polls.Load()-start[i] < n {
				return false
			}
		}
		return true
	}, "workers polled over gRPC %d times", n)
}

// connCounter counts a gRPC server's open connections.
type connCounter struct{ open *atomic.Int64 }

func (connCounter) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (connCounter) HandleRPC(context.Context, stats.RPCStats)                         {}
func (connCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (c connCounter) HandleConn(_ context.Context, s stats.ConnStats) {
	switch s.(type) {
	case *stats.ConnBegin:
		c.open.Add(1)
	case *stats.ConnEnd:
		c.open.Add(-1)
	}
}

// grpcCaddyfile is a config whose site accepts gRPC over h2c and serves routes, a sequence of
// Caddyfile directives.
func grpcCaddyfile(global, routes string) string {
	return fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	servers {
		protocols h1 h2c
	}
	sglang_load {
		%s
	}
}
http://127.0.0.1:9080 {
	%s
}
`, global, routes)
}

// grpcProxy is a reverse_proxy to the workers' gRPC ports over h2c, routing by loads polled over gRPC.
func grpcProxy(policy string, workers ...*simWorker) string {
	addrs := make([]string, len(workers))
	for i, w := range workers {
		addrs[i] = w.grpc
	}
	return fmt.Sprintf(`reverse_proxy %s {
		transport http {
			versions h2c
		}
		lb_policy sglang_load {
			load_transport grpc
			%s
		}
	}`, strings.Join(addrs, " "), policy)
}

// callThroughCaddy makes n GetLoads calls through Caddy and counts the answers by the worker that gave
// them; any failed call fails the test.
func callThroughCaddy(t *testing.T, n int) map[string]int {
	t.Helper()
	conn, err := grpc.NewClient("127.0.0.1:9080", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := schedulerpb.NewSglangSchedulerClient(conn)
	counts := make(map[string]int)
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := client.GetLoads(ctx, &schedulerpb.GetLoadsRequest{Include: []string{"core"}})
		cancel()
		if err != nil {
			t.Fatalf("call %d through Caddy: %v", i, err)
		}
		counts[resp.GetVersion()]++
	}
	return counts
}

// Routing on the load signals that gRPC polls bring follows the load as it moves. The signals: these
// workers decode at a thousandth of a token a second, which their reports' gen_throughput rounds to 0
// or 2, so the cost metric, which prices by the speeds measured, may find the worker that was busy the
// slower one after the move, and rightly by what it was told.
func TestGRPCWorkersRoutedByGRPCLoads(t *testing.T) {
	busy, idle := newSimWorker(t, "busy", nil), newSimWorker(t, "idle", nil)
	busy.load(t, 2)
	tester := caddytest.NewTester(t)
	tester.InitServer(grpcCaddyfile("interval 100ms", grpcProxy("metric auto\n\t\t\tchoose least", busy, idle)), "caddyfile")
	waitGRPCPolls(t, 2, busy, idle)

	counts := callThroughCaddy(t, 100)
	t.Logf("proxied gRPC calls by worker: %v", counts)
	if counts["idle"] < 90 {
		t.Errorf("less loaded worker answered %d of 100 proxied gRPC calls, want >= 90: %v", counts["idle"], counts)
	}
	if got := busy.proxied.Load() + idle.proxied.Load(); got != 100 {
		t.Errorf("workers saw %d proxied calls, want 100", got)
	}

	// The load moves (closing the busy worker ends its requests): routing follows it.
	idle.load(t, 2)
	busy.sim.Close()
	waitGRPCPolls(t, 2, busy, idle)
	c := callThroughCaddy(t, 50)
	t.Logf("after the load moved: %v", c)
	if c["busy"] < 45 {
		t.Errorf("after the load moved, the now idle worker answered %d of 50: %v", c["busy"], c)
	}
}

func TestGRPCLoadsOverTLS(t *testing.T) {
	cert := selfSignedCert(t)
	busy, idle := newSimWorker(t, "busy", &cert), newSimWorker(t, "idle", &cert)
	busy.load(t, 1)
	// The proxy's transport uses TLS, so the load polls do too; the self-signed certificate is accepted
	// only because both opt out of verification.
	tester := caddytest.NewTester(t)
	tester.InitServer(grpcCaddyfile("interval 100ms", fmt.Sprintf(`reverse_proxy %s %s {
		transport http {
			tls
			tls_insecure_skip_verify
		}
		lb_policy sglang_load {
			load_transport grpc
			load_tls_insecure_skip_verify
			choose least
		}
	}`, busy.grpc, idle.grpc)), "caddyfile")
	waitGRPCPolls(t, 2, busy, idle)

	counts := callThroughCaddy(t, 50)
	if counts["idle"] < 45 {
		t.Errorf("less loaded TLS worker answered %d of 50: %v", counts["idle"], counts)
	}
}

func TestMixedFleetHTTPAndGRPCGroups(t *testing.T) {
	grpcBusy, grpcIdle := newSimWorker(t, "grpc-busy", nil), newSimWorker(t, "grpc-idle", nil)
	grpcBusy.load(t, 2)
	httpBusy, httpIdle := newTestWorker(t, "http-busy", 0.9, 20), newTestWorker(t, "http-idle", 0.1, 0)

	tester := caddytest.NewTester(t)
	tester.InitServer(grpcCaddyfile("interval 100ms", fmt.Sprintf(`handle /sglang.grpc.scheduler.SglangScheduler/* {
		%s
	}
	handle {
		reverse_proxy %s %s {
			lb_policy sglang_load {
				choose least
			}
		}
	}`, grpcProxy("choose least", grpcBusy, grpcIdle), httpBusy.addr(), httpIdle.addr())), "caddyfile")
	waitGRPCPolls(t, 2, grpcBusy, grpcIdle)
	waitPolls(t, 2, httpBusy, httpIdle)

	if c := callThroughCaddy(t, 50); c["grpc-idle"] < 45 {
		t.Errorf("gRPC group: less loaded worker answered %d of 50: %v", c["grpc-idle"], c)
	}
	if c := sendRequests(t, proxyURL, 50); c["http-idle"] < 45 {
		t.Errorf("HTTP group: less loaded worker got %d of 50: %v", c["http-idle"], c)
	}
	if grpcBusy.proxied.Load()+grpcIdle.proxied.Load() != 50 || httpBusy.served.Load()+httpIdle.served.Load() != 50 {
		t.Errorf("requests crossed groups: gRPC workers saw %d, HTTP workers %d; want 50 each",
			grpcBusy.proxied.Load()+grpcIdle.proxied.Load(), httpBusy.served.Load()+httpIdle.served.Load())
	}
}

// Every reload opens the new config's connection and closes the old one; a worker dropped from the
// config, and every worker once the app is gone, has no connection left.
func TestGRPCConnectionsClosedAcrossReloads(t *testing.T) {
	a, b := newSimWorker(t, "a", nil), newSimWorker(t, "b", nil)
	tester := caddytest.NewTester(t)
	load := func(interval time.Duration, workers ...*simWorker) {
		t.Helper()
		// A different interval each time, so that Caddy does not skip the reload as unchanged.
		tester.InitServer(grpcCaddyfile(fmt.Sprintf("interval %s", interval), grpcProxy("", workers...)), "caddyfile")
		waitGRPCPolls(t, 2, workers...)
	}
	openConns := func(w *simWorker, want int64) {
		t.Helper()
		eventually(t, 10*time.Second, func() bool { return w.conns.Load() == want },
			"%s to have %d open gRPC connections (has %d)", w.name, want, w.conns.Load())
	}

	load(100*time.Millisecond, a, b)
	openConns(a, 1)
	openConns(b, 1)
	settle := func() int {
		runtime.GC()
		return runtime.NumGoroutine()
	}
	base := settle()

	const reloads = 6
	for i := range reloads {
		load(time.Duration(101+i)*time.Millisecond, a, b)
		openConns(a, 1)
		openConns(b, 1)
	}
	// A leaked connection would keep its goroutines (reader, keepalive, balancer): at least two per
	// worker per reload.
	eventually(t, 10*time.Second, func() bool { return settle() < base+reloads },
		"goroutines back near %d after %d reloads (now %d)", base, reloads, runtime.NumGoroutine())
	t.Logf("goroutines: %d after the first config, %d after %d reloads", base, runtime.NumGoroutine(), reloads)

	load(110*time.Millisecond, a)
	openConns(b, 0)
	openConns(a, 1)

	// A config without the policy: the sglang_load app is stopped and cleaned up.
	tester.InitServer(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
}
http://127.0.0.1:9080 {
	respond "no workers"
}
`, "caddyfile")
	tester.AssertGetResponse(proxyURL, http.StatusOK, "no workers")
	openConns(a, 0)
	openConns(b, 0)
}

// selfSignedCert is a certificate for 127.0.0.1 that no client trusts: httptest's own.
func selfSignedCert(t *testing.T) tls.Certificate {
	t.Helper()
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	defer srv.Close()
	return srv.TLS.Certificates[0]
}
