package main

import (
	"fmt"
	"html"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"
)

// machine describes the host: core count and CPU model, for the results' header.
func machine() string {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	return fmt.Sprintf("%d cores (nproc), %s, %s/%s, %s", runtime.NumCPU(), model, runtime.GOOS, runtime.GOARCH, runtime.Version())
}

// writeResult writes a result file into out/<today>/.
func writeResult(out, name, content string) error {
	dir := filepath.Join(out, time.Now().Format("2006-01-02"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644)
}

// metric is one figure of an armResult, with how to read it.
type metric struct {
	name        string
	get         func(armResult) float64
	decimals    int
	lowerBetter bool
}

var (
	mP50      = metric{"p50 s", func(r armResult) float64 { return r.p50 }, 2, true}
	mP90      = metric{"p90 s", func(r armResult) float64 { return r.p90 }, 2, true}
	mP99      = metric{"p99 s", func(r armResult) float64 { return r.p99 }, 2, true}
	mTTFTMean = metric{"TTFT mean s", func(r armResult) float64 { return r.ttftMean }, 2, true}
	mTTFT50   = metric{"TTFT p50 s", func(r armResult) float64 { return r.ttft50 }, 2, true}
	mTTFT90   = metric{"TTFT p90 s", func(r armResult) float64 { return r.ttft90 }, 2, true}
	mTTFT99   = metric{"TTFT p99 s", func(r armResult) float64 { return r.ttft99 }, 2, true}
	mTok      = metric{"out tok/s", func(r armResult) float64 { return r.tokPerSec }, 0, false}
	mHit      = metric{"hit rate", func(r armResult) float64 { return r.hit }, 3, false}
	mEvicted  = metric{"evicted ÷ prompt", func(r armResult) float64 { return r.evicted }, 3, true}
	mAgain    = metric{"prefilled again ÷ prompt", func(r armResult) float64 { return r.again }, 3, true}
	mSeconds  = metric{"run s", func(r armResult) float64 { return r.seconds }, 0, true}
)

func values(rs []armResult, m metric) []float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = m.get(r)
	}
	return v
}

// ratioSpread is a policy's figure m divided by a baseline's, seed by seed: median and range.
func ratioSpread(rs, base []armResult, m metric) spread {
	return spreadOf(ratios(values(rs, m), values(base, m)))
}

// ratioCell is a policy's figure divided by a baseline's, seed by seed: median, range, and whether the
// whole range lies on one side of 1.
func ratioCell(rs, base []armResult, m metric) string {
	s := ratioSpread(rs, base, m)
	v := s.verdict()
	if !m.lowerBetter {
		switch v {
		case "better on every seed":
			v = "worse on every seed"
		case "worse on every seed":
			v = "better on every seed"
		}
	}
	short := map[string]string{"better on every seed": "**better**", "worse on every seed": "**worse**", "within seed range": "~", "one seed": "(1 seed)"}[v]
	return s.format(2) + " " + short
}

func (sr seedResults) find(name string) []armResult {
	if i := slices.Index(sr.policies, name); i >= 0 {
		return sr.byPolicy[i]
	}
	return nil
}

func header(b *strings.Builder, title string) {
	fmt.Fprintf(b, "### %s, %s\n\n", title, time.Now().Format("2006-01-02"))
	fmt.Fprintf(b, "Machine: %s.\n\n", machine())
}

func fleetLine(portBase int) string {
	names := make([]string, len(workerScales))
	for i := range workerScales {
		c := workerConfig(i)
		names[i] = fmt.Sprintf("%s (pool %d, batch %d, decode %g tok/s, prefill %g tok/s)", c.Name, c.MaxTotalTokens,
			c.MaxRunningRequests, c.DecodeTokensPerSec, c.PrefillTokensPerSec)
	}
	ports := "on any free ports (-fleet-ports 0): a rerun draws other prefix homes"
	if portBase != 0 {
		ports = fmt.Sprintf("on fixed ports from %d (-fleet-ports), a block per seed and arm", portBase)
	}
	admission := "each request reserves its prompt and whole max_tokens when admitted (-sglang-admission=false)"
	if sglangAdmission {
		admission = "admitting as SGLang does (-sglang-admission, the default): KV allocated as decoded, admission on " +
			"a guess of the output to come, requests retracted when it was wrong"
	}
	return "Workers: " + strings.Join(names, ", ") + "; " + admission + "; " + ports + "."
}

