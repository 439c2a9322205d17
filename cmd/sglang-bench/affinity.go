package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

type affinityOptions struct {
	qualityOptions
	workloads string
	option    string // on, off, auto
	questions int    // per group of the shared-prefix workload
	// questionTokens sizes each question of the shared-prefix and tools workloads (0: the shape's).
	questionTokens int
}

// affinityLB is the lb_policy of the sglang_load affinity row, and headerLB of the session header's.
const (
	affinityLB = "lb_policy sglang_load {\n\t\t\taffinity prefix\n\t\t}"
	headerLB   = "lb_policy sglang_load {\n\t\t\taffinity header " + sessionHeader + "\n\t\t}"
)

// sessionHeader names a request's conversation in the sessions workload, as a chat front end sends one;
// the other workloads send none, so the header row routes them on cost alone.
const sessionHeader = "X-Session-ID"

// affinityPolicies are the rows of the affinity table; withAffinity adds sglang_load's own affinity.
func affinityPolicies(withAffinity bool) []policy {
	ps := []policy{
		{name: "round_robin", lb: "lb_policy round_robin"},
		{name: "least_conn", lb: "lb_policy least_conn"},
		{name: "sglang_load", lb: "lb_policy sglang_load", interval: 10 * time.Second},
	}
	if withAffinity {
		ps = append(ps, policy{name: "sglang_load affinity prefix", lb: affinityLB, interval: 10 * time.Second},
			policy{name: "sglang_load affinity header", lb: headerLB, interval: 10 * time.Second})
	}
	return append(ps,
		policy{name: "cache_aware (re-impl.)", router: newCacheAware},
		policy{name: "prefix_hash (re-impl.)", router: newPrefixHash},
	)
}

// affinityWorkload is one workload of the affinity benchmark, with the hit rate a perfect router could reach.
type affinityWorkload struct {
	name, about string
	jobs        func(seed int64, rate float64) []job
	ideal       string // the analytic ideal, as a formula with its value
}

// affinityWorkloads are the workloads, the shared-prefix and tools ones with questions per group and
// questionTokens per question (the default shape's when 0).
func affinityWorkloads(questions, questionTokens int) []affinityWorkload {
	sp, ss, tw, ag, ch := defaultSharedPrefix, defaultSessions, defaultTools, defaultAgents, defaultChat
	sp.questions = cmp.Or(questions, sp.questions)
	tw.questions = cmp.Or(questions, tw.questions)
	sp.questionTokens = cmp.Or(questionTokens, sp.questionTokens)
	tw.questionTokens = cmp.Or(questionTokens, tw.questionTokens)
	// Turn t resends the history: its prompt P_t is the first message, t answers and t more messages. The
	// simulator, as SGLang's radix cache, keeps prompts and answers: all of P_t but the new message is
	// cached in the ideal case, nothing of turn 0.
	sessPrompt, sessCached := sessionsIdeal(ss)
	return []affinityWorkload{
		{name: "shared-prefix",
			about: fmt.Sprintf("SGLang bench_serving generated-shared-prefix shape: %d groups, %d-token system prompt, %d questions of %d tokens per group, "+
				"%d output tokens, groups interleaved at random, Poisson arrivals", sp.groups, sp.systemTokens, sp.questions, sp.questionTokens, sp.outputTokens),
			jobs: func(seed int64, rate float64) []job { return sharedPrefixWorkload(seed, rate, sp) },
			ideal: fmt.Sprintf("(Q−1)/Q × S/(S+q) = %d/%d × %d/%d = %.3f (every question but each group's first finds its system prompt cached)",
				sp.questions-1, sp.questions, sp.systemTokens, sp.systemTokens+sp.questionTokens,
				float64(sp.questions-1)/float64(sp.questions)*float64(sp.systemTokens)/float64(sp.systemTokens+sp.questionTokens))},
		{name: "sessions",
			about: fmt.Sprintf("multi-turn chat: %d sessions of %d turns starting at Poisson arrivals of rate ÷ %d; first message %d tokens, "+
				"then %d tokens a turn, %d output tokens (max), think time %s mean; each turn resends the history with the answers as received",
				ss.sessions, ss.turns, ss.turns, ss.firstTokens, ss.messageTokens, ss.outputTokens, ss.thinkTime),
			jobs: func(seed int64, rate float64) []job { return sessionWorkload(seed, rate/float64(ss.turns), ss) },
			ideal: fmt.Sprintf("Σ_{t≥1}(P_t − m) / Σ_t P_t with P_t = F + t(o+m) = %.3f at full-length answers: all but each turn's new "+
				"message is cached, the previous answers too (the simulator, as SGLang's radix cache, keeps generated tokens); "+
				"answers that end early lower it", sessCached/sessPrompt)},
		applicationSessions("agents", "agents' conversations", "tool definitions", " (past the first 16 KiB of the prompt)", "T", ag.toolTokens, ag),
		applicationSessions("chat", "chat applications' conversations", "system prompt", "", "S", ch.systemTokens, ch),
		{name: "tools",
			about: fmt.Sprintf("agents: %d applications, each with its own tool definitions of %d tokens (JSON, sent after the messages as the OpenAI SDK sends them), "+
				"%d questions of %d tokens per application as the only message, %d output tokens, applications interleaved at random, Poisson arrivals: "+
				"the shared-prefix shape with the shared part in the tools, which the chat template writes ahead of the messages",
				tw.apps, tw.toolTokens, tw.questions, tw.questionTokens, tw.outputTokens),
			jobs: func(seed int64, rate float64) []job { return toolsWorkload(seed, rate, tw) },
			ideal: fmt.Sprintf("(Q−1)/Q × T/(T+q) = %d/%d × %d/%d = %.3f (every question but each application's first finds its tools cached)",
				tw.questions-1, tw.questions, tw.toolTokens, tw.toolTokens+tw.questionTokens,
				float64(tw.questions-1)/float64(tw.questions)*float64(tw.toolTokens)/float64(tw.toolTokens+tw.questionTokens))},
		{name: "unique",
			about: fmt.Sprintf("the quality workload (no shared prefix: every prompt starts with a nonce), %d requests", sp.groups*sp.questions),
			jobs:  func(seed int64, rate float64) []job { return qualityWorkload(seed, rate, sp.groups*sp.questions) },
			ideal: "0 (no two prompts share a block)"},
	}
}

