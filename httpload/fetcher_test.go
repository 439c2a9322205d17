package httpload

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"

	"github.com/caddy-sglang/caddy-sglang/internal/testports"
)

const testKey = "sk-test-secret-7f3c9a1e"

// checkNoKey fails if err shows the API key.
func checkNoKey(t *testing.T, err error) {
	t.Helper()
	if err != nil && strings.Contains(err.Error(), testKey) {
		t.Fatalf("error shows the api key: %v", err)
	}
}

// worker is a test SGLang worker on 127.0.0.1:0.
func worker(t *testing.T, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)
	return ts
}

func newFetcher(t *testing.T, cfg Config) *Fetcher {
	t.Helper()
	f, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

type reportResult struct {
	rep *loadpolicy.Report
	err error
}

// fetch polls f once under a deadline of timeout and checks that no error shows the key.
func fetch(t *testing.T, f *Fetcher, timeout time.Duration) (*reportResult, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start := time.Now()
	rep, err := f.Fetch(ctx)
	checkNoKey(t, err)
	return &reportResult{rep: rep, err: err}, time.Since(start)
}

func TestNew(t *testing.T) {
	good := []struct{ base, want string }{
		{"http://127.0.0.1:30000", "http://127.0.0.1:30000/v1/loads?include=core"},
		{"http://127.0.0.1:30000/", "http://127.0.0.1:30000/v1/loads?include=core"},
		{"https://worker.internal/sglang/", "https://worker.internal/sglang/v1/loads?include=core"},
		{"http://[::1]:30000", "http://[::1]:30000/v1/loads?include=core"},
	}
	for _, tt := range good {
		f, err := New(Config{URL: tt.base})
		if err != nil {
			t.Errorf("%s: %v", tt.base, err)
			continue
		}
		if f.URL() != tt.want {
			t.Errorf("%s: URL %q, want %q", tt.base, f.URL(), tt.want)
		}
		if f.maxBody != DefaultMaxBody {
			t.Errorf("%s: max body %d", tt.base, f.maxBody)
		}
		_ = f.Close()
	}

	bad := []struct {
		cfg  Config
		want string
	}{
		{Config{URL: ""}, `""`},
		{Config{URL: "127.0.0.1:30000"}, `"127.0.0.1:30000"`},
		{Config{URL: "ftp://127.0.0.1:30000"}, "scheme must be http or https"},
		{Config{URL: "http://"}, "no host"},
		{Config{URL: "http://:30000"}, "no host"},
		{Config{URL: "http://127.0.0.1:30000?x=1"}, "no query"},
		{Config{URL: "http://127.0.0.1:30000#frag"}, "no query"},
		{Config{URL: "http://admin:" + testKey + "@127.0.0.1:30000"}, "credentials"},
		{Config{URL: "http://admin:" + testKey + "@127.0.0.1:port/"}, `"http://xxxxx@127.0.0.1:port/"`},
		{Config{URL: "http://127.0.0.1:30000", APIKey: testKey + "\r\nX-Evil: 1"}, "api key"},
		{Config{URL: "http://127.0.0.1:30000", MaxBody: -1}, "max body -1"},
	}
	for _, tt := range bad {
		_, err := New(tt.cfg)
		if err == nil {
			t.Errorf("%q: no error", tt.cfg.URL)
			continue
		}
		checkNoKey(t, err)
		if !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %q does not contain %q", tt.cfg.URL, err, tt.want)
		}
	}
}

// The default client dials the worker itself, whatever HTTP_PROXY says: a proxy that is listening
// would see no request.
func TestDefaultClientHasNoProxy(t *testing.T) {
	var proxied atomic.Int32
	proxy := worker(t, func(w http.ResponseWriter, r *http.Request) { proxied.Add(1) })
	t.Setenv("HTTP_PROXY", proxy.URL)
	t.Setenv("http_proxy", proxy.URL)
	ts := worker(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, `{"loads":[]}`) })
	f := newFetcher(t, Config{URL: ts.URL})
	if res, _ := fetch(t, f, 5*time.Second); res.err != nil || proxied.Load() != 0 {
		t.Fatalf("fetch %v, %d requests through the proxy", res.err, proxied.Load())
	}
}

