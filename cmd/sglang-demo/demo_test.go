package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/testports"
)

func TestMovePorts(t *testing.T) {
	in := "# workers on 127.0.0.1:30000\n{\n\tadmin localhost:2019\n}\n:8080 {\n\treverse_proxy 127.0.0.1:30000 127.0.0.1:30001 # 127.0.0.1:30001\n}\n"
	moves := map[string]string{
		"localhost:2019":  "localhost:4019",
		":8080":           ":4080",
		"127.0.0.1:30000": "127.0.0.1:41000",
		"127.0.0.1:30001": "127.0.0.1:41001",
	}
	got, err := movePorts(in, moves)
	if err != nil {
		t.Fatal(err)
	}
	want := "# workers on 127.0.0.1:30000\n{\n\tadmin localhost:4019\n}\n:4080 {\n\treverse_proxy 127.0.0.1:41000 127.0.0.1:41001 # 127.0.0.1:30001\n}\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	moves["127.0.0.1:30002"] = "127.0.0.1:41002"
	if _, err := movePorts(in, moves); err == nil || !strings.Contains(err.Error(), "127.0.0.1:30002") {
		t.Fatalf("a missing address: %v", err)
	}
}

// The rewrite that -affinity makes: affinity prefix first in the sglang_load block, its metric line
// gone (affinity prices with the cost metric), the rest of the file as it was.
func TestWithAffinity(t *testing.T) {
	in := ":8080 {\n\treverse_proxy a b {\n\t\tlb_policy sglang_load {\n\t\t\t# metric: what to compare\n\t\t\tmetric auto\n" +
		"\t\t\tchoose power_of_two\n\t\t}\n\t\tflush_interval -1\n\t\ttransport http {\n\t\t\tread_timeout 10m\n\t\t}\n\t}\n}\n"
	got, err := withAffinity(in)
	if err != nil {
		t.Fatal(err)
	}
	want := ":8080 {\n\treverse_proxy a b {\n\t\tlb_policy sglang_load {\n\t\t\taffinity prefix\n\t\t\t# metric: what to compare\n" +
		"\t\t\tchoose power_of_two\n\t\t}\n\t\tflush_interval -1\n\t\ttransport http {\n\t\t\tread_timeout 10m\n\t\t}\n\t}\n}\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	if _, err := withAffinity(":8080 {\n\treverse_proxy a b {\n\t\tlb_policy least_conn\n\t}\n}\n"); err == nil {
		t.Error("a Caddyfile without an sglang_load block: no error")
	}
	example, err := os.ReadFile("../../Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := withAffinity(string(example)); err != nil || !strings.Contains(got, "\t\t\taffinity prefix\n") {
		t.Errorf("Caddyfile.example: %v", err)
	}
}

