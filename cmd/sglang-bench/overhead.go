package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

type overheadOptions struct {
	caddy, out string
	backends   int
	requests   int
	rate       float64 // requests/s
	rounds     int
	conns      int
	chunk      int // requests per run; a round alternates runs until requests per policy are sent
	body       string
	policies   []policy
}

// chunks is how many runs of chunk requests a round sends each policy.
func (o overheadOptions) chunks() int { return max(o.requests/o.chunk, 1) }

// overheadPolicies are the configurations compared, the baseline (Caddy's least_conn) first: least_conn
// again, a control whose ratio to the first is what the harness itself makes of two equal Caddys; the
// default sglang_load (the cost metric, reading no body); and the cost metric named, which reads each
// request's body too; sglang_load polls every second. The studies tell what placement alone does to
// Caddy's CPU (first sends every request to one backend, random spreads them at random) from what the
// policy's code does.
var overheadPolicies = []policy{
	{name: "least_conn", lb: "lb_policy least_conn"},
	{name: "least_conn again", lb: "lb_policy least_conn"},
	sglangLoad("sglang_load", time.Second),
	sglangLoad("sglang_load metric cost", time.Second, "metric cost"),
	study(policy{name: "first", lb: "lb_policy first"}),
	study(policy{name: "random", lb: "lb_policy random"}),
	study(sglangLoad("sglang_load choose least", time.Second, "choose least")),
	study(sglangLoad("sglang_load metric auto", time.Second, "metric auto")),
}

// overheadRows are the rows that always run, then the studies named in only (comma list).
func overheadRows(only string) ([]policy, error) {
	rows, err := selectPolicies(overheadPolicies, "")
	if err != nil || only == "" {
		return rows, err
	}
	named, err := selectPolicies(overheadPolicies, only)
	if err != nil {
		return nil, err
	}
	for _, p := range named {
		if !p.study {
			return nil, fmt.Errorf("-policies: %q is not a study row of the overhead mode", p.name)
		}
	}
	return append(rows, named...), nil
}

// Positions in the rows: the control and the default sglang_load.
const (
	overheadControl = 1
	overheadDefault = 2
)

// overheadBody is the request each policy proxies: a chat of about size bytes (at least a small one),
// which the cost metric reads.
func overheadBody(size int) string {
	const head, tail = `{"model":"m","messages":[{"role":"user","content":"`, `"}],"max_tokens":8}`
	content := "hi"
	if pad := size - len(head) - len(tail); pad > len(content) {
		content = strings.Repeat("x", pad)
	}
	return head + content + tail
}

// overheadGoal is the most CPU per proxied request the default sglang_load may take, as a ratio to
// least_conn's.
const overheadGoal = 1.03

// runOverhead measures Caddy's CPU time per proxied request with each policy: a fixed count of
// requests sent at a fixed rate, well below what the machine can serve, so that the client and Caddy
// do not fight for the cores and the CPU time, not the throughput, carries the difference. Each round
// starts its Caddys afresh, in an order rotated by one from the round before, and takes turns between
// them, so that no policy keeps a place; the control row shows what remains (about 2%).
func runOverhead(ctx context.Context, o overheadOptions, stdout, stderr io.Writer) error {
	addrs, stop, err := startLoadServers(ctx, "backends", o.backends, stderr)
	if err != nil {
		return err
	}
	defer stop()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: o.conns, MaxConnsPerHost: o.conns}}
	defer client.CloseIdleConnections()
	n := len(o.policies)
	perReq := make([][]float64, n) // by policy, then round
	ratios := make([][]float64, n) // to the baseline, by policy, then round
	var rows strings.Builder
	chunks := o.chunks()
	for round := range o.rounds {
		cpu, err := overheadRound(ctx, o, addrs, round, client, stderr)
		if err != nil {
			return err
		}
		row := fmt.Sprintf("| %d |", round+1)
		for k := range n {
			perReq[k] = append(perReq[k], float64(cpu[k].Microseconds())/float64(chunks*o.chunk))
			ratios[k] = append(ratios[k], perReq[k][round]/perReq[0][round])
			row += fmt.Sprintf(" %.1f |", perReq[k][round])
		}
		for k := 1; k < n; k++ {
			row += fmt.Sprintf(" %.3f |", ratios[k][round])
		}
		fmt.Fprintf(stderr, "overhead round %d (µs per request, then ratios): %s\n", round+1, row)
		rows.WriteString(row + "\n")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "### Proxy overhead by CPU, %s\n\nMachine: %s.\n\n", time.Now().Format("2006-01-02"), machine())
	names := make([]string, n)
	for k, p := range o.policies {
		names[k] = "`" + p.name + "`"
	}
	fmt.Fprintf(&b, "Caddy processes (%s) with %s (sglang_load polling loads every 1s), "+
		"in front of the same %d loopback backends (another process; small JSON answers), started afresh each round in an order rotated by one. Per round and policy: %d POSTs to /v1/chat/completions "+
		"(a %d-byte chat body) sent at %.0f req/s over at most %d connections by this process, in runs of %d taking turns between the policies; "+
		"each Caddy's user+system CPU time from /proc/<pid>/stat (10ms ticks) over its runs, divided by its requests. %d rounds.\n\n",
		o.caddy, strings.Join(names, ", "), o.backends, chunks*o.chunk, len(o.body), o.rate, o.conns, o.chunk, o.rounds)
	b.WriteString("| round |")
	for _, name := range names {
		b.WriteString(" " + name + " µs/request |")
	}
	for _, name := range names[1:] {
		b.WriteString(" " + name + " ÷ " + names[0] + " |")
	}
	b.WriteString("\n|---:|" + strings.Repeat("---:|", 2*n-1) + "\n")
	b.WriteString(rows.String())
	b.WriteString("\n| policy | µs/request, median (min..max) | ÷ `least_conn`, median (min..max) |\n|---|---:|---:|\n")
	for k := range n {
		ratio := "1"
		if k > 0 {
			ratio = spreadOf(ratios[k]).format(3)
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", names[k], spreadOf(perReq[k]).format(1), ratio)
	}
	control, def := spreadOf(ratios[overheadControl]), spreadOf(ratios[overheadDefault])
	fmt.Fprintf(&b, "\nThe control, two equal Caddys: %s. Default `sglang_load`: median ratio **%.3f** (goal ≤ %.2f: %s); "+
		"its per-round ratios span %.1f%% (max − min).\n", control.format(3), def.med, overheadGoal,
		map[bool]string{true: "met", false: "missed"}[def.med <= overheadGoal], 100*(def.hi-def.lo))
	fmt.Fprint(stdout, b.String())
	return writeResult(o.out, "overhead.md", b.String())
}

