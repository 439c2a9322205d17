package sglangsim

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestOutputLength(t *testing.T) {
	cases := []struct {
		name        string
		low         float64
		max, lo, hi int64
	}{
		{"off", 0, 100, 100, 100},
		{"one means off", 1, 100, 100, 100},
		{"half of 10", 0.5, 10, 5, 10},
		{"0.3 of 1000", 0.3, 1000, 300, 1000},
		{"tiny fraction keeps a token", 0.01, 50, 1, 50},
		{"no output", 0.5, 0, 0, 0},
		{"one token", 0.5, 1, 1, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seen := map[int64]bool{}
			var sum float64
			const n = 4000
			for i := range n {
				digest := mix64(uint64(i))
				got := outputLength(c.low, digest, 7, c.max)
				if got < c.lo || got > c.hi {
					t.Fatalf("digest %x: %d outside [%d, %d]", digest, got, c.lo, c.hi)
				}
				if again := outputLength(c.low, digest, 7, c.max); again != got {
					t.Fatalf("digest %x: %d then %d", digest, got, again)
				}
				seen[got] = true
				sum += float64(got)
			}
			// Uniform over [lo, hi]: every length of a small range occurs, and the mean is the middle.
			if span := c.hi - c.lo + 1; span <= 10 && int64(len(seen)) != span {
				t.Errorf("%d distinct lengths, want %d", len(seen), span)
			}
			if mid := float64(c.lo+c.hi) / 2; math.Abs(sum/n-mid) > 0.03*float64(c.hi)+0.01 {
				t.Errorf("mean %.2f, want about %.2f", sum/n, mid)
			}
		})
	}
	// The draw depends on the sizes as well as the text: "hi" with different prompt_tokens differs.
	d := textKey([]byte("hi")).digest()
	lengths := map[int64]bool{}
	for p := range int64(50) {
		lengths[outputLength(0.3, d, p+1, 1000)] = true
	}
	if len(lengths) < 40 {
		t.Fatalf("50 prompt sizes gave %d lengths", len(lengths))
	}
}

// The same request gets the same length on every worker, and the finish reason says why it ended.
func TestFinishEarlyAcrossWorkers(t *testing.T) {
	cfg := fastConfig()
	cfg.FinishEarly = 0.3
	_, base1 := startWorker(t, cfg)
	_, base2 := startWorker(t, cfg)
	stops := 0
	for i := range 20 {
		body := map[string]any{"text": fmt.Sprintf("question %d", i), "sampling_params": map[string]any{"max_new_tokens": 40}}
		g1, g2 := postGenerate(t, base1, body), postGenerate(t, base2, body)
		n := g1.MetaInfo.CompletionTokens
		if n != g2.MetaInfo.CompletionTokens || n < 12 || n > 40 || g1.Text != filler(0, n) {
			t.Fatalf("request %d: %d and %d tokens, text %q", i, n, g2.MetaInfo.CompletionTokens, g1.Text)
		}
		want := "length"
		if n < 40 {
			want = "stop"
			stops++
		}
		if g1.MetaInfo.FinishReason["type"] != want {
			t.Fatalf("request %d: %d tokens, finish %v", i, n, g1.MetaInfo.FinishReason)
		}

		chat := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "x"}}, "max_tokens": 40, "prompt_tokens": i + 1}
		resp, b := do(t, "POST", base1+"/v1/chat/completions", "", chat)
		mustStatus(t, resp, b, http.StatusOK)
		var c openAIResponse
		if err := json.Unmarshal(b, &c); err != nil {
			t.Fatal(err)
		}
		want = "length"
		if c.Usage.CompletionTokens < 40 {
			want = "stop"
		}
		if *c.Choices[0].FinishReason != want || c.Choices[0].Message.Content != filler(0, c.Usage.CompletionTokens) {
			t.Fatalf("chat: %s", b)
		}
	}
	if stops == 0 {
		t.Fatal("no answer ended early")
	}
}