// The rewrite that -metric makes: the metric first in the sglang_load block, its metric and choose
// lines gone (the metric's own default choice applies), the rest of the file as it was.
func TestWithMetric(t *testing.T) {
	in := ":8080 {\n\treverse_proxy a b {\n\t\tlb_policy sglang_load {\n\t\t\tmetric auto\n\t\t\tchoose power_of_two # two\n" +
		"\t\t\tfallback least_conn\n\t\t}\n\t\ttransport http {\n\t\t\tread_timeout 10m\n\t\t}\n\t}\n}\n"
	got, err := withMetric(in, "cost")
	if err != nil {
		t.Fatal(err)
	}
	want := ":8080 {\n\treverse_proxy a b {\n\t\tlb_policy sglang_load {\n\t\t\tmetric cost\n" +
		"\t\t\tfallback least_conn\n\t\t}\n\t\ttransport http {\n\t\t\tread_timeout 10m\n\t\t}\n\t}\n}\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	for _, args := range [][]string{{"-metric", "fastest"}, {"-metric", "cost", "-affinity"}} {
		if _, err := parseFlags(args, io.Discard); err == nil || !strings.Contains(err.Error(), "-metric") {
			t.Errorf("%v: error %v, want one that names -metric", args, err)
		}
	}
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"-capacity", "1000, 2000,3000", "-decode-speed", "50,100,150.5", "-worker-port", "41000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.capacities[1] != 2000 || o.speeds[2] != 150.5 || o.workerAddr(2) != "127.0.0.1:41002" || o.requests != 200 || o.sharedPrompts != 0 {
		t.Fatalf("%+v", o)
	}
	if o, err := parseFlags([]string{"-affinity"}, io.Discard); err != nil || !o.affinity || o.sharedPrompts != 32 {
		t.Fatalf("-affinity: %+v, %v; want affinity on over 32 shared prompts", o, err)
	}
	for _, args := range [][]string{
		{"-requests", "0"},
		{"-concurrency", "0"},
		{"-long", "1.5"},
		{"-stream", "-0.1"},
		{"-capacity", "1000,2000"},
		{"-capacity", "1000,0,3000"},
		{"-decode-speed", "1,x,3"},
		{"-http-port", "30001"},
		{"-admin-port", "8080"},
		{"-worker-port", "65534"},
		{"-grace", "0s"},
		{"-shared-prompts", "-1"},
		{"extra"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}

func TestPlan(t *testing.T) {
	specs := plan(50, 0.2, 0.3, 0, 7)
	var long, stream int
	for _, s := range specs {
		if s.long {
			long++
			if s.prompt < longPromptMin || s.maxTokens < longOutMin {
				t.Errorf("long request %+v", s)
			}
		} else if s.prompt > shortPromptMax || s.maxTokens > shortOutMax {
			t.Errorf("short request %+v", s)
		}
		stream += b2i(s.stream)
	}
	if long != 10 || stream != 15 {
		t.Fatalf("%d long, %d streamed of 50; want 10 and 15", long, stream)
	}
	groups := map[int]int{}
	for i, s := range plan(50, 0.2, 0.3, 4, 7) {
		if s != (spec{specs[i].long, specs[i].stream, specs[i].prompt, specs[i].maxTokens, s.group, i}) {
			t.Fatalf("with shared prompts, request %d is %+v; want %+v but for its group", i, s, specs[i])
		}
		groups[s.group]++
	}
	if len(groups) != 4 || groups[-1] != 0 {
		t.Errorf("requests per shared prompt %v; want four prompts, all used", groups)
	}
	if a, b := systemPrompt(1), systemPrompt(2); len(a) != 4*systemPromptTokens || a[:64] == b[:64] {
		t.Errorf("system prompts: %d bytes, first blocks %q and %q; want %d bytes, distinct from the start", len(a), a[:64], b[:64], 4*systemPromptTokens)
	}
}

// TestDemo runs the demo the way `make demo` does, with fewer requests and on free loopback ports, and
// checks its report and that every process it started is gone; then it interrupts a second run in the
// middle of its burst, as Ctrl-C would, and SIGKILLs a third once its children are up. It builds Caddy and runs five processes, so it is skipped under
// -short (and only then).
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: skipping the end-to-end demo (builds Caddy, runs processes)")
	}
	bin := t.TempDir()
	buildCtx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(buildCtx, "go", "build", "-o", bin+string(filepath.Separator),
		"github.com/caddy-sglang/caddy-sglang/cmd/caddy",
		"github.com/caddy-sglang/caddy-sglang/cmd/sglang-sim",
		"github.com/caddy-sglang/caddy-sglang/cmd/sglang-demo")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

	t.Run("run", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		cmd, tmp, text := runDemo(t, ctx, bin, 30, "-concurrency", "8")
		// The table: a header and one row per worker, whose request counts add up to the burst.
		if !strings.Contains(text, "\nworker  ") || !strings.Contains(text, "peak KV use") {
			t.Errorf("no table header")
		}
		if sum := columnSum(t, text, cmd, "requests", func(row []string) string { return row[4] }); sum != 30 {
			t.Errorf("the rows count %d requests, want 30", sum)
		}
		// The workers admit as SGLang does by default: the table counts each worker's retracted
		// requests, which add up in the total row.
		if !strings.Contains(text, "prompt cached  retracted\n") {
			t.Errorf("no retracted column")
		}
		retracted := columnSum(t, text, cmd, "retracted", func(row []string) string { return row[len(row)-1] })
		if all := tableRow(text, "all"); all == nil || all[len(all)-1] != strconv.Itoa(retracted) {
			t.Errorf("total row %q, want %d retracted", all, retracted)
		}
		if !strings.Contains(text, "/sglang_load/workers") || !strings.Contains(text, "Admin API") {
			t.Errorf("no admin API view")
		}
		if !strings.Contains(text, "Stopped caddy (exit status 0)") {
			t.Errorf("caddy did not stop on SIGTERM")
		}
		if left, _ := os.ReadDir(tmp); len(left) > 0 {
			t.Errorf("the demo left %d files in its temp dir", len(left))
		}
	})

	// -affinity end to end: Caddy runs the rewritten Caddyfile, every request succeeds, and the table
	// shows the prefix cache at work. Whether affinity beats load alone is the benchmark's to say.
	t.Run("affinity", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		_, _, text := runDemo(t, ctx, bin, 40, "-concurrency", "4", "-affinity", "-shared-prompts", "4")
		all := tableRow(text, "all")
		if all == nil {
			t.Fatal("no total row")
		}
		// 4 prompts of 2,048 tokens among 40 requests, 4 at a time: even a prompt missed once on
		// every worker leaves most of the burst's prompt tokens cached. The share is the row's
		// next-to-last field: the retracted count follows it.
		cached := all[len(all)-2]
		share, err := strconv.Atoi(strings.TrimSuffix(cached, "%"))
		if err != nil || share < 50 {
			t.Errorf("prompt tokens cached over the fleet: %q, want at least 50%%", cached)
		}
		// The admin view, half-way through the burst, shows the blocks the index sent each worker.
		if blocks := adminBlocks(t, text); blocks <= 0 {
			t.Errorf("the admin view's prompt blocks add up to %d, want some", blocks)
		}
	})

	// -sglang-admission=false: the workers reserve each request's prompt and whole max_tokens, every
	// request succeeds, and the table has no retracted column.
	t.Run("reserving", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		cmd, _, text := runDemo(t, ctx, bin, 30, "-concurrency", "8", "-sglang-admission=false")
		if !strings.Contains(text, "prompt cached\n") || strings.Contains(text, "retracted") {
			t.Errorf("want a table without a retracted column")
		}
		if sum := columnSum(t, text, cmd, "requests", func(row []string) string { return row[4] }); sum != 30 {
			t.Errorf("the rows count %d requests, want 30", sum)
		}
	})

	t.Run("interrupted", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		cmd, _ := demoCommand(t, ctx, bin, "-requests", "200", "-concurrency", "8")
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Interrupt once the progress bar shows answers: the burst is under way.
		lines := make(chan string)
		go func() {
			defer close(lines)
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				lines <- sc.Text()
			}
		}()
		var out strings.Builder
		interrupted := false
		for line := range lines {
			out.WriteString(line + "\n")
			if !interrupted && strings.HasPrefix(line, "[") {
				if err := cmd.Process.Signal(os.Interrupt); err != nil {
					t.Fatal(err)
				}
				interrupted = true
			}
		}
		err = cmd.Wait()
		t.Logf("demo output:\n%s%s", &out, &stderr)
		if !interrupted {
			t.Fatal("the burst never started")
		}
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 130 {
			t.Errorf("interrupted demo: %v, want exit status 130", err)
		}
		assertNoSurvivors(t, bin)
		if !strings.Contains(out.String(), "Interrupted") || !strings.Contains(out.String(), "Stopped caddy") {
			t.Errorf("no orderly stop after the interrupt")
		}
	})
	// SIGKILL leaves the demo no chance to stop anything: the kernel must take the children down with it
	// (Pdeathsig, where the system has it).
	t.Run("killed", func(t *testing.T) {
		if runtime.GOOS != "linux" {
			t.Skipf("the children die with a SIGKILLed demo on Linux and FreeBSD; this test reads Linux's /proc, not %s's", runtime.GOOS)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		cmd, _ := demoCommand(t, ctx, bin, "-requests", "200", "-concurrency", "8")
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		ready, readDone := make(chan struct{}), make(chan struct{})
		var out strings.Builder
		go func() {
			defer close(readDone)
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				out.WriteString(sc.Text() + "\n")
				if strings.Contains(sc.Text(), "all ready in") {
					close(ready)
				}
			}
		}()
		defer func() {
			_ = cmd.Process.Kill()
			<-readDone // the pipe ends with the demo: its children write to their log files
			_ = cmd.Wait()
			t.Logf("demo output:\n%s%s", &out, &stderr)
		}()
		select {
		case <-ready:
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			t.Fatalf("the demo never got ready; stderr:\n%s", &stderr)
		}
		children := childrenOf(t, cmd.Process.Pid)
		if len(children) != workers+1 {
			t.Fatalf("the ready demo has %d children %v, want %d workers and Caddy", len(children), children, workers)
		}
		if err := cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			var alive []procStat
			for _, c := range children {
				if c.alive() {
					alive = append(alive, c)
				}
			}
			if len(alive) == 0 {
				break
			}
			if time.Now().After(deadline) {
				for _, c := range alive {
					if p, err := os.FindProcess(c.pid); err == nil {
						_ = p.Kill() // do not leave them to the next test
					}
				}
				t.Fatalf("10s after the demo was killed, its children %v still run", alive)
			}
			time.Sleep(20 * time.Millisecond) // polling the process table: there is nothing to wait on
		}
		assertNoSurvivors(t, bin)
	})
}

