package sglangsim

import (
	"context"
	"encoding/json"
	"math"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/httpload"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

func TestLoadsWireShape(t *testing.T) {
	_, base := startWorker(t, Config{MaxTotalTokens: 90000, MaxRunningRequests: 256, DPRanks: 2, Version: "0.5.9"})

	resp, b := get(t, base+"/v1/loads?include=core")
	mustStatus(t, resp, b, http.StatusOK)
	var l wireLoads
	decodeStrict(t, b, &l)
	if l.Version != "0.5.9" || l.Accelerator != "sim" || l.NumAccelerators != 2 || len(l.Loads) != 2 {
		t.Fatalf("top level: %s", b)
	}
	if _, err := time.Parse("2006-01-02T15:04:05.999999-07:00", l.Timestamp); err != nil || !strings.HasSuffix(l.Timestamp, "+00:00") {
		t.Fatalf("timestamp %q: %v", l.Timestamp, err)
	}
	if l.DPRankCount != nil || l.Aggregate != nil {
		t.Fatalf("current shape carries legacy fields: %s", b)
	}
	for i, rk := range l.Loads {
		if rk.DPRank != i || rk.MaxTotalNumTokens != 90000 || rk.MaxRunningRequests != 256 ||
			rk.NumWaitingUncachedTokens == nil || rk.NumTotalReqs != nil || rk.Memory != nil || rk.Queues != nil {
			t.Fatalf("rank %d: %+v", i, rk)
		}
	}
	// Every core field of the wire description is present.
	var raw struct{ Loads []map[string]json.RawMessage }
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
		"num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
		"gen_throughput", "cache_hit_rate", "utilization"} {
		if _, ok := raw.Loads[0][f]; !ok {
			t.Errorf("field %s missing", f)
		}
	}

	rep, err := httpload.DecodeLoads(b, time.Now())
	if err != nil {
		t.Fatalf("httpload.DecodeLoads: %v", err)
	}
	all := loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldWaitingUncachedTokens |
		loadpolicy.FieldUsedTokens | loadpolicy.FieldTotalTokens | loadpolicy.FieldMaxTotalTokens |
		loadpolicy.FieldMaxRunning | loadpolicy.FieldTokenUsage | loadpolicy.FieldGenThroughput |
		loadpolicy.FieldCacheHitRate | loadpolicy.FieldUtilization
	if len(rep.Ranks) != 2 || !rep.Ranks[1].Has(all) || rep.MaxTotalTokens != 180000 || rep.Version != "0.5.9" {
		t.Fatalf("report: %+v", rep)
	}

	// No include means all: memory and queues appear.
	resp, b = get(t, base+"/v1/loads")
	mustStatus(t, resp, b, http.StatusOK)
	l = wireLoads{}
	decodeStrict(t, b, &l)
	if m := l.Loads[0].Memory; m == nil || m.TokenCapacity != 90000 || l.Loads[0].Queues == nil {
		t.Fatalf("include=all: %s", b)
	}
	resp, b = get(t, base+"/v1/loads?include=core,queues&include=spec&dp_rank=1")
	mustStatus(t, resp, b, http.StatusOK)
	l = wireLoads{}
	decodeStrict(t, b, &l)
	if len(l.Loads) != 1 || l.Loads[0].DPRank != 1 || l.Loads[0].Queues == nil || l.Loads[0].Memory != nil {
		t.Fatalf("include=core,queues dp_rank=1: %s", b)
	}

	resp, b = get(t, base+"/v1/loads?include=core&format=prometheus")
	mustStatus(t, resp, b, http.StatusOK)
	if !strings.Contains(string(b), `sglang:max_total_num_tokens{dp_rank="1"} 90000`) {
		t.Fatalf("prometheus loads:\n%s", b)
	}

	for _, q := range []string{"include=core,bogus", "dp_rank=2", "dp_rank=x", "format=xml"} {
		resp, b = get(t, base+"/v1/loads?"+q)
		mustStatus(t, resp, b, http.StatusBadRequest)
	}
}