const spreadLegend = "Every figure is the median over seeds with its range (min..max) in brackets. A ratio is computed seed by " +
	"seed against the baseline of the same seed (both saw the same requests at the same moments); **better** / " +
	"**worse**: the whole range is on that side of 1, so the difference holds on every seed; ~: the range includes 1.\n\n"

// sizesLine says how long the workload's prompts and answers are.
func sizesLine(o qualityOptions) string {
	short, long := scaledOutput(shortOutput, o.outputScale), scaledOutput(longOutput, o.outputScale)
	if o.independentAnswers {
		return fmt.Sprintf("prompts %.0f%% short (%d tokens), %.0f%% long (%d); answers drawn apart from the prompts, "+
			"%.0f%% short (max_tokens %d), %.0f%% long (max_tokens %d)",
			(1-longShare)*100, shortPrompt, longShare*100, longPrompt, (1-longShare)*100, short, longShare*100, long)
	}
	return fmt.Sprintf("%.0f%% short (prompt %d, max_tokens %d), %.0f%% long (prompt %d, max_tokens %d)",
		(1-longShare)*100, shortPrompt, short, longShare*100, longPrompt, long)
}

// samplesLine says what share of the workload asks for several answers, if any.
func samplesLine(o qualityOptions) string {
	if o.samplesShare <= 0 || o.samples <= 1 {
		return ""
	}
	return fmt.Sprintf("%.0f%% ask for %d answers (n); ", o.samplesShare*100, o.samples)
}

func qualityMarkdown(o qualityOptions, runs []qualityRun, total cpuUse) string {
	var b strings.Builder
	header(&b, "Routing quality")
	fmt.Fprintf(&b, "Workload: %d requests per policy and seed, Poisson arrivals; %s; %.0f%% streamed; %seach prompt unique from its first token. Seeds %v. %s "+
		"All policies of a seed run at once, each with its own Caddy and its own workers, sent the same requests at the same moments.\n\n",
		o.requests, sizesLine(o), streamShare*100, samplesLine(o), o.seeds, fleetLine(o.fleetPorts))
	fmt.Fprintf(&b, "CPU, whole run: %s.\n\n", total)
	b.WriteString(spreadLegend)
	for _, run := range runs {
		fmt.Fprintf(&b, "#### %g requests/s\n\nCPU: %s.\n\n", run.rate, run.cpu)
		figuresTable(&b, run.res, []metric{mP50, mP90, mP99, mTTFTMean, mTTFT90, mTTFT99, mTok})
		ratioTables(&b, run.res, []metric{mP50, mP90, mP99, mTTFTMean, mTTFT99, mTok}, "least_conn", "round_robin")
		targetsTable(&b, run.res)
		controlLine(&b, run.res)
		kvTable(&b, run.res)
		if lc := run.res.find("least_conn"); lc != nil {
			var m, p []float64
			for _, r := range lc {
				m, p = append(m, r.kvMean[0]), append(p, r.kvPeak[0])
			}
			fmt.Fprintf(&b, "Busy check: under least_conn the smallest worker's KV use peaks at %s (mean %s); above 70%% on every seed: %s.\n\n",
				percents(p), percents(m), map[bool]string{true: "yes", false: "no"}[spreadOf(p).lo > 0.7])
		}
		whyTables(&b, run.res)
	}
	return b.String()
}

// percents is the spread of fractions as percentages: "90% (85..95%)".
func percents(xs []float64) string {
	s := spreadOf(xs)
	return fmt.Sprintf("%.0f%% (%.0f..%.0f%%)", s.med*100, s.lo*100, s.hi*100)
}

// figuresTable: one row per policy, median (range) of each metric, failures, and per-worker shares.
func figuresTable(b *strings.Builder, sr seedResults, ms []metric) {
	b.WriteString("| policy |")
	for _, m := range ms {
		b.WriteString(" " + m.name + " |")
	}
	fmt.Fprintf(b, " failed (max) | share %s |\n|---|", strings.Join(sr.labels(), " / "))
	b.WriteString(strings.Repeat("---:|", len(ms)+1) + "---|\n")
	for i, name := range sr.policies {
		rs := sr.byPolicy[i]
		fmt.Fprintf(b, "| %s |", name)
		for _, m := range ms {
			fmt.Fprintf(b, " %s |", spreadOf(values(rs, m)).format(m.decimals))
		}
		failed := 0
		for _, r := range rs {
			failed = max(failed, r.failed)
		}
		fmt.Fprintf(b, " %d | %s |\n", failed, shares(rs))
	}
	b.WriteString("\n")
}

