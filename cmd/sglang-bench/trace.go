package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/trace"
)

// traceOptions are the flags of -mode trace.
type traceOptions struct {
	qualityOptions // caddy, out, only (-policies), fleetPorts
	path           string
	slices         []traceSlice
	speedup        float64
	fleet          traceFleet
	maxTokens      maxTokensMode
	timeout        time.Duration // per request
}

// parse checks the trace flags and reads the slices, the fleet and the max_tokens mode.
func (o *traceOptions) parse(from, length time.Duration, slicesFlag, fleetSpec, maxTokens string) error {
	if o.path == "" {
		return errors.New("-mode trace needs -trace, the trace file (Azure 2023 CSV or Mooncake JSONL)")
	}
	var err error
	switch {
	case slicesFlag != "":
		if o.slices, err = parseSlices(slicesFlag); err != nil {
			return err
		}
	case from < 0:
		return fmt.Errorf("-from %s: must not be negative", from)
	case length < 0:
		return fmt.Errorf("-length %s: must not be negative (0: to the end)", length)
	default:
		o.slices = []traceSlice{{from, length}}
	}
	if !(o.speedup > 0 && o.speedup <= 1000) {
		return fmt.Errorf("-speedup %g: want a factor in (0, 1000]", o.speedup)
	}
	if o.timeout <= 0 {
		return fmt.Errorf("-trace-timeout %s: must be positive", o.timeout)
	}
	if o.fleet, err = parseFleet(fleetSpec); err != nil {
		return err
	}
	o.maxTokens, err = parseMaxTokens(maxTokens)
	return err
}

// traceSalt seeds the prompt texts: the same on every run, so a rerun sends the same bytes.
const traceSalt = 1

// tracePolicies are the rows of the trace mode. The 1 s and cache_aware rows are studies, run when
// -policies names them: six rows of Caddy and fleet fit 2 cores on the Mooncake conversation trace.
func tracePolicies() []policy {
	return []policy{
		{name: "round_robin", lb: "lb_policy round_robin"},
		{name: "least_conn", lb: "lb_policy least_conn"},
		{name: controlPolicy, lb: "lb_policy least_conn"},
		sglangLoad("sglang_load default 10s", 10*time.Second),
		study(sglangLoad("sglang_load default 1s", time.Second)),
		// The simulator's decode halves at 16 more requests, the policy's default assumes 32.
		study(sglangLoad("sglang_load default 10s halving 16", 10*time.Second, "decode_batch_halving 16")),
		sglangLoad("sglang_load cost 10s", 10*time.Second, "metric cost"),
		sglangLoad("sglang_load affinity prefix 10s", 10*time.Second, "affinity prefix"),
		study(policy{name: "cache_aware (re-impl.)", router: newCacheAware}),
	}
}

// traceSlice is a part of a trace, in trace time: from, for length (0: to the end).
type traceSlice struct {
	from, length time.Duration
}

func (s traceSlice) String() string {
	if s.length <= 0 {
		return shortDuration(s.from) + "+end"
	}
	return shortDuration(s.from) + "+" + shortDuration(s.length)
}

// shortDuration is d without zero trailing units: 10m, 1h30m, 90s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// parseSlices reads -slices: a comma list of FROM+LENGTH durations, e.g. 0s+5m,10m+5m.
func parseSlices(s string) ([]traceSlice, error) {
	var out []traceSlice
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		from, length, ok := strings.Cut(f, "+")
		if !ok {
			return nil, fmt.Errorf("-slices: %q: want FROM+LENGTH, e.g. 10m+4m", f)
		}
		var sl traceSlice
		var err error
		if sl.from, err = time.ParseDuration(from); err != nil || sl.from < 0 {
			return nil, fmt.Errorf("-slices: %q: start %q is not a duration of 0 or more", f, from)
		}
		if sl.length, err = time.ParseDuration(length); err != nil || sl.length <= 0 {
			return nil, fmt.Errorf("-slices: %q: length %q is not a duration above 0", f, length)
		}
		out = append(out, sl)
	}
	return out, nil
}

// maxTokensMode is what the clients send as max_tokens (-max-tokens): the trace's output length
// (exact), a fixed cap, or nothing.
type maxTokensMode struct {
	cap    int  // cap:N
	absent bool // nothing; exact when neither
}

func (m maxTokensMode) String() string {
	switch {
	case m.absent:
		return "absent"
	case m.cap > 0:
		return "cap:" + strconv.Itoa(m.cap)
	}
	return "exact"
}

func parseMaxTokens(s string) (maxTokensMode, error) {
	switch s {
	case "exact":
		return maxTokensMode{}, nil
	case "absent":
		return maxTokensMode{absent: true}, nil
	}
	if n, ok := strings.CutPrefix(s, "cap:"); ok {
		if c, err := strconv.Atoi(n); err == nil && c >= 1 {
			return maxTokensMode{cap: c}, nil
		}
	}
	return maxTokensMode{}, fmt.Errorf("-max-tokens %q: want exact, cap:N (N a whole number from 1) or absent", s)
}

// answerTokens is the answer's length the request names: the trace's output length, at least 1 (the
// simulator's floor).
func answerTokens(r trace.Request) int { return max(1, r.OutputTokens) }

// traceBody is a request's body: one user message of the prompt text (trace.PromptText), answer_tokens
// of the trace's output length, max_tokens as m says, streamed with the usage at the end.
func traceBody(r trace.Request, salt uint64, m maxTokensMode) []byte {
	b := make([]byte, 0, r.InputTokens*trace.BytesPerToken+256)
	b = append(b, `{"model":"bench","messages":[{"role":"user","content":"`...)
	b = trace.AppendPromptText(b, r, salt) // plain words: safe inside a JSON string as they are
	b = append(b, `"}]`...)
	switch {
	case m.absent:
	case m.cap > 0:
		b = strconv.AppendInt(append(b, `,"max_tokens":`...), int64(m.cap), 10)
	default:
		b = strconv.AppendInt(append(b, `,"max_tokens":`...), int64(answerTokens(r)), 10)
	}
	b = strconv.AppendInt(append(b, `,"answer_tokens":`...), int64(answerTokens(r)), 10)
	return append(b, `,"stream":true,"stream_options":{"include_usage":true}}`...)
}
