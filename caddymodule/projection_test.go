package caddymodule_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// holdingWorker answers /v1/loads with a fixed load, and holds every other request, its body read,
// until the test releases it: the requests Caddy sends it stay in flight, as generations do between
// two polls, and the worker's report never counts them.
type holdingWorker struct {
	name    string
	srv     *httptest.Server
	release chan struct{}
	once    sync.Once
}

// arrival is a request as a holdingWorker received it.
type arrival struct {
	worker string
	bytes  int
}

// newHoldingWorker serves a holdingWorker whose report is the one rank given (JSON), telling arrived
// of each request it receives.
func newHoldingWorker(t *testing.T, name, rank string, arrived chan<- arrival) *holdingWorker {
	t.Helper()
	w := &holdingWorker{name: name, release: make(chan struct{})}
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/loads" {
			rw.Header().Set("Content-Type", "application/json")
			io.WriteString(rw, loadsBody(rank))
			return
		}
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		select { // a test that failed takes no more arrivals, and releases its workers
		case arrived <- arrival{worker: name, bytes: int(n)}:
		case <-w.release:
		}
		select {
		case <-w.release:
		case <-r.Context().Done():
		}
		rw.Header().Set("X-Worker", name)
		io.WriteString(rw, name)
	}))
	t.Cleanup(func() {
		w.unblock()
		w.srv.Close()
	})
	return w
}

func (w *holdingWorker) addr() string { return strings.TrimPrefix(w.srv.URL, "http://") }

// unblock answers every request held and every later one at once; it may be called more than once.
func (w *holdingWorker) unblock() { w.once.Do(func() { close(w.release) }) }

// idleRank is a rank of a large KV pool with running requests, none waiting: it reports no speed, so
// the cost model prices every worker of it at its stand-ins and pokes no poll to measure one.
func idleRank(running int) string {
	return fmt.Sprintf(`{"dp_rank":0,"num_running_reqs":%d,"num_waiting_reqs":0,"num_waiting_uncached_tokens":0,`+
		`"num_used_tokens":%d,"max_total_num_tokens":1000000,"max_running_requests":64}`, running, running*300)
}

// heldRequests sends requests through Caddy that the workers hold, one at a time: each is sent once
// the one before reached its worker, so each Select sees every earlier request in flight.
type heldRequests struct {
	t       *testing.T
	arrived chan arrival
	workers []*holdingWorker
	wg      sync.WaitGroup
	errs    chan error
}

func newHeldRequests(t *testing.T) *heldRequests {
	return &heldRequests{t: t, arrived: make(chan arrival), errs: make(chan error, 1024)}
}

// send posts body to path through Caddy, and returns where it arrived.
func (h *heldRequests) send(path, body string) arrival {
	h.t.Helper()
	h.wg.Go(func() {
		resp, err := http.Post(proxyURL+strings.TrimPrefix(path, "/"), "application/json", strings.NewReader(body))
		if err != nil {
			h.errs <- err
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			h.errs <- fmt.Errorf("POST %s: status %d", path, resp.StatusCode)
		}
	})
	select {
	case a := <-h.arrived:
		if a.bytes != len(body) {
			h.t.Fatalf("the worker read %d bytes of a %d-byte body", a.bytes, len(body))
		}
		return a
	case err := <-h.errs:
		h.t.Fatalf("a request failed before it reached a worker: %v", err)
	case <-time.After(15 * time.Second):
		h.t.Fatal("no request reached a worker within 15s")
	}
	return arrival{}
}

// finish releases every request held and checks that each was answered.
func (h *heldRequests) finish() {
	h.t.Helper()
	for _, w := range h.workers {
		w.unblock()
	}
	h.wg.Wait()
	close(h.errs)
	for err := range h.errs {
		h.t.Error(err)
	}
}

