package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Request sizes, in tokens. Long requests are a few thousand tokens of context with a long answer: a
// handful fill the smallest worker's KV pool, which is what a load-aware router must notice.
const (
	shortPromptMin, shortPromptMax = 128, 512
	shortOutMin, shortOutMax       = 32, 128
	longPromptMin, longPromptMax   = 2048, 6144
	longOutMin, longOutMax         = 256, 768
)

// systemPromptTokens is the size of each shared system prompt (-shared-prompts).
const systemPromptTokens = 2048

// spec is one request of the burst. The simulator takes the prompt size from prompt_tokens and
// answers exactly maxTokens tokens of 4 bytes each; a request with a system prompt (group >= 0) sends
// its prompt as text instead, so that the workers' prefix caches see what it shares.
type spec struct {
	long, stream      bool
	prompt, maxTokens int
	group             int // the shared system prompt, -1 for none
	index             int
}

// result is how one request went.
type result struct {
	spec
	upstream string // the worker that answered, from Caddy's X-Upstream response header
	latency  time.Duration
	err      error
}

// plan draws n requests from seed: round(n × longFrac) long ones and round(n × streamFrac) streamed
// ones, at random places; with groups > 0, each shares one of that many system prompts.
func plan(n int, longFrac, streamFrac float64, groups int, seed uint64) []spec {
	r := rand.New(rand.NewPCG(seed, seed))
	between := func(lo, hi int) int { return lo + r.IntN(hi-lo+1) }
	specs := make([]spec, n)
	for _, i := range r.Perm(n)[:int(math.Round(float64(n)*longFrac))] {
		specs[i].long = true
	}
	for _, i := range r.Perm(n)[:int(math.Round(float64(n)*streamFrac))] {
		specs[i].stream = true
	}
	for i := range specs {
		s := &specs[i]
		if s.long {
			s.prompt, s.maxTokens = between(longPromptMin, longPromptMax), between(longOutMin, longOutMax)
		} else {
			s.prompt, s.maxTokens = between(shortPromptMin, shortPromptMax), between(shortOutMin, shortOutMax)
		}
		s.group, s.index = -1, i
	}
	if groups > 0 { // drawn after the sizes, so that a seed's sizes do not depend on -shared-prompts
		for i := range specs {
			specs[i].group = r.IntN(groups)
		}
	}
	return specs
}

// burst sends specs to url, concurrency at a time, and calls progress after each answer. It stops
// starting requests when ctx ends.
func burst(ctx context.Context, client *http.Client, url string, specs []spec, concurrency int, progress func(done, failed int)) []result {
	results := make([]result, len(specs))
	next := make(chan int)
	var done, failed atomic.Int64
	var wg sync.WaitGroup
	for range min(concurrency, len(specs)) {
		wg.Go(func() {
			for i := range next {
				res := send(ctx, client, url, specs[i])
				results[i] = res
				f := failed.Load()
				if res.err != nil {
					f = failed.Add(1)
				}
				progress(int(done.Add(1)), int(f))
			}
		})
	}
feed:
	for i := range specs {
		select {
		case next <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	return results
}

type chatResponse struct {
	Choices []struct {
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
}

// send makes one chat completion and checks that the whole answer arrived: exactly maxTokens tokens
// and, for a stream, the closing [DONE].
func send(ctx context.Context, client *http.Client, url string, s spec) result {
	res := result{spec: s}
	content := "Summarise the attached report."
	if !s.long {
		content = "Say hello."
	}
	request := map[string]any{
		"model":         "sglang-sim",
		"messages":      []map[string]string{{"role": "user", "content": content}},
		"max_tokens":    s.maxTokens,
		"prompt_tokens": s.prompt, // the simulator's override of the prompt size
		"stream":        s.stream,
	}
	if s.group >= 0 {
		delete(request, "prompt_tokens")
		request["messages"] = []map[string]string{
			{"role": "system", "content": systemPrompt(s.group)},
			{"role": "user", "content": fmt.Sprintf("Request %d: %s", s.index, content)},
		}
	}
	body, _ := json.Marshal(request)
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	res.upstream = resp.Header.Get("X-Upstream")
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		res.err = fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
		return res
	}
	var text int
	if s.stream {
		text, res.err = readStream(resp.Body)
	} else {
		var c chatResponse
		if res.err = json.NewDecoder(resp.Body).Decode(&c); res.err == nil && len(c.Choices) == 1 {
			text = len(c.Choices[0].Message.Content)
		}
	}
	res.latency = time.Since(start)
	if res.err == nil && text != 4*s.maxTokens {
		res.err = fmt.Errorf("answer of %d bytes, want %d tokens of 4 bytes", text, s.maxTokens)
	}
	return res
}

// readStream reads Server-Sent Events until [DONE] and returns the length of the streamed content.
func readStream(r io.Reader) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	n := 0
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			return n, nil
		}
		var c chatResponse
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return n, fmt.Errorf("invalid stream chunk %q: %w", data, err)
		}
		for _, ch := range c.Choices {
			n += len(ch.Delta.Content)
		}
	}
	if err := sc.Err(); err != nil {
		return n, err
	}
	return n, errors.New("stream ended without [DONE]")
}

// systemPrompt is shared system prompt g: systemPromptTokens tokens of 4 bytes (the simulator's
// measure), different from the first block on.
func systemPrompt(g int) string {
	words := [...]string{" you", " are", " a", " careful", " helper", " who", " answers", " in", " plain", " words"}
	var b strings.Builder
	fmt.Fprintf(&b, "Assistant %04d.", g)
	r := rand.New(rand.NewPCG(uint64(g), 0x5157))
	for b.Len() < 4*systemPromptTokens {
		b.WriteString(words[r.IntN(len(words))])
	}
	return b.String()[:4*systemPromptTokens]
}
