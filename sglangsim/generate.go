package sglangsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Request sizes. The prompt is ceil(len(text in bytes) / 4) tokens, at least 1 (the usual rule of thumb
// for English with a BPE tokenizer), summed over every chat message's text; /generate also accepts
// input_ids, one token each. An integer "prompt_tokens" field in the body overrides the estimate, so a
// benchmark can send exact sizes without building large prompts. The output is exactly max_tokens
// (chat; also max_completion_tokens) or sampling_params.max_new_tokens (/generate) tokens, default 128:
// the simulator never stops early.
const (
	defaultMaxOut = 128
	maxBodyBytes  = 64 << 20
)

// HeaderWorker names the worker on every generate and chat response; HeaderQueueTime carries the
// seconds the request waited for admission, so benchmarks can measure queueing through a proxy.
const (
	HeaderWorker    = "X-Sglang-Sim-Worker"
	HeaderQueueTime = "X-Sglang-Sim-Queue-Time"
	HeaderDPRank    = "X-Sglang-Sim-Dp-Rank"
)

func promptTokens(textBytes int) int64 { return max(1, (int64(textBytes)+3)/4) }

// fillerWords are all four bytes long, so output text re-tokenises to its token count.
var fillerWords = [...]string{" the", " sim", " kv ", " and", " gpu", " for", " tok", " run"}

// filler returns the text of output tokens [from, to).
func filler(from, to int64) string {
	var b strings.Builder
	b.Grow(int(to-from) * 4)
	for i := from; i < to; i++ {
		b.WriteString(fillerWords[i%int64(len(fillerWords))])
	}
	return b.String()
}

type sizeOverrides struct {
	PromptTokens     *int64 `json:"prompt_tokens"`
	DataParallelRank *int   `json:"data_parallel_rank"`
}

type generateRequest struct {
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams struct {
		MaxNewTokens *int64 `json:"max_new_tokens"`
	} `json:"sampling_params"`
	Stream bool `json:"stream"`
	sizeOverrides
}

type chatRequest struct {
	Model    string `json:"model"`
	Messages []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	} `json:"messages"`
	MaxTokens           *int64 `json:"max_tokens"`
	MaxCompletionTokens *int64 `json:"max_completion_tokens"`
	Stream              bool   `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	sizeOverrides
}

// badRequest is a request body the simulator refuses with 400.
func badRequest(format string, args ...any) error {
	return &requestError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

func decodeBody(r *http.Request, rw http.ResponseWriter, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(rw, r.Body, maxBodyBytes))
	if err := dec.Decode(v); err != nil {
		return badRequest("invalid request body: %v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return badRequest("invalid request body: trailing data")
	}
	return nil
}

// sizes resolves the prompt override, the output length and the DP rank (-1: round-robin).
func (o sizeOverrides) sizes(estimate int64, maxOut *int64) (prompt, out int64, dpRank int, err error) {
	prompt, out, dpRank = estimate, defaultMaxOut, -1
	if o.PromptTokens != nil {
		if *o.PromptTokens < 1 {
			return 0, 0, 0, badRequest("prompt_tokens must be at least 1, got %d", *o.PromptTokens)
		}
		prompt = *o.PromptTokens
	}
	if maxOut != nil {
		if *maxOut < 0 {
			return 0, 0, 0, badRequest("max tokens must not be negative, got %d", *maxOut)
		}
		out = *maxOut
	}
	if o.DataParallelRank != nil {
		if *o.DataParallelRank < 0 {
			return 0, 0, 0, badRequest("data_parallel_rank must not be negative, got %d", *o.DataParallelRank)
		}
		dpRank = *o.DataParallelRank
	}
	return prompt, out, dpRank, nil
}

func (r generateRequest) estimate() (int64, error) {
	var text string
	switch kind(r.Text) {
	case "string":
		if err := json.Unmarshal(r.Text, &text); err != nil {
			return 0, badRequest("invalid text: %v", err)
		}
		return promptTokens(len(text)), nil
	case "absent":
	default:
		return 0, badRequest("text must be a string: batch requests are not simulated")
	}
	switch kind(r.InputIDs) {
	case "absent":
		return 0, badRequest("one of text and input_ids is required")
	case "array":
		var ids []int64
		if err := json.Unmarshal(r.InputIDs, &ids); err != nil {
			return 0, badRequest("input_ids must be a list of integers: batch requests are not simulated")
		}
		return max(1, int64(len(ids))), nil
	default:
		return 0, badRequest("input_ids must be a list of integers")
	}
}

func (r chatRequest) estimate() (int64, error) {
	if len(r.Messages) == 0 {
		return 0, badRequest("messages must not be empty")
	}
	n := 0
	for i, m := range r.Messages {
		switch kind(m.Content) {
		case "absent":
		case "string":
			var s string
			if err := json.Unmarshal(m.Content, &s); err != nil {
				return 0, badRequest("invalid messages[%d].content: %v", i, err)
			}
			n += len(s)
		case "array":
			var parts []struct {
				Text string `json:"text"`
			}
			if err := json.Unmarshal(m.Content, &parts); err != nil {
				return 0, badRequest("invalid messages[%d].content: %v", i, err)
			}
			for _, p := range parts {
				n += len(p.Text)
			}
		default:
			return 0, badRequest("messages[%d].content must be a string or a list of parts", i)
		}
	}
	return promptTokens(n), nil
}

// kind names the JSON type of raw, "absent" for a missing field or null.
func kind(raw json.RawMessage) string {
	s := strings.TrimSpace(string(raw))
	switch {
	case s == "" || s == "null":
		return "absent"
	case s[0] == '"':
		return "string"
	case s[0] == '[':
		return "array"
	case s[0] == '{':
		return "object"
	}
	return "other"
}

// enqueue queues a request and waits until its prefill is done. When it fails or the client goes away it
// answers (if it still can) and returns nil.
func (w *Worker) enqueue(rw http.ResponseWriter, r *http.Request, prompt, maxOut int64, dpRank int) *request {
	req, err := w.submit(prompt, maxOut, dpRank)
	if err != nil {
		writeError(rw, err)
		return nil
	}
	select {
	case <-req.started:
	case <-req.done:
	case <-r.Context().Done():
		w.abort(req)
		return nil
	}
	if closed(req.done) && req.err != nil {
		writeError(rw, &requestError{http.StatusServiceUnavailable, req.err.Error()})
		return nil
	}
	h := rw.Header()
	h.Set(HeaderQueueTime, strconv.FormatFloat(req.queueTime(), 'f', 6, 64))
	h.Set(HeaderDPRank, strconv.Itoa(req.rank.id))
	return req
}

// wait blocks until the request is done; false when it failed or the client went away.
func (w *Worker) wait(ctx context.Context, rw http.ResponseWriter, req *request) bool {
	select {
	case <-req.done:
	case <-ctx.Done():
		w.abort(req)
		return false
	}
	if req.err != nil {
		writeError(rw, &requestError{http.StatusServiceUnavailable, req.err.Error()})
		return false
	}
	return true
}

// follow calls emit with each batch of new output tokens [from, to) until the request is done, and
// once more with final set when it finished (possibly with from == to). It returns false when the
// request failed or the client went away.
func (w *Worker) follow(ctx context.Context, req *request, emit func(from, to int64, final bool)) bool {
	var sent int64
	for {
		select {
		case <-req.notify:
			if e := req.emitted.Load(); e > sent {
				emit(sent, e, false)
				sent = e
			}
		case <-req.done:
			if req.err != nil {
				return false
			}
			emit(sent, req.emitted.Load(), true)
			return true
		case <-ctx.Done():
			w.abort(req)
			return false
		}
	}
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// queueTime is the time from arrival to admission, in seconds; valid once started is closed.
func (r *request) queueTime() float64 { return r.admitted.Sub(r.enqueued).Seconds() }

// e2e is the time from arrival to the last token, in seconds; valid once done is closed.
func (r *request) e2e() float64 { return r.finished.Sub(r.enqueued).Seconds() }

// sse writes Server-Sent Events and flushes each one.
type sse struct {
	rw http.ResponseWriter
	rc *http.ResponseController
}

func newSSE(rw http.ResponseWriter) *sse {
	h := rw.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	rw.WriteHeader(http.StatusOK)
	return &sse{rw: rw, rc: http.NewResponseController(rw)}
}

func (s *sse) send(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	s.raw(b)
}

func (s *sse) raw(b []byte) {
	_, _ = s.rw.Write([]byte("data: "))
	_, _ = s.rw.Write(b)
	_, _ = s.rw.Write([]byte("\n\n"))
	_ = s.rc.Flush()
}

func (s *sse) done() { s.raw([]byte("[DONE]")) }

type metaInfo struct {
	ID               string         `json:"id"`
	FinishReason     map[string]any `json:"finish_reason"`
	PromptTokens     int64          `json:"prompt_tokens"`
	CompletionTokens int64          `json:"completion_tokens"`
	CachedTokens     int64          `json:"cached_tokens"`
	QueueTime        float64        `json:"queue_time"`
	E2ELatency       float64        `json:"e2e_latency,omitempty"`
}

type generateResponse struct {
	Text     string   `json:"text"`
	MetaInfo metaInfo `json:"meta_info"`
}

// handleGenerate serves SGLang's native POST /generate.
func (w *Worker) handleGenerate(rw http.ResponseWriter, r *http.Request) {
	rw.Header().Set(HeaderWorker, w.cfg.Name)
	var body generateRequest
	if err := decodeBody(r, rw, &body); err != nil {
		writeError(rw, err)
		return
	}
	est, err := body.estimate()
	if err != nil {
		writeError(rw, err)
		return
	}
	prompt, maxOut, dpRank, err := body.sizes(est, body.SamplingParams.MaxNewTokens)
	if err != nil {
		writeError(rw, err)
		return
	}
	req := w.enqueue(rw, r, prompt, maxOut, dpRank)
	if req == nil {
		return
	}
	meta := func(tokens int64, final bool) metaInfo {
		m := metaInfo{
			ID:               fmt.Sprintf("%x", req.id),
			PromptTokens:     prompt,
			CompletionTokens: tokens,
			QueueTime:        round(req.queueTime(), 6),
		}
		if final {
			m.FinishReason = map[string]any{"type": "length", "length": maxOut}
			m.E2ELatency = round(req.e2e(), 6)
		}
		return m
	}
	if !body.Stream {
		if w.wait(r.Context(), rw, req) {
			writeJSON(rw, http.StatusOK, generateResponse{Text: filler(0, maxOut), MetaInfo: meta(maxOut, true)})
		}
		return
	}
	// SGLang streams the cumulative text by default.
	s := newSSE(rw)
	if w.follow(r.Context(), req, func(_, to int64, final bool) {
		s.send(generateResponse{Text: filler(0, to), MetaInfo: meta(to, final)})
	}) {
		s.done()
	}
}

type chatMessage struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
}

type chatChoice struct {
	Index        int          `json:"index"`
	Message      *chatMessage `json:"message,omitempty"`
	Delta        *chatMessage `json:"delta,omitempty"`
	FinishReason *string      `json:"finish_reason"`
}

type chatUsage struct {
	PromptTokens     int64   `json:"prompt_tokens"`
	CompletionTokens int64   `json:"completion_tokens"`
	TotalTokens      int64   `json:"total_tokens"`
	QueueTime        float64 `json:"queue_time"` // extension: seconds waiting for admission
}

type chatResponse struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   *chatUsage   `json:"usage,omitempty"`
}

// handleChat serves POST /v1/chat/completions. A stream sends its first chunk when prefill finishes,
// so the time to the first chunk is the time to the first token.
func (w *Worker) handleChat(rw http.ResponseWriter, r *http.Request) {
	rw.Header().Set(HeaderWorker, w.cfg.Name)
	var body chatRequest
	if err := decodeBody(r, rw, &body); err != nil {
		writeError(rw, err)
		return
	}
	est, err := body.estimate()
	if err != nil {
		writeError(rw, err)
		return
	}
	maxTokens := body.MaxTokens
	if maxTokens == nil {
		maxTokens = body.MaxCompletionTokens
	}
	prompt, maxOut, dpRank, err := body.sizes(est, maxTokens)
	if err != nil {
		writeError(rw, err)
		return
	}
	req := w.enqueue(rw, r, prompt, maxOut, dpRank)
	if req == nil {
		return
	}
	model := body.Model
	if model == "" {
		model = modelName
	}
	resp := chatResponse{
		ID:      fmt.Sprintf("chatcmpl-%x", req.id),
		Created: time.Now().Unix(),
		Model:   model,
	}
	usage := func() *chatUsage {
		return &chatUsage{
			PromptTokens:     prompt,
			CompletionTokens: maxOut,
			TotalTokens:      prompt + maxOut,
			QueueTime:        round(req.queueTime(), 6),
		}
	}
	length := "length"
	if !body.Stream {
		if w.wait(r.Context(), rw, req) {
			resp.Object = "chat.completion"
			resp.Choices = []chatChoice{{
				Message:      &chatMessage{Role: "assistant", Content: filler(0, maxOut)},
				FinishReason: &length,
			}}
			resp.Usage = usage()
			writeJSON(rw, http.StatusOK, resp)
		}
		return
	}
	resp.Object = "chat.completion.chunk"
	s := newSSE(rw)
	first := true
	chunk := func(delta chatMessage, finish *string) {
		resp.Choices = []chatChoice{{Delta: &delta, FinishReason: finish}}
		s.send(resp)
	}
	if maxOut == 0 {
		chunk(chatMessage{Role: "assistant"}, nil)
		first = false
	}
	if !w.follow(r.Context(), req, func(from, to int64, _ bool) {
		if from == to {
			return
		}
		d := chatMessage{Content: filler(from, to)}
		if first {
			d.Role, first = "assistant", false
		}
		chunk(d, nil)
	}) {
		return
	}
	chunk(chatMessage{}, &length)
	if body.StreamOptions != nil && body.StreamOptions.IncludeUsage {
		resp.Choices, resp.Usage = []chatChoice{}, usage()
		s.send(resp)
	}
	s.done()
}

// writeError answers an OpenAI-style error object, as SGLang does on its generate routes.
func writeError(rw http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	var re *requestError
	if errors.As(err, &re) {
		status = re.status
	}
	typ := "InternalServerError"
	switch status {
	case http.StatusBadRequest:
		typ = "BadRequestError"
	case http.StatusServiceUnavailable:
		typ = "ServiceUnavailableError"
	}
	writeJSON(rw, status, map[string]any{
		"object": "error", "message": err.Error(), "type": typ, "param": nil, "code": status,
	})
}
