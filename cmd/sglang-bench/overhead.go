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
}

// overheadPolicies are the configurations compared: sglang_load and Caddy's least_conn.
var overheadPolicies = []struct{ name, global, lb string }{
	{"sglang_load", "\tsglang_load {\n\t\tinterval 1s\n\t}\n", "lb_policy sglang_load"},
	{"least_conn", "", "lb_policy least_conn"},
}

// runOverhead measures Caddy's CPU time per proxied request with each policy: a fixed count of
// requests sent at a fixed rate, well below what the machine can serve, so that the client and Caddy
// do not fight for the cores and the CPU time, not the throughput, carries the difference. Both
// Caddys run for the whole benchmark; rounds alternate which goes first.
func runOverhead(ctx context.Context, o overheadOptions, stdout, stderr io.Writer) error {
	addrs, stop, err := startLoadServers(ctx, "backends", o.backends, stderr)
	if err != nil {
		return err
	}
	defer stop()
	procs := make([]*caddyProc, len(overheadPolicies))
	for i, p := range overheadPolicies {
		proc, err := startCaddy(ctx, o.caddy, func(admin string, port int) string {
			return fmt.Sprintf("{\n\tadmin %s\n\tauto_https off\n\tpersist_config off\n%s}\nhttp://127.0.0.1:%d {\n\treverse_proxy %s {\n\t\t%s\n\t}\n}\n",
				admin, p.global, port, strings.Join(addrs, " "), p.lb)
		}, stderr)
		if err != nil {
			return err
		}
		defer proc.Stop()
		procs[i] = proc
	}
	if err := procs[0].waitFresh(ctx, len(addrs), 20*time.Second); err != nil {
		return err
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: o.conns, MaxConnsPerHost: o.conns}}
	defer client.CloseIdleConnections()
	// Warm-up: connections opened on both sides, code paths hot.
	for i, p := range procs {
		if _, _, err := sendAtRate(ctx, client, p.SiteURL+"/v1/chat/completions", o.requests/10, o.rate, o.conns); err != nil {
			return fmt.Errorf("%s warm-up: %w", overheadPolicies[i].name, err)
		}
	}
	perReq := make([][]float64, len(procs))
	var rows strings.Builder
	chunks := max(o.requests/o.chunk, 1)
	for round := range o.rounds {
		// A round is chunks short runs per policy, alternating, so that a change in the machine's load
		// during the round falls on both alike.
		var cpu [2]time.Duration
		for c := range 2 * chunks {
			k := (c + round) % 2
			cpu0, err := procCPU(procs[k].pid())
			if err != nil {
				return err
			}
			_, failed, err := sendAtRate(ctx, client, procs[k].SiteURL+"/v1/chat/completions", o.chunk, o.rate, o.conns)
			if err != nil {
				return err
			}
			cpu1, err := procCPU(procs[k].pid())
			if err != nil {
				return err
			}
			if failed > 0 {
				return fmt.Errorf("%s round %d: %d of %d requests failed", overheadPolicies[k].name, round+1, failed, o.chunk)
			}
			cpu[k] += cpu1 - cpu0
		}
		for k := range procs {
			perReq[k] = append(perReq[k], float64(cpu[k].Microseconds())/float64(chunks*o.chunk))
		}
		s, l := perReq[0][round], perReq[1][round]
		fmt.Fprintf(stderr, "overhead round %d: sglang_load %.1f, least_conn %.1f µs CPU per request\n", round+1, s, l)
		fmt.Fprintf(&rows, "| %d | %.1f | %.1f | %.3f |\n", round+1, s, l, s/l)
	}
	ratios := make([]float64, o.rounds)
	for i := range ratios {
		ratios[i] = perReq[0][i] / perReq[1][i]
	}
	rs, ss, ls := spreadOf(ratios), spreadOf(perReq[0]), spreadOf(perReq[1])
	var b strings.Builder
	fmt.Fprintf(&b, "### Proxy overhead by CPU, %s\n\nMachine: %s.\n\n", time.Now().Format("2006-01-02"), machine())
	fmt.Fprintf(&b, "Two Caddy processes (%s), one with `lb_policy sglang_load` (loads polled every 1s), one with `lb_policy least_conn`, "+
		"in front of the same %d loopback backends (another process; small JSON answers). Per round and policy: %d POSTs to /v1/chat/completions "+
		"sent at %.0f req/s over at most %d connections by this process, in runs of %d alternating between the two policies; "+
		"each Caddy's user+system CPU time from /proc/<pid>/stat (10ms ticks) over its runs, divided by its requests. %d rounds.\n\n",
		o.caddy, o.backends, chunks*o.chunk, o.rate, o.conns, o.chunk, o.rounds)
	b.WriteString("| round | sglang_load µs/request | least_conn µs/request | ratio |\n|---:|---:|---:|---:|\n")
	b.WriteString(rows.String())
	fmt.Fprintf(&b, "\nmedian (min..max): sglang_load %s µs, least_conn %s µs, ratio %s.\n\n",
		ss.format(1), ls.format(1), rs.format(3))
	width := rs.hi - rs.lo
	fmt.Fprintf(&b, "Median ratio **%.3f** (goal ≤ 1.03: %s). The per-round ratios span %.1f%% (max − min); ",
		rs.med, map[bool]string{true: "met", false: "missed"}[rs.med <= 1.03], 100*width)
	if width < 0.03 {
		b.WriteString("narrower than 3%, so a 3% difference shows.\n")
	} else {
		b.WriteString("wider than 3%, so single rounds cannot tell 3% apart; the median of the rounds is the figure.\n")
	}
	fmt.Fprint(stdout, b.String())
	return writeResult(o.out, "overhead.md", b.String())
}

// sendAtRate sends n requests to url on a fixed schedule of rate per second, over at most conns
// requests in flight, and returns the time taken and how many failed. A request whose slot comes while
// all conns are busy waits for one, so the rate holds only while the server keeps up.
func sendAtRate(ctx context.Context, client *http.Client, url string, n int, rate float64, conns int) (time.Duration, int, error) {
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}`
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