// applicationSessions is the workload of shape s: conversations behind their applications' part (tool
// definitions or a system prompt) of tokens each, which where says where it lies and the ideal's formula
// calls symbol.
func applicationSessions(name, about, part, where, symbol string, tokens int, s sessionShape) affinityWorkload {
	prompt, cached := sessionsIdeal(s)
	return affinityWorkload{name: name,
		about: fmt.Sprintf("%s: %d applications, each with its own %s of %d tokens%s; "+
			"%d sessions of %d turns, each of one application, starting at Poisson arrivals of rate ÷ %d; first message %d tokens, then %d tokens a turn, "+
			"%d output tokens (max), think time %s mean; each turn resends the %s and the history with the answers as received",
			about, s.apps, part, tokens, where, s.sessions, s.turns, s.turns, s.firstTokens, s.messageTokens, s.outputTokens, s.thinkTime, part),
		jobs: func(seed int64, rate float64) []job { return sessionWorkload(seed, rate/float64(s.turns), s) },
		ideal: fmt.Sprintf("Σ_t cached / Σ_t P_t with P_t = %s + F + t(o+m), the %s cached at turn 0 and all but the new message after, "+
			"= %.3f at full-length answers (each application's first turn finds nothing; answers that end early lower it)", symbol, part, cached/prompt)}
}

// sessionsIdeal is the prompt tokens of a session of shape s summed over its turns, and of them those
// an ideal cache holds: turn t resends the application's tools and system prompt, the first message, t
// answers and t more messages, so all but its new message is cached after turn 0, and turn 0 finds the
// application's part.
func sessionsIdeal(s sessionShape) (prompt, cached float64) {
	app := s.toolTokens + s.systemTokens
	for t := range s.turns {
		p := float64(app + s.firstTokens + t*(s.outputTokens+s.messageTokens))
		prompt += p
		if t > 0 {
			cached += p - float64(s.messageTokens)
		} else {
			cached += float64(app)
		}
	}
	return prompt, cached
}

