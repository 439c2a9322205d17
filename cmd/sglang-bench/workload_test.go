package main

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestQualityWorkloadIsSeeded(t *testing.T) {
	a, b := qualityWorkload(7, 24, 500), qualityWorkload(7, 24, 500)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave two different workloads")
	}
	c := qualityWorkload(8, 24, 500)
	same := 0
	for i := range a {
		if a[i].at == c[i].at {
			same++
		}
	}
	if same > 0 {
		t.Fatalf("seeds 7 and 8 share %d arrival times", same)
	}
}

func TestQualityWorkloadShares(t *testing.T) {
	const n, rate = 20000, 24.0
	jobs := qualityWorkload(3, rate, n)
	if len(jobs) != n {
		t.Fatalf("got %d jobs, want %d", len(jobs), n)
	}
	var long, stream int
	for i, j := range jobs {
		if j.index != i || j.group != -1 || len(j.messages) != 1 {
			t.Fatalf("job %d: index %d group %d messages %d", i, j.index, j.group, len(j.messages))
		}
		wantPrompt, wantOut := shortPrompt, shortOutput
		if j.long {
			long++
			wantPrompt, wantOut = longPrompt, longOutput
		}
		if j.stream {
			stream++
		}
		if got := promptTokens("", j.messages); got != wantPrompt || j.maxTokens != wantOut {
			t.Fatalf("job %d (long %t): prompt %d max_tokens %d, want %d and %d", i, j.long, got, j.maxTokens, wantPrompt, wantOut)
		}
		if j.pick < 0 || j.pick >= 1 {
			t.Fatalf("job %d: pick %g outside [0,1)", i, j.pick)
		}
	}
	// Binomial standard deviations are under 0.004 at this n: 0.015 is well over 3 of them.
	if s := float64(long) / n; math.Abs(s-longShare) > 0.015 {
		t.Errorf("long share %.3f, want %.2f", s, longShare)
	}
	if s := float64(stream) / n; math.Abs(s-streamShare) > 0.015 {
		t.Errorf("streamed share %.3f, want %.2f", s, streamShare)
	}
	// Mean gap of n exponential gaps: relative standard deviation 1/sqrt(n) = 0.7%.
	gap := jobs[n-1].at.Seconds() / n
	if math.Abs(gap*rate-1) > 0.03 {
		t.Errorf("mean inter-arrival %.4fs, want %.4fs", gap, 1/rate)
	}
}

func TestQualityPromptsShareNoBlock(t *testing.T) {
	jobs := qualityWorkload(1, 24, 2000)
	c := newIdealCache()
	for _, j := range jobs {
		c.add(j.tools, j.messages)
	}
	if c.cached != 0 {
		t.Fatalf("%d tokens of unique prompts would be cached", c.cached)
	}
}

func TestToolsWorkload(t *testing.T) {
	s := defaultTools
	jobs := toolsWorkload(5, 8, s)
	if len(jobs) != s.apps*s.questions {
		t.Fatalf("got %d jobs, want %d", len(jobs), s.apps*s.questions)
	}
	tools := map[int]string{}
	firstBlocks := map[string]bool{}
	for i, j := range jobs {
		if len(j.messages) != 1 || j.messages[0].Role != "user" || !j.stream {
			t.Fatalf("job %d: %d messages, stream %t", i, len(j.messages), j.stream)
		}
		if !json.Valid([]byte(j.tools)) {
			t.Fatalf("job %d: tools are not JSON: %.80s", i, j.tools)
		}
		if got := promptTokens(j.tools, nil); got != s.toolTokens || len(j.tools) != s.toolTokens*bytesPerToken {
			t.Fatalf("job %d: tools of %d bytes, %d tokens; want %d tokens exactly", i, len(j.tools), got, s.toolTokens)
		}
		if got := promptTokens("", j.messages); got != s.questionTokens {
			t.Fatalf("job %d: question %d tokens, want %d", i, got, s.questionTokens)
		}
		if prev, ok := tools[j.group]; ok && prev != j.tools {
			t.Fatalf("application %d has two sets of tools", j.group)
		}
		tools[j.group] = j.tools
		firstBlocks[j.tools[:cacheBlockTokens*bytesPerToken]] = true
	}
	if len(tools) != s.apps || len(firstBlocks) != s.apps {
		t.Fatalf("%d applications, %d distinct first blocks of tools; want %d", len(tools), len(firstBlocks), s.apps)
	}
	// Every question but each application's first finds its tools.
	checkIdeal(t, jobs, s.questions, s.toolTokens, s.questionTokens)
}

