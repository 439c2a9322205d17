package sglangsim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"
)

func blockTokens(bs []block) []int64 {
	var out []int64
	for _, b := range bs {
		out = append(out, b.tokens)
	}
	return out
}

func TestPromptBlocks(t *testing.T) {
	text := func(n int) promptKey { return textKey(bytes.Repeat([]byte("x"), n)) }
	ids := make([]int64, 40)
	cases := []struct {
		name                   string
		key                    promptKey
		prompt, output         int64
		wantPrompt, wantAnswer []int64
	}{
		// 200 bytes = 50 tokens: 3 whole 64-byte blocks of 16 tokens, the 50th token uncached.
		{"text", text(200), 50, 0, []int64{16, 16, 16}, nil},
		// 192 bytes = 48 tokens: the third block would cover the last token, so it waits for the answer.
		{"last token never cached", text(192), 48, 0, []int64{16, 16}, nil},
		{"prompt's last block with the answer", text(192), 48, 1, []int64{16, 16}, []int64{16}},
		// 100 bytes + a 20-token answer (80 bytes): the second block ends 28 bytes into the answer, at
		// token 25 + 7; the answer's last token is 44.
		{"answer", text(100), 25, 20, []int64{16}, []int64{16}},
		// A chat answer is framed as the assistant message: 126 + 10 + 128 + 1 bytes. The key is 32
		// tokens for a size of 30: block ends 16·30/32 = 15, then past the key 30 + 2/4, 30 + 66/4,
		// and 30 + 130/4 = 62 is past the answer's last token, 61.
		{"chat answer", chatKey(bytes.Repeat([]byte("x"), 126)), 30, 32, []int64{15}, []int64{15, 16}},
		// prompt_tokens 100 over a 50-token text: each block stands for 32 tokens.
		{"override scales up", text(200), 100, 0, []int64{32, 32, 32}, nil},
		// prompt_tokens 10: block ends at floor(16i·10/50) = 3, 6, 9.
		{"override scales down", text(200), 10, 0, []int64{3, 3, 3}, nil},
		// prompt_tokens 1: every block would stand for no token.
		{"one-token prompt", text(200), 1, 0, nil, nil},
		{"short text", text(63), 16, 0, nil, nil},
		// Token ids: the answer has no ids to resend, only the prompt's own last block comes later.
		{"input_ids", idsKey(ids), 40, 100, []int64{16, 16}, nil},
		{"input_ids, whole", idsKey(ids[:32]), 32, 100, []int64{16}, []int64{16}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, a := c.key.blocks(c.prompt, c.output)
			if got := blockTokens(p); !equal(got, c.wantPrompt) {
				t.Errorf("prompt block tokens %v, want %v", got, c.wantPrompt)
			}
			if got := blockTokens(a); !equal(got, c.wantAnswer) {
				t.Errorf("answer block tokens %v, want %v", got, c.wantAnswer)
			}
		})
	}

	// Chained: a shared first block hashes alike, the next ones differ.
	a, _ := textKey([]byte(strings.Repeat("a", 64)+strings.Repeat("b", 64)+"z")).blocks(33, 0)
	b, _ := textKey([]byte(strings.Repeat("a", 64)+strings.Repeat("c", 64)+"z")).blocks(33, 0)
	if len(a) != 2 || len(b) != 2 || a[0].hash != b[0].hash || a[1].hash == b[1].hash {
		t.Fatalf("chained hashes: %v %v", a, b)
	}
	// Text and token ids of the same bytes are different prompts.
	raw := bytes.Repeat([]byte{1, 0, 0, 0}, 17)
	ti, _ := textKey(raw).blocks(17, 0)
	ii, _ := idsKey(make17Ones()).blocks(17, 0)
	if len(ti) != 1 || len(ii) != 1 || ti[0].hash == ii[0].hash {
		t.Fatalf("text %v and ids %v", ti, ii)
	}
}

func make17Ones() []int64 {
	ids := make([]int64, 17)
	for i := range ids {
		ids[i] = 1
	}
	return ids
}