// Polls reuse one kept-alive connection, also across a chunked answer and a short error body.
func TestFetchKeepsConnectionAlive(t *testing.T) {
	var n atomic.Int32
	ts := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch n.Add(1) % 3 {
		case 0:
			http.Error(w, "busy", http.StatusServiceUnavailable)
		case 1:
			w.Header().Set("Content-Length", "12")
			_, _ = io.WriteString(w, `{"loads":[]}`)
		default: // flushed before the end: chunked
			_, _ = io.WriteString(w, `{"loads":[`)
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, `]}`)
		}
	}))
	var conns atomic.Int32
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	ts.Start()
	t.Cleanup(ts.Close)
	f := newFetcher(t, Config{URL: ts.URL})
	for i := range 9 {
		res, _ := fetch(t, f, 5*time.Second)
		var se *StatusError
		if (i+1)%3 == 0 {
			if !errors.As(res.err, &se) || se.Code != http.StatusServiceUnavailable {
				t.Fatalf("poll %d: %v, want status 503", i, res.err)
			}
		} else if res.err != nil || !res.rep.Empty() {
			t.Fatalf("poll %d: %+v, %v", i, res.rep, res.err)
		}
	}
	if c := conns.Load(); c != 1 {
		t.Errorf("9 polls opened %d connections, want 1", c)
	}
}

func TestFetchRequest(t *testing.T) {
	body := readFixture(t, "loads_current.json")
	for _, key := range []string{testKey, ""} {
		var (
			mu  sync.Mutex
			got *http.Request
		)
		ts := worker(t, func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			got = r.Clone(context.Background())
			mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(body)
		})
		f := newFetcher(t, Config{URL: ts.URL, APIKey: key})
		res, _ := fetch(t, f, 5*time.Second)
		if res.err != nil {
			t.Fatal(res.err)
		}
		if len(res.rep.Ranks) != 1 || res.rep.Running != 12 || res.rep.Version != "0.5.x" {
			t.Errorf("report %+v", res.rep)
		}
		if time.Since(res.rep.Received) > time.Minute {
			t.Errorf("received %v", res.rep.Received)
		}
		mu.Lock()
		if got.Method != http.MethodGet || got.URL.Path != "/v1/loads" || got.URL.RawQuery != "include=core" {
			t.Errorf("request %s %s", got.Method, got.URL)
		}
		wantAuth := ""
		if key != "" {
			wantAuth = "Bearer " + key
		}
		if a := got.Header.Get("Authorization"); a != wantAuth {
			t.Errorf("authorization %q, want %q", a, wantAuth)
		}
		mu.Unlock()
	}
}

func TestFetchCustomClient(t *testing.T) {
	ts := worker(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"loads":[]}`)
	})
	var trips atomic.Int32
	client := &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		trips.Add(1)
		return http.DefaultTransport.RoundTrip(r)
	})}
	f := newFetcher(t, Config{URL: ts.URL, Client: client})
	res, _ := fetch(t, f, 5*time.Second)
	if res.err != nil || !res.rep.Empty() || trips.Load() != 1 {
		t.Fatalf("report %+v, err %v, round trips %d", res.rep, res.err, trips.Load())
	}
}

func TestFetchOverTLS(t *testing.T) {
	ts := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"loads":[{"dp_rank":0,"num_running_reqs":2,"num_waiting_reqs":0}]}`)
	}))
	t.Cleanup(ts.Close)
	pool := x509.NewCertPool()
	pool.AddCert(ts.Certificate())

	f := newFetcher(t, Config{URL: ts.URL, TLS: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}})
	if res, _ := fetch(t, f, 5*time.Second); res.err != nil || res.rep.Running != 2 {
		t.Fatalf("Fetch with the worker's CA = %+v, %v", res.rep, res.err)
	}

	// Verification is on by default: the self-signed certificate is not in the system roots.
	res, _ := fetch(t, newFetcher(t, Config{URL: ts.URL}), 5*time.Second)
	var certErr *tls.CertificateVerificationError
	if !errors.As(res.err, &certErr) || !strings.Contains(res.err.Error(), ts.URL) {
		t.Errorf("Fetch of an untrusted certificate = %v, want a certificate verification error naming the URL", res.err)
	}

	if _, err := New(Config{URL: ts.URL, TLS: &tls.Config{}, Client: http.DefaultClient}); err == nil {
		t.Error("New accepted both a TLS config and a client")
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// hang blocks a handler until the test ends or the client goes away.
func hang(t *testing.T) func(r *http.Request) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) }) // runs before the server's Close, which waits for handlers
	return func(r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}
}

