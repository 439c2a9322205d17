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
	"sync"
	"sync/atomic"
	"time"
)

// Request sizes. The prompt is ceil(len(text in bytes) / 4) tokens, at least 1 (the usual rule of thumb
// for English with a BPE tokenizer), summed over every chat message's text; /generate and
// /v1/completions also accept token ids, one token each. An integer "prompt_tokens" field in the body
// overrides the size, so a benchmark can send exact sizes without building large prompts; the prefix
// cache still keys on the text, each of its blocks standing for a share of prompt_tokens in proportion
// (see promptKey.blocks). The output is max_tokens (chat and completions; also max_completion_tokens) or
// sampling_params.max_new_tokens (/generate) tokens, default 128, or fewer with Config.FinishEarly.
// n (sampling_params.n for /generate) asks for that many answers, at most MaxSamples: as SGLang does,
// the prompt is prefilled once, and the answers decode side by side on its rank, each as a request.
const (
	defaultMaxOut = 128
	// noMaxTokens is the output cap of a request that names its answer's length (answer_tokens) and
	// no max_tokens: SGLang lets it run to the end of the context, which maxNewTokens cuts to.
	noMaxTokens  = 1 << 24
	maxBodyBytes = 64 << 20
)

// MaxSamples is the most answers (n) a request may ask for.
const MaxSamples = 128

// HeaderWorker names the worker on every generate and chat response; HeaderQueueTime carries the
// seconds the request waited for admission and HeaderFirstTokenTime the seconds from its arrival to its
// first token (its prefill done), so benchmarks can tell queueing, prefill and decode apart through a
// proxy, streamed or not.
const (
	HeaderWorker         = "X-Sglang-Sim-Worker"
	HeaderQueueTime      = "X-Sglang-Sim-Queue-Time"
	HeaderFirstTokenTime = "X-Sglang-Sim-First-Token-Time"
	HeaderDPRank         = "X-Sglang-Sim-Dp-Rank"
)

func promptTokens(textBytes int) int64 {
	return max(1, (int64(textBytes)+bytesPerToken-1)/bytesPerToken)
}

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
	// AnswerTokens is the length the answer has, as a trace recorded it, at most the output the request
	// may have; a client's max_tokens, where sent, is only its cap. Absent: FinishEarly or max_tokens.
	AnswerTokens *int64 `json:"answer_tokens"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type generateRequest struct {
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams struct {
		MaxNewTokens *int64 `json:"max_new_tokens"`
		N            *int64 `json:"n"`
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
	// Tools (or the older Functions) are tool definitions, which the chat template writes into the
	// prompt ahead of the messages.
	Tools               json.RawMessage `json:"tools"`
	Functions           json.RawMessage `json:"functions"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	N                   *int64          `json:"n"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	sizeOverrides
}

type completionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	MaxTokens     *int64          `json:"max_tokens"`
	N             *int64          `json:"n"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
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
	if o.AnswerTokens != nil {
		if *o.AnswerTokens < 1 {
			return 0, 0, 0, badRequest("answer_tokens must be at least 1, got %d", *o.AnswerTokens)
		}
		if maxOut == nil {
			out = noMaxTokens // SGLang's default: as much as the context leaves
		}
	}
	if o.DataParallelRank != nil {
		if *o.DataParallelRank < 0 {
			return 0, 0, 0, badRequest("data_parallel_rank must not be negative, got %d", *o.DataParallelRank)
		}
		dpRank = *o.DataParallelRank
	}
	return prompt, out, dpRank, nil
}

// prompt returns the /generate prompt: text, else input_ids.
func (r generateRequest) prompt() (promptKey, error) {
	switch kind(r.Text) {
	case "string":
		var text string
		if err := json.Unmarshal(r.Text, &text); err != nil {
			return promptKey{}, badRequest("invalid text: %v", err)
		}
		return textKey([]byte(text)), nil
	case "absent":
	default:
		return promptKey{}, badRequest("text must be a string: batch requests are not simulated")
	}
	switch kind(r.InputIDs) {
	case "absent":
		return promptKey{}, badRequest("one of text and input_ids is required")
	case "array":
		var ids []int64
		if err := json.Unmarshal(r.InputIDs, &ids); err != nil {
			return promptKey{}, badRequest("input_ids must be a list of integers: batch requests are not simulated")
		}
		return idsKey(ids), nil
	default:
		return promptKey{}, badRequest("input_ids must be a list of integers")
	}
}

