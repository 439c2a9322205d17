package caddymodule_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// testWorker is a loopback HTTP server that answers like an SGLang worker: /v1/loads with a load the
// test sets, and any other path with its name, so tests can count where requests went.
type testWorker struct {
	name      string
	srv       *httptest.Server
	usage     atomic.Value // string: the JSON of the loads array
	loadPolls atomic.Int64
	served    atomic.Int64
	hanging   atomic.Bool
	noLoads   atomic.Bool // answer 404 on the load endpoints
	release   chan struct{}
	stopOnce  sync.Once
}

func newTestWorker(t *testing.T, name string, tokenUsage float64, waiting int) *testWorker {
	t.Helper()
	return startTestWorker(t, name, tokenUsage, waiting, nil)
}

// startTestWorker is newTestWorker serving on ln, or on 127.0.0.1:0 when ln is nil.
func startTestWorker(t *testing.T, name string, tokenUsage float64, waiting int, ln net.Listener) *testWorker {
	t.Helper()
	w := serveTestWorker(name, tokenUsage, waiting, ln)
	t.Cleanup(w.stop)
	return w
}

// serveTestWorker is startTestWorker for a caller that stops the worker itself.
func serveTestWorker(name string, tokenUsage float64, waiting int, ln net.Listener) *testWorker {
	w := &testWorker{name: name, release: make(chan struct{})}
	w.setLoad(tokenUsage, waiting)
	w.srv = httptest.NewUnstartedServer(http.HandlerFunc(w.serve))
	if ln != nil {
		w.srv.Listener.Close()
		w.srv.Listener = ln
	}
	w.srv.Start()
	return w
}

// stop closes the worker's server; it may be called more than once.
func (w *testWorker) stop() {
	w.stopOnce.Do(func() {
		close(w.release)
		w.srv.Close()
	})
}

// setLoad sets the load the worker reports, in the current /v1/loads shape.
func (w *testWorker) setLoad(tokenUsage float64, waiting int) {
	used := int(tokenUsage * 100000)
	w.usage.Store(fmt.Sprintf(`[{"dp_rank":0,"num_running_reqs":%d,"num_waiting_reqs":%d,"num_waiting_uncached_tokens":%d,`+
		`"num_used_tokens":%d,"num_total_tokens":%d,"max_total_num_tokens":100000,"max_running_requests":64,`+
		`"token_usage":%.4f,"gen_throughput":1000.0,"cache_hit_rate":0.1,"utilization":0.0}]`,
		used/1000, waiting, waiting*500, used, used+waiting*500, tokenUsage))
}

func (w *testWorker) serve(rw http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/v1/loads", "/get_load":
		if r.URL.Path == "/v1/loads" {
			w.loadPolls.Add(1)
		}
		if w.noLoads.Load() {
			http.NotFound(rw, r)
			return
		}
		if w.hanging.Load() {
			select {
			case <-w.release:
			case <-r.Context().Done():
			}
			return
		}
		if r.URL.Path == "/get_load" {
			http.NotFound(rw, r)
			return
		}
		rw.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(rw, `{"timestamp":"2026-11-30T10:00:00.123456+00:00","version":"0.5.9","loads":%s}`, w.usage.Load())
	default:
		w.served.Add(1)
		rw.Header().Set("X-Worker", w.name)
		fmt.Fprint(rw, w.name)
	}
}

// addr is the worker's host:port.
func (w *testWorker) addr() string { return strings.TrimPrefix(w.srv.URL, "http://") }

// waitPolls waits until every worker's load endpoint has been asked at least n more times.
func waitPolls(t *testing.T, n int64, workers ...*testWorker) {
	t.Helper()
	start := make([]int64, len(workers))
	for i, w := range workers {
		start[i] = w.loadPolls.Load()
	}
	eventually(t, 10*time.Second, func() bool {
		for i, w := range workers {
			if w.loadPolls.Load()-start[i] < n {
				return false
			}
		}
		return true
	}, "workers polled %d times", n)
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, within time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out after %s waiting for: %s", within, fmt.Sprintf(format, args...))
		case <-tick.C:
		}
	}
}

// sendRequests sends n sequential GETs to url and counts the answers by worker name; any non-200
// fails the test.
func sendRequests(t *testing.T, url string, n int) map[string]int {
	t.Helper()
	counts := make(map[string]int)
	client := &http.Client{Timeout: 10 * time.Second}
	for i := 0; i < n; i++ {
		resp, err := client.Get(url)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
		counts[resp.Header.Get("X-Worker")]++
	}
	return counts
}
