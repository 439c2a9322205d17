package main

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

var token = regexp.MustCompile(`\S+`)

// movePorts rewrites the addresses of a Caddyfile: every token equal to a key of moves becomes its
// value, outside comments. Every key must occur, so that a changed example fails loudly instead of
// running against the wrong ports.
func movePorts(caddyfile string, moves map[string]string) (string, error) {
	seen := make(map[string]bool)
	lines := strings.Split(caddyfile, "\n")
	for i, line := range lines {
		code, comment := line, ""
		if j := strings.IndexByte(line, '#'); j >= 0 {
			code, comment = line[:j], line[j:]
		}
		lines[i] = token.ReplaceAllStringFunc(code, func(t string) string {
			if to, ok := moves[t]; ok {
				seen[t] = true
				return to
			}
			return t
		}) + comment
	}
	var missing []string
	for from := range moves {
		if !seen[from] {
			missing = append(missing, from)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return "", fmt.Errorf("config has no address %s to move", strings.Join(missing, ", "))
	}
	return strings.Join(lines, "\n"), nil
}

// withAffinity turns on prefix affinity in the Caddyfile's `lb_policy sglang_load` block: it adds
// `affinity prefix` as the block's first line and drops its `metric` line, since affinity prices
// requests with the cost metric.
func withAffinity(caddyfile string) (string, error) {
	return inPolicyBlock(caddyfile, "affinity prefix", "metric")
}

// withMetric sets the metric of the Caddyfile's `lb_policy sglang_load` block, and drops its `choose`
// line so that the metric's own default choice applies (a window of the cheapest with the cost metric).
func withMetric(caddyfile, metric string) (string, error) {
	return inPolicyBlock(caddyfile, "metric "+metric, "metric", "choose")
}

// inPolicyBlock adds line as the first of the Caddyfile's `lb_policy sglang_load` block, and drops the
// block's lines whose option is one of drop.
func inPolicyBlock(caddyfile, line string, drop ...string) (string, error) {
	lines := strings.Split(caddyfile, "\n")
	for i, l := range lines {
		code, _, _ := strings.Cut(l, "#")
		if strings.Join(strings.Fields(code), " ") != "lb_policy sglang_load {" {
			continue
		}
		indent := l[:len(l)-len(strings.TrimLeft(l, " \t"))]
		out := append(slices.Clone(lines[:i+1]), indent+"\t"+line)
		depth, j := 1, i+1
		for ; j < len(lines) && depth > 0; j++ {
			code, _, _ := strings.Cut(lines[j], "#")
			depth += strings.Count(code, "{") - strings.Count(code, "}")
			if f := strings.Fields(code); depth == 1 && len(f) > 0 && slices.Contains(drop, f[0]) {
				continue
			}
			out = append(out, lines[j])
		}
		return strings.Join(append(out, lines[j:]...), "\n"), nil
	}
	return "", fmt.Errorf("no `lb_policy sglang_load {` block to add %q to", line)
}