func TestLegacyShapeAndGetLoad(t *testing.T) {
	_, base := startWorker(t, Config{LegacyShape: true, DPRanks: 2})
	resp, b := get(t, base+"/v1/loads?include=core")
	mustStatus(t, resp, b, http.StatusOK)
	var l wireLoads
	decodeStrict(t, b, &l)
	if l.DPRankCount == nil || *l.DPRankCount != 2 || l.Aggregate == nil {
		t.Fatalf("legacy top level: %s", b)
	}
	if rk := l.Loads[0]; rk.NumTotalReqs == nil || rk.NumWaitingUncachedTokens != nil {
		t.Fatalf("legacy rank: %s", b)
	}
	rep, err := httpload.DecodeLoads(b, time.Now())
	if err != nil || len(rep.Ranks) != 2 || rep.Ranks[0].Has(loadpolicy.FieldWaitingUncachedTokens) {
		t.Fatalf("httpload.DecodeLoads legacy: %+v, %v", rep, err)
	}

	resp, b = get(t, base+"/get_load")
	mustStatus(t, resp, b, http.StatusOK)
	var gl []struct {
		DPRank         int     `json:"dp_rank"`
		NumReqs        int     `json:"num_reqs"`
		NumWaitingReqs int     `json:"num_waiting_reqs"`
		NumTokens      int64   `json:"num_tokens"`
		TsTic          float64 `json:"ts_tic"`
	}
	decodeStrict(t, b, &gl)
	if len(gl) != 2 || gl[1].DPRank != 1 || gl[0].TsTic <= 0 {
		t.Fatalf("get_load: %s", b)
	}
	if _, err := httpload.DecodeLegacyLoads(b, time.Now()); err != nil {
		t.Fatalf("httpload.DecodeLegacyLoads: %v", err)
	}

	resp, b = get(t, base+"/metrics")
	mustStatus(t, resp, b, http.StatusOK)
	for _, m := range []string{"num_running_reqs", "num_queue_reqs", "token_usage", "num_used_tokens", "max_total_num_tokens", "gen_throughput"} {
		if !strings.Contains(string(b), "# TYPE sglang:"+m+" gauge\nsglang:"+m+"{") {
			t.Errorf("metric sglang:%s missing", m)
		}
	}
}

func TestLoadsFollowRequests(t *testing.T) {
	cfg := fastConfig()
	cfg.DecodeTokensPerSec = 500
	w, base := startWorker(t, cfg)
	if l := loads(t, base); l.NumRunningReqs != 0 || l.NumUsedTokens != 0 {
		t.Fatalf("idle worker: %+v", l)
	}
	const n = 4
	var chans []<-chan result
	for range n {
		chans = append(chans, goPost(t.Context(), base+"/generate", gen(100, 100)))
	}
	eventually(t, "all requests running", func() bool {
		l := loads(t, base)
		return l.NumRunningReqs == n && l.NumUsedTokens == n*200 && l.TokenUsage > 0
	})
	eventually(t, "gen_throughput > 0", func() bool { return loads(t, base).GenThroughput > 0 })
	for _, ch := range chans {
		r := await(t, ch)
		if r.status != http.StatusOK || r.header.Get(HeaderWorker) != "test" {
			t.Fatalf("generate: %d %v %s", r.status, r.header, r.body)
		}
		var g struct {
			Text     string
			MetaInfo struct {
				PromptTokens     int64    `json:"prompt_tokens"`
				CompletionTokens int64    `json:"completion_tokens"`
				E2ELatency       float64  `json:"e2e_latency"`
				QueueTime        *float64 `json:"queue_time"`
			} `json:"meta_info"`
		}
		if err := json.Unmarshal(r.body, &g); err != nil {
			t.Fatal(err)
		}
		if g.MetaInfo.PromptTokens != 100 || g.MetaInfo.CompletionTokens != 100 || len(g.Text) != 400 ||
			g.MetaInfo.E2ELatency <= 0 || g.MetaInfo.QueueTime == nil {
			t.Fatalf("generate response: %s", r.body)
		}
	}
	eventually(t, "drained", func() bool {
		l := loads(t, base)
		return l.NumRunningReqs == 0 && l.NumWaitingReqs == 0 && l.NumUsedTokens == 0 && l.TokenUsage == 0
	})
	if s := w.Stats(); s.Served != n || s.PeakUsedTokens != n*200 || s.Failed != 0 {
		t.Fatalf("stats: %+v", s)
	}
}

