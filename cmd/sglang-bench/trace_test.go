package main

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/trace"
	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

func TestParseFleet(t *testing.T) {
	good := []struct {
		spec string
		want []sglangsim.Config // per group
		n    []int
	}{
		{"2x(pool=400000,prefill=12000,decode=150)+2x(pool=200000,prefill=6000,decode=75)",
			[]sglangsim.Config{{MaxTotalTokens: 400000, PrefillTokensPerSec: 12000, DecodeTokensPerSec: 150},
				{MaxTotalTokens: 200000, PrefillTokensPerSec: 6000, DecodeTokensPerSec: 75}}, []int{2, 2}},
		{" 1x( batch = 8 , chunk=4096 ) ", []sglangsim.Config{{MaxRunningRequests: 8, MaxPrefillTokens: 4096}}, []int{1}},
		{"3x()", []sglangsim.Config{{}}, []int{3}},
		{"1x(decode=0.5)+1x(pool=1)", []sglangsim.Config{{DecodeTokensPerSec: 0.5}, {MaxTotalTokens: 1}}, []int{1, 1}},
		{"2x(timing=step,speed=2,host=800000,hostload=50000)+1x(timing=linear)",
			[]sglangsim.Config{{Timing: sglangsim.TimingStep, Speed: 2, HostPoolTokens: 800000, HostLoadTokensPerSec: 50000},
				{Timing: sglangsim.TimingLinear}}, []int{2, 1}},
	}
	for _, c := range good {
		f, err := parseFleet(c.spec)
		if err != nil {
			t.Errorf("%q: %v", c.spec, err)
			continue
		}
		if len(f.groups) != len(c.want) {
			t.Errorf("%q: %d groups, want %d", c.spec, len(f.groups), len(c.want))
			continue
		}
		for i, g := range f.groups {
			if g.cfg != c.want[i] || g.count != c.n[i] {
				t.Errorf("%q group %d: %d× %+v, want %d× %+v", c.spec, i+1, g.count, g.cfg, c.n[i], c.want[i])
			}
		}
	}
	bad := []struct{ spec, want string }{
		{"", "-fleet: empty; want groups like 2x(pool=400000,prefill=12000,decode=150) joined by +"},
		{"2(pool=1)", `-fleet group 1 "2(pool=1)": want Nx(key=value,...) with keys pool, prefill, decode, batch, chunk, timing, speed, host, hostload`},
		{"2x(pool=1", `-fleet group 1 "2x(pool=1": want Nx(key=value,...) with keys pool, prefill, decode, batch, chunk, timing, speed, host, hostload`},
		{"1x(pool=1)+0x(pool=1)", `-fleet group 2 "0x(pool=1)": count "0": want a whole number from 1 to 32`},
		{"ax(pool=1)", `-fleet group 1 "ax(pool=1)": count "a": want a whole number from 1 to 32`},
		{"2x(size=1)", `-fleet group 1 "2x(size=1)": unknown key "size": want pool, prefill, decode, batch, chunk, timing, speed, host, hostload`},
		{"2x(pool)", `-fleet group 1 "2x(pool)": "pool": want key=value`},
		{"2x(pool=1,pool=2)", `-fleet group 1 "2x(pool=1,pool=2)": key pool given twice`},
		{"2x(pool=abc)", `-fleet group 1 "2x(pool=abc)": pool=abc: want a whole number of tokens from 1 to 2147483647`},
		{"2x(pool=-5)", `-fleet group 1 "2x(pool=-5)": pool=-5: want a whole number of tokens from 1 to 2147483647`},
		{"1x(batch=1.5)", `-fleet group 1 "1x(batch=1.5)": batch=1.5: want a whole number of requests from 1 to 2147483647`},
		{"1x(decode=0)", `-fleet group 1 "1x(decode=0)": decode=0: want a number of tokens/s above 0`},
		{"1x(prefill=Inf)", `-fleet group 1 "1x(prefill=Inf)": prefill=Inf: want a number of tokens/s above 0`},
		{"1x(prefill=NaN)", `-fleet group 1 "1x(prefill=NaN)": prefill=NaN: want a number of tokens/s above 0`},
		{"1x(timing=fast)", `-fleet group 1 "1x(timing=fast)": timing=fast: want linear or step`},
		{"1x(speed=-1)", `-fleet group 1 "1x(speed=-1)": speed=-1: want a factor of the step model's speed above 0`},
		{"1x(host=0)", `-fleet group 1 "1x(host=0)": host=0: want a whole number of tokens from 1 to 2147483647`},
		{"1x(hostload=x)", `-fleet group 1 "1x(hostload=x)": hostload=x: want a number of tokens/s above 0`},
		{"20x()+20x()", "-fleet: 40 workers; at most 32 (every arm runs its own fleet)"},
	}
	for _, c := range bad {
		_, err := parseFleet(c.spec)
		if err == nil || err.Error() != c.want {
			t.Errorf("%q: error %v, want %q", c.spec, err, c.want)
		}
	}
}

