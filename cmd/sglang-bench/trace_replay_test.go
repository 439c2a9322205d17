package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/trace"
)

// TestTraceReplay replays a tiny Mooncake trace, two conversations of two turns, through least_conn and
// the default sglang_load, each with its own Caddy and its own one-worker fleet: every request succeeds,
// each second turn finds its first turn's prompt cached, and the report cites the trace. It builds Caddy
// and runs two Caddy processes, so it is skipped under -short (and only then).
func TestTraceReplay(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: skipping the end-to-end replay (builds Caddy, runs processes)")
	}
	bin := t.TempDir()
	buildCtx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(buildCtx, "go", "build", "-o", bin+string(filepath.Separator), "github.com/caddy-sglang/caddy-sglang/cmd/caddy")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	// Lines 3 and 4 are the second turns of lines 1 and 2: their leading ids agree, so their prompts
	// start with the first turns' whole prompts (1000 and 700 tokens).
	path := filepath.Join(t.TempDir(), "tiny.jsonl")
	rows := `{"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2]}
{"timestamp": 0, "input_length": 700, "output_length": 30, "hash_ids": [3, 4]}
{"timestamp": 1000, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 5]}
{"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [3, 4, 6]}
`
	if err := os.WriteFile(path, []byte(rows), 0o600); err != nil {
		t.Fatal(err)
	}
	o := traceOptions{path: path, speedup: 1, timeout: time.Minute}
	o.caddy, o.out, o.only = filepath.Join(bin, "caddy"), t.TempDir(), "least_conn,sglang_load default 10s"
	if err := o.parse(0, 0, "", "1x(pool=100000,prefill=50000,decode=1000)", "exact"); err != nil {
		t.Fatal(err)
	}
	ctx, cancelRun := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancelRun()
	var stdout, stderr bytes.Buffer
	if err := runTrace(ctx, o, &stdout, &stderr); err != nil {
		t.Fatalf("runTrace: %v\n%s", err, stderr.String())
	}
	mds, _ := filepath.Glob(filepath.Join(o.out, "*", "traces-tiny-0s+end.md"))
	csvs, _ := filepath.Glob(filepath.Join(o.out, "*", "traces-tiny-0s+end.csv"))
	if len(mds) != 1 || len(csvs) != 1 {
		t.Fatalf("result files %v %v, want one report and one CSV", mds, csvs)
	}
	md, err := os.ReadFile(mds[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{trace.FormatMooncake.Source(), "| 0s+end | 4 |", "| least_conn | 4 (4..4) | 0 |",
		"| sglang_load default 10s | 4 (4..4) | 0 |", "traces-tiny-0s+end.csv"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	if !strings.Contains(stdout.String(), trace.FormatMooncake.Source()) {
		t.Errorf("summary lacks the citation:\n%s", stdout.String())
	}
	checkTables(t, string(md))

	f, err := os.Open(csvs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	lines, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(lines) != 1+2*4 {
		t.Fatalf("%d CSV lines, want a header and 8", len(lines))
	}
	col := map[string]int{}
	for i, name := range lines[0] {
		col[name] = i
	}
	// The turn each second turn continues, and the tokens they share.
	shared := map[string]int{"3": 1000, "4": 700}
	seen := map[string]int{}
	for _, l := range lines[1:] {
		row, line := l[col["row"]], l[col["line"]]
		seen[row]++
		if l[col["ok"]] != "true" || l[col["worker"]] != "w0" {
			t.Errorf("%s line %s: ok %s on %q (%s), want ok on w0", row, line, l[col["ok"]], l[col["worker"]], l[col["failure"]])
		}
		cached, _ := strconv.Atoi(l[col["cached"]])
		prompt, _ := strconv.Atoi(l[col["prompt"]])
		want, second := shared[line]
		// The simulator caches whole blocks of 16 tokens of the chat key, whose role prefix shifts them: a
		// second turn finds its shared prefix cached less at most two blocks.
		switch {
		case second && (cached < want-2*16 || cached > want):
			t.Errorf("%s line %s: %d of %d prompt tokens cached, want %d less at most 32", row, line, cached, prompt, want)
		case !second && cached != 0:
			t.Errorf("%s line %s: %d tokens cached on a first turn", row, line, cached)
		}
		traced := map[string][2]int{"1": {1000, 20}, "2": {700, 30}, "3": {1500, 20}, "4": {1200, 10}}[line]
		if out, _ := strconv.Atoi(l[col["output"]]); prompt != traced[0] || out != traced[1] {
			t.Errorf("%s line %s: %d prompt and %d output tokens, want the traced %d and %d", row, line, prompt, out, traced[0], traced[1])
		}
	}
	if seen["least_conn"] != 4 || seen["sglang_load default 10s"] != 4 {
		t.Errorf("CSV lines per row %v, want 4 each", seen)
	}
}