// caddyAccepts reports whether the binary adapts a Caddyfile with this lb_policy.
func caddyAccepts(ctx context.Context, binary, lb string) bool {
	dir, err := os.MkdirTemp("", "sglang-bench-adapt-")
	if err != nil {
		return false
	}
	defer os.RemoveAll(dir)
	file := filepath.Join(dir, "Caddyfile")
	cf := fmt.Sprintf("http://127.0.0.1:1 {\n\treverse_proxy 127.0.0.1:2 {\n\t\t%s\n\t}\n}\n", lb)
	if os.WriteFile(file, []byte(cf), 0o600) != nil {
		return false
	}
	cmd := exec.CommandContext(ctx, binary, "adapt", "--config", file, "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir, "HOME="+dir)
	return cmd.Run() == nil
}

func runAffinity(ctx context.Context, o affinityOptions, stdout, stderr io.Writer) error {
	if _, err := os.Stat(o.caddy); err != nil {
		return fmt.Errorf("-caddy %s: %w (run make build first)", o.caddy, err)
	}
	var withAffinity bool
	note := ""
	switch o.option {
	case "on":
		withAffinity = true
	case "off":
		note = "The `affinity prefix` row is off (-affinity-option off)."
	case "auto":
		withAffinity = caddyAccepts(ctx, o.caddy, affinityLB)
		if !withAffinity {
			note = "The `affinity prefix` row is left out: this binary does not accept the option."
		}
	default:
		return fmt.Errorf("-affinity-option %q: want on, off or auto", o.option)
	}
	ps, err := selectPolicies(affinityPolicies(withAffinity), o.only)
	if err != nil {
		return err
	}
	var specs []armSpec
	for _, p := range ps {
		for _, n := range o.instances {
			specs = append(specs, armSpec{p, n})
		}
	}
	var chosen []affinityWorkload
	for _, name := range strings.Split(o.workloads, ",") {
		found := false
		for _, w := range affinityWorkloads(o.questions, o.questionTokens) {
			if w.name == strings.TrimSpace(name) {
				chosen, found = append(chosen, w), true
			}
		}
		if !found {
			return fmt.Errorf("-workloads: unknown workload %q: want shared-prefix, sessions, agents, chat, tools or unique", name)
		}
	}
	mark := markCPU()
	var b strings.Builder
	header(&b, "Prefix affinity")
	fmt.Fprintf(&b, "Seeds %v; every arm (policy × instances) has its own fleet, all arms of a seed run at once; requests go to "+
		"one of an arm's instances at random (the same choice in every arm). %s %s\n\n", o.seeds, fleetLine(o.fleetPorts), note)
	b.WriteString("The re-implementations (labelled re-impl.) are in-process routers inside the bench, one state per instance " +
		"(so ×3 means three separate trees or in-flight counts): the bench asks the router for a worker and sends the request " +
		"straight to it, skipping the proxy hop — a difference of tens of microseconds against latencies of seconds.\n\n")
	b.WriteString("Hit rate: cached ÷ prompt tokens over the fleet, from each answer's usage.prompt_tokens_details.cached_tokens. " +
		"Ideal (measured): one cache of unlimited size that saw every prompt (and answer) in the order sent, counting whole blocks of " +
		fmt.Sprint(cacheBlockTokens) + " tokens of the prompt text that an earlier prompt had; the formula under each workload is the same " +
		"figure computed from the shape.\n\n")
	b.WriteString(spreadLegend)
	for _, w := range chosen {
		fmt.Fprintf(&b, "#### Workload %s\n\n%s. Ideal hit rate: %s.\n\n", w.name, w.about, w.ideal)
		for _, rate := range o.rates {
			cpu0 := markCPU()
			res, err := runSeeds(ctx, o.caddy, specs, o.affinitySeedsAtOnce(), o.fleetPorts, o.seeds, func(seed int64) []job {
				jobs := w.jobs(seed, rate)
				return jobs[:min(len(jobs), o.requests)]
			},
				stderr, fmt.Sprintf("affinity %s %g/s", w.name, rate))
			if err != nil {
				return err
			}
			fmt.Fprintf(&b, "##### %s at %g requests/s\n\nCPU: %s.\n\n", w.name, rate, cpuSince(cpu0))
			affinityTable(&b, res)
			ratioTables(&b, res, []metric{mHit, mTTFTMean, mTTFT90, mP50, mP99, mTok}, "sglang_load", "cache_aware (re-impl.)")
			instanceRatios(&b, res, []metric{mHit, mTTFTMean, mP99})
			kvTable(&b, res)
			// Written as it grows, so a failure late in a long run keeps what was measured.
			if err := writeResult(o.out, "affinity.md", b.String()+"\n(run incomplete)\n"); err != nil {
				return err
			}
		}
	}
	fmt.Fprintf(&b, "CPU, whole run: %s.\n", cpuSince(mark))
	md := b.String()
	if err := writeResult(o.out, "affinity.md", md); err != nil {
		return err
	}
	fmt.Fprint(stdout, md)
	return nil
}

// affinityTable: hit rate beside the ideal, the cache the workers evicted and what they prefilled again
// for it, TTFT, latency, throughput and shares, median (range) over seeds.
func affinityTable(b *strings.Builder, sr seedResults) {
	ms := []metric{mHit, mEvicted, mAgain, mTTFT50, mTTFT99, mP50, mP99, mTok}
	b.WriteString("| policy | hit rate | ideal (measured) | hit ÷ ideal | evicted ÷ prompt tokens | prefilled again ÷ prompt tokens | TTFT p50 s | TTFT p99 s | p50 s | p99 s | out tok/s | failed (max) | share " +
		strings.Join(workerLabels(), " / ") + " |\n|---|" + strings.Repeat("---:|", 11) + "---|\n")
	for i, name := range sr.policies {
		rs := sr.byPolicy[i]
		ideal := values(rs, metric{get: func(r armResult) float64 { return r.ideal }})
		failed := 0
		for _, r := range rs {
			failed = max(failed, r.failed)
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s |", name, spreadOf(values(rs, ms[0])).format(3), spreadOf(ideal).format(3),
			spreadOf(ratios(values(rs, mHit), ideal)).format(2))
		for _, m := range ms[1:] {
			fmt.Fprintf(b, " %s |", spreadOf(values(rs, m)).format(m.decimals))
		}
		fmt.Fprintf(b, " %d | %s |\n", failed, shares(rs))
	}
	b.WriteString("\n")
}
