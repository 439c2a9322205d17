package caddymodule_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// hashBody answers with the SHA-256 and the length of the body a request carried (X-Body-Sha256,
// X-Body-Length), which it hands on to h unchanged.
func hashBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		setBodyHash(rw, body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		h.ServeHTTP(rw, r)
	})
}

// generateOf is a /generate body whose text is n bytes of plain ASCII: n/4 prompt tokens, rounded up,
// to the simulator as to the policy reading it, and 51 bytes of JSON more to its Content-Length.
func generateOf(n int) string {
	return `{"text":"` + strings.Repeat("abcd ", n/5+1)[:n] + `","sampling_params":{"max_new_tokens":16}}`
}

// SGLang refuses a prompt of max_req_len - 5 tokens or more, its rank's pool less 6: 4,090 of the small
// worker's 4,096, which the large one (65,536) takes. The default policy sizes a prompt by its
// Content-Length (4 bytes a token) without reading the body, and reads it where that length says a
// worker would refuse: the body then says whether it does. The small worker prefills twelve times as
// fast as the large one (both measured before the test), so where it takes a prompt it is the cheaper;
// where its refusal is confirmed the large one takes it. Every body reaches the worker byte for byte.
func TestDefaultPolicyAtTheRefusalThreshold(t *testing.T) {
	small := serveSim(t, sglangsim.Config{Name: "small", MaxTotalTokens: 4096, PrefillTokensPerSec: 1e5, DecodeTokensPerSec: 1e5}, hashBody)
	large := serveSim(t, sglangsim.Config{Name: "large", MaxTotalTokens: 65536, PrefillTokensPerSec: 8000, DecodeTokensPerSec: 1e5}, hashBody)
	addrs := []string{strings.TrimPrefix(small.URL, "http://"), strings.TrimPrefix(large.URL, "http://")}
	tester := caddytest.NewTester(t)
	tester.InitServer(caddyfileFor("interval 1s", "", addrs...), "caddyfile")
	// A prompt sent to each directly, so that each one's prefill speed is measured: priced at a
	// stand-in, the small one would be priced no faster than the large one.
	post(t, small.URL+"/generate", `{"text":"warm up","prompt_tokens":4000,"sampling_params":{"max_new_tokens":1}}`, nil)
	post(t, large.URL+"/generate", `{"text":"warm up","prompt_tokens":1000,"sampling_params":{"max_new_tokens":1}}`, nil)
	waitAddrs(t, 10*time.Second, "both workers' prefill measured", func(w worker) bool {
		return w.Score != nil && w.Score.Prefill != nil
	}, addrs...)

	for _, tc := range []struct {
		name   string
		body   string
		prompt int64  // the prompt's tokens, as the simulator counts them
		want   string // the worker that must answer
	}{
		// 16,356 bytes: 4,089 tokens by the Content-Length, not read; the text is 4,077.
		{"under by its Content-Length", generateOf(16356 - 51), 4077, "small"},
		// 16,360 bytes, 4,090 tokens: the small worker would refuse it, so the body is read, whose text
		// (16,309 bytes, 4,078 tokens) it takes.
		{"at the threshold by its Content-Length, under by its text", generateOf(16360 - 51), 4078, "small"},
		{"one token under by its text", generateOf(16356), 4089, "small"},
		{"at the threshold by its text", generateOf(16360), 4090, "large"},
		{"one token over by its text", generateOf(16364), 4091, "large"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Each worker's last report idle: a request caught running would take room in the small pool.
			idleAtLastPoll(t, addrs)
			resp, err := http.Post(proxyURL+"generate", "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var answer struct {
				MetaInfo struct {
					PromptTokens int64 `json:"prompt_tokens"`
				} `json:"meta_info"`
			}
			b, _ := io.ReadAll(resp.Body)
			by := resp.Header.Get(sglangsim.HeaderWorker)
			if resp.StatusCode != http.StatusOK || by != tc.want {
				t.Fatalf("status %d from %q, want 200 from %s: %s", resp.StatusCode, by, tc.want, b)
			}
			if err := json.Unmarshal(b, &answer); err != nil || answer.MetaInfo.PromptTokens != tc.prompt {
				t.Errorf("the worker counted %d prompt tokens (%v), want %d", answer.MetaInfo.PromptTokens, err, tc.prompt)
			}
			sum := sha256.Sum256([]byte(tc.body))
			if resp.Header.Get("X-Body-Sha256") != hex.EncodeToString(sum[:]) || resp.Header.Get("X-Body-Length") != fmt.Sprint(len(tc.body)) {
				t.Errorf("the worker got %s bytes with sha256 %s; sent %d with %x",
					resp.Header.Get("X-Body-Length"), resp.Header.Get("X-Body-Sha256"), len(tc.body), sum)
			}
		})
	}
}