// prompt returns the chat prompt, keyed by the tool definitions (their JSON as sent) and then every
// message's role and text in order. Its size counts the tool definitions and the message text.
func (r chatRequest) prompt() (key promptKey, textBytes int, err error) {
	if len(r.Messages) == 0 {
		return promptKey{}, 0, badRequest("messages must not be empty")
	}
	var b []byte
	for _, defs := range []json.RawMessage{r.Tools, r.Functions} {
		if kind(defs) != "absent" {
			b = append(append(b, defs...), 0)
			textBytes += len(defs)
		}
	}
	for i, m := range r.Messages {
		b = append(append(b, m.Role...), 0)
		start := len(b)
		switch kind(m.Content) {
		case "absent":
		case "string":
			var s string
			if err := json.Unmarshal(m.Content, &s); err != nil {
				return promptKey{}, 0, badRequest("invalid messages[%d].content: %v", i, err)
			}
			b = append(b, s...)
		case "array":
			var parts []struct {
				Text string `json:"text"`
			}
			if err := json.Unmarshal(m.Content, &parts); err != nil {
				return promptKey{}, 0, badRequest("invalid messages[%d].content: %v", i, err)
			}
			for _, p := range parts {
				b = append(b, p.Text...)
			}
		default:
			return promptKey{}, 0, badRequest("messages[%d].content must be a string or a list of parts", i)
		}
		textBytes += len(b) - start
		b = append(b, 0)
	}
	return chatKey(b), textBytes, nil
}

