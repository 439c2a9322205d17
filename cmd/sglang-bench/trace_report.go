package main

import (
	"encoding/csv"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/trace"
)

// traceResults is the runs' figures as the quality tables take them: a slice stands where a seed does.
func traceResults(o traceOptions, runs []traceRun, ps []policy) seedResults {
	sr := seedResults{byPolicy: make([][]armResult, len(ps)), workers: o.fleet.labels()}
	for i, p := range ps {
		sr.policies = append(sr.policies, p.name)
		for _, run := range runs {
			sr.byPolicy[i] = append(sr.byPolicy[i], run.results[i])
		}
	}
	for i := range runs {
		sr.seeds = append(sr.seeds, int64(i+1))
	}
	return sr
}

// maxTokensText says what the clients sent as max_tokens, and what that tells a router.
func maxTokensText(m maxTokensMode, runs []traceRun) string {
	switch {
	case m.absent:
		return "not sent (-max-tokens absent), as most chat clients send none: a router that reads the body learns nothing of " +
			"the answer's length, and the simulator lets an answer run as far as its rank holds beside the prompt"
	case m.cap > 0:
		cut := 0
		for _, run := range runs {
			for _, r := range run.reqs {
				if r.OutputTokens > m.cap {
					cut++
				}
			}
		}
		return fmt.Sprintf("%d on every request (-max-tokens cap:%d), a client's fixed cap; %d requests whose traced answer is longer "+
			"are cut to it", m.cap, m.cap, cut)
	}
	return "the traced output length (-max-tokens exact): a router that reads the body knows every answer's length in advance, " +
		"which no production router does"
}

