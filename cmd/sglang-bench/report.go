package main

import (
	"fmt"
	"html"
	"os"
	"path/filepath"
	"runtime"
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

func secs(d time.Duration) string { return fmt.Sprintf("%.2f", d.Seconds()) }

func qualityMarkdown(o qualityOptions, jobs []job, rs []result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "### Routing quality, %s\n\n", time.Now().Format("2006-01-02"))
	fmt.Fprintf(&b, "Machine: %s.\n\n", machine())
	names := make([]string, len(workerScales))
	for i := range workerScales {
		c := workerConfig(i)
		names[i] = fmt.Sprintf("%s (pool %d, batch %d, decode %g tok/s)", c.Name, c.MaxTotalTokens, c.MaxRunningRequests, c.DecodeTokensPerSec)
	}
	fmt.Fprintf(&b, "Workload: seed %d, %d requests, Poisson arrivals at %g/s for %s; %.0f%% short (prompt %d, output %d), "+
		"%.0f%% long (prompt %d, output %d); %.0f%% streamed. Workers: %s. Each policy gets a fresh Caddy and fresh workers.\n\n",
		o.seed, len(jobs), o.rate, o.duration, (1-longShare)*100, shortPrompt, shortOutput, longShare*100, longPrompt, longOutput,
		streamShare*100, strings.Join(names, ", "))
	b.WriteString("| policy | req/s | tok/s | p50 s | p90 s | p99 s | TTFT p50 s | TTFT p99 s | queue mean s | queue p99 s | failed | share " +
		strings.Join(workerLabels(), " / ") + " |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range rs {
		shares := make([]string, len(r.share))
		for i, s := range r.share {
			shares[i] = fmt.Sprintf("%.0f%%", s*100)
		}
		fmt.Fprintf(&b, "| %s | %.1f | %.0f | %s | %s | %s | %s | %s | %.2f | %.2f | %d | %s |\n", r.policy.name, r.throughput,
			r.tokensPerSec, secs(r.p50), secs(r.p90), secs(r.p99), secs(r.ttft50), secs(r.ttft99), r.queueMean, r.queue99,
			r.failed, strings.Join(shares, " / "))
	}
	b.WriteString(targets(rs))
	return b.String()
}

func workerLabels() []string {
	l := make([]string, len(workerScales))
	for i, k := range workerScales {
		l[i] = fmt.Sprintf("%gx", k)
	}
	return l
}

// targets checks the targets at interval 10s: p99 <= 0.6x least_conn and <= 0.5x round_robin,
// p50 no worse than least_conn.
func targets(rs []result) string {
	find := func(name string) *result {
		for i := range rs {
			if rs[i].policy.name == name {
				return &rs[i]
			}
		}
		return nil
	}
	lc, rr := find("least_conn"), find("round_robin")
	if lc == nil || rr == nil {
		return ""
	}
	var b strings.Builder
	b.WriteString("\nTargets at interval 10s (p99 ≤ 0.6× least_conn, p99 ≤ 0.5× round_robin, p50 ≤ least_conn):\n\n")
	b.WriteString("| policy | p99 ÷ least_conn | p99 ÷ round_robin | p50 ÷ least_conn | met |\n|---|---:|---:|---:|---|\n")
	for _, r := range rs {
		if r.policy.interval != 10*time.Second {
			continue
		}
		a, c, p := ratio(r.p99, lc.p99), ratio(r.p99, rr.p99), ratio(r.p50, lc.p50)
		met := "yes"
		if a > 0.6 || c > 0.5 || p > 1 {
			met = "no"
		}
		fmt.Fprintf(&b, "| %s | %.2f | %.2f | %.2f | %s |\n", r.policy.name, a, c, p, met)
	}
	return b.String()
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return a.Seconds() / b.Seconds()
}

// qualitySVG draws p50, p90 and p99 latency per policy as horizontal bars, by hand, without dependencies.
func qualitySVG(rs []result) string {
	const (
		left, right, top, row, barH = 300, 80, 50, 42, 11
		width                       = 1000
	)
	var maxS float64
	for _, r := range rs {
		maxS = max(maxS, r.p99.Seconds())
	}
	if maxS == 0 {
		maxS = 1
	}
	height := top + row*len(rs) + 40
	scale := float64(width-left-right) / maxS
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">End-to-end latency by policy (seconds; shorter is better)</text>`+"\n", 10)
	colors := []struct{ name, fill string }{{"p50", "#4c9be8"}, {"p90", "#f0a830"}, {"p99", "#d9534f"}}
	for i, c := range colors {
		x := width - right - 240 + i*80
		fmt.Fprintf(&b, `<rect x="%d" y="30" width="12" height="12" fill="%s"/><text x="%d" y="41">%s</text>`+"\n", x, c.fill, x+16, c.name)
	}
	for i, r := range rs {
		y := top + i*row
		if i%2 == 1 {
			fmt.Fprintf(&b, `<rect x="0" y="%d" width="%d" height="%d" fill="#f4f4f4"/>`+"\n", y-2, width, row)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-8, y+row/2+2, html.EscapeString(r.policy.name))
		for k, v := range []time.Duration{r.p50, r.p90, r.p99} {
			w := v.Seconds() * scale
			by := y + 3 + k*barH
			fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`, left, by, w, barH-1, colors[k].fill)
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" font-size="10">%.2f</text>`+"\n", float64(left)+w+4, by+barH-2, v.Seconds())
		}
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", left, top-4, left, top+row*len(rs))
	b.WriteString("</svg>\n")
	return b.String()
}
