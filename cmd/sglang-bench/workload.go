package main

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
	"time"
)

// The quality workload: 80% short requests, 20% long ones (prompt and output); 30% of each are streamed.
const (
	shortPrompt, shortOutput = 200, 64
	longPrompt, longOutput   = 2000, 512
	longShare, streamShare   = 0.2, 0.3
	requestTimeout           = 300 * time.Second // round_robin at the busy rate queues for minutes
)

// bytesPerToken is the simulator's token measure: a prompt of n bytes of text is ceil(n/4) tokens.
const bytesPerToken = 4

// message is one chat message of a request body.
type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// job is one request of a workload, the same for every policy of a run.
type job struct {
	index        int
	at           time.Duration // arrival, from the start of the run
	long, stream bool
	maxTokens    int
	messages     []message // the whole conversation sent; a session job gets its history at send time
	pick         float64   // uniform [0,1): which Caddy instance (or router instance) takes it
	group        int       // shared-prefix group or session; -1 when none
	turn         int       // session turn, from 0
	session      string    // the session header's value (sessionHeader); empty outside sessions
	samples      int       // answers asked for (n); 0 or 1 for one
	tools        string    // the chat's tool definitions, JSON sent after the messages; empty for none
}

// words of exactly bytesPerToken bytes, so text of n words is n tokens in the simulator's measure.
var textWords = [...]string{" abc", " def", " ghi", " jkl", " mno", " pqr", " stu", " vwx", " yza", " bcd",
	" efg", " hij", " klm", " nop", " qrs", " tuv"}

// text returns n tokens of seeded text. Different seeds give different text from the first token on.
func text(rnd *rand.Rand, n int) string {
	var b strings.Builder
	b.Grow(n * bytesPerToken)
	for range n {
		b.WriteString(textWords[rnd.IntN(len(textWords))])
	}
	return b.String()
}

// nonce is a one-token-aligned unique start of a prompt, so no two prompts share a cached prefix block.
func nonce(seed int64, i int) string {
	s := fmt.Sprintf("%08x%08x", uint32(seed), uint32(i))
	return s[:len(s)/bytesPerToken*bytesPerToken]
}

// qualityWorkload is the seeded arrival schedule every policy gets: n Poisson arrivals at rate, each
// prompt unique from its first token (a nonce), so the simulator's prefix cache never hits by accident.
func qualityWorkload(seed int64, rate float64, n int) []job {
	rnd := rand.New(rand.NewPCG(uint64(seed), 0x5eed))
	jobs := make([]job, 0, n)
	var at time.Duration
	for i := range n {
		at += time.Duration(rnd.ExpFloat64() / rate * float64(time.Second))
		long := rnd.Float64() < longShare
		stream := rnd.Float64() < streamShare
		prompt, out := shortPrompt, shortOutput
		if long {
			prompt, out = longPrompt, longOutput
		}
		n := nonce(seed, i)
		content := n + text(rnd, prompt-len(n)/bytesPerToken)
		jobs = append(jobs, job{index: i, at: at, long: long, stream: stream, maxTokens: out,
			messages: []message{{"user", content}}, pick: rnd.Float64(), group: -1})
	}
	return jobs
}

// withSamples makes a seeded share of jobs ask for n answers each. Its own random stream, so the jobs
// are otherwise those of the workload without it.
func withSamples(jobs []job, seed int64, share float64, n int) []job {
	if share <= 0 || n <= 1 {
		return jobs
	}
	rnd := rand.New(rand.NewPCG(uint64(seed), 0x5a3b1e5))
	for i := range jobs {
		if rnd.Float64() < share {
			jobs[i].samples = n
		}
	}
	return jobs
}