// shares is the median share of each worker over seeds.
func shares(rs []armResult) string {
	var out []string
	if len(rs) > 0 {
		out = make([]string, len(rs[0].share))
	}
	for w := range out {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = r.share[w]
		}
		out[w] = fmt.Sprintf("%.0f%%", spreadOf(v).med*100)
	}
	return strings.Join(out, " / ")
}

// ratioTables: per baseline, every policy's ratio of each metric, then the same ratios seed by seed.
func ratioTables(b *strings.Builder, sr seedResults, ms []metric, baselines ...string) {
	for _, base := range baselines {
		br := sr.find(base)
		if br == nil {
			continue
		}
		fmt.Fprintf(b, "Ratio to %s, seed by seed (latencies: lower is better; tok/s and hit rate: higher):\n\n| policy |", base)
		for _, m := range ms {
			b.WriteString(" " + strings.TrimSuffix(m.name, " s") + " |")
		}
		b.WriteString("\n|---|" + strings.Repeat("---|", len(ms)) + "\n")
		for i, name := range sr.policies {
			if name == base {
				continue
			}
			fmt.Fprintf(b, "| %s |", name)
			for _, m := range ms {
				fmt.Fprintf(b, " %s |", ratioCell(sr.byPolicy[i], br, m))
			}
			b.WriteString("\n")
		}
		b.WriteString("\n")
	}
	b.WriteString("<details><summary>Every ratio, seed by seed</summary>\n\n| policy | ratio |")
	for _, s := range sr.seeds {
		fmt.Fprintf(b, " seed %d |", s)
	}
	b.WriteString("\n|---|---|" + strings.Repeat("---:|", len(sr.seeds)) + "\n")
	for i, name := range sr.policies {
		for _, base := range baselines {
			br := sr.find(base)
			if br == nil || name == base {
				continue
			}
			for _, m := range ms {
				fmt.Fprintf(b, "| %s | %s ÷ %s |", name, strings.TrimSuffix(m.name, " s"), base)
				for _, r := range ratios(values(sr.byPolicy[i], m), values(br, m)) {
					fmt.Fprintf(b, " %.2f |", r)
				}
				b.WriteString("\n")
			}
		}
	}
	b.WriteString("\n</details>\n\n")
}

// targetsTable checks issue targets at a 10 s interval on every seed: p99 ≤ 0.6× least_conn, p50 ≤ 1.0×
// least_conn, p99 ≤ 0.5× round_robin, and p99 within 10% of the same policy at a 1 s interval.
func targetsTable(b *strings.Builder, sr seedResults) {
	lc, rr := sr.find("least_conn"), sr.find("round_robin")
	if lc == nil || rr == nil {
		return
	}
	b.WriteString("Targets at a 10 s interval, on every seed (p99 ≤ 0.6× least_conn, p50 ≤ 1.0× least_conn, p99 ≤ 0.5× round_robin, " +
		"p99 within 10% of the same policy at 1 s); worst seed shown:\n\n")
	b.WriteString("| policy | p99 ÷ least_conn | p50 ÷ least_conn | p99 ÷ round_robin | p99 ÷ same at 1 s | met |\n|---|---:|---:|---:|---:|---|\n")
	for i, name := range sr.policies {
		if !strings.Contains(name, " 10s") {
			continue
		}
		rs := sr.byPolicy[i]
		a := ratioSpread(rs, lc, mP99)
		p := ratioSpread(rs, lc, mP50)
		c := ratioSpread(rs, rr, mP99)
		met := a.hi <= 0.6 && p.hi <= 1 && c.hi <= 0.5
		same := "-"
		if fast := sr.find(strings.Replace(name, " 10s", " 1s", 1)); fast != nil {
			s := ratioSpread(rs, fast, mP99)
			same = fmt.Sprintf("%.2f..%.2f", s.lo, s.hi)
			met = met && s.lo >= 0.9 && s.hi <= 1.1
		}
		fmt.Fprintf(b, "| %s | %.2f | %.2f | %.2f | %s | %s |\n", name, a.hi, p.hi, c.hi, same, map[bool]string{true: "yes", false: "no"}[met])
	}
	b.WriteString("\n")
}