func TestQueueWhenPoolFull(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 1000
	cfg.DecodeTokensPerSec = 1000
	w, base := startWorker(t, cfg)
	// Each request needs 400 + 100 tokens: two fit in the pool, three wait.
	var chans []<-chan result
	for range 5 {
		chans = append(chans, goPost(t.Context(), base+"/generate", gen(400, 100)))
	}
	eventually(t, "requests queued on a full pool", func() bool {
		l := loads(t, base)
		if l.NumWaitingReqs > 0 {
			if l.NumUsedTokens > 1000 || l.TokenUsage > 1 {
				t.Fatalf("pool over capacity: %+v", l)
			}
			return l.NumWaitingUncachedTokens != nil && *l.NumWaitingUncachedTokens == int64(l.NumWaitingReqs)*400 &&
				l.NumTotalTokens == l.NumUsedTokens+*l.NumWaitingUncachedTokens
		}
		return false
	})
	queued := 0
	for _, ch := range chans {
		r := await(t, ch)
		mustOK(t, r)
		var g struct {
			MetaInfo struct {
				QueueTime float64 `json:"queue_time"`
			} `json:"meta_info"`
		}
		if err := json.Unmarshal(r.body, &g); err != nil {
			t.Fatal(err)
		}
		if g.MetaInfo.QueueTime >= 0.05 {
			queued++
		}
	}
	if queued < 3 {
		t.Errorf("%d requests report a queue time, want at least 3", queued)
	}
	eventually(t, "queue drained", func() bool {
		l := loads(t, base)
		return l.NumWaitingReqs == 0 && *l.NumWaitingUncachedTokens == 0 && l.NumUsedTokens == 0
	})
	if s := w.Stats(); s.PeakUsedTokens != 1000 || s.PeakTokenUsage != 1 {
		t.Fatalf("peak: %+v", s)
	}
}

func mustOK(t *testing.T, r result) {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
}

func TestRunningCapQueues(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxRunningRequests = 2
	cfg.DecodeTokensPerSec = 1000
	_, base := startWorker(t, cfg)
	var chans []<-chan result
	for range 5 {
		chans = append(chans, goPost(t.Context(), base+"/generate", gen(10, 100)))
	}
	eventually(t, "running cap reached", func() bool {
		l := loads(t, base)
		if l.NumRunningReqs > 2 {
			t.Fatalf("running %d above the cap", l.NumRunningReqs)
		}
		return l.NumRunningReqs == 2 && l.NumWaitingReqs > 0
	})
	for _, ch := range chans {
		mustOK(t, await(t, ch))
	}
}

func TestRoundRobinRanks(t *testing.T) {
	cfg := fastConfig()
	cfg.DPRanks = 2
	cfg.DecodeTokensPerSec = 0.001 // requests stay running until the worker closes
	w, base := startWorker(t, cfg)
	a := goPost(t.Context(), base+"/generate", gen(10, 10))
	b := goPost(t.Context(), base+"/generate", gen(10, 10))
	eventually(t, "one request on each rank", func() bool {
		l := w.Loads()
		return l[0].Running == 1 && l[1].Running == 1
	})
	w.Close()
	for _, ch := range []<-chan result{a, b} {
		if r := await(t, ch); r.status != http.StatusServiceUnavailable {
			t.Fatalf("after Close: %d %s", r.status, r.body)
		}
	}
	resp, body := do(t, "POST", base+"/generate", "", gen(1, 1))
	mustStatus(t, resp, body, http.StatusServiceUnavailable)
}