// withIndependentAnswers draws each job's answer long (longOutput) or short (shortOutput) on a draw of
// its own, at the same share, whatever its prompt (-independent-answers): a router then learns an
// answer's size from max_tokens only, not from the prompt's length. long then marks a long answer. Its
// own random stream, so the arrivals and prompts are those of the workload without it.
func withIndependentAnswers(jobs []job, seed int64) []job {
	rnd := rand.New(rand.NewPCG(uint64(seed), 0x1d3a45))
	for i := range jobs {
		jobs[i].long = rnd.Float64() < longShare
		jobs[i].maxTokens = shortOutput
		if jobs[i].long {
			jobs[i].maxTokens = longOutput
		}
	}
	return jobs
}

// withOutputScale multiplies every job's max_tokens by k (-output-scale): the same arrivals and prompts,
// longer answers, as a reasoning model's.
func withOutputScale(jobs []job, k float64) []job {
	for i := range jobs {
		jobs[i].maxTokens = scaledOutput(jobs[i].maxTokens, k)
	}
	return jobs
}

// scaledOutput is max_tokens out times k; a k of 0 or 1 leaves it.
func scaledOutput(out int, k float64) int {
	if k <= 0 || k == 1 {
		return out
	}
	return max(1, int(math.Round(float64(out)*k)))
}

// sharedPrefixShape is SGLang bench_serving's generated-shared-prefix dataset: groups of questions that
// share one long system prompt.
type sharedPrefixShape struct {
	groups, questions            int
	systemTokens, questionTokens int
	outputTokens                 int
}

var defaultSharedPrefix = sharedPrefixShape{groups: 32, questions: 16, systemTokens: 2048, questionTokens: 128, outputTokens: 256}

// sharedPrefixWorkload sends every question of every group once, the groups interleaved at random, at
// Poisson arrivals of rate. All are streamed, so TTFT is measured on each.
func sharedPrefixWorkload(seed int64, rate float64, s sharedPrefixShape) []job {
	rnd := rand.New(rand.NewPCG(uint64(seed), 0xa11))
	systems := make([]string, s.groups)
	for g := range systems {
		systems[g] = nonce(seed, g) + text(rnd, s.systemTokens-len(nonce(seed, g))/bytesPerToken)
	}
	return interleaved(rnd, rate, s.groups, s.questions, s.outputTokens, func(g int) job {
		return job{messages: []message{{"system", systems[g]}, {"user", text(rnd, s.questionTokens)}}}
	})
}

// interleaved is questions requests of each of groups groups, the groups interleaved at random, at
// Poisson arrivals of rate, all streamed (TTFT is measured on each), of outputTokens at most; ask makes
// group g's next request, its messages and tools.
func interleaved(rnd *rand.Rand, rate float64, groups, questions, outputTokens int, ask func(g int) job) []job {
	order := make([]int, 0, groups*questions)
	for g := range groups {
		for range questions {
			order = append(order, g)
		}
	}
	rnd.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	jobs := make([]job, len(order))
	var at time.Duration
	for i, g := range order {
		at += time.Duration(rnd.ExpFloat64() / rate * float64(time.Second))
		pick := rnd.Float64() // before ask's draws, as when each job was one literal
		j := ask(g)
		j.index, j.at, j.stream, j.maxTokens, j.group, j.pick = i, at, true, outputTokens, g, pick
		jobs[i] = j
	}
	return jobs
}

// toolsShape is an agent workload: applications whose requests share their tool definitions, each a
// user's question with no system message, as function calling is often sent.
type toolsShape struct {
	apps, questions            int
	toolTokens, questionTokens int
	outputTokens               int
}

// defaultTools is the shared-prefix shape with each group's shared prompt moved from a system message
// into tool definitions: the same tokens, in the place the chat template gives them.
var defaultTools = toolsShape{apps: 32, questions: 16, toolTokens: 2048, questionTokens: 128, outputTokens: 256}