// checkIdeal checks that the measured ideal hit rate of jobs, groups of questions that share their
// first shared tokens, each followed by question tokens of its own, equals the formula: every question
// but each group's first finds the shared part cached.
func checkIdeal(t *testing.T, jobs []job, questions, shared, question int) {
	t.Helper()
	c := newIdealCache()
	for _, j := range jobs {
		c.add(j.tools, j.messages)
	}
	want := float64(questions-1) / float64(questions) * float64(shared) / float64(shared+question)
	if math.Abs(c.rate()-want) > 1e-9 {
		t.Fatalf("ideal hit rate %.6f, want %.6f", c.rate(), want)
	}
}

func TestSharedPrefixWorkload(t *testing.T) {
	s := defaultSharedPrefix
	jobs := sharedPrefixWorkload(5, 8, s)
	if len(jobs) != s.groups*s.questions {
		t.Fatalf("got %d jobs, want %d", len(jobs), s.groups*s.questions)
	}
	system := map[int]string{}
	count := map[int]int{}
	adjacent := 0
	for i, j := range jobs {
		if len(j.messages) != 2 || j.messages[0].Role != "system" || j.messages[1].Role != "user" || !j.stream {
			t.Fatalf("job %d: %d messages, stream %t", i, len(j.messages), j.stream)
		}
		if got := promptTokens("", j.messages[:1]); got != s.systemTokens {
			t.Fatalf("job %d: system prompt %d tokens, want %d", i, got, s.systemTokens)
		}
		if got := promptTokens("", j.messages[1:]); got != s.questionTokens {
			t.Fatalf("job %d: question %d tokens, want %d", i, got, s.questionTokens)
		}
		if prev, ok := system[j.group]; ok && prev != j.messages[0].Content {
			t.Fatalf("group %d has two system prompts", j.group)
		}
		system[j.group] = j.messages[0].Content
		count[j.group]++
		if i > 0 && jobs[i-1].group == j.group {
			adjacent++
		}
		if i > 0 && j.at <= jobs[i-1].at {
			t.Fatalf("job %d arrives at %s, not after job %d", i, j.at, i-1)
		}
	}
	for g := range s.groups {
		if count[g] != s.questions {
			t.Fatalf("group %d has %d questions, want %d", g, count[g], s.questions)
		}
	}
	distinct := map[string]bool{}
	for _, p := range system {
		distinct[p[:64]] = true
	}
	if len(distinct) != s.groups {
		t.Fatalf("%d distinct system-prompt starts, want %d", len(distinct), s.groups)
	}
	// Interleaved at random: two neighbours share a group about 1 time in 32, not 15 in 16.
	if adjacent > len(jobs)/8 {
		t.Fatalf("%d of %d neighbours share a group: not interleaved", adjacent, len(jobs))
	}
	// Every question but each group's first finds its system prompt.
	checkIdeal(t, jobs, s.questions, s.systemTokens, s.questionTokens)
}

func TestSessionWorkload(t *testing.T) {
	s := sessionShape{sessions: 5, turns: 4, firstTokens: 100, messageTokens: 20, outputTokens: 8, thinkTime: time.Second}
	jobs := sessionWorkload(2, 1, s)
	if !reflect.DeepEqual(jobs, sessionWorkload(2, 1, s)) {
		t.Fatal("the same seed gave two different workloads")
	}
	seqs := sequences(jobs)
	if len(seqs) != s.sessions {
		t.Fatalf("%d sequences, want %d", len(seqs), s.sessions)
	}
	for k, seq := range seqs {
		if len(seq) != s.turns {
			t.Fatalf("session %d: %d turns, want %d", k, len(seq), s.turns)
		}
		if k > 0 && seq[0].at <= seqs[k-1][0].at {
			t.Fatalf("session %d starts at %s, not after session %d", k, seq[0].at, k-1)
		}
		for turn, j := range seq {
			want := s.messageTokens
			if turn == 0 {
				want = s.firstTokens
			}
			if j.turn != turn || j.group != seq[0].group || promptTokens("", j.messages) != want {
				t.Fatalf("session %d turn %d: turn %d group %d, %d tokens (want %d)", k, turn, j.turn, j.group,
					promptTokens("", j.messages), want)
			}
		}
	}
}