// procStat is a process as /proc/<pid>/stat shows it. The start time tells a reused pid apart.
type procStat struct {
	pid, ppid int
	state     byte
	start     string // field 22, in clock ticks since boot
}

// readProcStat reads /proc/<pid>/stat; ok is false when the process is gone.
func readProcStat(pid int) (st procStat, ok bool) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return st, false
	}
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return st, false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return st, false
	}
	st.pid = pid
	st.state = f[0][0]
	st.ppid, _ = strconv.Atoi(f[1])
	st.start = f[19]
	return st, true
}

// alive reports whether the process still runs: not exited, not a zombie awaiting its reaper, and not
// a newer process that got the same pid.
func (p procStat) alive() bool {
	now, ok := readProcStat(p.pid)
	return ok && now.start == p.start && now.state != 'Z' && now.state != 'X'
}

// childrenOf lists the processes whose parent is pid.
func childrenOf(t *testing.T, pid int) []procStat {
	t.Helper()
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil || len(dirs) == 0 {
		t.Fatalf("no /proc: %v", err)
	}
	var out []procStat
	for _, d := range dirs {
		p, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		if st, ok := readProcStat(p); ok && st.ppid == pid {
			out = append(out, st)
		}
	}
	return out
}

// demoCommand returns the demo on free ports with the binaries in bin, and the temp dir it uses. Caddy's
// config and data dirs are the test's own.
func demoCommand(t *testing.T, ctx context.Context, bin string, args ...string) (*exec.Cmd, string) {
	t.Helper()
	tmp := t.TempDir()
	args = append([]string{
		"-caddy", filepath.Join(bin, "caddy"),
		"-sim", filepath.Join(bin, "sglang-sim"),
		"-config", filepath.Join("..", "..", "Caddyfile.example"),
		"-http-port", strconv.Itoa(testports.Free(t, 1)),
		"-admin-port", strconv.Itoa(testports.Free(t, 1)),
		"-worker-port", strconv.Itoa(testports.Free(t, workers)),
		"-timeout", "90s",
	}, args...)
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "sglang-demo"), args...)
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp, "XDG_CONFIG_HOME="+t.TempDir(), "XDG_DATA_HOME="+t.TempDir())
	cmd.WaitDelay = 10 * time.Second
	return cmd, tmp
}