// toolDefinitions is one application's tools as an OpenAI client sends them: n tokens of JSON in the
// simulator's measure (4n bytes), unique from its first block (the nonce leads its first tool's name).
func toolDefinitions(rnd *rand.Rand, nonce string, n int) string {
	head := `[{"type":"function","function":{"name":"` + nonce + `_lookup","description":"`
	tail := `","parameters":{"type":"object","properties":{"id":{"type":"string"}}}}}]`
	pad := n*bytesPerToken - len(head) - len(tail)
	return head + text(rnd, pad/bytesPerToken) + strings.Repeat(".", pad%bytesPerToken) + tail
}

// toolsWorkload sends every question of every application once, the applications interleaved at
// random, at Poisson arrivals of rate, all streamed.
func toolsWorkload(seed int64, rate float64, s toolsShape) []job {
	rnd := rand.New(rand.NewPCG(uint64(seed), 0x7001))
	tools := make([]string, s.apps)
	for a := range tools {
		tools[a] = toolDefinitions(rnd, nonce(seed, a), s.toolTokens)
	}
	return interleaved(rnd, rate, s.apps, s.questions, s.outputTokens, func(a int) job {
		return job{messages: []message{{"user", text(rnd, s.questionTokens)}}, tools: tools[a]}
	})
}

// sessionShape is a multi-turn chat workload: sessions start at Poisson arrivals; each turn resends the
// whole history (the previous answers as the workers gave them) plus a new user message, sent when the
// previous answer arrived and a think time passed.
type sessionShape struct {
	sessions, turns            int
	firstTokens, messageTokens int
	outputTokens               int
	thinkTime                  time.Duration // mean, exponential
	// apps, when not 0, gives each session application session % apps's tool definitions of toolTokens
	// tokens and its system prompt of systemTokens tokens (either may be 0): an agent's or a chat
	// application's conversations, which share the application's tools or instructions ahead of their
	// own messages.
	apps, toolTokens, systemTokens int
}

var defaultSessions = sessionShape{sessions: 64, turns: 6, firstTokens: 1024, messageTokens: 128, outputTokens: 128,
	thinkTime: 2 * time.Second}

// defaultAgents is a coding agent's shape: two applications whose tools and instructions run past 16
// KiB (5,120 tokens), each with many users' conversations of several turns behind them, more than one
// worker holds at a busy rate.
var defaultAgents = sessionShape{sessions: 160, turns: 6, firstTokens: 512, messageTokens: 128, outputTokens: 128,
	thinkTime: 2 * time.Second, apps: 2, toolTokens: 5120}

// defaultChat is a chat application's shape: four applications, each with a system prompt of 1,024
// tokens (4 KiB, far past the 1 KiB from which each conversation behind it has its own home), and many
// users' conversations of several turns behind each.
var defaultChat = sessionShape{sessions: 160, turns: 6, firstTokens: 256, messageTokens: 128, outputTokens: 128,
	thinkTime: 2 * time.Second, apps: 4, systemTokens: 1024}

// sessionWorkload returns every turn of every session; at is the session's start for turn 0 and the think
// time after the previous answer for later turns. messages holds only the new user message: the sender
// prepends the history.
func sessionWorkload(seed int64, rate float64, s sessionShape) []job {
	rnd := rand.New(rand.NewPCG(uint64(seed), 0xc4a7))
	tools, systems := make([]string, s.apps), make([]string, s.apps)
	appRnd := rand.New(rand.NewPCG(uint64(seed), 0xa9e7)) // a stream of its own: sessions without applications draw as before
	for a := range tools {
		if s.toolTokens > 0 {
			tools[a] = toolDefinitions(appRnd, nonce(seed, s.sessions+a), s.toolTokens)
		}
	}
	for a := range systems {
		if s.systemTokens > 0 {
			n := nonce(seed, s.sessions+s.apps+a)
			systems[a] = n + text(appRnd, s.systemTokens-len(n)/bytesPerToken)
		}
	}
	var jobs []job
	var start time.Duration
	for g := range s.sessions {
		start += time.Duration(rnd.ExpFloat64() / rate * float64(time.Second))
		for t := range s.turns {
			at := start
			content := text(rnd, s.messageTokens)
			if t == 0 {
				content = nonce(seed, g) + text(rnd, s.firstTokens-len(nonce(seed, g))/bytesPerToken)
			} else {
				at = time.Duration(rnd.ExpFloat64() * float64(s.thinkTime))
			}
			j := job{index: len(jobs), at: at, stream: true, maxTokens: s.outputTokens, group: g, turn: t,
				pick: rnd.Float64(), messages: []message{{"user", content}}, session: fmt.Sprintf("%d-%d", seed, g)}
			if s.apps > 0 {
				j.tools = tools[g%s.apps]
				if t == 0 && systems[g%s.apps] != "" {
					j.messages = append([]message{{"system", systems[g%s.apps]}}, j.messages...)
				}
			}
			jobs = append(jobs, j)
		}
	}
	return jobs
}