// The workers are named in group order, carry the bench's simulator options, and the fleet's cache is
// its pools together, the simulator's default where a group sets none.
func TestTraceFleetConfigs(t *testing.T) {
	f, err := parseFleet("2x(pool=1000,host=500)+1x()")
	if err != nil {
		t.Fatal(err)
	}
	cfgs := f.configs()
	if len(cfgs) != 3 {
		t.Fatalf("%d workers, want 3", len(cfgs))
	}
	for i, c := range cfgs {
		if want := "w" + strconv.Itoa(i); c.Name != want || f.labels()[i] != want {
			t.Errorf("worker %d named %q (label %q), want %q", i, c.Name, f.labels()[i], want)
		}
		if c.SGLangAdmission != sglangAdmission {
			t.Errorf("worker %d: SGLangAdmission %v, want the flag's %v", i, c.SGLangAdmission, sglangAdmission)
		}
	}
	if cfgs[1].MaxTotalTokens != 1000 || cfgs[2].MaxTotalTokens != 0 {
		t.Errorf("pools %d, %d: want 1000 and unset", cfgs[1].MaxTotalTokens, cfgs[2].MaxTotalTokens)
	}
	def := sglangsim.New(sglangsim.Config{}).Config().MaxTotalTokens
	if got, want := f.cacheTokens(), 2*(1000+500)+def; got != want {
		t.Errorf("cache tokens %d, want %d", got, want)
	}
	if s := f.String(); !strings.Contains(s, "w0–w1: pool 1000 tokens") || !strings.Contains(s, ", host tier 500 tokens loading at ") ||
		!strings.Contains(s, "w2: pool "+strconv.FormatInt(def, 10)+" tokens, prefill ") {
		t.Errorf("description %q", s)
	}
}

func TestParseMaxTokens(t *testing.T) {
	for s, want := range map[string]maxTokensMode{"exact": {}, "absent": {absent: true}, "cap:4096": {cap: 4096}, "cap:1": {cap: 1}} {
		got, err := parseMaxTokens(s)
		if err != nil || got != want || got.String() != s {
			t.Errorf("%q: %+v (%q), %v; want %+v", s, got, got.String(), err, want)
		}
	}
	for _, s := range []string{"", "cap", "cap:", "cap:0", "cap:-3", "cap:1.5", "cap:x", "Exact", "none"} {
		_, err := parseMaxTokens(s)
		want := `-max-tokens "` + s + `": want exact, cap:N (N a whole number from 1) or absent`
		if err == nil || err.Error() != want {
			t.Errorf("%q: error %v, want %q", s, err, want)
		}
	}
}

func TestTraceOptionsParse(t *testing.T) {
	o := traceOptions{path: "t.jsonl", speedup: 1, timeout: time.Minute}
	if err := o.parse(10*time.Minute, 4*time.Minute, "", "1x()", "exact"); err != nil {
		t.Fatal(err)
	}
	if len(o.slices) != 1 || o.slices[0] != (traceSlice{10 * time.Minute, 4 * time.Minute}) || o.slices[0].String() != "10m+4m" {
		t.Errorf("slices %v, want 10m+4m", o.slices)
	}
	if err := o.parse(0, 0, "0s+90s, 1h+1h30m", "1x()", "exact"); err != nil {
		t.Fatal(err)
	}
	if got := []string{o.slices[0].String(), o.slices[1].String()}; got[0] != "0s+1m30s" || got[1] != "1h+1h30m" {
		t.Errorf("slices %v", got)
	}
	if s := (traceSlice{time.Minute, 0}).String(); s != "1m+end" {
		t.Errorf("a slice to the end reads %q", s)
	}
	bad := []struct {
		o                    traceOptions
		from, length         time.Duration
		slices, fleet, maxTk string
		want                 string
	}{
		{traceOptions{speedup: 1, timeout: time.Minute}, 0, 0, "", "1x()", "exact", "-mode trace needs -trace, the trace file (Azure 2023 CSV or Mooncake JSONL)"},
		{o, -time.Second, 0, "", "1x()", "exact", "-from -1s: must not be negative"},
		{o, 0, -time.Second, "", "1x()", "exact", "-length -1s: must not be negative (0: to the end)"},
		{o, 0, 0, "10m", "1x()", "exact", `-slices: "10m": want FROM+LENGTH, e.g. 10m+4m`},
		{o, 0, 0, "x+1m", "1x()", "exact", `-slices: "x+1m": start "x" is not a duration of 0 or more`},
		{o, 0, 0, "1m+0s", "1x()", "exact", `-slices: "1m+0s": length "0s" is not a duration above 0`},
		{traceOptions{path: "t", speedup: 0, timeout: time.Minute}, 0, 0, "", "1x()", "exact", "-speedup 0: want a factor in (0, 1000]"},
		{traceOptions{path: "t", speedup: 1}, 0, 0, "", "1x()", "exact", "-trace-timeout 0s: must be positive"},
		{o, 0, 0, "", "1x(x=1)", "exact", `-fleet group 1 "1x(x=1)": unknown key "x": want pool, prefill, decode, batch, chunk, timing, speed, host, hostload`},
		{o, 0, 0, "", "1x()", "cap:0", `-max-tokens "cap:0": want exact, cap:N (N a whole number from 1) or absent`},
	}
	for _, c := range bad {
		err := c.o.parse(c.from, c.length, c.slices, c.fleet, c.maxTk)
		if err == nil || err.Error() != c.want {
			t.Errorf("error %v, want %q", err, c.want)
		}
	}
}