// traceMarkdown is the report of a trace replay.
func traceMarkdown(o traceOptions, format trace.Format, runs []traceRun, ps []policy, total cpuUse, csvName string) string {
	var b strings.Builder
	base := filepath.Base(o.path)
	header(&b, "Trace replay: "+base)
	fmt.Fprintf(&b, "Trace: `%s` (%s format). Source: %s.\n\n", base, format, format.Source())
	var sl []string
	for _, r := range runs {
		sl = append(sl, r.slice.String())
	}
	fmt.Fprintf(&b, "Replay: slice %s of the trace (start+length, in trace time), sent %gx as fast (-speedup). Each request is one user "+
		"message of its traced prompt length (4 bytes of text a token; equal hash ids give equal block texts, so requests whose "+
		"leading ids agree share a prefix in the workers' prefix caches and for the prefix routers), `answer_tokens` its traced output "+
		"length, so every answer has the recorded length; max_tokens %s. Every request is streamed with include_usage: TTFT is the "+
		"client's time to the first event. Open loop: each request goes at its trace time whatever the answers; each has %s to "+
		"end (-trace-timeout).\n\n", strings.Join(sl, ", "), o.speedup, maxTokensText(o.maxTokens, runs), o.timeout)
	admission := "each request reserves its prompt and whole max_tokens when admitted (-sglang-admission=false)"
	if sglangAdmission {
		admission = "admitting as SGLang does (KV allocated as decoded, retraction when the guess was wrong)"
	}
	ports := "on any free ports"
	if o.fleetPorts != 0 {
		ports = fmt.Sprintf("on fixed ports from %d, a block per row, the same for every slice", o.fleetPorts)
	}
	fmt.Fprintf(&b, "Fleet `%s`: %s; %s; %s.\n\n", o.fleet.spec, o.fleet, admission, ports)
	b.WriteString("Rows: each has its own Caddy (or, for a re-implementation, an in-process router sending straight to the " +
		"worker) and its own fleet; all rows of a slice run at once, sent the same bytes at the same moments; every fleet starts " +
		"with empty caches. ")
	for _, p := range ps {
		if p.lb != "" {
			fmt.Fprintf(&b, "%s: `%s`%s. ", p.name, strings.Join(strings.Fields(p.lb), " "), intervalText(p.interval))
		}
	}
	b.WriteString("\n\n")

	fmt.Fprintf(&b, "The slices, in trace time (prompt and output in tokens; hit-rate bounds from the slice's hash ids, in 512-token "+
		"blocks: one cache that never evicts, and one LRU cache of the fleet's %d pool tokens together):\n\n", o.fleet.cacheTokens())
	b.WriteString("| slice | requests | span s | rate /s | sent /s | prompt mean / p50 / p99 / max | output mean / p99 | long: prompt > | " +
		"hit bound unlimited | hit bound LRU | arms start s | replay s | CPU |\n|---|" + strings.Repeat("---:|", 11) + "---|\n")
	for _, r := range runs {
		s := r.stats
		fmt.Fprintf(&b, "| %s | %d | %.0f | %.2f | %.2f | %.0f / %.0f / %.0f / %.0f | %.0f / %.0f | %d | %.3f | %.3f | %.0f | %.0f | %s |\n",
			r.slice, s.Requests, s.Duration.Seconds(), s.Rate, s.Rate*o.speedup, s.PromptMean, s.PromptP50, s.PromptP99, s.PromptMax,
			s.OutputMean, s.OutputP99, r.longFrom, r.unlimited, r.lru, r.armsStarted.Seconds(), r.replayed.Seconds(), r.cpu)
	}
	b.WriteString("\n")

	sr := traceResults(o, runs, ps)
	if len(runs) == 1 {
		b.WriteString("Figures of the slice (one slice: each range is the value itself). Latency: from sending to the last " +
			"byte; throughput: output tokens over the replay, from the first request sent to the last answer.\n\n")
	} else {
		b.WriteString("Figures, median over slices with the range (min..max) in brackets; a ratio is taken slice by slice " +
			"(**better** / **worse**: on every slice). Latency: from sending to the last byte; throughput: output tokens " +
			"over the replay.\n\n")
	}
	figuresTable(&b, sr, []metric{mP50, mP90, mP99, mTTFTMean, mTTFT50, mTTFT90, mTTFT99, mTok})
	traceCacheTable(&b, sr, runs)
	controlLine(&b, sr)
	fmt.Fprintf(&b, "In the tables below, long means a prompt above the slice's p90 (%s tokens); every request is streamed; "+
		"a seed is a slice.\n\n", longFromText(runs))
	whyTables(&b, sr)
	b.WriteString("<details><summary>Caddy's counts and the speeds sglang_load held per worker at the end (decode alone / prefill, " +
		"tokens/s)</summary>\n\n| slice | policy | counts |\n|---|---|---|\n")
	for _, run := range runs {
		for _, r := range run.results {
			fmt.Fprintf(&b, "| %s | %s | %s |\n", run.slice, r.name, strings.TrimSpace(r.routing.String()+r.speeds))
		}
	}
	b.WriteString("\n</details>\n\n")
	fmt.Fprintf(&b, "Every request's figures: `%s` (one line per row and request: slice, row, trace line, arrival s as sent, worker, "+
		"prompt, cached and output tokens, latency, TTFT, and the worker's queue and first-token times, s).\n\n", csvName)
	fmt.Fprintf(&b, "CPU, whole run: %s.\n", total)
	return b.String()
}

func intervalText(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return ", loads polled every " + shortDuration(d)
}

func longFromText(runs []traceRun) string {
	var s []string
	for _, r := range runs {
		s = append(s, strconv.Itoa(r.longFrom))
	}
	return strings.Join(s, ", ")
}

// mOK is an arm's completed requests.
var mOK = metric{"ok", func(r armResult) float64 { return float64(r.requests - r.failed) }, 0, false}

