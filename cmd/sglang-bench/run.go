package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// policy is one configuration under test: a Caddy lb_policy, or an in-process router.
type policy struct {
	name     string
	lb       string        // the lb_policy line and block; empty for an in-process router
	interval time.Duration // sglang_load polling interval; 0 for Caddy's own policies
	router   func(workers int) router
	// study marks a row that measures one change to the model: it runs only when -policies names it,
	// so that the default run keeps the machine below saturation.
	study bool
}

// sglangLoad is an lb_policy sglang_load block with the given lines, polled every interval.
func sglangLoad(name string, interval time.Duration, lines ...string) policy {
	lb := "lb_policy sglang_load"
	if len(lines) > 0 {
		lb += " {\n\t\t\t" + strings.Join(lines, "\n\t\t\t") + "\n\t\t}"
	}
	return policy{name: name, lb: lb, interval: interval}
}

// caddyfile is the config of a Caddy with admin at admin that serves port by proxying to addrs with
// p, its loads polled every p.interval.
func (p policy) caddyfile(admin string, port int, addrs []string) string {
	global := ""
	if p.interval > 0 {
		global = fmt.Sprintf("\tsglang_load {\n\t\tinterval %s\n\t}\n", p.interval)
	}
	return fmt.Sprintf("{\n\tadmin %s\n\tauto_https off\n\tpersist_config off\n%s}\nhttp://127.0.0.1:%d {\n\treverse_proxy %s {\n\t\t%s\n\t}\n}\n",
		admin, global, port, strings.Join(addrs, " "), p.lb)
}

// sample is one request's outcome, as the client measured it.
type sample struct {
	job           int
	ok            bool
	long, stream  bool
	worker        int // index in the fleet; -1 unknown
	start, end    time.Time
	latency, ttft time.Duration
	// queue is the seconds the request waited for admission, and firstToken from its arrival to its
	// first token, as the worker measured them (the simulator's headers).
	queue, firstToken   float64
	prompt, cached, out int    // tokens, from the response's usage
	failure             string // why it failed, when it did
}

// arm is one policy in one run: its own fleet, and its Caddy instances or router instances; requests
// go to instance int(job.pick × count).
type arm struct {
	policy  policy
	fleet   *fleet
	caddys  []*caddyProc
	routers []router
	client  *http.Client

	mu      sync.Mutex
	samples []sample
	ideal   *idealCache
}

// startArm starts a fleet and n Caddy instances (or n router instances) in front of it.
func startArm(ctx context.Context, caddy string, p policy, n int, ports []int) (*arm, error) {
	f, err := startFleet(ports)
	if err != nil {
		return nil, err
	}
	return startArmOn(ctx, caddy, p, n, f)
}

// startArmOn starts n Caddy instances (or n router instances) in front of the fleet f, and closes f
// when they fail to start.
func startArmOn(ctx context.Context, caddy string, p policy, n int, f *fleet) (*arm, error) {
	a := &arm{policy: p, fleet: f, ideal: newIdealCache(),
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}}}
	if p.router != nil {
		for range n {
			a.routers = append(a.routers, p.router(len(f.addrs)))
		}
		return a, nil
	}
	cf := func(admin string, port int) string { return p.caddyfile(admin, port, f.addrs) }
	for range n {
		c, err := startCaddyRetrying(ctx, caddy, cf)
		if err != nil {
			a.Close()
			return nil, err
		}
		a.caddys = append(a.caddys, c)
	}
	if p.interval > 0 {
		for _, c := range a.caddys {
			// A first poll lost on a busy machine is repeated an interval later: allow two.
			if err := c.waitFresh(ctx, len(f.addrs), 2*p.interval+20*time.Second); err != nil {
				a.Close()
				return nil, fmt.Errorf("waiting for the first loads: %w", err)
			}
		}
	}
	return a, nil
}

func (a *arm) Close() {
	for _, c := range a.caddys {
		c.Stop()
	}
	a.client.CloseIdleConnections()
	a.fleet.Close()
}

func (a *arm) instances() int { return max(len(a.caddys), len(a.routers)) }