// A body is valid JSON with one user message of the prompt's length, answer_tokens the traced output,
// max_tokens as the mode says, streamed with the usage; two requests whose leading ids agree share
// their prompts' leading text.
func TestTraceBody(t *testing.T) {
	first := trace.Request{Line: 1, InputTokens: 1000, OutputTokens: 40, HashIDs: []int64{7, 8}}
	second := trace.Request{Line: 5, InputTokens: 1500, OutputTokens: 0, HashIDs: []int64{7, 8, 9}}
	type body struct {
		Model    string `json:"model"`
		Messages []struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"messages"`
		MaxTokens     *int `json:"max_tokens"`
		AnswerTokens  *int `json:"answer_tokens"`
		Stream        bool `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	for _, c := range []struct {
		mode          maxTokensMode
		first, second *int // max_tokens sent
	}{
		{maxTokensMode{}, ptr(40), ptr(1)}, // exact: the traced output, at least 1
		{maxTokensMode{cap: 4096}, ptr(4096), ptr(4096)},
		{maxTokensMode{absent: true}, nil, nil},
	} {
		var contents []string
		for k, r := range []trace.Request{first, second} {
			raw := traceBody(r, 3, c.mode)
			var b body
			dec := json.NewDecoder(bytes.NewReader(raw))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&b); err != nil {
				t.Fatalf("%s: request %d: %v in %.200s", c.mode, k, err, raw)
			}
			if len(b.Messages) != 1 || b.Messages[0].Role != "user" || len(b.Messages[0].Content) != 4*r.InputTokens {
				t.Fatalf("%s: request %d: messages %d, role %q, %d bytes; want one user message of %d bytes", c.mode, k,
					len(b.Messages), b.Messages[0].Role, len(b.Messages[0].Content), 4*r.InputTokens)
			}
			if b.Messages[0].Content != trace.PromptText(r, 3) {
				t.Errorf("%s: request %d: the content is not trace.PromptText", c.mode, k)
			}
			if want := max(1, r.OutputTokens); b.AnswerTokens == nil || *b.AnswerTokens != want {
				t.Errorf("%s: request %d: answer_tokens %v, want %d", c.mode, k, deref(b.AnswerTokens), want)
			}
			want := []*int{c.first, c.second}[k]
			if (want == nil) != (b.MaxTokens == nil) || want != nil && *want != *b.MaxTokens {
				t.Errorf("%s: request %d: max_tokens %v, want %v", c.mode, k, deref(b.MaxTokens), deref(want))
			}
			if !b.Stream || !b.StreamOptions.IncludeUsage {
				t.Errorf("%s: request %d: stream %v include_usage %v, want both", c.mode, k, b.Stream, b.StreamOptions.IncludeUsage)
			}
			contents = append(contents, b.Messages[0].Content)
		}
		if !strings.HasPrefix(contents[1], contents[0]) {
			t.Errorf("%s: the second prompt does not start with the first, though their leading ids agree", c.mode)
		}
	}
}

func ptr(n int) *int { return &n }

func deref(p *int) any {
	if p == nil {
		return "absent"
	}
	return *p
}