// The prefill counters: their ratio between two polls is the configured prefill speed.
func TestPrefillCounters(t *testing.T) {
	w, start := handDriven(t, Config{PrefillTokensPerSec: 1000, DecodeTokensPerSec: 1})
	queueByHand(w, sized(500, 10), start)
	w.admit(w.ranks[0], start)
	steps := []struct {
		at         time.Duration
		tokens, us int64
	}{
		{100 * time.Millisecond, 100, 100_000},
		{300 * time.Millisecond, 300, 300_000},
		{time.Second, 500, 500_000}, // done at 500: the stream idles for the rest of the step
		{1500 * time.Millisecond, 500, 500_000},
	}
	for _, s := range steps {
		w.step(start.Add(s.at))
		l := w.loadsLocked(start.Add(s.at))[0]
		if l.PrefillUncachedTokens != s.tokens || l.PrefillBusyMicros != s.us {
			t.Fatalf("at %v: %d tokens, %d us; want %d, %d", s.at, l.PrefillUncachedTokens, l.PrefillBusyMicros, s.tokens, s.us)
		}
	}
	handBack(w)

	// Over HTTP, two polls around a request.
	cfg := fastConfig()
	cfg.PrefillTokensPerSec = 20000
	_, base := startWorker(t, cfg)
	before := loads(t, base)
	postGenerate(t, base, gen(2000, 1))
	after := loads(t, base)
	if before.Timestamp == nil || after.TotalPrefillUncached == nil || after.TotalPrefillBusyUs == nil {
		t.Fatalf("counters missing: %+v", after)
	}
	tokens := *after.TotalPrefillUncached - *before.TotalPrefillUncached
	busy := float64(*after.TotalPrefillBusyUs-*before.TotalPrefillBusyUs) / 1e6
	if tokens != 2000 || math.Abs(float64(tokens)/busy-20000) > 1 {
		t.Fatalf("%d tokens in %.6f s busy", tokens, busy)
	}
	if age := float64(time.Now().UnixMicro())/1e6 - *after.Timestamp; age < 0 || age > 5 {
		t.Fatalf("rank timestamp %v is %v s old", *after.Timestamp, age)
	}
	resp, b := get(t, base+"/metrics")
	mustStatus(t, resp, b, http.StatusOK)
	if !strings.Contains(string(b), "# TYPE sglang:total_prefill_busy_us counter\n") ||
		!strings.Contains(string(b), `sglang:total_prefill_uncached_tokens{model_name="sglang-sim",dp_rank="0"} 2000`) {
		t.Fatalf("metrics:\n%s", b)
	}

	// Omitted: as an older SGLang, the fields are absent, not zero.
	cfg.OmitPrefillCounters = true
	_, base = startWorker(t, cfg)
	resp, b = get(t, base+"/v1/loads?include=core")
	mustStatus(t, resp, b, http.StatusOK)
	if strings.Contains(string(b), "total_prefill") || !strings.Contains(string(b), `"timestamp"`) {
		t.Fatalf("counters not omitted: %s", b)
	}
	resp, b = get(t, base+"/metrics")
	mustStatus(t, resp, b, http.StatusOK)
	if strings.Contains(string(b), "total_prefill") {
		t.Fatalf("counters not omitted from /metrics:\n%s", b)
	}
}

// A queued request counts only the tokens the cache does not cover on arrival.
func TestWaitingUncachedTokens(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 1000
	cfg.MaxRunningRequests = 1
	cfg.DecodeTokensPerSec = 0.001 // the first token, at prefill, is all a request gets
	w, base := startWorker(t, cfg)
	a := map[string]any{"text": strings.Repeat("a", 260), "sampling_params": map[string]any{"max_new_tokens": 1}}
	postGenerate(t, base, a) // 65 tokens, 64 of them cached afterwards
	slow := goPost(t.Context(), base+"/generate", gen(800, 100))
	eventually(t, "slow request running", func() bool { return w.Loads()[0].Running == 1 })
	queued := goPost(t.Context(), base+"/generate", a)
	eventually(t, "request queued", func() bool { return w.Loads()[0].Waiting == 1 })
	l := loads(t, base)
	if *l.NumWaitingUncachedTokens != 1 || l.NumTotalTokens != l.NumUsedTokens+65 {
		t.Fatalf("loads: %+v", l)
	}
	w.Close()
	await(t, slow)
	await(t, queued)
}