// An application's sessions (an agent's, a chat application's) are the plain sessions with the
// application's part on them, of the size asked: its tools on every turn, or its system prompt ahead
// of each first turn; the same for the sessions of one application, others for another's. The sessions
// draw as they do without it.
func TestApplicationSessionsWorkload(t *testing.T) {
	plain := sessionShape{sessions: 6, turns: 3, firstTokens: 100, messageTokens: 20, outputTokens: 8, thinkTime: time.Second}
	bare := sessionWorkload(3, 1, plain)
	tools, system := plain, plain
	tools.apps, tools.toolTokens = 2, 300
	system.apps, system.systemTokens = 2, 300
	for _, c := range []struct {
		name  string
		shape sessionShape
		// take takes the application's part off j and returns it ("" where j has none), and says
		// whether j should have one.
		take func(j *job) (part string, want bool)
	}{
		{"tools", tools, func(j *job) (string, bool) {
			part := j.tools
			j.tools = ""
			return part, true
		}},
		{"system prompt", system, func(j *job) (string, bool) {
			if len(j.messages) < 2 || j.messages[0].Role != "system" {
				return "", j.turn == 0
			}
			part := j.messages[0].Content
			j.messages = j.messages[1:]
			return part, j.turn == 0
		}},
	} {
		parts := map[int]string{}
		for i, j := range sessionWorkload(3, 1, c.shape) {
			part, want := c.take(&j)
			if (part != "") != want {
				t.Fatalf("%s: job %d (turn %d): %q, want one: %v", c.name, i, j.turn, part, want)
			}
			if part != "" {
				if got := promptTokens(part, nil); got != 300 {
					t.Fatalf("%s: job %d: %d tokens, want 300", c.name, i, got)
				}
				app := j.group % c.shape.apps
				if prev, ok := parts[app]; ok && prev != part {
					t.Fatalf("%s: job %d: application %d's differs from one session to another", c.name, i, app)
				}
				parts[app] = part
			}
			if !reflect.DeepEqual(j, bare[i]) {
				t.Fatalf("%s: job %d: %+v, want as without it %+v", c.name, i, j, bare[i])
			}
		}
		if len(parts) != 2 || parts[0] == parts[1] {
			t.Fatalf("%s: %d applications' sent, alike: %v; want one of its own for each of 2", c.name, len(parts), parts[0] == parts[1])
		}
	}
}

func TestSequencesKeepsSingleJobsApart(t *testing.T) {
	jobs := sharedPrefixWorkload(1, 10, sharedPrefixShape{groups: 2, questions: 3, systemTokens: 32, questionTokens: 16, outputTokens: 4})
	seqs := sequences(jobs)
	if len(seqs) != len(jobs) {
		t.Fatalf("%d sequences for %d single jobs", len(seqs), len(jobs))
	}
	for i, s := range seqs {
		if len(s) != 1 || s[0].index != i {
			t.Fatalf("sequence %d: %d jobs, first %d", i, len(s), s[0].index)
		}
	}
}

func TestBlockHashesChain(t *testing.T) {
	block := strings.Repeat("a", cacheBlockTokens*bytesPerToken)
	other := strings.Repeat("b", cacheBlockTokens*bytesPerToken)
	a := blockHashes(block + block + other + "tail")
	b := blockHashes(block + block + block)
	if len(a) != 3 || len(b) != 3 {
		t.Fatalf("got %d and %d blocks, want 3 (a partial block does not count)", len(a), len(b))
	}
	if a[0] != b[0] || a[1] != b[1] || a[2] == b[2] {
		t.Fatalf("hashes %x and %x: want the first two equal, the third different", a, b)
	}
	// Chained: the same block after a different prefix hashes differently.
	c := blockHashes(other + block)
	if c[1] == a[1] {
		t.Fatal("block 1 hashes the same after different prefixes")
	}
}