// prompt returns the completion prompt: a string, a list of token ids, or a list of one string.
func (r completionRequest) prompt() (promptKey, error) {
	switch kind(r.Prompt) {
	case "string":
		var text string
		if err := json.Unmarshal(r.Prompt, &text); err != nil {
			return promptKey{}, badRequest("invalid prompt: %v", err)
		}
		return textKey([]byte(text)), nil
	case "array":
		var ids []int64
		if err := json.Unmarshal(r.Prompt, &ids); err == nil {
			if len(ids) == 0 {
				return promptKey{}, badRequest("prompt must not be empty")
			}
			return idsKey(ids), nil
		}
		var texts []string
		if err := json.Unmarshal(r.Prompt, &texts); err != nil || len(texts) != 1 {
			return promptKey{}, badRequest("prompt must be a string, a list of token ids or a list of one string: batch requests are not simulated")
		}
		return textKey([]byte(texts[0])), nil
	case "absent":
		return promptKey{}, badRequest("prompt is required")
	default:
		return promptKey{}, badRequest("prompt must be a string or a list")
	}
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
func (w *Worker) enqueue(rw http.ResponseWriter, r *http.Request, j job) *request {
	req, err := w.submit(j)
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
	h.Set(HeaderFirstTokenTime, strconv.FormatFloat(req.firstToken.Sub(req.enqueued).Seconds(), 'f', 6, 64))
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
	mu sync.Mutex // the answers of a request for several stream at once
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
	s.mu.Lock()
	defer s.mu.Unlock()
	_, _ = s.rw.Write([]byte("data: "))
	_, _ = s.rw.Write(b)
	_, _ = s.rw.Write([]byte("\n\n"))
	_ = s.rc.Flush()
}

func (s *sse) done() { s.raw([]byte("[DONE]")) }

// call is one parsed generation request, whichever API it came through: its first answer's job, and
// the others' when it asks for several.
type call struct {
	job
	more         []job
	stream       bool
	includeUsage bool   // OpenAI stream_options.include_usage
	model        string // OpenAI model name to echo
}

// newCall resolves a request's sizes and plans its jobs, one per answer asked for (n).
func (w *Worker) newCall(k promptKey, estimate int64, o sizeOverrides, maxTokens, n *int64) (call, error) {
	prompt, maxOut, dpRank, err := o.sizes(estimate, maxTokens)
	if err != nil {
		return call{}, err
	}
	samples := int64(1)
	if n != nil {
		if *n < 1 || *n > MaxSamples {
			return call{}, badRequest("n must be in [1, %d], got %d", MaxSamples, *n)
		}
		samples = *n
	}
	answer := int64(-1)
	if o.AnswerTokens != nil {
		answer = *o.AnswerTokens
	}
	c := call{job: w.plan(k, prompt, maxOut, answer, dpRank, 0)}
	for i := 1; i < int(samples); i++ {
		c.more = append(c.more, w.plan(k, prompt, maxOut, answer, dpRank, i))
	}
	return c, nil
}

// sample is the job of answer i.
func (c *call) sample(i int) *job {
	if i == 0 {
		return &c.job
	}
	return &c.more[i-1]
}

// outputs is the output tokens of every answer.
func (c *call) outputs() int64 {
	n := c.output
	for _, j := range c.more {
		n += j.output
	}
	return n
}

// finishReason is "stop" for an answer that ended before its max_tokens, as at an end-of-sequence
// token, else "length".
func (j *job) finishReason() string {
	if j.output < j.maxTokens {
		return "stop"
	}
	return "length"
}

// dialect is one API's request and response shapes; serve runs the part they share. reqs are the
// requests of a call's answers, in order.
type dialect interface {
	parse(w *Worker, rw http.ResponseWriter, r *http.Request) (call, error)
	// reply is the whole answer of a request that does not stream.
	reply(c *call, reqs []*request) any
	// streamer returns the function that sends answer i's output tokens [from, to) as they come; final
	// marks its last call, once that answer is done.
	streamer(c *call, reqs []*request, i int, s *sse) func(from, to int64, final bool)
	// streamEnd sends what follows every answer's last event, before [DONE].
	streamEnd(c *call, reqs []*request, s *sse)
}

// serve answers one API's generation requests. A stream sends its first event when prefill finishes,
// so the time to the first event is the time to the first token.
func (w *Worker) serve(d dialect) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set(HeaderWorker, w.cfg.Name)
		c, err := d.parse(w, rw, r)
		if err != nil {
			writeError(rw, err)
			return
		}
		req := w.enqueue(rw, r, c.job)
		if req == nil {
			return
		}
		reqs := w.submitMore(rw, req, c.more)
		if reqs == nil {
			return
		}
		if !c.stream {
			if w.waitAll(r.Context(), rw, reqs) {
				writeJSON(rw, http.StatusOK, d.reply(&c, reqs))
			}
			return
		}
		s := newSSE(rw)
		if w.followAll(r.Context(), reqs, func(i int) func(from, to int64, final bool) { return d.streamer(&c, reqs, i, s) }) {
			d.streamEnd(&c, reqs, s)
			s.done()
		}
	}
}

// submitMore submits the other answers of first's request once first has prefilled, on its rank,
// where they find the prompt cached. It returns every answer's request, or nil when one failed (it
// has answered then).
func (w *Worker) submitMore(rw http.ResponseWriter, first *request, more []job) []*request {
	reqs := []*request{first}
	for _, j := range more {
		j.dpRank = first.rank.id
		req, err := w.submit(j)
		if err != nil {
			for _, r := range reqs {
				w.abort(r)
			}
			writeError(rw, err)
			return nil
		}
		reqs = append(reqs, req)
	}
	return reqs
}

// waitAll is wait for every request, aborting the rest when one fails.
func (w *Worker) waitAll(ctx context.Context, rw http.ResponseWriter, reqs []*request) bool {
	for i, req := range reqs {
		if !w.wait(ctx, rw, req) {
			for _, rest := range reqs[i+1:] {
				w.abort(rest)
			}
			return false
		}
	}
	return true
}

// followAll is follow for every request at once, emit(i) sending request i's tokens; when one fails
// the others are aborted.
func (w *Worker) followAll(ctx context.Context, reqs []*request, emit func(i int) func(from, to int64, final bool)) bool {
	if len(reqs) == 1 {
		return w.follow(ctx, reqs[0], emit(0))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var failed atomic.Bool
	for i, req := range reqs {
		wg.Go(func() {
			if !w.follow(ctx, req, emit(i)) {
				failed.Store(true)
				cancel()
			}
		})
	}
	wg.Wait()
	return !failed.Load()
}

// eosTokenID is what /generate reports as the matched stop token of an answer that ended early.
const eosTokenID = 2

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
	Index    *int     `json:"index,omitempty"` // which answer, when the request asked for several
}