func TestCloseReleasesWaiting(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 100
	cfg.DecodeTokensPerSec = 0.001
	w, base := startWorker(t, cfg)
	run := goPost(t.Context(), base+"/generate", gen(50, 50))
	wait := goPost(t.Context(), base+"/v1/chat/completions", map[string]any{
		"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "prompt_tokens": 50, "max_tokens": 50})
	eventually(t, "one waiting", func() bool { return w.Loads()[0].Waiting == 1 })
	w.Close()
	for _, ch := range []<-chan result{run, wait} {
		if r := await(t, ch); r.status != http.StatusServiceUnavailable {
			t.Fatalf("after Close: %d %s", r.status, r.body)
		}
	}
	resp, b := get(t, base+"/health")
	mustStatus(t, resp, b, http.StatusServiceUnavailable)
}

func TestClientCancelFreesKV(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 102 // a request of 50 + 50 is the most it holds (the pool less 2)
	cfg.DecodeTokensPerSec = 0.001
	w, base := startWorker(t, cfg)
	ctx, cancel := context.WithCancel(t.Context())
	run := goPost(ctx, base+"/generate", gen(50, 50))
	wait := goPost(ctx, base+"/generate", gen(50, 50))
	eventually(t, "one running and one waiting", func() bool {
		l := w.Loads()[0]
		return l.UsedTokens == 100 && l.Waiting == 1
	})
	cancel()
	<-run
	<-wait
	eventually(t, "KV freed", func() bool {
		l := w.Loads()[0]
		return l.UsedTokens == 0 && l.Waiting == 0 && l.Running == 0
	})
	if s := w.Stats(); s.Failed != 2 || s.Served != 0 {
		t.Fatalf("stats: %+v", s)
	}
}

func TestStreamingChat(t *testing.T) {
	cfg := fastConfig()
	cfg.DecodeTokensPerSec = 1000
	_, base := startWorker(t, cfg)
	body := map[string]any{
		"model":          "m",
		"messages":       []any{map[string]any{"role": "user", "content": "0123456789"}},
		"max_tokens":     40,
		"stream":         true,
		"stream_options": map[string]any{"include_usage": true},
	}
	b, _ := json.Marshal(body)
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" ||
		resp.Header.Get(HeaderWorker) != "test" || resp.Header.Get(HeaderQueueTime) == "" {
		t.Fatalf("stream response: %d %v", resp.StatusCode, resp.Header)
	}
	events := sseEvents(t, resp.Body)
	if len(events) < 4 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("events: %q", events)
	}
	var content strings.Builder
	var finish string
	var usage *openAIUsage
	contentChunks := 0
	for i, e := range events[:len(events)-1] {
		var c openAIResponse
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("chunk %q: %v", e, err)
		}
		if c.Object != "chat.completion.chunk" || c.Model != "m" {
			t.Fatalf("chunk %q", e)
		}
		if c.Usage != nil {
			usage = c.Usage
			continue
		}
		d := c.Choices[0].Delta
		if i == 0 && d.Role != "assistant" {
			t.Fatalf("first chunk without role: %q", e)
		}
		if d.Content != "" {
			contentChunks++
		}
		content.WriteString(d.Content)
		if f := c.Choices[0].FinishReason; f != nil {
			finish = *f
		}
	}
	if content.String() != filler(0, 40) || finish != "length" || contentChunks < 2 {
		t.Fatalf("content %q (%d chunks), finish %q", content.String(), contentChunks, finish)
	}
	if usage == nil || usage.PromptTokens != 3 || usage.CompletionTokens != 40 || usage.TotalTokens != 43 {
		t.Fatalf("usage: %+v", usage)
	}
}