func TestIdealCacheByHand(t *testing.T) {
	blk := func(c string) string { return strings.Repeat(c, cacheBlockTokens*bytesPerToken) }
	c := newIdealCache()
	// Content of 4 blocks, 64 tokens; promptText puts "user:" before it, shifting the blocks by 5 bytes.
	c.add("", []message{{"user", blk("x") + blk("y") + blk("z") + blk("w")}})
	c.add("", []message{{"user", blk("x") + blk("y") + blk("q") + blk("w")}})
	// The second shares block 0 ("user:" and x) and block 1 (x's end and y); block 2 holds q instead of z.
	if c.prompt != 2*4*cacheBlockTokens || c.cached != 2*cacheBlockTokens {
		t.Fatalf("prompt %d cached %d, want %d and %d", c.prompt, c.cached, 2*4*cacheBlockTokens, 2*cacheBlockTokens)
	}
}

func TestIdealCacheRemembersAnswers(t *testing.T) {
	blk := func(c string) string { return strings.Repeat(c, cacheBlockTokens*bytesPerToken) }
	first := []message{{"user", blk("a") + blk("b")}}
	c := newIdealCache()
	c.add("", first)
	history := append(first, message{"assistant", blk("c") + blk("d")})
	c.remember("", history)
	if c.prompt != 2*cacheBlockTokens || c.cached != 0 {
		t.Fatalf("remember counted as a prompt: prompt %d cached %d", c.prompt, c.cached)
	}
	c.add("", append(history, message{"user", blk("e")}))
	// promptText of the history is 4 blocks + 17 bytes of roles and newlines: its 4 whole blocks are cached.
	if c.cached != 4*cacheBlockTokens {
		t.Fatalf("cached %d tokens of the second turn, want the history's 4 blocks, %d", c.cached, 4*cacheBlockTokens)
	}
}

// TestAffinityWorkloadsQuestions checks that -questions sizes the shared-prefix and tools workloads,
// their ideals and the unique one alike, and that 0 keeps the default shape; the conversations'
// workloads (sessions, agents, chat) have their own shape.
func TestAffinityWorkloadsQuestions(t *testing.T) {
	for _, tc := range []struct{ questions, want int }{{0, defaultSharedPrefix.questions}, {64, 64}} {
		for _, w := range affinityWorkloads(tc.questions, 0) {
			if w.name == "sessions" || w.name == "agents" || w.name == "chat" {
				continue
			}
			requests := defaultSharedPrefix.groups * tc.want
			if got := len(w.jobs(1, 8)); got != requests {
				t.Errorf("questions %d: %s has %d requests, want %d", tc.questions, w.name, got, requests)
			}
			if (w.name == "shared-prefix" || w.name == "tools") && !strings.Contains(w.ideal, fmt.Sprintf("%d/%d", tc.want-1, tc.want)) {
				t.Errorf("questions %d: ideal %q does not count %d questions", tc.questions, w.ideal, tc.want)
			}
			if w.name == "unique" && !strings.Contains(w.about, fmt.Sprintf("%d requests", requests)) {
				t.Errorf("questions %d: unique workload says %q, want %d requests", tc.questions, w.about, requests)
			}
		}
	}
}

// TestAffinityWorkloadsQuestionTokens checks that -question-tokens sizes each question of the
// shared-prefix and tools workloads, what their reports say and their ideals, and that 0 keeps 128.
func TestAffinityWorkloadsQuestionTokens(t *testing.T) {
	for _, tc := range []struct{ tokens, want int }{{0, 128}, {512, 512}} {
		for _, w := range affinityWorkloads(0, tc.tokens) {
			if w.name != "shared-prefix" && w.name != "tools" {
				continue
			}
			j := w.jobs(1, 8)[0]
			if got := promptTokens("", j.messages[len(j.messages)-1:]); got != tc.want {
				t.Errorf("question tokens %d: %s asks %d tokens, want %d", tc.tokens, w.name, got, tc.want)
			}
			shared := defaultSharedPrefix.systemTokens
			if w.name == "tools" {
				shared = defaultTools.toolTokens
			}
			if !strings.Contains(w.about, fmt.Sprintf("of %d tokens per", tc.want)) || !strings.Contains(w.ideal, fmt.Sprintf("/%d =", shared+tc.want)) {
				t.Errorf("question tokens %d: %s says %q, ideal %q", tc.tokens, w.name, w.about, w.ideal)
			}
		}
	}
}

