package caddymodule_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// canary is a server that no config names: any request it gets is counted, load polls apart.
type canary struct {
	srv         *httptest.Server
	requests    atomic.Int64
	loadQueries atomic.Int64 // requests for /v1/loads or /get_load
	conns       atomic.Int64
}

func newCanary(t *testing.T) *canary {
	t.Helper()
	c := &canary{}
	c.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		c.requests.Add(1)
		if strings.HasSuffix(r.URL.Path, "/v1/loads") || strings.HasSuffix(r.URL.Path, "/get_load") {
			c.loadQueries.Add(1)
		}
		rw.Header().Set("X-Worker", "canary")
		io.WriteString(rw, loadsBody(`{"dp_rank":0,"num_running_reqs":0,"num_waiting_reqs":0,"token_usage":0}`))
	}))
	c.srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			c.conns.Add(1)
		}
	}
	c.srv.Start()
	t.Cleanup(c.srv.Close)
	return c
}

func (c *canary) addr() string { return strings.TrimPrefix(c.srv.URL, "http://") }

// Only the configured upstreams are polled: no address is taken from a request (Host, forwarding
// headers, query, an admin call) or from a worker's answer (fields naming another address, redirects).
func TestOnlyConfiguredAddressesArePolled(t *testing.T) {
	can := newCanary(t)
	canURL := can.srv.URL
	liar := newFaultWorker(t, "liar", answer(`{"version":"`+canURL+`","url":"`+canURL+`/v1/loads","host":"`+can.addr()+
		`","dp_rank_count":1,"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":0,"token_usage":0.2,"address":"`+can.addr()+`"}]}`))
	redirector := newFaultWorker(t, "redirector", func(_ *testWorker, rw http.ResponseWriter, r *http.Request) {
		http.Redirect(rw, r, canURL+r.URL.Path, http.StatusFound)
	})
	legacyRedirector := newFaultWorker(t, "legacy-redirector", func(_ *testWorker, rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/loads" {
			http.NotFound(rw, r)
			return
		}
		http.Redirect(rw, r, canURL+"/get_load", http.StatusTemporaryRedirect)
	})
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	sglang_load {
		interval 100ms
	}
}
http://127.0.0.1:9080 {
	handle /dyn/* {
		reverse_proxy {http.request.header.X-Backend} {
			lb_policy sglang_load
		}
	}
	handle {
		reverse_proxy %s %s %s {
			lb_policy sglang_load
		}
	}
}
`, liar.addr(), redirector.addr(), legacyRedirector.addr()), "caddyfile")
	waitPolls(t, 2, liar, redirector, legacyRedirector)

	// Requests that name the canary every way a client can.
	client := &http.Client{Timeout: 10 * time.Second}
	for i := range 20 {
		req, _ := http.NewRequest(http.MethodGet, proxyURL+"?upstream="+canURL+"&host="+can.addr(), nil)
		req.Host = can.addr()
		req.Header.Set("X-Forwarded-For", "127.0.0.1")
		req.Header.Set("X-Forwarded-Host", can.addr())
		req.Header.Set("X-Real-IP", "127.0.0.1")
		req.Header.Set("Forwarded", "for=127.0.0.1;host="+can.addr())
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Worker") == "canary" {
			t.Fatalf("request %d: status %d from %q", i, resp.StatusCode, resp.Header.Get("X-Worker"))
		}
	}
	// An upstream taken from a request header by the config: the canary is proxied to, as configured,
	// but a dial address that is a placeholder is never polled.
	for i := range 5 {
		req, _ := http.NewRequest(http.MethodGet, proxyURL+"dyn/x", nil)
		req.Header.Set("X-Backend", can.addr())
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("dynamic request %d: %v", i, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	// The admin API takes no address either.
	for _, path := range []string{"/sglang_load/refresh?address=" + can.addr(), "/sglang_load/refresh"} {
		req, _ := http.NewRequest(http.MethodPost, adminURL+path, strings.NewReader(`{"address":"`+can.addr()+`","upstreams":["`+can.addr()+`"]}`))
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if code, _ := adminDo(t, http.MethodGet, "/sglang_load/workers/"+can.addr()); code != http.StatusNotFound {
		t.Errorf("GET /sglang_load/workers/<canary>: status %d, want 404", code)
	}
	waitPolls(t, 3, liar, redirector, legacyRedirector)

	if n := can.loadQueries.Load(); n != 0 {
		t.Errorf("the canary was asked for its load %d times", n)
	}
	if n, dyn := can.requests.Load(), int64(5); n != dyn {
		t.Errorf("the canary got %d requests, want only the %d proxied to it by the dynamic upstream", n, dyn)
	}
	view := workers(t)
	if len(view) != 3 {
		t.Errorf("admin view lists %d endpoints, want the 3 configured: %v", len(view), view)
	}
	if v := view[liar.addr()]; v.State != "fresh" {
		t.Errorf("worker naming the canary: state %q, want fresh (the extra fields are ignored)", v.State)
	}
	for _, w := range []*testWorker{redirector, legacyRedirector} {
		if v := view[w.addr()]; v.State != "missing" || v.LastErrorResult != "http_status" {
			t.Errorf("%s: state %q, error %q (%s); want missing with the redirect status as the error", w.name, v.State, v.LastError, v.LastErrorResult)
		}
	}
}

// The API key never shows: not in the config API (a placeholder stays one), the admin view, the
// metrics, the logs, nor a load error, even when a worker echoes it back over HTTP or gRPC.
func TestAPIKeyRedactedEverywhere(t *testing.T) {
	const secret = "sk-redact-0f1e2d3c4b5a6978"
	t.Setenv("SGLANG_TEST_API_KEY", secret)
	var echoedHTTP, echoedGRPC atomic.Int64
	httpEcho := newFaultWorker(t, "http-echo", func(_ *testWorker, rw http.ResponseWriter, r *http.Request) {
		echoedHTTP.Add(1)
		rw.Header().Set("WWW-Authenticate", "Bearer error="+r.Header.Get("Authorization"))
		http.Error(rw, "bad key "+r.Header.Get("Authorization"), http.StatusUnauthorized)
	})
	grpcEcho := newGRPCFaultWorker(t, "grpc-echo", func(ctx context.Context, _ *grpcFaultWorker) (*schedulerpb.GetLoadsResponse, error) {
		echoedGRPC.Add(1)
		md, _ := metadata.FromIncomingContext(ctx)
		return nil, status.Errorf(codes.Unauthenticated, "bad key %v", md.Get("authorization"))
	})
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	tester := caddytest.NewTester(t)
	tester.InitServer(fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	log {
		output file %s
		level DEBUG
	}
	servers {
		protocols h1 h2c
	}
	sglang_load {
		interval 100ms
	}
}
http://127.0.0.1:9080 {
	handle /sglang.grpc.scheduler.SglangScheduler/* {
		reverse_proxy %s {
			transport http {
				versions h2c
			}
			lb_policy sglang_load {
				load_transport grpc
				api_key {env.SGLANG_TEST_API_KEY}
			}
		}
	}
	handle {
		reverse_proxy %s {
			lb_policy sglang_load {
				api_key {env.SGLANG_TEST_API_KEY}
			}
		}
	}
}
`, logFile, grpcEcho.addr, httpEcho.addr()), "caddyfile")
	eventually(t, 10*time.Second, func() bool { return echoedHTTP.Load() >= 3 && echoedGRPC.Load() >= 3 }, "polls echoed the key")

	var shown bytes.Buffer
	for _, path := range []string{"/config/", "/sglang_load/workers", "/metrics"} {
		_, body := adminDo(t, http.MethodGet, path)
		shown.Write(body)
	}
	_, body := adminDo(t, http.MethodPost, "/sglang_load/refresh")
	shown.Write(body)
	if !strings.Contains(shown.String(), "{env.SGLANG_TEST_API_KEY}") || !strings.Contains(shown.String(), "Unauthenticated") {
		t.Errorf("admin output lacks the placeholder or the gRPC error: %s", shown.String())
	}
	if strings.Contains(shown.String(), secret) {
		t.Errorf("the API key appears in the admin output:\n%s", shown.String())
	}
	// Provisioning errors do not carry the key either: a key that cannot be sent in a header.
	resp, err := http.Post(adminURL+"/load", "application/json", strings.NewReader(`{"apps":{"http":{"servers":{"s":{"listen":[":9080"],`+
		`"routes":[{"handle":[{"handler":"reverse_proxy","load_balancing":{"selection_policy":{"policy":"sglang_load","api_key":"`+
		secret+`\r\nX-Injected: 1"}},"upstreams":[{"dial":"127.0.0.1:1"}]}]}]}}}},"admin":{"listen":"localhost:2999"}}`))
	if err != nil {
		t.Fatal(err)
	}
	loadErr, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK || !strings.Contains(string(loadErr), "api key") || strings.Contains(string(loadErr), secret) {
		t.Errorf("loading a config with a bad key: status %d: %s; want an error naming the api key, without it", resp.StatusCode, loadErr)
	}

	logs, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), `"msg":"poll"`) || !strings.Contains(string(logs), "Unauthenticated") {
		t.Errorf("the captured log lacks the poll lines")
	}
	for _, line := range strings.Split(string(logs), "\n") {
		if strings.Contains(line, secret) {
			t.Errorf("the API key appears in a log line: %s", line)
		}
	}
}

// A TLS load endpoint is verified unless the config opts out for it: skipping verification for the
// proxied traffic does not skip it for the load polls.
func TestLoadTLSVerifiedByDefault(t *testing.T) {
	var polls atomic.Int64
	tlsWorker := httptest.NewTLSServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/loads" {
			polls.Add(1)
			io.WriteString(rw, loadsBody(`{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":0,"token_usage":0.2}`))
			return
		}
		rw.Header().Set("X-Worker", "tls")
		io.WriteString(rw, "tls")
	}))
	t.Cleanup(tlsWorker.Close)
	addr := strings.TrimPrefix(tlsWorker.URL, "https://")
	config := func(policy string) string {
		return fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	sglang_load {
		interval 200ms
		timeout 5s
	}
}
http://127.0.0.1:9080 {
	reverse_proxy https://%s {
		transport http {
			tls_insecure_skip_verify
		}
		lb_policy sglang_load {
			%s
		}
	}
}
`, addr, policy)
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(config(""), "caddyfile")
	v := waitAddrs(t, 10*time.Second, "polls refused", func(w worker) bool { return w.PollsFailed >= 2 }, addr)[addr]
	if v.State != "missing" || !strings.Contains(v.LastError, "certificate") || polls.Load() != 0 {
		t.Errorf("self-signed load endpoint: state %q, error %q, %d polls answered; want every poll refused on the certificate",
			v.State, v.LastError, polls.Load())
	}
	tester.AssertGetResponse(proxyURL, http.StatusOK, "tls") // the proxied traffic's own opt-out stands

	tester.InitServer(config("load_tls_insecure_skip_verify"), "caddyfile")
	v = waitAddrs(t, 10*time.Second, "polls answered", func(w worker) bool { return polledOK(w) && w.LastError == "" }, addr)[addr]
	if polls.Load() == 0 {
		t.Errorf("with load_tls_insecure_skip_verify: error %q, %d polls", v.LastError, polls.Load())
	}
}

// The admin routes change nothing but by POST /sglang_load/refresh, which only polls.
func TestAdminRoutesReadOnlyButRefresh(t *testing.T) {
	busy, idle := newTestWorker(t, "busy", 0.9, 20), newTestWorker(t, "idle", 0.1, 0)
	tester := caddytest.NewTester(t)
	// Polled once at start, then not for an hour: any other poll was caused by an admin call.
	tester.InitServer(caddyfile("interval 1h", "", busy, idle), "caddyfile")
	before := waitWorkers(t, 10*time.Second, "polled once", polledOK, busy, idle)
	polls := func() int64 { return busy.loadPolls.Load() + idle.loadPolls.Load() }
	start := polls()

	for _, c := range []struct {
		method, path string
		want         int
	}{
		{http.MethodPost, "/sglang_load/workers", http.StatusMethodNotAllowed},
		{http.MethodPut, "/sglang_load/workers", http.StatusMethodNotAllowed},
		{http.MethodPatch, "/sglang_load/workers", http.StatusMethodNotAllowed},
		{http.MethodDelete, "/sglang_load/workers", http.StatusMethodNotAllowed},
		{http.MethodPost, "/sglang_load/workers/" + idle.addr(), http.StatusMethodNotAllowed},
		{http.MethodPatch, "/sglang_load/workers/" + idle.addr(), http.StatusMethodNotAllowed},
		{http.MethodDelete, "/sglang_load/workers/" + idle.addr(), http.StatusMethodNotAllowed},
		{http.MethodGet, "/sglang_load/refresh", http.StatusMethodNotAllowed},
		{http.MethodPut, "/sglang_load/refresh", http.StatusMethodNotAllowed},
		{http.MethodDelete, "/sglang_load/refresh", http.StatusMethodNotAllowed},
		{http.MethodPost, "/sglang_load/", http.StatusNotFound},
		{http.MethodPost, "/sglang_load/config", http.StatusNotFound},
		{http.MethodDelete, "/sglang_load/workers/" + idle.addr() + "/report", http.StatusMethodNotAllowed},
	} {
		req, _ := http.NewRequest(c.method, adminURL+c.path, strings.NewReader(`{"interval":"1ms","upstreams":[]}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("%s %s: status %d, want %d", c.method, c.path, resp.StatusCode, c.want)
		}
	}
	after := workers(t)
	if polls() != start || len(after) != len(before) {
		t.Errorf("admin calls other than refresh polled %d times or changed the workers (%d -> %d)", polls()-start, len(before), len(after))
	}
	for addr, v := range after {
		if b := before[addr]; v.Interval != b.Interval || v.PollsOK != b.PollsOK || v.Endpoint != b.Endpoint {
			t.Errorf("%s changed: %+v -> %+v", addr, b, v)
		}
	}
	if code, _ := adminDo(t, http.MethodPost, "/sglang_load/refresh"); code != http.StatusOK || polls() != start+2 {
		t.Errorf("refresh: status %d, %d polls, want 200 and one poll per worker", code, polls()-start)
	}
}