func TestStreamingGenerateAndChat(t *testing.T) {
	_, base := startWorker(t, fastConfig())
	resp, err := http.Post(base+"/generate", "application/json",
		strings.NewReader(`{"text":"abcdefgh","sampling_params":{"max_new_tokens":20},"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	events := sseEvents(t, resp.Body)
	resp.Body.Close()
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("events: %q", events)
	}
	var last generateResponse
	if err := json.Unmarshal([]byte(events[len(events)-2]), &last); err != nil {
		t.Fatal(err)
	}
	if last.Text != filler(0, 20) || last.MetaInfo.CompletionTokens != 20 || last.MetaInfo.PromptTokens != 2 ||
		last.MetaInfo.FinishReason["type"] != "length" || last.MetaInfo.E2ELatency <= 0 {
		t.Fatalf("last event: %+v", last)
	}

	r, b := do(t, "POST", base+"/v1/chat/completions", "", map[string]any{
		"messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "12345"}}}},
	})
	mustStatus(t, r, b, http.StatusOK)
	var c openAIResponse
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	if c.Object != "chat.completion" || c.Choices[0].Message.Content != filler(0, defaultMaxOut) ||
		c.Usage.PromptTokens != 2 || c.Usage.CompletionTokens != defaultMaxOut || r.Header.Get(HeaderWorker) != "test" {
		t.Fatalf("chat: %s", b)
	}
}

func TestBadRequests(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 100
	cfg.DPRanks = 2
	_, base := startWorker(t, cfg)
	for _, body := range []string{
		// A prompt of the pool less 6 tokens or more, as SGLang refuses it.
		`{"text":"hi","prompt_tokens":94,"sampling_params":{"max_new_tokens":1}}`,
		`{"text":"hi","prompt_tokens":9223372036854775807,"sampling_params":{"max_new_tokens":1}}`,
		`{"text":["a","b"]}`,
		`{"text":"hi","prompt_tokens":1.5}`,
		`{"text":"hi","prompt_tokens":0}`,
		`{"sampling_params":{}}`,
		`{"text":"hi","data_parallel_rank":2}`,
		`{"text":"hi"} trailing`,
		`not json`,
	} {
		resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400", body, resp.StatusCode)
		}
	}
	resp, b := do(t, "POST", base+"/v1/chat/completions", "", map[string]any{"messages": []any{}})
	mustStatus(t, resp, b, http.StatusBadRequest)
}

// SGLang's limits on one request, on a rank of a 100-token pool: a prompt of 94 tokens or more is
// refused with a 400 that says so; a longer output than the rank holds beside the prompt is cut to it
// (max_new_tokens to 98 less the prompt) and ends by its length.
func TestOutputCutToThePool(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 100
	_, base := startWorker(t, cfg)
	for _, v := range []struct{ prompt, maxOut, completion int64 }{
		{1, math.MaxInt64, 97},
		{93, 100, 5},
		{10, 50, 50},
	} {
		resp, b := do(t, "POST", base+"/generate", "", gen(v.prompt, v.maxOut))
		mustStatus(t, resp, b, http.StatusOK)
		var g struct {
			MetaInfo struct {
				CompletionTokens int64 `json:"completion_tokens"`
				FinishReason     struct {
					Type   string `json:"type"`
					Length int64  `json:"length"`
				} `json:"finish_reason"`
			} `json:"meta_info"`
		}
		if err := json.Unmarshal(b, &g); err != nil {
			t.Fatal(err)
		}
		if m := g.MetaInfo; m.CompletionTokens != v.completion || m.FinishReason.Type != "length" || m.FinishReason.Length != v.completion {
			t.Errorf("prompt %d, max_new_tokens %d: %d tokens, finish %+v; want %d, by length", v.prompt, v.maxOut, m.CompletionTokens, m.FinishReason, v.completion)
		}
	}
	resp, b := do(t, "POST", base+"/generate", "", gen(94, 1))
	mustStatus(t, resp, b, http.StatusBadRequest)
	if want := "Input length (94 tokens) exceeds the maximum allowed length (94 tokens)"; !strings.Contains(string(b), want) {
		t.Errorf("refusal %s, want it to say %q", b, want)
	}
}

func TestAPIKey(t *testing.T) {
	cfg := fastConfig()
	cfg.APIKey = "s3cret"
	_, base := startWorker(t, cfg)
	chat := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "x"}}, "max_tokens": 1}
	cases := []struct {
		method, path string
		body         any
	}{
		{"GET", "/v1/loads", nil},
		{"GET", "/get_load", nil},
		{"POST", "/generate", gen(1, 1)},
		{"POST", "/v1/chat/completions", chat},
	}
	for _, c := range cases {
		resp, b := do(t, c.method, base+c.path, "", c.body)
		mustStatus(t, resp, b, http.StatusUnauthorized)
		resp, b = do(t, c.method, base+c.path, "wrong", c.body)
		mustStatus(t, resp, b, http.StatusUnauthorized)
		resp, b = do(t, c.method, base+c.path, "s3cret", c.body)
		mustStatus(t, resp, b, http.StatusOK)
	}
	for _, p := range []string{"/health", "/metrics"} {
		resp, b := get(t, base+p)
		mustStatus(t, resp, b, http.StatusOK)
	}
}

func TestFaults(t *testing.T) {
	w, base := startWorker(t, fastConfig())
	f := w.Faults()

	// Hang: a poll with a deadline gives up; a pending one answers once released.
	f.SetHangLoads(true)
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	req, _ := http.NewRequestWithContext(ctx, "GET", base+"/v1/loads", nil)
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("hung /v1/loads answered")
	}
	cancel()
	eventually(t, "hung request released by its context", func() bool { return f.State().Hung == 0 })
	done := make(chan int, 1)
	go func() {
		resp, err := http.Get(base + "/get_load")
		if err != nil {
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	eventually(t, "request hanging", func() bool { return f.State().Hung == 1 })
	select {
	case <-done:
		t.Fatal("hung /get_load answered")
	default:
	}
	f.SetHangLoads(false)
	if code := <-done; code != http.StatusOK {
		t.Fatalf("released /get_load: %d", code)
	}

	f.SetGarbageLoads(true)
	resp, b := get(t, base+"/v1/loads")
	mustStatus(t, resp, b, http.StatusOK)
	if json.Valid(b) {
		t.Fatalf("garbage is valid JSON: %q", b)
	}
	if _, err := httpload.DecodeLoads(b, time.Now()); err == nil {
		t.Fatal("httpload.DecodeLoads accepted garbage")
	}
	f.SetGarbageLoads(false)

	f.SetNotFoundLoads(true)
	resp, b = get(t, base+"/v1/loads")
	mustStatus(t, resp, b, http.StatusNotFound)
	resp, b = get(t, base+"/get_load")
	mustStatus(t, resp, b, http.StatusOK)
	f.SetNotFoundLoads(false)

	var hookGot time.Duration
	f.OnDown(func(d time.Duration) { hookGot = d })
	f.Down(time.Hour)
	if hookGot != time.Hour {
		t.Fatalf("OnDown hook got %v", hookGot)
	}
	for _, p := range []string{"/health", "/v1/loads", "/metrics"} {
		resp, b = get(t, base+p)
		mustStatus(t, resp, b, http.StatusServiceUnavailable)
	}
	resp, b = do(t, "POST", base+"/generate", "", gen(1, 1))
	mustStatus(t, resp, b, http.StatusServiceUnavailable)

	// The control endpoint stays reachable while down.
	resp, b = do(t, "POST", base+"/sim/fault?down=0&garbage=1&not_found=true", "", nil)
	mustStatus(t, resp, b, http.StatusOK)
	var st FaultState
	decodeStrict(t, b, &st)
	if st != (FaultState{GarbageLoads: true, NotFoundLoads: true}) || f.IsDown() {
		t.Fatalf("fault state: %s", b)
	}
	resp, b = do(t, "POST", base+"/sim/fault?reset=1&hang_loads=1", "", nil)
	mustStatus(t, resp, b, http.StatusOK)
	if st := f.State(); st != (FaultState{HangLoads: true}) {
		t.Fatalf("after reset: %+v", st)
	}
	f.Reset()
	resp, b = do(t, "POST", base+"/sim/fault?down=5s", "", nil)
	mustStatus(t, resp, b, http.StatusOK)
	if !f.IsDown() {
		t.Fatal("down=5s did not take the worker down")
	}
	f.Down(0)
	for _, q := range []string{"bogus=1", "garbage=maybe", "down=soon"} {
		resp, b = do(t, "POST", base+"/sim/fault?"+q, "", nil)
		mustStatus(t, resp, b, http.StatusBadRequest)
	}
	resp, b = get(t, base+"/v1/loads")
	mustStatus(t, resp, b, http.StatusOK)
	resp, b = get(t, base+"/sim/stats")
	mustStatus(t, resp, b, http.StatusOK)
}

// An idle worker must cost no goroutine, so one process can host a large fleet.
func TestIdleWorkersAreFree(t *testing.T) {
	before := runtime.NumGoroutine()
	ws := make([]*Worker, 1000)
	for i := range ws {
		ws[i] = New(Config{})
	}
	for _, w := range ws {
		_ = w.Loads()
	}
	if after := runtime.NumGoroutine(); after > before+5 {
		t.Fatalf("1000 idle workers started %d goroutines", after-before)
	}
	// A worker's clock stops once it drains.
	w := New(fastConfig())
	defer w.Close()
	r, err := w.submit(sized(1, 5))
	if err != nil {
		t.Fatal(err)
	}
	<-r.done
	eventually(t, "tick goroutine stops", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return !w.looping
	})
}

// The decode model: a lone request decodes at DecodeTokensPerSec, a batch shares the speed-up.
func TestDecodeSpeedModel(t *testing.T) {
	w, start := handDriven(t, Config{PrefillTokensPerSec: 1e9, DecodeTokensPerSec: 100, DPRanks: 1})
	var reqs []*request
	for range 17 {
		reqs = append(reqs, queueByHand(w, sized(1, 1000), start))
	}
	w.admit(w.ranks[0], start)
	w.step(start.Add(time.Millisecond))        // prefill: first token each
	w.step(start.Add(1001 * time.Millisecond)) // one second of decode with 17 in the batch
	handBack(w)
	// 100 / (1 + 16/16) = 50 tokens/s each, plus the first token from prefill.
	for _, r := range reqs {
		if got := r.emitted.Load(); got != 51 {
			t.Fatalf("emitted %d, want 51", got)
		}
	}
	if got := w.Loads()[0].Running; got != 17 {
		t.Fatalf("running %d", got)
	}
}

// Admitted requests behind a prefill batch's tokens are reported as SGLang reports the requests its
// prefill batch has not taken: waiting, their uncached tokens queued, their reservations not in use.
func TestPrefillQueueReportsAsWaiting(t *testing.T) {
	w, start := handDriven(t, Config{PrefillTokensPerSec: 1000, DecodeTokensPerSec: 100, DPRanks: 1, MaxTotalTokens: 10000, MaxPrefillTokens: 1000})
	for range 3 {
		queueByHand(w, sized(500, 10), start)
	}
	w.admit(w.ranks[0], start)
	w.step(start.Add(100 * time.Millisecond)) // 100 of the first prompt's 500 tokens prefilled
	handBack(w)

	l := w.Loads()[0]
	// The batch takes the first's 400 tokens left and the second's 500; the third's would pass 1000.
	// Used: the two first requests' 510 reserved tokens each; total adds the queued prompt.
	if l.Running != 2 || l.Waiting != 1 || l.WaitingUncachedTokens != 500 || l.UsedTokens != 1020 ||
		l.TotalTokens != 1520 || l.TokenUsage != 0.102 {
		t.Fatalf("loads %+v: want 2 running, 1 waiting with 500 uncached tokens, 1020 used, 1520 total", l)
	}
}

// The first token's time reaches the client of an answer that is not streamed: a header, beside the
// queue time, so a benchmark splits its latency into queue, prefill and decode.
func TestFirstTokenTimeHeader(t *testing.T) {
	_, base := startWorker(t, Config{Name: "test", PrefillTokensPerSec: 8000, DecodeTokensPerSec: 100})
	start := time.Now()
	resp, _ := do(t, "POST", base+"/generate", "", gen(800, 10)) // prefill 0.1 s, then 9 tokens at 100/s
	elapsed := time.Since(start).Seconds()
	queue, err1 := strconv.ParseFloat(resp.Header.Get(HeaderQueueTime), 64)
	first, err2 := strconv.ParseFloat(resp.Header.Get(HeaderFirstTokenTime), 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("headers %v: %v, %v", resp.Header, err1, err2)
	}
	if queue < 0 || first < queue+0.1-tickEvery.Seconds() || first+0.09-tickEvery.Seconds() > elapsed {
		t.Errorf("queue %.3f s, first token %.3f s, answer %.3f s: want queue <= first token - 0.1 s (prefill), "+
			"first token <= answer - 0.09 s (decode)", queue, first, elapsed)
	}
}

// The chat template writes tool definitions into the prompt: they count in its size, and two prompts
// with different tools share no cached prefix.
func TestChatToolsCountInThePrompt(t *testing.T) {
	_, base := startWorker(t, fastConfig())
	tools := `[{"type":"function","function":{"name":"lookup","parameters":{"type":"object"}}}]`
	body := func(tools string) map[string]any {
		return map[string]any{"messages": []any{map[string]any{"role": "user", "content": strings.Repeat("abcd", 40)}},
			"max_tokens": 4, "tools": json.RawMessage(tools)}
	}
	ask := func(b map[string]any) openAIUsage {
		t.Helper()
		resp, raw := do(t, "POST", base+"/v1/chat/completions", "", b)
		mustStatus(t, resp, raw, http.StatusOK)
		var r openAIResponse
		if err := json.Unmarshal(raw, &r); err != nil || r.Usage == nil {
			t.Fatalf("%s: %v", raw, err)
		}
		return *r.Usage
	}
	if u := ask(body(tools)); u.PromptTokens != int64(len(tools)+160+3)/4 {
		t.Errorf("prompt %d tokens, want the tools' %d bytes and the message's 160 at 4 a token", u.PromptTokens, len(tools))
	}
	other := strings.Replace(tools, "lookup", "search", 1)
	if u := ask(body(other)); u.PromptTokensDetails.CachedTokens != 0 {
		t.Errorf("other tools found %d tokens cached", u.PromptTokensDetails.CachedTokens)
	}
	if u := ask(body(tools)); u.PromptTokensDetails.CachedTokens == 0 {
		t.Error("the same tools and message again found nothing cached")
	}
}

// answer_tokens gives an answer the length a trace recorded: within a client's max_tokens (which only
// caps it, ending by length past it), and without one up to what the rank holds beside the prompt.
func TestAnswerTokens(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 100
	cfg.FinishEarly = 0.3 // answer_tokens overrides the drawn length
	_, base := startWorker(t, cfg)
	chat := func(answer int64, maxTokens *int64) map[string]any {
		b := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "prompt_tokens": 10, "answer_tokens": answer}
		if maxTokens != nil {
			b["max_tokens"] = *maxTokens
		}
		return b
	}
	cap50, cap5 := int64(50), int64(5)
	for _, v := range []struct {
		answer    int64
		maxTokens *int64
		want      int64
		finish    string
	}{
		{20, &cap50, 20, "stop"},
		{20, &cap5, 5, "length"},
		{20, nil, 20, "stop"},
		{500, nil, 88, "length"}, // the pool less 2, less the prompt
	} {
		resp, b := do(t, "POST", base+"/v1/chat/completions", "", chat(v.answer, v.maxTokens))
		mustStatus(t, resp, b, http.StatusOK)
		var c struct {
			Choices []struct {
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
			Usage struct {
				CompletionTokens int64 `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &c); err != nil {
			t.Fatal(err)
		}
		if c.Usage.CompletionTokens != v.want || c.Choices[0].FinishReason != v.finish {
			t.Errorf("answer_tokens %d, max_tokens %v: %d tokens, finish %q; want %d, %q", v.answer, v.maxTokens, c.Usage.CompletionTokens, c.Choices[0].FinishReason, v.want, v.finish)
		}
	}
	resp, b := do(t, "POST", base+"/v1/chat/completions", "", chat(0, nil))
	mustStatus(t, resp, b, http.StatusBadRequest)
}