func TestFetchDeadline(t *testing.T) {
	tests := []struct {
		name    string
		handler func(block func(*http.Request)) http.HandlerFunc
	}{
		{"no headers", func(block func(*http.Request)) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { block(r) }
		}},
		{"half a body", func(block func(*http.Request)) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", "1000")
				_, _ = io.WriteString(w, `{"loads":[`)
				w.(http.Flusher).Flush()
				block(r)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := worker(t, tt.handler(hang(t)))
			f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
			res, took := fetch(t, f, 100*time.Millisecond)
			if !errors.Is(res.err, context.DeadlineExceeded) {
				t.Fatalf("error %v, want a deadline error", res.err)
			}
			if res.rep != nil {
				t.Errorf("report %+v with error", res.rep)
			}
			if took > 3*time.Second {
				t.Errorf("took %v after a 100ms deadline", took)
			}
		})
	}
}

func TestFetchErrors(t *testing.T) {
	tests := []struct {
		name    string
		handler http.HandlerFunc
		check   func(t *testing.T, f *Fetcher, err error)
	}{
		{"500", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "scheduler died; auth was "+r.Header.Get("Authorization"), http.StatusInternalServerError)
		}, wantStatus(http.StatusInternalServerError)},
		{"401", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "bad key "+r.Header.Get("Authorization"), http.StatusUnauthorized)
		}, wantStatus(http.StatusUnauthorized)},
		{"400 unknown include", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, `{"error":"unknown include token"}`, http.StatusBadRequest)
		}, wantStatus(http.StatusBadRequest)},
		{"html", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/html")
			_, _ = io.WriteString(w, "<html><body>welcome, "+r.Header.Get("Authorization")+"</body></html>")
		}, wantDecode("", "invalid character")},
		{"empty", func(w http.ResponseWriter, r *http.Request) {}, wantDecode("", "unexpected end of JSON input")},
		{"wrong type", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"loads":[{"num_running_reqs":"`+r.Header.Get("Authorization")+`"}]}`)
		}, wantDecode("loads[0].num_running_reqs", "want an integer, got string")},
		{"connection dropped", func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		}, func(t *testing.T, f *Fetcher, err error) {
			if err == nil || !strings.Contains(err.Error(), f.URL()) {
				t.Errorf("error %v does not name %s", err, f.URL())
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := worker(t, tt.handler)
			f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
			res, _ := fetch(t, f, 5*time.Second)
			if res.err == nil || res.rep != nil {
				t.Fatalf("report %+v, error %v", res.rep, res.err)
			}
			tt.check(t, f, res.err)
		})
	}
}

func wantStatus(code int) func(*testing.T, *Fetcher, error) {
	return func(t *testing.T, f *Fetcher, err error) {
		t.Helper()
		var se *StatusError
		if !errors.As(err, &se) || se.Code != code || se.URL != f.URL() {
			t.Fatalf("error %#v, want status %d from %s", err, code, f.URL())
		}
		if !strings.Contains(err.Error(), strconv.Itoa(code)) {
			t.Errorf("error %q does not name the status", err)
		}
	}
}

func wantDecode(field, msg string) func(*testing.T, *Fetcher, error) {
	return func(t *testing.T, f *Fetcher, err error) {
		t.Helper()
		var de *DecodeError
		if !errors.As(err, &de) || de.URL != f.URL() || de.Field != field {
			t.Fatalf("error %#v, want a decode error of %q from %s", err, field, f.URL())
		}
		if !strings.Contains(err.Error(), msg) || !strings.Contains(err.Error(), f.URL()) {
			t.Errorf("error %q does not contain %q and the URL", err, msg)
		}
	}
}

func TestFetchTooLarge(t *testing.T) {
	const size = 50 << 20
	tests := []struct {
		name     string
		declared bool
	}{
		{"declared length", true},
		{"chunked", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			written := make(chan int64, 1)
			ts := worker(t, func(w http.ResponseWriter, r *http.Request) {
				if tt.declared {
					w.Header().Set("Content-Length", strconv.Itoa(size))
				}
				n, _ := io.WriteString(w, `{"loads":[`)
				total := int64(n)
				chunk := []byte(strings.Repeat(" ", 32<<10))
				for total < size {
					n, err := w.Write(chunk[:min(int64(len(chunk)), size-total)])
					total += int64(n)
					if err != nil {
						break
					}
				}
				written <- total
			})
			f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
			res, took := fetch(t, f, 10*time.Second)
			var tl *TooLargeError
			if !errors.As(res.err, &tl) || tl.Limit != DefaultMaxBody || tl.URL != f.URL() {
				t.Fatalf("error %v, want a too-large error", res.err)
			}
			if !strings.Contains(res.err.Error(), strconv.Itoa(DefaultMaxBody)) {
				t.Errorf("error %q does not name the limit", res.err)
			}
			if took > 5*time.Second {
				t.Errorf("took %v", took)
			}
			select {
			case n := <-written:
				if n >= size {
					t.Errorf("server wrote the whole %d bytes", n)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("server still writing: the client kept reading")
			}
		})
	}
}

func TestFetchMaxBody(t *testing.T) {
	const limit = 1024
	body := `{"loads":[]}`
	exact := body + strings.Repeat(" ", limit-len(body))
	for _, tt := range []struct {
		body string
		ok   bool
	}{{exact, true}, {exact + " ", false}} {
		ts := worker(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(tt.body)))
			_, _ = io.WriteString(w, tt.body)
		})
		f := newFetcher(t, Config{URL: ts.URL, MaxBody: limit})
		res, _ := fetch(t, f, 5*time.Second)
		var tl *TooLargeError
		if tt.ok != (res.err == nil) || (!tt.ok && (!errors.As(res.err, &tl) || tl.Limit != limit)) {
			t.Errorf("%d bytes: report %+v, error %v", len(tt.body), res.rep, res.err)
		}
	}
}

// legacyWorker serves /get_load and, once upgraded, /v1/loads; it counts the requests per path.
type legacyWorker struct {
	upgraded   atomic.Bool // /v1/loads exists
	dropLegacy atomic.Bool // /get_load answers 404
	loads      atomic.Int32
	legacy     atomic.Int32
	badAuth    atomic.Int32
	current    []byte
	old        []byte
}

func (lw *legacyWorker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Authorization") != "Bearer "+testKey {
		lw.badAuth.Add(1)
	}
	switch r.URL.Path {
	case "/v1/loads":
		lw.loads.Add(1)
		if lw.upgraded.Load() {
			_, _ = w.Write(lw.current)
			return
		}
	case "/get_load":
		lw.legacy.Add(1)
		if !lw.dropLegacy.Load() {
			_, _ = w.Write(lw.old)
			return
		}
	}
	http.NotFound(w, r)
}

func TestFetchLegacy(t *testing.T) {
	lw := &legacyWorker{current: readFixture(t, "loads_current.json"), old: readFixture(t, "get_load.json")}
	ts := worker(t, lw.ServeHTTP)
	f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})

	res, _ := fetch(t, f, 5*time.Second)
	if res.err != nil {
		t.Fatal(res.err)
	}
	if len(res.rep.Ranks) != 2 || res.rep.Running != 12 || res.rep.Waiting != 7 || !f.Legacy() {
		t.Fatalf("report %+v, legacy %v", res.rep, f.Legacy())
	}
	if lw.loads.Load() != 1 || lw.legacy.Load() != 1 {
		t.Fatalf("requests: /v1/loads %d, /get_load %d", lw.loads.Load(), lw.legacy.Load())
	}

	// The next polls go straight to /get_load, until the probe of /v1/loads is due.
	for i := 2; i <= legacyProbeEvery; i++ {
		if res, _ := fetch(t, f, 5*time.Second); res.err != nil || len(res.rep.Ranks) != 2 {
			t.Fatalf("poll %d: %+v, %v", i, res.rep, res.err)
		}
	}
	if lw.loads.Load() != 1 || lw.legacy.Load() != legacyProbeEvery {
		t.Fatalf("after %d polls: /v1/loads %d, /get_load %d", legacyProbeEvery, lw.loads.Load(), lw.legacy.Load())
	}

	// The worker is upgraded: the probe notices and polling moves back to /v1/loads.
	lw.upgraded.Store(true)
	for i := range 3 {
		res, _ := fetch(t, f, 5*time.Second)
		if res.err != nil || len(res.rep.Ranks) != 1 || res.rep.Version != "0.5.x" || f.Legacy() {
			t.Fatalf("poll %d after upgrade: %+v, %v, legacy %v", i, res.rep, res.err, f.Legacy())
		}
	}
	if lw.loads.Load() != 4 || lw.legacy.Load() != legacyProbeEvery {
		t.Fatalf("after upgrade: /v1/loads %d, /get_load %d", lw.loads.Load(), lw.legacy.Load())
	}
	if lw.badAuth.Load() != 0 {
		t.Errorf("%d requests without the bearer token", lw.badAuth.Load())
	}
}

func TestFetchLegacyGone(t *testing.T) {
	lw := &legacyWorker{current: readFixture(t, "loads_current.json"), old: readFixture(t, "get_load.json")}
	ts := worker(t, lw.ServeHTTP)
	f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
	if res, _ := fetch(t, f, 5*time.Second); res.err != nil || !f.Legacy() {
		t.Fatalf("%+v, %v, legacy %v", res.rep, res.err, f.Legacy())
	}
	// Between probes the worker swaps /get_load for /v1/loads: the same poll finds the new endpoint.
	lw.upgraded.Store(true)
	lw.dropLegacy.Store(true)
	res, _ := fetch(t, f, 5*time.Second)
	if res.err != nil || len(res.rep.Ranks) != 1 || f.Legacy() {
		t.Fatalf("%+v, %v, legacy %v", res.rep, res.err, f.Legacy())
	}
}

func TestFetchNeitherEndpoint(t *testing.T) {
	lw := &legacyWorker{}
	lw.dropLegacy.Store(true)
	ts := worker(t, lw.ServeHTTP)
	f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
	for range 2 {
		res, _ := fetch(t, f, 5*time.Second)
		wantStatus(http.StatusNotFound)(t, f, res.err)
		if f.Legacy() {
			t.Fatal("legacy without /get_load")
		}
	}
	if lw.loads.Load() != 2 || lw.legacy.Load() != 2 {
		t.Fatalf("/v1/loads %d, /get_load %d", lw.loads.Load(), lw.legacy.Load())
	}
}

func TestFetchLegacyFailing(t *testing.T) {
	// /v1/loads is missing and /get_load fails otherwise: that failure is the one to report.
	ts := worker(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/get_load" {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		http.NotFound(w, r)
	})
	f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
	res, _ := fetch(t, f, 5*time.Second)
	var se *StatusError
	if !errors.As(res.err, &se) || se.Code != http.StatusServiceUnavailable || !strings.HasSuffix(se.URL, "/get_load") {
		t.Fatalf("error %v", res.err)
	}
	if f.Legacy() {
		t.Error("legacy after a failed /get_load")
	}
}

func TestFetchConcurrent(t *testing.T) {
	lw := &legacyWorker{current: readFixture(t, "loads_current.json"), old: readFixture(t, "get_load.json")}
	ts := worker(t, lw.ServeHTTP)
	f := newFetcher(t, Config{URL: ts.URL, APIKey: testKey})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 20 {
				if g == 0 && i == 10 {
					lw.upgraded.Store(true)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				rep, err := f.Fetch(ctx)
				cancel()
				if err != nil || rep.Empty() {
					t.Errorf("fetch: %+v, %v", rep, err)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestClose(t *testing.T) {
	closed := make(chan struct{}, 16)
	ts := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"loads":[]}`)
	}))
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateClosed {
			closed <- struct{}{}
		}
	}
	ts.Start()
	t.Cleanup(ts.Close)
	f := newFetcher(t, Config{URL: ts.URL})
	if res, _ := fetch(t, f, 5*time.Second); res.err != nil {
		t.Fatal(res.err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("idle connection still open after Close")
	}
	// A closed Fetcher still works: Close only drops idle connections.
	if res, _ := fetch(t, f, 5*time.Second); res.err != nil {
		t.Fatal(res.err)
	}
}