// generateAPI is SGLang's native POST /generate. Its stream sends the cumulative text, as SGLang's does
// by default.
type generateAPI struct{}

func (generateAPI) parse(w *Worker, rw http.ResponseWriter, r *http.Request) (call, error) {
	var body generateRequest
	if err := decodeBody(r, rw, &body); err != nil {
		return call{}, err
	}
	k, err := body.prompt()
	if err != nil {
		return call{}, err
	}
	c, err := w.newCall(k, max(1, k.tokens), body.sizeOverrides, body.SamplingParams.MaxNewTokens, body.SamplingParams.N)
	c.stream = body.Stream
	return c, err
}

func (generateAPI) meta(j *job, req *request, tokens int64, final bool) metaInfo {
	m := metaInfo{
		ID:               fmt.Sprintf("%x", req.id),
		PromptTokens:     j.prompt,
		CompletionTokens: tokens,
		CachedTokens:     req.cached,
		QueueTime:        round(req.queueTime(), 6),
	}
	if final {
		if j.finishReason() == "stop" {
			m.FinishReason = map[string]any{"type": "stop", "matched": eosTokenID}
		} else {
			m.FinishReason = map[string]any{"type": "length", "length": j.maxTokens}
		}
		m.E2ELatency = round(req.e2e(), 6)
	}
	return m
}

// reply is an object, or a list of them for a request of several answers, as SGLang answers.
func (g generateAPI) reply(c *call, reqs []*request) any {
	out := make([]generateResponse, len(reqs))
	for i, req := range reqs {
		j := c.sample(i)
		out[i] = generateResponse{Text: filler(0, j.output), MetaInfo: g.meta(j, req, j.output, true), Index: answerIndex(i, len(reqs))}
	}
	if len(out) == 1 {
		return out[0]
	}
	return out
}

// answerIndex is answer i's index as /generate sends it: only when the request asked for several.
func answerIndex(i, answers int) *int {
	if answers < 2 {
		return nil
	}
	return &i
}

// streamer sends answer i's cumulative text; with several answers each event says whose it is.
func (g generateAPI) streamer(c *call, reqs []*request, i int, s *sse) func(from, to int64, final bool) {
	j, req, index := c.sample(i), reqs[i], answerIndex(i, len(reqs))
	return func(_, to int64, final bool) {
		s.send(generateResponse{Text: filler(0, to), MetaInfo: g.meta(j, req, to, final), Index: index})
	}
}

func (generateAPI) streamEnd(*call, []*request, *sse) {}

type chatMessage struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
}

// openAIChoice is a choice of a chat answer (message or delta) or of a completion (text).
type openAIChoice struct {
	Index        int          `json:"index"`
	Message      *chatMessage `json:"message,omitempty"`
	Delta        *chatMessage `json:"delta,omitempty"`
	Text         *string      `json:"text,omitempty"`
	FinishReason *string      `json:"finish_reason"`
}

type openAIUsage struct {
	PromptTokens        int64         `json:"prompt_tokens"`
	CompletionTokens    int64         `json:"completion_tokens"`
	TotalTokens         int64         `json:"total_tokens"`
	PromptTokensDetails promptDetails `json:"prompt_tokens_details"`
	QueueTime           float64       `json:"queue_time"` // extension: seconds waiting for admission
}

type promptDetails struct {
	CachedTokens int64 `json:"cached_tokens"`
}

type openAIResponse struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Created int64          `json:"created"`
	Model   string         `json:"model"`
	Choices []openAIChoice `json:"choices"`
	Usage   *openAIUsage   `json:"usage,omitempty"`
}

// openAIAPI is POST /v1/chat/completions (chat) or POST /v1/completions.
type openAIAPI struct{ chat bool }