// runArms sends the same sequences to every arm at the same moments and waits for every answer. Each
// sequence is one request, or the turns of one session: a turn goes out its at after the previous answer,
// carrying the conversation so far. KV use is sampled on every fleet while requests are out. sent, when
// not nil, is called once every sequence has started.
func runArms(ctx context.Context, arms []*arm, seqs [][]job, sent func()) time.Time {
	kvCtx, stopKV := context.WithCancel(ctx)
	for _, a := range arms {
		go a.fleet.sampleKV(kvCtx, 200*time.Millisecond)
	}
	var wg sync.WaitGroup
	begin := time.Now()
	for _, seq := range seqs {
		if d := time.Until(begin.Add(seq[0].at)); d > 0 {
			select {
			case <-time.After(d): // the arrival schedule itself, not synchronisation
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		for _, a := range arms {
			wg.Go(func() { a.runSequence(ctx, seq) })
		}
	}
	if sent != nil {
		sent()
	}
	wg.Wait()
	stopKV()
	return begin
}

func (a *arm) runSequence(ctx context.Context, seq []job) {
	var history []message
	for t, j := range seq {
		if t > 0 {
			select {
			case <-time.After(j.at): // think time
			case <-ctx.Done():
				return
			}
		}
		msgs := append(append([]message(nil), history...), j.messages...)
		s, answer := a.send(ctx, j, msgs, len(seq) > 1)
		a.mu.Lock()
		a.samples = append(a.samples, s)
		a.ideal.add(j.tools, msgs)
		a.mu.Unlock()
		if !s.ok {
			return
		}
		history = append(msgs, message{"assistant", answer})
		a.mu.Lock()
		a.ideal.remember(j.tools, history)
		a.mu.Unlock()
	}
}

type chatBody struct {
	Model         string          `json:"model"`
	Messages      []message       `json:"messages"`
	Tools         json.RawMessage `json:"tools,omitempty"` // after the messages, as the OpenAI SDK sends them
	MaxTokens     int             `json:"max_tokens"`
	N             int             `json:"n,omitempty"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type chatAnswer struct {
	Choices []struct {
		Message *message `json:"message"`
		Delta   *message `json:"delta"`
	} `json:"choices"`
	Usage *usageJSON `json:"usage"`
}

func (s *sample) setUsage(u *usageJSON) {
	if u == nil {
		return
	}
	s.prompt, s.out = u.PromptTokens, u.CompletionTokens
	if u.PromptTokensDetails != nil {
		s.cached = u.PromptTokensDetails.CachedTokens
	}
}

// send runs one request through the arm and measures it; with wantText it also returns the answer's text.
func (a *arm) send(ctx context.Context, j job, msgs []message, wantText bool) (sample, string) {
	s := sample{job: j.index, long: j.long, stream: j.stream, worker: -1}
	body := chatBody{Model: "bench", Messages: msgs, Tools: json.RawMessage(j.tools), MaxTokens: j.maxTokens, N: j.samples, Stream: j.stream}
	if j.stream {
		body.StreamOptions = &streamOptions{IncludeUsage: true}
	}
	raw, err := json.Marshal(body)
	if err != nil {
		s.failure = err.Error()
		return s, ""
	}
	url, done := a.target(j, msgs)
	defer done()
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(raw))
	if err != nil {
		s.failure = err.Error()
		return s, ""
	}
	req.Header.Set("Content-Type", "application/json")
	if j.session != "" {
		req.Header.Set(sessionHeader, j.session)
	}
	s.start = time.Now()
	resp, err := a.client.Do(req)
	if err != nil {
		s.failure = err.Error()
		return s, ""
	}
	defer resp.Body.Close()
	s.worker = workerIndex(resp.Header.Get(sglangsim.HeaderWorker))
	answer := s.readAnswer(resp, j.stream, wantText)
	return s, answer
}

// readAnswer reads a response to a request sent at s.start: the worker's timings, the usage, TTFT when
// stream, whether it succeeded; with wantText it returns the answer's text.
func (s *sample) readAnswer(resp *http.Response, stream, wantText bool) string {
	s.queue, _ = strconv.ParseFloat(resp.Header.Get(sglangsim.HeaderQueueTime), 64)
	s.firstToken, _ = strconv.ParseFloat(resp.Header.Get(sglangsim.HeaderFirstTokenTime), 64)
	var answer strings.Builder
	if stream {
		// The simulator sends the first chunk when prefill ends: the first data line is the first token.
		r := bufio.NewReader(resp.Body)
		for {
			line, err := r.ReadBytes('\n')
			if data, ok := bytes.CutPrefix(line, []byte("data: ")); ok {
				if s.ttft == 0 {
					s.ttft = time.Since(s.start)
				}
				if wantText || bytes.Contains(data, []byte(`"usage"`)) {
					var c chatAnswer
					if json.Unmarshal(data, &c) == nil {
						s.setUsage(c.Usage)
						for _, ch := range c.Choices {
							if ch.Delta != nil {
								answer.WriteString(ch.Delta.Content)
							}
						}
					}
				}
			}
			if err != nil {
				if !errors.Is(err, io.EOF) {
					s.failure = "reading the stream: " + err.Error()
					return ""
				}
				break
			}
		}
	} else {
		var c chatAnswer
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			s.failure = fmt.Sprintf("status %d, body: %v", resp.StatusCode, err)
			return ""
		}
		s.setUsage(c.Usage)
		for _, ch := range c.Choices {
			if ch.Message != nil {
				answer.WriteString(ch.Message.Content)
			}
		}
	}
	s.end = time.Now()
	s.latency = s.end.Sub(s.start)
	s.ok = resp.StatusCode == http.StatusOK
	if !s.ok {
		s.failure = fmt.Sprintf("status %d", resp.StatusCode)
	}
	return answer.String()
}

// target is where a job goes: a Caddy instance, or the worker an in-process router instance picks
// (sent to it directly); done tells that router the request ended.
func (a *arm) target(j job, msgs []message) (url string, done func()) {
	n := a.instances()
	i := min(int(j.pick*float64(n)), n-1)
	if len(a.routers) == 0 {
		return a.caddys[i].SiteURL, func() {}
	}
	r := a.routers[i]
	w := r.pick(promptText(j.tools, msgs))
	return "http://" + a.fleet.addrs[w], func() { r.done(w) }
}

// sequences turns a workload into what runArms sends: a session's turns together (in turn order),
// any other job alone.
func sequences(jobs []job) [][]job {
	var seqs [][]job
	session := map[int]int{}
	for _, j := range jobs {
		if j.turn > 0 {
			k := session[j.group]
			seqs[k] = append(seqs[k], j)
			continue
		}
		if j.group >= 0 {
			session[j.group] = len(seqs)
		}
		seqs = append(seqs, []job{j})
	}
	return seqs
}