// A worker that closes each connection after one answer without saying so, as one whose keep-alive
// timeout is shorter than the polling interval does: every poll still succeeds.
func TestFetchRetriesClosedIdleConnection(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var accepted atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			go func() {
				defer c.Close()
				buf := make([]byte, 4<<10)
				if _, err := c.Read(buf); err != nil {
					return
				}
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{\"loads\":[]}")
			}()
		}
	}()
	f := newFetcher(t, Config{URL: "http://" + ln.Addr().String()})
	for i := range 3 {
		if res, _ := fetch(t, f, 5*time.Second); res.err != nil {
			t.Fatalf("poll %d: %v", i, res.err)
		}
	}
	if n := accepted.Load(); n != 3 {
		t.Errorf("%d connections for 3 polls, want one each", n)
	}
}

// A poll of a port nothing listens on can reach its own socket (the kernel may pick that very port as
// the source, since it is in the ephemeral range). The poll must fail as refused and let the port go,
// so the worker can listen on it. Binding the source port makes the self-connection certain.
func TestPollThatReachesItselfIsRefused(t *testing.T) {
	addr := testports.Unused(t)
	f, err := New(Config{URL: "http://" + addr.String()})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.poller.dialer.LocalAddr = addr
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = f.Fetch(ctx)
	if !errors.Is(err, syscall.ECONNREFUSED) || !strings.Contains(err.Error(), "connected to itself") {
		t.Fatalf("poll of %s from %s: %v; want a refusal that says it connected to itself", addr, addr, err)
	}
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatalf("the worker's port after the poll: %v", err)
	}
	_ = ln.Close()
}