// workerAddrOf is worker i's address in the demo command's arguments.
func workerAddrOf(cmd *exec.Cmd, i int) string {
	for j, a := range cmd.Args {
		if a == "-worker-port" {
			p, _ := strconv.Atoi(cmd.Args[j+1])
			return net.JoinHostPort("127.0.0.1", strconv.Itoa(p+i))
		}
	}
	return ""
}

// runDemo runs the demo with a burst of requests and the other flags to its end, and checks that it
// exited 0, left no process behind and had every request succeed; it returns the command, its temp
// dir and its output.
func runDemo(t *testing.T, ctx context.Context, bin string, requests int, flags ...string) (*exec.Cmd, string, string) {
	t.Helper()
	cmd, tmp := demoCommand(t, ctx, bin, append([]string{"-requests", strconv.Itoa(requests)}, flags...)...)
	out, err := cmd.CombinedOutput()
	t.Logf("demo output:\n%s", out)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	assertNoSurvivors(t, bin)
	text := string(out)
	if !strings.Contains(text, fmt.Sprintf("%d ok, 0 failed", requests)) {
		t.Errorf("not every request succeeded")
	}
	return cmd, tmp, text
}

// adminBlocks is the sum of the admin view's "prompt blocks" column, -1 when the view has none.
func adminBlocks(t *testing.T, text string) int {
	t.Helper()
	sum, inView := -1, false
	for line := range strings.Lines(text) {
		switch {
		case strings.Contains(line, "in flight") && strings.HasSuffix(strings.TrimSpace(line), "prompt blocks"):
			sum, inView = 0, true
		case inView && strings.HasPrefix(line, "  127.0.0.1:"):
			f := strings.Fields(line)
			n, err := strconv.Atoi(f[len(f)-1])
			if err != nil {
				t.Fatalf("admin row %q: prompt blocks %q", line, f[len(f)-1])
			}
			sum += n
		default:
			inView = false
		}
	}
	return sum
}