// traceCacheTable: per row, requests completed and failed, the fleet's hit rate beside the slice's bounds,
// what the workers evicted and prefilled again, and the ratios to least_conn.
func traceCacheTable(b *strings.Builder, sr seedResults, runs []traceRun) {
	var unlimited, lru []float64
	for _, r := range runs {
		unlimited, lru = append(unlimited, r.unlimited), append(lru, r.lru)
	}
	lc := sr.find("least_conn")
	ratioMs := []metric{mP50, mP99, mTTFTMean, mTTFT50}
	b.WriteString("Requests, prefix cache (cached ÷ prompt tokens from each answer's usage.prompt_tokens_details.cached_tokens, " +
		"beside the slice's bounds) and ratios to least_conn (lower is better):\n\n")
	b.WriteString("| policy | ok | failed | hit rate | ÷ unlimited bound | ÷ LRU bound | evicted ÷ prompt | prefilled again ÷ prompt |")
	for _, m := range ratioMs {
		fmt.Fprintf(b, " %s ÷ least_conn |", strings.TrimSuffix(m.name, " s"))
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", 7+len(ratioMs)) + "\n")
	for i, name := range sr.policies {
		rs := sr.byPolicy[i]
		failed := 0
		for _, r := range rs {
			failed += r.failed
		}
		hits := values(rs, mHit)
		fmt.Fprintf(b, "| %s | %s | %d | %s | %s | %s | %s | %s |", name, spreadOf(values(rs, mOK)).format(0), failed,
			spreadOf(hits).format(3), spreadOf(ratios(hits, unlimited)).format(2), spreadOf(ratios(hits, lru)).format(2),
			spreadOf(values(rs, mEvicted)).format(3), spreadOf(values(rs, mAgain)).format(3))
		for _, m := range ratioMs {
			if lc == nil || name == "least_conn" {
				b.WriteString(" - |")
				continue
			}
			fmt.Fprintf(b, " %s |", ratioCell(rs, lc, m))
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
}

// traceCSV is every request's figures, a line per row and request.
func traceCSV(o traceOptions, runs []traceRun, ps []policy) string {
	var b strings.Builder
	w := csv.NewWriter(&b)
	labels := o.fleet.labels()
	_ = w.Write([]string{"slice", "row", "line", "arrival_s", "worker", "prompt", "cached", "output", "latency_s", "ttft_s",
		"queue_s", "first_token_s", "ok", "failure"})
	sec := func(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 4, 64) }
	for _, run := range runs {
		for i, samples := range run.samples {
			for _, s := range samples {
				worker := ""
				if s.worker >= 0 {
					worker = labels[s.worker]
				}
				r := run.reqs[s.job]
				_ = w.Write([]string{run.slice.String(), ps[i].name, strconv.Itoa(r.Line), sec(r.At), worker,
					strconv.Itoa(s.prompt), strconv.Itoa(s.cached), strconv.Itoa(s.out), sec(s.latency), sec(s.ttft),
					strconv.FormatFloat(s.queue, 'f', 4, 64), strconv.FormatFloat(s.firstToken, 'f', 4, 64),
					strconv.FormatBool(s.ok), s.failure})
			}
		}
	}
	w.Flush()
	return b.String()
}

// traceSummary is the short report for stdout: the trace and slices, and per row the key figures
// (medians over slices).
func traceSummary(o traceOptions, format trace.Format, runs []traceRun, ps []policy, report string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "trace %s: %s\n", filepath.Base(o.path), format.Source())
	fmt.Fprintf(&b, "fleet %s, speedup %g, max_tokens %s\n", o.fleet.spec, o.speedup, o.maxTokens)
	for _, r := range runs {
		fmt.Fprintf(&b, "slice %s: %d requests at %.2f/s, prompt mean %.0f p99 %.0f, output mean %.0f; hit bounds unlimited %.3f, LRU %.3f\n",
			r.slice, r.stats.Requests, r.stats.Rate*o.speedup, r.stats.PromptMean, r.stats.PromptP99, r.stats.OutputMean, r.unlimited, r.lru)
	}
	sr := traceResults(o, runs, ps)
	lc := sr.find("least_conn")
	fmt.Fprintf(&b, "%-34s %5s %6s %7s %7s %9s %8s %6s %8s %8s\n", "policy", "ok", "failed", "p50 s", "p99 s", "TTFT mean", "TTFT p50", "hit",
		"p50÷lc", "p99÷lc")
	med := func(rs []armResult, m metric) float64 { return spreadOf(values(rs, m)).med }
	for i, name := range sr.policies {
		rs := sr.byPolicy[i]
		failed := 0
		for _, r := range rs {
			failed += r.failed
		}
		p50, p99 := "-", "-"
		if lc != nil {
			p50 = fmt.Sprintf("%.2f", ratioSpread(rs, lc, mP50).med)
			p99 = fmt.Sprintf("%.2f", ratioSpread(rs, lc, mP99).med)
		}
		fmt.Fprintf(&b, "%-34s %5.0f %6d %7.2f %7.2f %9.2f %8.2f %6.3f %8s %8s\n", name, med(rs, mOK), failed, med(rs, mP50), med(rs, mP99),
			med(rs, mTTFTMean), med(rs, mTTFT50), med(rs, mHit), p50, p99)
	}
	fmt.Fprintf(&b, "report: %s\n", report)
	return b.String()
}
