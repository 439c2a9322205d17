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