// overheadRound starts the round's Caddys and returns each one's CPU time over its runs. A round is
// short runs per policy, in turn, so that a change in the machine's load during the round falls on
// every policy alike.
func overheadRound(ctx context.Context, o overheadOptions, addrs []string, round int, client *http.Client, stderr io.Writer) ([]time.Duration, error) {
	procs, err := startOverheadCaddys(ctx, o, addrs, round, client, stderr)
	if err != nil {
		return nil, err
	}
	defer func() {
		client.CloseIdleConnections() // else each Caddy waits out its grace period on them
		for _, p := range procs {
			p.Stop()
		}
	}()
	n := len(procs)
	cpu := make([]time.Duration, n)
	for c := range n * o.chunks() {
		k := (c + round) % n
		cpu0, err := procCPU(procs[k].pid())
		if err != nil {
			return nil, err
		}
		_, failed, err := sendAtRate(ctx, client, procs[k].SiteURL+"/v1/chat/completions", o.body, o.chunk, o.rate, o.conns)
		if err != nil {
			return nil, err
		}
		cpu1, err := procCPU(procs[k].pid())
		if err != nil {
			return nil, err
		}
		if failed > 0 {
			return nil, fmt.Errorf("%s round %d: %d of %d requests failed", o.policies[k].name, round+1, failed, o.chunk)
		}
		cpu[k] += cpu1 - cpu0
	}
	return cpu, nil
}

// startOverheadCaddys starts a Caddy per policy, the first the round's number along the list, waits
// until the sglang_load ones have polled every backend and warms each up (connections opened on both
// sides, code paths hot). procs[k] is policy k's.
func startOverheadCaddys(ctx context.Context, o overheadOptions, addrs []string, round int, client *http.Client, stderr io.Writer) (procs []*caddyProc, err error) {
	n := len(o.policies)
	procs = make([]*caddyProc, n)
	defer func() {
		if err != nil {
			for _, p := range procs {
				if p != nil {
					p.Stop()
				}
			}
		}
	}()
	for i := range n {
		k := (i + round) % n
		p := o.policies[k]
		procs[k], err = startCaddy(ctx, o.caddy, func(admin string, port int) string { return p.caddyfile(admin, port, addrs) }, stderr)
		if err != nil {
			return procs, err
		}
	}
	for k, p := range o.policies {
		if p.interval > 0 {
			if err := procs[k].waitFresh(ctx, len(addrs), 20*time.Second); err != nil {
				return procs, err
			}
		}
	}
	for k, p := range procs {
		if _, _, err := sendAtRate(ctx, client, p.SiteURL+"/v1/chat/completions", o.body, o.requests/10, o.rate, o.conns); err != nil {
			return procs, fmt.Errorf("%s warm-up: %w", o.policies[k].name, err)
		}
	}
	return procs, nil
}

// sendAtRate sends n requests with body to url on a fixed schedule of rate per second, over at most conns
// requests in flight, and returns the time taken and how many failed. A request whose slot comes while
// all conns are busy waits for one, so the rate holds only while the server keeps up.
func sendAtRate(ctx context.Context, client *http.Client, url, body string, n int, rate float64, conns int) (time.Duration, int, error) {
	slots := make(chan struct{}, conns)
	var failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	gap := time.Duration(float64(time.Second) / rate)
	for i := range n {
		if d := time.Until(start.Add(time.Duration(i) * gap)); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				wg.Wait()
				return 0, 0, ctx.Err()
			}
		}
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			resp, err := client.Post(url, "application/json", strings.NewReader(body))
			if err != nil {
				failed.Add(1)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	return time.Since(start), int(failed.Load()), nil
}