// controlLine says how far from 1 the control's ratios to least_conn read: two equal routers.
func controlLine(b *strings.Builder, sr seedResults) {
	lc, ctl := sr.find("least_conn"), sr.find(controlPolicy)
	if lc == nil || ctl == nil {
		return
	}
	p50, p99 := ratioSpread(ctl, lc, mP50), ratioSpread(ctl, lc, mP99)
	fmt.Fprintf(b, "The control, a second least_conn on the same requests: p50 ÷ least_conn %.2f..%.2f, p99 ÷ least_conn %.2f..%.2f "+
		"over seeds; a seed's ratio that far from 1 is within what two equal routers read.\n\n", p50.lo, p50.hi, p99.lo, p99.hi)
}

// kvTable: each worker's mean and peak KV use (token_usage, sampled every 200 ms while requests were out).
func kvTable(b *strings.Builder, sr seedResults) {
	b.WriteString("KV use per worker, mean / peak over the run (median over seeds; token_usage sampled every 200 ms):\n\n| policy |")
	for _, l := range workerLabels() {
		fmt.Fprintf(b, " %s |", l)
	}
	columns := len(workerScales)
	if sglangAdmission {
		b.WriteString(" retracted ÷ requests |")
		columns++
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", columns) + "\n")
	for i, name := range sr.policies {
		fmt.Fprintf(b, "| %s |", name)
		for w := range workerScales {
			var m, p []float64
			for _, r := range sr.byPolicy[i] {
				m, p = append(m, r.kvMean[w]), append(p, r.kvPeak[w])
			}
			fmt.Fprintf(b, " %.0f%% / %.0f%% |", spreadOf(m).med*100, spreadOf(p).med*100)
		}
		if sglangAdmission {
			var rt []float64
			for _, r := range sr.byPolicy[i] {
				rt = append(rt, r.retracted)
			}
			fmt.Fprintf(b, " %s |", spreadOf(rt).format(3))
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
}

// whyTables describes, per policy, the requests that make its p99 (the slowest 1% of each seed) and
// those that make its p50 (the 5% around each seed's median), pooled.
func whyTables(b *strings.Builder, sr seedResults) {
	b.WriteString("Why the p99: the slowest 1% of each seed's requests, pooled over seeds, means. queue: waiting for " +
		"admission; prefill: from admission to the first token, including the wait behind other prompts' prefill; decode: " +
		"the rest of the latency, the proxy's and the network's share included. The worker measures the first two " +
		"(the simulator's X-Sglang-Sim-Queue-Time and X-Sglang-Sim-First-Token-Time), streamed or not.\n\n")
	bandTable(b, sr, func(r armResult) []sample { return r.tail })
	b.WriteString("Why the p50: the 5% of each seed's requests around its median (from the 47.5th to the 52.5th " +
		"percentile), pooled over seeds, means; columns as above.\n\n")
	bandTable(b, sr, func(r armResult) []sample { return r.middle })
}

// bandTable is a table of the requests of each policy's band, pooled over seeds.
func bandTable(b *strings.Builder, sr seedResults, of func(armResult) []sample) {
	fmt.Fprintf(b, "| policy | n | long | streamed | on %s | latency s | queue s | prefill s | decode s |\n",
		strings.Join(sr.labels(), " / "))
	b.WriteString("|---|---:|---:|---:|---|---:|---:|---:|---:|\n")
	for i, name := range sr.policies {
		var t []sample
		for _, r := range sr.byPolicy[i] {
			t = append(t, of(r)...)
		}
		fmt.Fprintf(b, "| %s | %s |\n", name, describeBand(t, len(sr.labels())))
	}
	b.WriteString("\n")
}

// describeBand is the table cells for a band of requests: what they were, where they went (on a fleet
// of workers), and where their time went (means).
func describeBand(t []sample, workers int) string {
	if len(t) == 0 {
		return "0 | | | | | | |"
	}
	var long, streamed int
	on := make([]int, workers)
	var lat, queue, prefill, decode []float64
	for _, s := range t {
		if s.long {
			long++
		}
		if s.stream {
			streamed++
		}
		if s.worker >= 0 {
			on[s.worker]++
		}
		lat, queue = append(lat, s.latency.Seconds()), append(queue, s.queue)
		prefill = append(prefill, s.firstToken-s.queue)
		decode = append(decode, s.latency.Seconds()-s.firstToken)
	}
	pct := func(k int) string { return fmt.Sprintf("%.0f%%", float64(k)*100/float64(len(t))) }
	ons := make([]string, len(on))
	for i, k := range on {
		ons[i] = pct(k)
	}
	return fmt.Sprintf("%d | %s | %s | %s | %.2f | %.2f | %.2f | %.2f", len(t), pct(long), pct(streamed), strings.Join(ons, " / "),
		mean(lat), mean(queue), mean(prefill), mean(decode))
}

// qualitySVG draws the median p50, p90 and p99 latency per policy as horizontal bars, with the p99's
// range over seeds as a whisker, by hand, without dependencies.
func qualitySVG(sr seedResults) string {
	const (
		left, right, top, row, barH = 300, 80, 50, 42, 11
		width                       = 1000
	)
	var maxS float64
	for _, rs := range sr.byPolicy {
		maxS = max(maxS, spreadOf(values(rs, mP99)).hi)
	}
	if maxS == 0 {
		maxS = 1
	}
	height := top + row*len(sr.policies) + 40
	scale := float64(width-left-right) / maxS
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">End-to-end latency by policy, median over seeds, p99 range as whisker (s; shorter is better)</text>`+"\n", 10)
	colors := []struct{ name, fill string }{{"p50", "#4c9be8"}, {"p90", "#f0a830"}, {"p99", "#d9534f"}}
	for i, c := range colors {
		x := width - right - 240 + i*80
		fmt.Fprintf(&b, `<rect x="%d" y="30" width="12" height="12" fill="%s"/><text x="%d" y="41">%s</text>`+"\n", x, c.fill, x+16, c.name)
	}
	for i, name := range sr.policies {
		rs := sr.byPolicy[i]
		y := top + i*row
		if i%2 == 1 {
			fmt.Fprintf(&b, `<rect x="0" y="%d" width="%d" height="%d" fill="#f4f4f4"/>`+"\n", y-2, width, row)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-8, y+row/2+2, html.EscapeString(name))
		for k, m := range []metric{mP50, mP90, mP99} {
			s := spreadOf(values(rs, m))
			w := s.med * scale
			by := y + 3 + k*barH
			fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`, left, by, w, barH-1, colors[k].fill)
			if m.name == mP99.name {
				fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#333"/>`, float64(left)+s.lo*scale, by+barH/2,
					float64(left)+s.hi*scale, by+barH/2)
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" font-size="10">%.2f</text>`+"\n", float64(left)+max(w, s.hi*scale)+4, by+barH-2, s.med)
		}
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", left, top-4, left, top+row*len(sr.policies))
	b.WriteString("</svg>\n")
	return b.String()
}

// instanceRatios compares each arm of several instances with the same policy's single instance.
func instanceRatios(b *strings.Builder, sr seedResults, ms []metric) {
	fmt.Fprintf(b, "Several instances ÷ one instance of the same policy, seed by seed:\n\n| policy |")
	for _, m := range ms {
		b.WriteString(" " + strings.TrimSuffix(m.name, " s") + " |")
	}
	b.WriteString("\n|---|" + strings.Repeat("---|", len(ms)) + "\n")
	for i, name := range sr.policies {
		single, _, several := strings.Cut(name, " ×")
		base := sr.find(single)
		if !several || base == nil {
			continue
		}
		fmt.Fprintf(b, "| %s |", name)
		for _, m := range ms {
			fmt.Fprintf(b, " %s |", ratioCell(sr.byPolicy[i], base, m))
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
}

// labels is the fleet's worker labels, for the share columns: workers, or the quality fleet's.
func (sr seedResults) labels() []string {
	if sr.workers != nil {
		return sr.workers
	}
	return workerLabels()
}

func workerLabels() []string {
	l := make([]string, len(workerScales))
	for i, k := range workerScales {
		l[i] = fmt.Sprintf("%gx", k)
	}
	return l
}

// speedsLine is the speeds a policy holds per worker, in workerScales' order, for a log line: decode
// alone / prefill, tokens/s, "-" where not measured.
func speedsLine(decodeAlone, prefill []float64) string {
	if len(decodeAlone) == 0 {
		return ""
	}
	out := make([]string, len(decodeAlone))
	for i := range decodeAlone {
		out[i] = speedText(decodeAlone[i]) + "/" + speedText(prefill[i])
	}
	return " speeds " + strings.Join(out, " ")
}

func speedText(v float64) string {
	if v <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", v)
}
