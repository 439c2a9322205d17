package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// replicaPolicies are compared with 1 and with more Caddy instances in front of one fleet.
func replicaPolicies() []policy {
	return []policy{
		{name: "least_conn", lb: "lb_policy least_conn"},
		sglangLoad("sglang_load power_of_two 10s", 10*time.Second, "metric auto", "choose power_of_two"),
		sglangLoad("sglang_load power_of_two 1s", time.Second, "metric auto", "choose power_of_two"),
		sglangLoad("sglang_load cost 10s", 10*time.Second, "metric cost"),
		sglangLoad("sglang_load default 10s", 10*time.Second),
		// Studies, run when named: the default with every unread answer assumed shorter, nearer this
		// workload's mean answer (about 100 tokens) than default_max_tokens' 256.
		study(sglangLoad("sglang_load default 10s max_tokens 128", 10*time.Second, "default_max_tokens 128")),
		study(sglangLoad("sglang_load default 10s max_tokens 64", 10*time.Second, "default_max_tokens 64")),
	}
}

// runReplicas runs each policy with every instance count at once, on the quality workload: each instance
// sees only its own in-flight requests and polls every worker itself.
func runReplicas(ctx context.Context, o qualityOptions, stdout, stderr io.Writer) error {
	if _, err := os.Stat(o.caddy); err != nil {
		return fmt.Errorf("-caddy %s: %w (run make build first)", o.caddy, err)
	}
	ps, err := selectPolicies(replicaPolicies(), o.only)
	if err != nil {
		return err
	}
	var specs []armSpec
	for _, p := range ps {
		for _, n := range o.instances {
			specs = append(specs, armSpec{p, n})
		}
	}
	mark := markCPU()
	var runs []qualityRun
	for _, rate := range o.rates {
		cpu0 := markCPU()
		res, err := runSeeds(ctx, o.caddy, specs, o.seedsAtOnce(rate, len(specs)), o.fleetPorts, o.seeds,
			func(seed int64) []job { return qualityWorkload(seed, rate, o.requests) }, stderr, fmt.Sprintf("replicas %g/s", rate))
		if err != nil {
			return err
		}
		runs = append(runs, qualityRun{rate: rate, res: res, cpu: cpuSince(cpu0)})
	}
	md := replicasMarkdown(o, ps, runs, cpuSince(mark))
	if err := writeResult(o.out, "replicas.md", md); err != nil {
		return err
	}
	fmt.Fprint(stdout, md)
	return nil
}

// expectedPollRate is the load polls a second each worker should answer in runs as long as rs's (their
// median), from instances Caddys polling every interval: each makes its first monitor.WarmUpPolls
// polls within about one interval, WarmUpPolls - 1 more than the interval gives.
func expectedPollRate(instances int, interval time.Duration, rs []armResult) float64 {
	rate := 1 / interval.Seconds()
	if run := spreadOf(values(rs, mSeconds)).med; run > 0 {
		rate += float64(monitor.WarmUpPolls-1) / run
	}
	return float64(instances) * rate
}

func replicasMarkdown(o qualityOptions, ps []policy, runs []qualityRun, total cpuUse) string {
	var b strings.Builder
	header(&b, "Several Caddy instances in front of one fleet")
	fmt.Fprintf(&b, "Workload: the quality workload, %d requests per arm and seed, seeds %v; each request goes to one of the "+
		"instances at random (the same choice in every arm). Instances share nothing: each counts only its own in-flight "+
		"requests and polls every worker itself. Every arm has its own fleet; all arms of a seed run at once. %s\n\n",
		o.requests, o.seeds, fleetLine(o.fleetPorts))
	fmt.Fprintf(&b, "CPU, whole run: %s.\n\n", total)
	b.WriteString(spreadLegend)
	for _, run := range runs {
		fmt.Fprintf(&b, "#### %g requests/s in total\n\nCPU: %s.\n\n", run.rate, run.cpu)
		figuresTable(&b, run.res, []metric{mP50, mP90, mP99, mTTFT99, mTok})
		fmt.Fprintf(&b, "p99 with more instances ÷ p99 with %d (goal: ≤ 1.15 with 3), and load polls each worker answered:\n\n", o.instances[0])
		b.WriteString("| policy | instances | p99 ratio | p50 ratio | polls/s per worker (median) | expected: instances × (1 ÷ interval + warm-up ÷ run) | goal met on every seed |\n")
		b.WriteString("|---|---:|---|---|---|---:|---|\n")
		for _, p := range ps {
			base := run.res.find(armSpec{p, o.instances[0]}.label())
			for _, n := range o.instances {
				s := armSpec{p, n}
				rs := run.res.find(s.label())
				polls := make([]string, len(workerScales))
				for w := range workerScales {
					v := make([]float64, len(rs))
					for i, r := range rs {
						v[i] = r.pollsPerSec[w]
					}
					polls[w] = fmt.Sprintf("%.2f", spreadOf(v).med)
				}
				expected, goal := "-", "-"
				if p.interval > 0 && len(rs) > 0 {
					expected = fmt.Sprintf("%.2f", expectedPollRate(n, p.interval, rs))
				}
				ratio := ratioSpread(rs, base, mP99)
				if n != o.instances[0] {
					goal = map[bool]string{true: "yes", false: "no"}[ratio.hi <= 1.15]
				}
				fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s | %s |\n", p.name, n, ratio.format(2),
					ratioSpread(rs, base, mP50).format(2), strings.Join(polls, " / "), expected, goal)
			}
		}
		b.WriteString("\n")
		whyTables(&b, run.res)
	}
	return b.String()
}
