package sglangsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// fastConfig is a worker quick enough for tests: prefill is near-instant, decode takes tens of ms.
func fastConfig() Config {
	return Config{Name: "test", PrefillTokensPerSec: 1e7, DecodeTokensPerSec: 2000}
}

// startWorker serves w on 127.0.0.1:0 until the test ends.
func startWorker(t *testing.T, cfg Config) (*Worker, string) {
	t.Helper()
	w := New(cfg)
	srv := httptest.NewServer(w.Handler())
	t.Cleanup(srv.Close)
	t.Cleanup(w.Close) // runs first: releases pending requests so srv.Close does not wait on them
	return w, srv.URL
}

func do(t *testing.T, method, url, auth string, body any) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", "Bearer "+auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func get(t *testing.T, url string) (*http.Response, []byte) { return do(t, "GET", url, "", nil) }

// wireLoads mirrors the /v1/loads body with the exact field names of the wire description.
type wireLoads struct {
	Timestamp       string     `json:"timestamp"`
	Version         string     `json:"version"`
	Accelerator     string     `json:"accelerator"`
	NumAccelerators int        `json:"num_accelerators"`
	DPRankCount     *int       `json:"dp_rank_count"`
	Loads           []wireRank `json:"loads"`
	Aggregate       *struct {
		TotalRunningReqs int     `json:"total_running_reqs"`
		TotalWaitingReqs int     `json:"total_waiting_reqs"`
		TotalReqs        int     `json:"total_reqs"`
		AvgTokenUsage    float64 `json:"avg_token_usage"`
		AvgThroughput    float64 `json:"avg_throughput"`
		AvgUtilization   float64 `json:"avg_utilization"`
		TotalUsedTokens  int64   `json:"total_used_tokens"`
		TotalTokens      int64   `json:"total_tokens"`
	} `json:"aggregate"`
}

type wireRank struct {
	DPRank                   int      `json:"dp_rank"`
	NumRunningReqs           int      `json:"num_running_reqs"`
	NumWaitingReqs           int      `json:"num_waiting_reqs"`
	NumWaitingUncachedTokens *int64   `json:"num_waiting_uncached_tokens"`
	NumTotalReqs             *int     `json:"num_total_reqs"`
	NumUsedTokens            int64    `json:"num_used_tokens"`
	NumTotalTokens           int64    `json:"num_total_tokens"`
	MaxTotalNumTokens        int64    `json:"max_total_num_tokens"`
	MaxRunningRequests       int      `json:"max_running_requests"`
	TokenUsage               float64  `json:"token_usage"`
	GenThroughput            float64  `json:"gen_throughput"`
	CacheHitRate             float64  `json:"cache_hit_rate"`
	Utilization              float64  `json:"utilization"`
	Timestamp                *float64 `json:"timestamp"`
	TotalPrefillUncached     *int64   `json:"total_prefill_uncached_tokens"`
	TotalPrefillBusyUs       *int64   `json:"total_prefill_busy_us"`
	Memory                   *struct {
		WeightGB      float64 `json:"weight_gb"`
		KVCacheGB     float64 `json:"kv_cache_gb"`
		GraphGB       float64 `json:"graph_gb"`
		TokenCapacity int64   `json:"token_capacity"`
	} `json:"memory"`
	Queues *struct {
		Waiting   int `json:"waiting"`
		Grammar   int `json:"grammar"`
		Paused    int `json:"paused"`
		Retracted int `json:"retracted"`
	} `json:"queues"`
}

// decodeStrict decodes b into v and fails on any field v does not name.
func decodeStrict(t *testing.T, b []byte, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
}

// loads fetches /v1/loads?include=core and returns the first rank.
func loads(t *testing.T, base string) wireRank {
	t.Helper()
	resp, b := get(t, base+"/v1/loads?include=core")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /v1/loads: %d %s", resp.StatusCode, b)
	}
	var l wireLoads
	decodeStrict(t, b, &l)
	if len(l.Loads) == 0 {
		t.Fatalf("no loads in %s", b)
	}
	return l.Loads[0]
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

type result struct {
	status int
	header http.Header
	body   []byte
	err    error
}

// goPost sends a POST in the background.
func goPost(ctx context.Context, url string, body any) <-chan result {
	ch := make(chan result, 1)
	go func() {
		b, _ := json.Marshal(body)
		req, err := http.NewRequestWithContext(ctx, "POST", url, bytes.NewReader(b))
		if err != nil {
			ch <- result{err: err}
			return
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			ch <- result{err: err}
			return
		}
		defer resp.Body.Close()
		rb, err := io.ReadAll(resp.Body)
		ch <- result{status: resp.StatusCode, header: resp.Header, body: rb, err: err}
	}()
	return ch
}

// sized is a job of exact sizes with no cacheable content, on any rank.
func sized(prompt, maxOut int64) job {
	return job{prompt: prompt, maxTokens: maxOut, output: maxOut, dpRank: -1}
}

func gen(prompt, maxOut int64) map[string]any {
	return map[string]any{"text": "hi", "prompt_tokens": prompt, "sampling_params": map[string]any{"max_new_tokens": maxOut}}
}

// sseEvents reads the data lines of an SSE body, noting when each arrived.
func sseEvents(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("unexpected SSE line %q", line)
		}
		out = append(out, data)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func mustStatus(t *testing.T, resp *http.Response, body []byte, want int) {
	t.Helper()
	if resp.StatusCode != want {
		t.Fatalf("%s %s: status %d, want %d: %s", resp.Request.Method, resp.Request.URL.Path, resp.StatusCode, want, body)
	}
}

func await(t *testing.T, ch <-chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatal(r.err)
		}
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("request did not finish")
	}
	panic("unreachable")
}

// handDriven makes a worker whose model moves only when the test steps it, and returns it locked, with
// the moment its model starts at. handBack unlocks it.
func handDriven(t *testing.T, cfg Config) (*Worker, time.Time) {
	t.Helper()
	w := New(cfg)
	t.Cleanup(w.Close)
	w.mu.Lock()
	w.looping = true // keeps the clock loop out
	w.last = time.Now()
	return w, w.last
}

// handBack unlocks a hand-driven worker; its clock loop starts with the next request.
func handBack(w *Worker) {
	w.looping = false
	w.mu.Unlock()
}

// queueByHand queues a request of j on the worker's first rank, arrived at the moment given; w.mu must be held.
func queueByHand(w *Worker, j job, at time.Time) *request {
	r := newRequest(0, j)
	w.ranks[0].queue(r, at)
	return r
}