func equal(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Eviction takes the least recently released entries, and of one prompt its deepest blocks first.
func TestPrefixCacheLRU(t *testing.T) {
	blocks := func(prefix string, n int) []block {
		out := make([]block, n)
		for i := range out {
			out[i] = block{hash: uint64(len(prefix)*1000 + int(prefix[0])*10 + i), tokens: 10}
		}
		return out
	}
	var c prefixCache
	hold := func(bs []block) []*cacheEntry {
		var pins []*cacheEntry
		for _, b := range bs {
			pins = append(pins, c.insert(b))
		}
		return pins
	}
	a, b := blocks("a", 3), blocks("b", 2)
	pa := hold(a)
	pb := hold(b)
	if c.pinned != 50 || c.evictable != 0 {
		t.Fatalf("held: pinned %d evictable %d", c.pinned, c.evictable)
	}
	c.unpin(pa) // a released first: least recent
	c.unpin(pb)
	if c.pinned != 0 || c.evictable != 50 {
		t.Fatalf("released: pinned %d evictable %d", c.pinned, c.evictable)
	}
	cases := []struct {
		evict      int64
		wantA      int // leading blocks of a still cached
		wantB      int
		evictable  int64
		descriptor string
	}{
		{0, 3, 2, 50, "nothing asked"},
		{5, 2, 2, 40, "a's deepest block goes first, whole"},
		{20, 0, 2, 20, "then the rest of a"},
		{15, 0, 0, 0, "then b, all of it"},
	}
	for _, tc := range cases {
		c.evict(tc.evict)
		if gotA, gotB := c.match(a), c.match(b); gotA != tc.wantA || gotB != tc.wantB || c.evictable != tc.evictable {
			t.Fatalf("%s: a %d b %d evictable %d, want %d %d %d", tc.descriptor, gotA, gotB, c.evictable, tc.wantA, tc.wantB, tc.evictable)
		}
	}

	// A held entry is never evicted, and re-holding an evictable one takes it off the list.
	pa = hold(a)
	c.unpin(pa[2:])
	c.evict(100)
	if c.match(a) != 2 || c.pinned != 20 || c.evictable != 0 {
		t.Fatalf("held entries: match %d pinned %d evictable %d", c.match(a), c.pinned, c.evictable)
	}
}

type genMeta struct {
	Text     string `json:"text"`
	MetaInfo struct {
		PromptTokens     int64          `json:"prompt_tokens"`
		CompletionTokens int64          `json:"completion_tokens"`
		CachedTokens     int64          `json:"cached_tokens"`
		FinishReason     map[string]any `json:"finish_reason"`
	} `json:"meta_info"`
}

func postGenerate(t *testing.T, base string, body map[string]any) genMeta {
	t.Helper()
	resp, b := do(t, "POST", base+"/generate", "", body)
	mustStatus(t, resp, b, http.StatusOK)
	var g genMeta
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// A repeated prompt prefills only its uncached tail, on every API.
func TestPrefixCacheHits(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 10000
	w, base := startWorker(t, cfg)
	long := strings.Repeat("p", 400) // 100 tokens: 6 whole blocks = 96 cacheable tokens
	system := strings.Repeat("s", 120)
	chat := func(role, question string) map[string]any {
		return map[string]any{"max_tokens": 2, "messages": []any{
			map[string]any{"role": role, "content": system},
			map[string]any{"role": "user", "content": question},
		}}
	}
	user := strings.Repeat("u", 120)
	turn := func(first, answer string, maxTokens int) map[string]any {
		msgs := []any{map[string]any{"role": "user", "content": first}}
		if answer != "" {
			msgs = append(msgs, map[string]any{"role": "assistant", "content": answer},
				map[string]any{"role": "user", "content": strings.Repeat("v", 20)})
		}
		return map[string]any{"max_tokens": maxTokens, "messages": msgs}
	}
	cases := []struct {
		name       string
		path       string
		body       map[string]any
		wantCached int64
	}{
		{"generate, first", "/generate", map[string]any{"text": long}, 0},
		{"generate, again", "/generate", map[string]any{"text": long}, 96},
		// The first 128 bytes shared: 2 blocks.
		{"generate, shared head", "/generate", map[string]any{"text": long[:128] + strings.Repeat("q", 272)}, 32},
		// prompt_tokens 200 over the same 100-token text: 6 blocks of 32 tokens.
		{"generate, size override", "/generate", map[string]any{"text": long, "prompt_tokens": 200}, 192},
		// The key renders "system\x00" + 120 bytes + "\x00" = 128 bytes, 2 blocks, then the question.
		// Size: 122 text bytes = 31 tokens over a 34-token key, blocks end at 16·31/34 = 14 and 29.
		{"chat, first", "/v1/chat/completions", chat("system", "q1"), 0},
		{"chat, other question", "/v1/chat/completions", chat("system", "q2"), 29},
		{"chat, other role", "/v1/chat/completions", chat("developer", "q2"), 0},
		{"completions, string", "/v1/completions", map[string]any{"prompt": long, "max_tokens": 2}, 96},
		{"completions, one-string list", "/v1/completions", map[string]any{"prompt": []string{long}, "max_tokens": 2}, 96},
		{"completions, token ids", "/v1/completions", map[string]any{"prompt": make([]int, 20), "max_tokens": 2}, 0},
		{"generate, same token ids", "/generate", map[string]any{"input_ids": make([]int, 20)}, 16},
		// A conversation's second turn finds the first turn's prompt and answer. Turn 1 cached blocks
		// ending at bytes 64, 128, 192 of "user\x00" + 120 bytes + "\x00assistant\x00" + answer.
		// Turn 2 is 268 text bytes = 67 tokens over a 291-byte = 73-token key: 48·67/73 = 44.
		{"chat, turn 1", "/v1/chat/completions", turn(user, "", 32), 0},
		{"chat, turn 2", "/v1/chat/completions", turn(user, filler(0, 32), 2), 44},
		// /generate with its answer appended: 100 bytes + 20 tokens; 2 blocks, 32 tokens.
		{"generate, answer", "/generate", map[string]any{"text": strings.Repeat("g", 100), "sampling_params": map[string]any{"max_new_tokens": 20}}, 0},
		{"generate, prompt + answer", "/generate", map[string]any{"text": strings.Repeat("g", 100) + filler(0, 20)}, 32},
	}
	var prompt, cached int64
	for _, c := range cases {
		resp, b := do(t, "POST", base+c.path, "", c.body)
		mustStatus(t, resp, b, http.StatusOK)
		var got struct {
			MetaInfo *struct {
				PromptTokens int64 `json:"prompt_tokens"`
				CachedTokens int64 `json:"cached_tokens"`
			} `json:"meta_info"`
			Usage *struct {
				PromptTokens        int64 `json:"prompt_tokens"`
				PromptTokensDetails *struct {
					CachedTokens int64 `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		var p, n int64
		switch {
		case got.MetaInfo != nil:
			p, n = got.MetaInfo.PromptTokens, got.MetaInfo.CachedTokens
		case got.Usage != nil && got.Usage.PromptTokensDetails != nil:
			p, n = got.Usage.PromptTokens, got.Usage.PromptTokensDetails.CachedTokens
		default:
			t.Fatalf("%s: no cached tokens in %s", c.name, b)
		}
		if n != c.wantCached {
			t.Errorf("%s: cached %d, want %d: %s", c.name, n, c.wantCached, b)
		}
		prompt += p
		cached += n
	}
	eventually(t, "drained", func() bool { return w.Loads()[0].Running == 0 })
	s := w.Stats()
	if s.PromptTokens != prompt || s.CachedTokens != cached || s.PrefilledTokens != prompt-cached {
		t.Fatalf("stats %+v, want prompt %d cached %d", s, prompt, cached)
	}
	l := loads(t, base)
	if want := round(float64(cached)/float64(prompt), 4); l.CacheHitRate != want || l.NumUsedTokens != 0 {
		t.Fatalf("loads %+v, want cache_hit_rate %v and nothing used", l, want)
	}
	resp, b := get(t, base+"/sim/stats")
	mustStatus(t, resp, b, http.StatusOK)
	var st Stats
	decodeStrict(t, b, &st)
	if st.CachedTokens != cached || st.PrefilledTokens != prompt-cached || st.Loads[0].CacheTokens == 0 {
		t.Fatalf("/sim/stats: %s", b)
	}

	// Off: nothing is cached.
	cfg.DisablePrefixCache = true
	_, base = startWorker(t, cfg)
	for range 2 {
		if g := postGenerate(t, base, map[string]any{"text": long}); g.MetaInfo.CachedTokens != 0 {
			t.Fatalf("cache off: %+v", g)
		}
	}
	if l := loads(t, base); l.CacheHitRate != 0 {
		t.Fatalf("cache off: %+v", l)
	}
}

// Under pool pressure the least recently used prompt's blocks go first, deepest block first.
func TestPrefixCacheEviction(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 200
	w, base := startWorker(t, cfg)
	// 260 bytes = 65 tokens: 4 blocks, 64 tokens cached once done; with one output token each
	// reserves 66 while it runs.
	a, b, c := strings.Repeat("a", 260), strings.Repeat("b", 260), strings.Repeat("c", 260)
	d := strings.Repeat("d", 116) // 29 tokens, one block; reserves 30
	steps := []struct {
		text                   string
		wantCached, wantCache  int64 // cached tokens of the answer; tokens in the cache afterwards
		wantEvicted, wantAgain int64 // tokens evicted, and prompt tokens prefilled again after eviction, so far
	}{
		{a, 0, 64, 0, 0},
		{b, 0, 128, 0, 0},
		{c, 0, 192, 0, 0},    // 0 used + 128 cached + 66 fits: nothing evicted
		{d, 0, 176, 32, 0},   // 30 more needs 22 evicted: a's last two blocks go, d's block comes
		{a, 32, 192, 48, 32}, // holds a's 2 blocks, needs 34: b's last block goes, a's 2 come back
		{b, 48, 192, 64, 48}, // holds b's 3 blocks, needs 18: c's last block goes, b's last comes back
	}
	for i, s := range steps {
		g := postGenerate(t, base, map[string]any{"text": s.text, "sampling_params": map[string]any{"max_new_tokens": 1}})
		if g.MetaInfo.CachedTokens != s.wantCached {
			t.Fatalf("step %d: cached %d, want %d", i, g.MetaInfo.CachedTokens, s.wantCached)
		}
		eventually(t, "request released", func() bool { return w.Loads()[0].UsedTokens == 0 })
		if l := w.Loads()[0]; l.CacheTokens != s.wantCache {
			t.Fatalf("step %d: cache holds %d tokens, want %d", i, l.CacheTokens, s.wantCache)
		}
		if st := w.Stats(); st.EvictedTokens != s.wantEvicted || st.PrefilledAgainTokens != s.wantAgain {
			t.Fatalf("step %d: %d tokens evicted, %d prefilled again; want %d, %d", i, st.EvictedTokens,
				st.PrefilledAgainTokens, s.wantEvicted, s.wantAgain)
		}
	}
	if s := w.Stats(); s.PeakUsedTokens > 200 {
		t.Fatalf("peak %d over the pool", s.PeakUsedTokens)
	}
}

// Streams report cached tokens in their usage chunk; completions stream text chunks.
func TestStreamingCompletionsAndCachedUsage(t *testing.T) {
	cfg := fastConfig()
	cfg.DecodeTokensPerSec = 1000
	_, base := startWorker(t, cfg)
	long := strings.Repeat("p", 400) // 100 tokens, 96 cacheable
	for _, c := range []struct {
		path       string
		body       map[string]any
		wantCached int64
	}{
		{"/v1/completions", map[string]any{"prompt": long}, 0},
		{"/v1/completions", map[string]any{"prompt": long}, 96},
		{"/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user", "content": long}}}, 0},
		// The key "user\x00" + 400 bytes + "\x00" is 102 tokens for a size of 100: blocks end at 16i·100/102.
		{"/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user", "content": long}}}, 94},
	} {
		chat := strings.Contains(c.path, "chat")
		c.body["max_tokens"], c.body["stream"] = 30, true
		c.body["stream_options"] = map[string]any{"include_usage": true}
		b, _ := json.Marshal(c.body)
		resp, err := http.Post(base+c.path, "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		events := sseEvents(t, resp.Body)
		resp.Body.Close()
		if len(events) < 4 || events[len(events)-1] != "[DONE]" {
			t.Fatalf("%s events: %q", c.path, events)
		}
		var text strings.Builder
		var finish string
		var usage *openAIUsage
		for _, e := range events[:len(events)-1] {
			var r openAIResponse
			decodeStrict(t, []byte(e), &r)
			wantObject := "text_completion"
			if chat {
				wantObject = "chat.completion.chunk"
			}
			if r.Object != wantObject || r.Model != modelName {
				t.Fatalf("chunk %s", e)
			}
			if r.Usage != nil {
				usage = r.Usage
				continue
			}
			ch := r.Choices[0]
			switch {
			case chat && ch.Delta != nil && ch.Text == nil:
				text.WriteString(ch.Delta.Content)
			case !chat && ch.Text != nil && ch.Delta == nil:
				text.WriteString(*ch.Text)
			default:
				t.Fatalf("chunk %s", e)
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
		if text.String() != filler(0, 30) || finish != "length" {
			t.Fatalf("%s: text %q, finish %q", c.path, text.String(), finish)
		}
		if usage == nil || usage.PromptTokens != 100 || usage.CompletionTokens != 30 ||
			usage.PromptTokensDetails.CachedTokens != c.wantCached {
			t.Fatalf("%s usage: %+v", c.path, usage)
		}
	}

	for _, body := range []string{
		`{"prompt":["a","b"]}`,
		`{"prompt":[]}`,
		`{"prompt":{"text":"a"}}`,
		`{"prompt":7}`,
		`{}`,
		`{"prompt":"a","max_tokens":-1}`,
	} {
		resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400", body, resp.StatusCode)
		}
	}
}

// Under a random mix of shared prefixes, sizes, aborts and eviction, the pool's books balance at every
// step, no cached block counts as evicted, and a drained worker holds nothing.
func TestPrefixCacheAccounting(t *testing.T) {
	linear := Config{MaxTotalTokens: 3000, PrefillTokensPerSec: 20000, DecodeTokensPerSec: 500, MaxRunningRequests: 8, FinishEarly: 0.3}
	step := linear
	step.Timing, step.HostPoolTokens, step.Speed = TimingStep, 1500, 10
	admission := step
	admission.SGLangAdmission, admission.MixedChunk = true, true
	for name, cfg := range map[string]Config{"linear": linear, "step, host tier": step, "step, host tier, SGLang admission, mixed": admission} {
		t.Run(name, func(t *testing.T) { prefixCacheAccounting(t, cfg) })
	}
}

func prefixCacheAccounting(t *testing.T, cfg Config) {
	w, start := handDriven(t, cfg)
	w.mu.Unlock() // each step below takes the lock; looping stays set, so the clock loop stays out
	rng := rand.New(rand.NewPCG(1, 2))
	prefixes := []string{strings.Repeat("a", 900), strings.Repeat("b", 2000), strings.Repeat("c", 300)}
	check := func(at string) {
		t.Helper()
		rk := w.ranks[0]
		var private, pinned, evictable int64
		for _, r := range rk.running {
			private += r.private
		}
		for _, e := range rk.cache.entries {
			if e.refs > 0 {
				pinned += e.tokens
			} else {
				evictable += e.tokens
			}
			if _, ok := rk.cache.gone[e.hash]; ok {
				t.Fatalf("%s: block %x cached and counted as evicted", at, e.hash)
			}
		}
		listed := int64(0)
		for e := rk.cache.lru.next; rk.cache.entries != nil && e != &rk.cache.lru; e = e.next {
			listed += e.tokens
		}
		if private != rk.private || pinned != rk.cache.pinned || evictable != rk.cache.evictable || listed != evictable ||
			rk.private < 0 || rk.used()+rk.cache.evictable > 3000 {
			t.Fatalf("%s: private %d/%d pinned %d/%d evictable %d/%d listed %d", at, private, rk.private, pinned,
				rk.cache.pinned, evictable, rk.cache.evictable, listed)
		}
		// The host tier holds what its list holds, within its size, and no block is in two places.
		if h := rk.cache.host; h != nil {
			var hosted int64
			listed := 0
			for e := h.lru.next; e != &h.lru; e = e.next {
				hosted += e.tokens
				listed++
				_, gone := rk.cache.gone[e.hash]
				if h.entries[e.hash] != e || rk.cache.entries[e.hash] != nil || gone {
					t.Fatalf("%s: host block %x also in the pool or gone, or not indexed", at, e.hash)
				}
			}
			if hosted != h.tokens || listed != len(h.entries) || h.tokens > h.capacity {
				t.Fatalf("%s: host tier lists %d tokens in %d blocks, counts %d in %d, holds at most %d", at, hosted, listed,
					h.tokens, len(h.entries), h.capacity)
			}
		}
	}
	var reqs []*request
	now := start
	for i := range 400 {
		text := prefixes[rng.IntN(len(prefixes))] + strings.Repeat("q", rng.IntN(400))
		j := w.plan(textKey([]byte(text)), promptTokens(len(text)), int64(1+rng.IntN(200)), -1, -1, 0)
		r, err := w.submit(j)
		if err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
		w.mu.Lock()
		now = now.Add(time.Duration(rng.IntN(20)) * time.Millisecond)
		w.step(now)
		w.mu.Unlock()
		if rng.IntN(10) == 0 {
			w.abort(reqs[rng.IntN(len(reqs))])
		}
		w.mu.Lock()
		check(fmt.Sprintf("request %d", i))
		w.mu.Unlock()
	}
	for range 10000 {
		w.mu.Lock()
		now = now.Add(50 * time.Millisecond)
		w.step(now)
		check("draining")
		idle := w.idleLocked()
		w.mu.Unlock()
		if idle {
			break
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	rk := w.ranks[0]
	if !w.idleLocked() || rk.used() != 0 || rk.cache.pinned != 0 || rk.cachedTokens == 0 || rk.cache.evictable == 0 {
		t.Fatalf("drained: used %d pinned %d cached %d evictable %d", rk.used(), rk.cache.pinned, rk.cachedTokens, rk.cache.evictable)
	}
	if cfg.HostPoolTokens > 0 && (rk.hostLoaded == 0 || rk.cache.host.size() == 0) {
		t.Fatalf("the host tier was never used: loaded %d, holds %d", rk.hostLoaded, rk.cache.host.size())
	}
	w.looping = false
}

// The cost of keying a request: an 8 KiB prompt (2,048 tokens) with a 256-token answer.
func BenchmarkPlan(b *testing.B) {
	text := []byte(strings.Repeat("s", 8<<10))
	for _, off := range []bool{false, true} {
		w := New(Config{DisablePrefixCache: off, FinishEarly: 0.3})
		b.Run(fmt.Sprintf("cache_off=%t", off), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				w.plan(chatKey(text), 2048, 256, -1, -1, 0)
			}
		})
	}
}

// The host tier keeps what it is given, least recently given out first when full, and gives a block
// back once: it is then in the pool.
func TestHostTierLRU(t *testing.T) {
	h := newHostTier(48)
	var gone []uint64
	forget := func(e *cacheEntry) { gone = append(gone, e.hash) }
	blocks := make([]block, 4)
	for i := range blocks {
		blocks[i] = block{hash: uint64(100 + i), tokens: 16}
	}
	// Evicted deepest first, as the pool evicts a prompt: 3, 2, 1, 0. The tier holds three.
	for i := 3; i >= 0; i-- {
		h.put(&cacheEntry{hash: blocks[i].hash, tokens: 16}, forget)
	}
	if h.size() != 48 || len(gone) != 1 || gone[0] != 103 {
		t.Fatalf("holds %d tokens, gone %v; want 48, the deepest block gone", h.size(), gone)
	}
	if n := h.match(blocks); n != 3 {
		t.Fatalf("matches %d leading blocks, want 3", n)
	}
	h.take(101)
	if n := h.match(blocks); n != 1 || h.size() != 32 {
		t.Fatalf("after taking block 1: matches %d, holds %d", n, h.size())
	}
	var none *hostTier
	if none.match(blocks) != 0 || none.size() != 0 {
		t.Fatal("no tier matches nothing")
	}
}

// A prompt evicted from the pool to the host tier comes back from it: its tokens load at
// HostLoadTokensPerSec beside the prefill of the rest, count as cached, and the tier keeps only
// the most recently evicted blocks it has room for.
func TestHostTierHits(t *testing.T) {
	a := []byte(strings.Repeat("a", 32000)) // 8000 tokens: 499 whole blocks before its last token
	b := []byte(strings.Repeat("b", 39960)) // 9990 tokens: evicts all of a from a pool of 10000
	cases := []struct {
		host       int64
		loaded     int64 // of a's 7984 cacheable tokens, the ones the tier gives back
		firstToken float64
	}{
		{0, 0, prefillPass(8000, 0)}, // no tier: a cold prefill
		{20000, 7984, 7984 / hostTPS},
		// Room for 250 blocks: the shallowest, evicted last; the rest is prefilled after them.
		{4000, 4000, prefillPass(4000, 4000)},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("host %d", c.host), func(t *testing.T) {
			w, start := handDriven(t, Config{Timing: TimingStep, MaxTotalTokens: 10000, HostPoolTokens: c.host})
			defer handBack(w)
			clk := &clock{w, start}
			run := func(text []byte) *request {
				t.Helper()
				r := queueByHand(w, w.plan(textKey(text), promptTokens(len(text)), 1, 0, -1, 0), clk.now)
				w.admit(w.ranks[0], clk.now)
				for r.state != stateDone {
					clk.to(clk.now.Add(tickEvery))
				}
				return r
			}
			run(a)
			run(b)
			if l := w.loadsLocked(clk.now)[0]; l.HostCacheTokens != min(c.host, 8000) {
				t.Fatalf("the tier holds %d tokens, want %d", l.HostCacheTokens, min(c.host, 8000))
			}
			again := run(a)
			rk := w.ranks[0]
			if again.cached != c.loaded || rk.hostLoaded != c.loaded {
				t.Fatalf("cached %d, loaded %d; want %d", again.cached, rk.hostLoaded, c.loaded)
			}
			near(t, "first token", again.firstToken, again.admitted.Add(time.Duration(c.firstToken*float64(time.Second))))
			if rk.againTokens != 7984-c.loaded {
				t.Errorf("%d tokens prefilled again after eviction, want %d", rk.againTokens, 7984-c.loaded)
			}
		})
	}
}

// Over HTTP, tokens loaded back from the host tier are reported as cached, in the answer and in
// cache_hit_rate.
func TestHostTierCachedTokens(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 1000
	cfg.HostPoolTokens = 1000
	w, base := startWorker(t, cfg)
	a, b := strings.Repeat("a", 2000), strings.Repeat("b", 3600) // 500 and 900 tokens
	ask := func(text string) int64 {
		return postGenerate(t, base, map[string]any{"text": text, "sampling_params": map[string]any{"max_new_tokens": 1}}).MetaInfo.CachedTokens
	}
	ask(a)
	ask(b) // a's blocks go to the host tier
	eventually(t, "b released", func() bool { return w.Loads()[0].UsedTokens == 0 })
	if got := ask(a); got != 496 {
		t.Fatalf("a again: %d tokens cached, want its 496 from the host tier", got)
	}
	if l := loads(t, base); l.CacheHitRate != round(496.0/1900, 4) {
		t.Fatalf("cache_hit_rate %v, want %v", l.CacheHitRate, round(496.0/1900, 4))
	}
}