func (a openAIAPI) parse(w *Worker, rw http.ResponseWriter, r *http.Request) (call, error) {
	var (
		k         promptKey
		estimate  int64
		sizes     sizeOverrides
		maxTokens *int64
		n         *int64
		stream    bool
		opts      *streamOptions
		model     string
	)
	if a.chat {
		var body chatRequest
		if err := decodeBody(r, rw, &body); err != nil {
			return call{}, err
		}
		var textBytes int
		var err error
		if k, textBytes, err = body.prompt(); err != nil {
			return call{}, err
		}
		estimate, sizes, maxTokens, n = promptTokens(textBytes), body.sizeOverrides, body.MaxTokens, body.N
		if maxTokens == nil {
			maxTokens = body.MaxCompletionTokens
		}
		stream, opts, model = body.Stream, body.StreamOptions, body.Model
	} else {
		var body completionRequest
		if err := decodeBody(r, rw, &body); err != nil {
			return call{}, err
		}
		var err error
		if k, err = body.prompt(); err != nil {
			return call{}, err
		}
		estimate, sizes, maxTokens, n = max(1, k.tokens), body.sizeOverrides, body.MaxTokens, body.N
		stream, opts, model = body.Stream, body.StreamOptions, body.Model
	}
	c, err := w.newCall(k, estimate, sizes, maxTokens, n)
	c.stream, c.includeUsage, c.model = stream, opts != nil && opts.IncludeUsage, model
	if c.model == "" {
		c.model = modelName
	}
	return c, err
}

func (a openAIAPI) envelope(c *call, req *request, chunk bool) openAIResponse {
	resp := openAIResponse{Created: time.Now().Unix(), Model: c.model}
	switch {
	case a.chat && chunk:
		resp.ID, resp.Object = fmt.Sprintf("chatcmpl-%x", req.id), "chat.completion.chunk"
	case a.chat:
		resp.ID, resp.Object = fmt.Sprintf("chatcmpl-%x", req.id), "chat.completion"
	default:
		resp.ID, resp.Object = fmt.Sprintf("cmpl-%x", req.id), "text_completion"
	}
	return resp
}

// usage counts the prompt once and every answer's output, as SGLang does for n answers.
func (openAIAPI) usage(c *call, req *request) *openAIUsage {
	out := c.outputs()
	return &openAIUsage{
		PromptTokens:        c.prompt,
		CompletionTokens:    out,
		TotalTokens:         c.prompt + out,
		PromptTokensDetails: promptDetails{CachedTokens: req.cached},
		QueueTime:           round(req.queueTime(), 6),
	}
}

func (a openAIAPI) reply(c *call, reqs []*request) any {
	resp := a.envelope(c, reqs[0], false)
	for i := range reqs {
		j := c.sample(i)
		text, finish := filler(0, j.output), j.finishReason()
		ch := openAIChoice{Index: i, FinishReason: &finish}
		if a.chat {
			ch.Message = &chatMessage{Role: "assistant", Content: text}
		} else {
			ch.Text = &text
		}
		resp.Choices = append(resp.Choices, ch)
	}
	resp.Usage = a.usage(c, reqs[0])
	return resp
}

// streamer sends a chunk per batch of answer i's new tokens (a chat's first carries the role) and a
// last chunk with its finish reason.
func (a openAIAPI) streamer(c *call, reqs []*request, i int, s *sse) func(from, to int64, final bool) {
	resp := a.envelope(c, reqs[0], true)
	j := c.sample(i)
	first := true
	send := func(text string, finish *string) {
		ch := openAIChoice{Index: i, FinishReason: finish}
		if a.chat {
			ch.Delta = &chatMessage{Content: text}
			if first {
				ch.Delta.Role = "assistant"
			}
		} else {
			ch.Text = &text
		}
		first = false
		resp.Choices = []openAIChoice{ch}
		s.send(resp)
	}
	return func(from, to int64, final bool) {
		if from < to || a.chat && first && final {
			send(filler(from, to), nil)
		}
		if !final {
			return
		}
		finish := j.finishReason()
		send("", &finish)
	}
}

// streamEnd sends the usage chunk when the client asked for it.
func (a openAIAPI) streamEnd(c *call, reqs []*request, s *sse) {
	if c.includeUsage {
		resp := a.envelope(c, reqs[0], true)
		resp.Choices, resp.Usage = []openAIChoice{}, a.usage(c, reqs[0])
		s.send(resp)
	}
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