// holdingCaddy serves one holding worker per rank behind the test's Caddy, with policy in its
// lb_policy block and polls an hour apart, and returns them once each has been polled: no poll comes
// during the test, so every Select after the first poll prices the requests sent since its report.
func holdingCaddy(t *testing.T, h *heldRequests, policy string, ranks ...string) []*holdingWorker {
	t.Helper()
	addrs := make([]string, len(ranks))
	for i, rank := range ranks {
		w := newHoldingWorker(t, fmt.Sprintf("w%d", i), rank, h.arrived)
		h.workers = append(h.workers, w)
		addrs[i] = w.addr()
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfileFor("interval 1h", policy, addrs...), "caddyfile")
	waitAddrs(t, 10*time.Second, "every worker polled", polledOK, addrs...)
	// Held requests are answered before the next test's config replaces this one.
	t.Cleanup(func() {
		for _, w := range h.workers {
			w.unblock()
		}
		h.wg.Wait()
	})
	return h.workers
}

// smallChat is a chat of a few tokens: the default policy sizes it by its Content-Length, its answer at
// default_max_tokens, without reading it.
const smallChat = `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":16}`

// Between two polls, the default policy projects each worker's report by the requests it sent there
// since. w0 reports no request running and w1, w2 one each; the requests are alike and each stays in
// flight. Priced on the reports alone, every one would go to w0, which reports the least; projected,
// each costs more where more are running (a larger batch decodes each more slowly, and the cost
// prices the delay to the others), so each goes to a worker running the fewest: they spread as
// round-robin does, and the counts running never differ by more than one.
func TestRequestsBetweenPollsSpreadByWhatWasSentSince(t *testing.T) {
	h := newHeldRequests(t)
	ws := holdingCaddy(t, h, "", idleRank(0), idleRank(1), idleRank(1))
	running := map[string]int{ws[0].name: 0, ws[1].name: 1, ws[2].name: 1}
	var order []string
	for i := range 12 {
		least := slices.Min([]int{running["w0"], running["w1"], running["w2"]})
		a := h.send("/v1/chat/completions", smallChat)
		order = append(order, a.worker)
		if running[a.worker] != least {
			t.Fatalf("request %d went to %s running %d, where the fewest running is %d (%v); sent in order: %v",
				i, a.worker, running[a.worker], least, running, order)
		}
		running[a.worker]++
	}
	// 2 reported and 12 sent over three workers: 14 = 5 + 5 + 4.
	if counts := []int{running["w0"], running["w1"], running["w2"]}; slices.Max(counts)-slices.Min(counts) > 1 {
		t.Errorf("running per worker %v, want within one of each other", counts)
	}
	h.finish()
}

// The projection weighs each request by its size: after a prompt of 100,000 tokens (its Content-Length
// read at 4 bytes a token; the body is not read) went to one of three idle workers, whose prefill at
// the stand-in 8,000 tokens/s takes it some 12 s, the next six small requests go to the other two,
// three each: each small one adds less than a second to its worker's price.
func TestALargePromptSentSinceKeepsSmallOnesAway(t *testing.T) {
	h := newHeldRequests(t)
	ws := holdingCaddy(t, h, "", idleRank(0), idleRank(0), idleRank(0))
	// A poll now: the prefill the model drains since the report is counted from it.
	if code, body := adminDo(t, http.MethodPost, "/sglang_load/refresh"); code != http.StatusOK {
		t.Fatalf("refresh: status %d: %s", code, body)
	}
	large := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a long document. ", 400_000/17) + `"}],"max_tokens":16}`
	big := h.send("/v1/chat/completions", large).worker
	got := map[string]int{}
	for range 6 {
		got[h.send("/v1/chat/completions", smallChat).worker]++
	}
	if got[big] != 0 {
		t.Errorf("small requests per worker %v: %d went to %s, which took the 100,000-token prompt", got, got[big], big)
	}
	for _, w := range ws {
		if w.name != big && got[w.name] != 3 {
			t.Errorf("small requests per worker %v, want 3 on each of the two without the long prompt", got)
			break
		}
	}
	h.finish()
}
