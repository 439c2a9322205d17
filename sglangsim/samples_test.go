package sglangsim

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// A request for n answers runs as SGLang runs it: the prompt prefilled once, then n requests decoding
// side by side on its rank, each holding its own output; the answer carries them all.
func TestSamplesRunSideBySide(t *testing.T) {
	cfg := fastConfig()
	cfg.DecodeTokensPerSec = 400
	cfg.FinishEarly = 0.3
	_, base := startWorker(t, cfg)
	prompt := strings.Repeat("a prompt of whole blocks. ", 40) // 1,040 bytes: 260 tokens, 16 whole blocks
	body := map[string]any{
		"messages":   []any{map[string]any{"role": "user", "content": prompt}},
		"max_tokens": 200, "n": 4,
	}
	ch := goPost(t.Context(), base+"/v1/chat/completions", body)
	eventually(t, "four answers running", func() bool { return loads(t, base).NumRunningReqs == 4 })
	l := loads(t, base)
	// The prompt once; the others find it cached, but for at most a part block each.
	if l.TotalPrefillUncached == nil || *l.TotalPrefillUncached < 260 || *l.TotalPrefillUncached > 260+3*cacheBlockTokens {
		t.Errorf("prefilled %v uncached tokens for four answers to a 260-token prompt, want it once", l.TotalPrefillUncached)
	}
	r := await(t, ch)
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	var resp openAIResponse
	if err := json.Unmarshal(r.body, &resp); err != nil {
		t.Fatal(err)
	}
	var out int64
	lengths := map[int]bool{}
	for i, c := range resp.Choices {
		if c.Index != i || c.Message == nil || c.FinishReason == nil {
			t.Fatalf("choice %d: %+v", i, c)
		}
		n := len(c.Message.Content) / 4
		out += int64(n)
		lengths[n] = true
	}
	if len(resp.Choices) != 4 || resp.Usage == nil || resp.Usage.PromptTokens != 260 || resp.Usage.CompletionTokens != out {
		t.Fatalf("%d choices, usage %+v; want 4, prompt 260 and completion %d", len(resp.Choices), resp.Usage, out)
	}
	if len(lengths) < 2 {
		t.Errorf("four answers of lengths %v: each should draw its own", lengths)
	}
}

// /generate answers a list for sampling_params.n, as SGLang does, and each streamed event says whose
// answer it is; OpenAI's stream interleaves choices by index and ends with one usage chunk.
func TestSamplesWireShapes(t *testing.T) {
	_, base := startWorker(t, fastConfig())
	resp, b := do(t, "POST", base+"/generate", "", map[string]any{"text": "hello there", "sampling_params": map[string]any{"n": 3, "max_new_tokens": 8}})
	mustStatus(t, resp, b, http.StatusOK)
	var list []generateResponse
	if err := json.Unmarshal(b, &list); err != nil || len(list) != 3 {
		t.Fatalf("generate with n 3: %s (%v)", b, err)
	}
	for i, g := range list {
		if g.Index == nil || *g.Index != i || g.MetaInfo.CompletionTokens != 8 || g.MetaInfo.PromptTokens != 3 {
			t.Errorf("answer %d: %+v", i, g)
		}
	}

	post := func(path string, body map[string]any) []string {
		t.Helper()
		raw, _ := json.Marshal(body)
		resp, err := http.Post(base+path, "application/json", strings.NewReader(string(raw)))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: status %d", path, resp.StatusCode)
		}
		return sseEvents(t, resp.Body)
	}
	events := post("/generate", map[string]any{"text": "hello there", "stream": true, "sampling_params": map[string]any{"n": 2, "max_new_tokens": 8}})
	final := map[int]int64{}
	for _, e := range events[:len(events)-1] {
		var g generateResponse
		if err := json.Unmarshal([]byte(e), &g); err != nil || g.Index == nil {
			t.Fatalf("event %q: %v", e, err)
		}
		if g.MetaInfo.FinishReason != nil {
			final[*g.Index] = g.MetaInfo.CompletionTokens
		}
	}
	if len(final) != 2 || final[0] != 8 || final[1] != 8 || events[len(events)-1] != "[DONE]" {
		t.Errorf("generate stream: finished %v; events %q", final, events)
	}

	events = post("/v1/completions", map[string]any{"prompt": "hello there", "n": 2, "max_tokens": 8, "stream": true,
		"stream_options": map[string]any{"include_usage": true}})
	text := map[int]string{}
	var usage *openAIUsage
	for i, e := range events[:len(events)-1] {
		var c openAIResponse
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("chunk %q: %v", e, err)
		}
		if c.Usage != nil {
			if i != len(events)-2 {
				t.Errorf("usage chunk %d of %d, want the last before [DONE]", i, len(events)-1)
			}
			usage = c.Usage
			continue
		}
		for _, ch := range c.Choices {
			text[ch.Index] += *ch.Text
		}
	}
	if text[0] != filler(0, 8) || text[1] != filler(0, 8) || usage == nil || usage.CompletionTokens != 16 || usage.PromptTokens != 3 {
		t.Errorf("completions stream: texts %v, usage %+v", text, usage)
	}

	for _, n := range []int{0, -1, MaxSamples + 1} {
		resp, b := do(t, "POST", base+"/v1/chat/completions", "", map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": n})
		mustStatus(t, resp, b, http.StatusBadRequest)
		if !strings.Contains(string(b), "n must be in [1, 128]") {
			t.Errorf("n %d: %s", n, b)
		}
	}
}

// A client that leaves a request for several answers frees every one of them, streamed or not.
func TestSamplesFreedWhenTheClientLeaves(t *testing.T) {
	cfg := fastConfig()
	cfg.DecodeTokensPerSec = 0.001
	w, base := startWorker(t, cfg)
	for _, stream := range []bool{false, true} {
		ctx, cancel := context.WithCancel(t.Context())
		body := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hello"}}, "max_tokens": 50, "n": 4, "stream": stream}
		ch := goPost(ctx, base+"/v1/chat/completions", body)
		eventually(t, "four answers running", func() bool { return w.Loads()[0].Running == 4 })
		cancel()
		<-ch
		eventually(t, "every answer freed", func() bool {
			l := w.Loads()[0]
			return l.Running == 0 && l.Waiting == 0 && l.UsedTokens == 0
		})
	}
}