// A share of the quality workload asks for several answers; the jobs are otherwise the same.
func TestWithSamples(t *testing.T) {
	plain := qualityWorkload(3, 24, 2000)
	jobs := withSamples(qualityWorkload(3, 24, 2000), 3, 0.1, 4)
	again := withSamples(qualityWorkload(3, 24, 2000), 3, 0.1, 4)
	asked := 0
	for i, j := range jobs {
		if j.samples != again[i].samples {
			t.Fatalf("job %d: %d answers, then %d: not seeded", i, j.samples, again[i].samples)
		}
		switch j.samples {
		case 4:
			asked++
		case 0:
		default:
			t.Fatalf("job %d asks for %d answers", i, j.samples)
		}
		j.samples = 0
		if fmt.Sprint(j) != fmt.Sprint(plain[i]) {
			t.Fatalf("job %d changed beyond its answers", i)
		}
	}
	if asked < 150 || asked > 250 {
		t.Errorf("%d of 2000 jobs ask for 4 answers, want about 200", asked)
	}
}

// -independent-answers draws each answer's size apart from its prompt's: the prompts and arrivals stay,
// a fifth of the answers are long, and as many of the long prompts' answers as of the short ones'.
func TestWithIndependentAnswers(t *testing.T) {
	const n = 20000
	plain := qualityWorkload(3, 24, n)
	jobs := withIndependentAnswers(qualityWorkload(3, 24, n), 3)
	var longAnswers, longPrompts, both int
	for i, j := range jobs {
		wantOut := shortOutput
		if j.long {
			wantOut = longOutput
			longAnswers++
		}
		if j.maxTokens != wantOut {
			t.Fatalf("job %d (long %t): max_tokens %d, want %d", i, j.long, j.maxTokens, wantOut)
		}
		if plain[i].long {
			longPrompts++
			if j.long {
				both++
			}
		}
		j.maxTokens, j.long = plain[i].maxTokens, plain[i].long
		if fmt.Sprint(j) != fmt.Sprint(plain[i]) {
			t.Fatalf("job %d changed beyond its answer", i)
		}
	}
	// Binomial standard deviations: under 0.003 over all jobs, under 0.007 over the long prompts'.
	if s := float64(longAnswers) / n; math.Abs(s-longShare) > 0.015 {
		t.Errorf("long answers %.3f of all, want %.2f", s, longShare)
	}
	if s := float64(both) / float64(longPrompts); math.Abs(s-longShare) > 0.03 {
		t.Errorf("long answers %.3f of the long prompts', want %.2f: not drawn apart", s, longShare)
	}
	if got := sizesLine(qualityOptions{outputScale: 1, independentAnswers: true}); !strings.Contains(got, "answers drawn apart from the prompts, 80% short (max_tokens 64), 20% long (max_tokens 512)") {
		t.Errorf("workload line: %s", got)
	}
}

// -output-scale multiplies max_tokens and changes nothing else of the jobs.
func TestWithOutputScale(t *testing.T) {
	plain := qualityWorkload(3, 24, 500)
	for _, c := range []struct {
		k           float64
		short, long int
	}{{1, shortOutput, longOutput}, {8, 512, 4096}, {0.5, 32, 256}, {0.001, 1, 1}} {
		jobs := withOutputScale(qualityWorkload(3, 24, 500), c.k)
		for i, j := range jobs {
			want := c.short
			if j.long {
				want = c.long
			}
			if j.maxTokens != want {
				t.Fatalf("k %g, job %d: max_tokens %d, want %d", c.k, i, j.maxTokens, want)
			}
			j.maxTokens = plain[i].maxTokens
			if fmt.Sprint(j) != fmt.Sprint(plain[i]) {
				t.Fatalf("k %g, job %d changed beyond its max_tokens", c.k, i)
			}
		}
	}
}