// promptTokens is a conversation's prompt in the simulator's measure: ceil(bytes/4) per message, summed,
// and its tool definitions' JSON at 4 bytes a token.
func promptTokens(tools string, msgs []message) int {
	n := (len(tools) + bytesPerToken - 1) / bytesPerToken
	for _, m := range msgs {
		n += max(1, (len(m.Content)+bytesPerToken-1)/bytesPerToken)
	}
	return n
}

// cacheBlockTokens is the block size, in tokens, of the prefix-cache accounting below.
const cacheBlockTokens = 16

// promptText is the text whose leading part a prefix cache (and the prefix routers) match on: the tool
// definitions, as the chat template writes them ahead of the messages, then the messages' contents in
// order, each introduced by its role. Prefix caches match token by token; this string is the bench's
// stand-in for the tokenised prompt.
func promptText(tools string, msgs []message) string {
	var b strings.Builder
	if tools != "" {
		b.WriteString("tools:")
		b.WriteString(tools)
		b.WriteByte('\n')
	}
	for _, m := range msgs {
		b.WriteString(m.Role)
		b.WriteByte(':')
		b.WriteString(m.Content)
		b.WriteByte('\n')
	}
	return b.String()
}

// blockHashes are the chained hashes of the whole blocks of cacheBlockTokens tokens of s: block i's hash
// covers everything up to its end, so equal hashes mean equal prefixes.
func blockHashes(s string) []uint64 {
	const blockBytes = cacheBlockTokens * bytesPerToken
	hs := make([]uint64, 0, len(s)/blockBytes)
	h := fnv.New64a()
	for end := blockBytes; end <= len(s); end += blockBytes {
		_, _ = h.Write([]byte(s[end-blockBytes : end]))
		hs = append(hs, h.Sum64())
	}
	return hs
}

// idealCache is a single cache of unlimited size that sees every prompt in order: the most prompt
// tokens any routing could find cached. A fleet's hit rate divided by this one's says how close routing
// comes to perfect affinity.
type idealCache struct {
	seen           map[uint64]struct{}
	cached, prompt int
}

func newIdealCache() *idealCache { return &idealCache{seen: map[uint64]struct{}{}} }

// add counts one prompt: its tokens, and those of its leading blocks that an earlier prompt had.
func (c *idealCache) add(tools string, msgs []message) {
	c.prompt += promptTokens(tools, msgs)
	hit := true
	for _, h := range blockHashes(promptText(tools, msgs)) {
		if _, ok := c.seen[h]; hit && ok {
			c.cached += cacheBlockTokens
		} else {
			hit = false
		}
		c.seen[h] = struct{}{}
	}
}

// remember caches a conversation without counting it as a prompt: an answer the worker generated, which
// the simulator (as SGLang's radix cache) keeps for the next turn that resends it.
func (c *idealCache) remember(tools string, msgs []message) {
	for _, h := range blockHashes(promptText(tools, msgs)) {
		c.seen[h] = struct{}{}
	}
}

func (c *idealCache) rate() float64 {
	if c.prompt == 0 {
		return 0
	}
	return float64(c.cached) / float64(c.prompt)
}