// columnSum sums one column of the table's worker rows, which field picks from each row's fields.
func columnSum(t *testing.T, text string, cmd *exec.Cmd, name string, field func(row []string) string) int {
	t.Helper()
	sum := 0
	for i := range workers {
		row := tableRow(text, workerAddrOf(cmd, i))
		if row == nil {
			t.Fatalf("no table row for worker %d", i)
		}
		n, err := strconv.Atoi(field(row))
		if err != nil {
			t.Fatalf("row %q: %s %q", row, name, field(row))
		}
		sum += n
	}
	return sum
}

// tableRow returns the fields of the worker table's row for addr (the admin view's rows are indented).
func tableRow(text, addr string) []string {
	for line := range strings.Lines(text) {
		if strings.HasPrefix(line, addr+" ") {
			return strings.Fields(line)
		}
	}
	return nil
}

// assertNoSurvivors fails when a process runs a binary from dir: the demo must have stopped and reaped
// every child it started. It reads the process table with ps, or from /proc where ps is not installed.
func assertNoSurvivors(t *testing.T, dir string) {
	t.Helper()
	var procs []string
	if out, err := exec.Command("ps", "-eo", "pid=,args=").Output(); err == nil {
		procs = strings.Split(string(out), "\n")
	} else {
		cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		if len(cmdlines) == 0 {
			t.Fatalf("no process table: ps: %v, and no /proc", err)
		}
		for _, f := range cmdlines {
			b, _ := os.ReadFile(f)
			procs = append(procs, filepath.Dir(f)+" "+strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
	for _, p := range procs {
		if strings.Contains(p, dir+string(filepath.Separator)) {
			t.Errorf("process survived the demo: %s", strings.TrimSpace(p))
		}
	}
}
