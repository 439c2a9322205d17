package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-sglang/caddy-sglang/affinity"
)

// caddyProc is a bin/caddy process running one generated Caddyfile, with its admin API and its site on
// free loopback ports and its data and config folders in a temporary folder of its own.
type caddyProc struct {
	cmd       *exec.Cmd
	dir       string
	admin     string // host:port of the admin API
	SiteURL   string
	exited    chan struct{}
	waitError error
}

// handedOut holds every port freePort has returned. Caddy binds its listeners with SO_REUSEPORT, so two
// instances given the same port both bind it and the kernel splits its connections between them: one
// arm's requests reached another Caddy's admin API and failed with its 404. The kernel may return a
// port that was just closed again, so no port is handed out twice in a run.
var handedOut = struct {
	sync.Mutex
	ports map[int]bool
}{ports: make(map[int]bool)}

// freePort returns a loopback port that was free a moment ago and that it has not returned before.
func freePort() (int, error) {
	handedOut.Lock()
	defer handedOut.Unlock()
	var held []net.Listener // ports handed out before stay bound until a new one is found
	defer func() {
		for _, ln := range held {
			ln.Close()
		}
	}()
	for range 1000 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		held = append(held, ln)
		port := ln.Addr().(*net.TCPAddr).Port
		if !handedOut.ports[port] {
			handedOut.ports[port] = true
			return port, nil
		}
	}
	return 0, errors.New("no loopback port that was not handed out before")
}

// startCaddy writes the Caddyfile that caddyfile(adminAddr, sitePort) returns and runs Caddy on it,
// returning once the admin API answers. Its log goes to logw.
func startCaddy(ctx context.Context, binary string, caddyfile func(admin string, port int) string, logw io.Writer) (*caddyProc, error) {
	adminPort, err := freePort()
	if err != nil {
		return nil, err
	}
	sitePort, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "sglang-bench-caddy-")
	if err != nil {
		return nil, err
	}
	p := &caddyProc{dir: dir, admin: fmt.Sprintf("127.0.0.1:%d", adminPort), SiteURL: fmt.Sprintf("http://127.0.0.1:%d", sitePort),
		exited: make(chan struct{})}
	file := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(file, []byte(caddyfile(p.admin, sitePort)), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	p.cmd = exec.Command(binary, "run", "--config", file, "--adapter", "caddyfile")
	p.cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir, "HOME="+dir)
	p.cmd.Stdout, p.cmd.Stderr = logw, logw
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting %s: %w", binary, err)
	}
	go func() {
		p.waitError = p.cmd.Wait()
		close(p.exited)
	}()
	err = pollUntil(ctx, 20*time.Second, func() (bool, error) {
		select {
		case <-p.exited:
			return false, fmt.Errorf("caddy exited: %v", p.waitError)
		default:
		}
		resp, err := http.Get("http://" + p.admin + "/config/")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

// startAttempts bounds the tries of startCaddyRetrying: a port that freePort found free can be taken by
// another process before Caddy binds it, more often when many instances start at once.
const startAttempts = 3

// startCaddyRetrying starts Caddy, keeping the end of its log, trying again on fresh ports when it exits
// during startup; the error carries the end of the last attempt's log.
func startCaddyRetrying(ctx context.Context, binary string, caddyfile func(admin string, port int) string) (*caddyProc, error) {
	var err error
	for range startAttempts {
		log := &logTail{max: 2048}
		var c *caddyProc
		if c, err = startCaddy(ctx, binary, caddyfile, log); err == nil {
			return c, nil
		}
		err = fmt.Errorf("%w; log: %s", err, log.String())
		if ctx.Err() != nil {
			break
		}
		fmt.Fprintf(os.Stderr, "sglang-bench: starting caddy again: %v\n", err)
	}
	return nil, err
}

// logTail keeps the last max bytes written to it.
type logTail struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (l *logTail) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	if len(l.b) > l.max {
		l.b = append(l.b[:0], l.b[len(l.b)-l.max:]...)
	}
	return len(p), nil
}

func (l *logTail) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.TrimSpace(string(l.b))
}

// waitFresh waits until the sglang_load admin API shows n workers with a fresh report, at most timeout.
func (p *caddyProc) waitFresh(ctx context.Context, n int, timeout time.Duration) error {
	return pollUntil(ctx, timeout, func() (bool, error) {
		resp, err := http.Get("http://" + p.admin + "/sglang_load/workers")
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return strings.Count(string(b), `"state":"fresh"`) >= n, nil
	})
}

// Stop interrupts Caddy, kills it if it has not exited within 10s, and removes its folder.
func (p *caddyProc) Stop() {
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	os.RemoveAll(p.dir)
}

// pollUntil calls check every 50ms until it returns true or an error, ctx ends or timeout passes.
func pollUntil(ctx context.Context, timeout time.Duration, check func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		ok, err := check()
		if err != nil || ok {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// routingCounts are what a Caddy's metrics say about how it routed and polled.
type routingCounts struct {
	byLoad, byFallback float64                         // selections_total by branch
	polls, pollsFailed float64                         // polls_total: every result, and every result but ok
	affinity           [len(affinity.Outcomes)]float64 // affinity_decisions_total, by affinity.Outcome
	homesMoved         float64                         // affinity_homes_moved_total
}

func (c *routingCounts) add(o routingCounts) {
	c.byLoad += o.byLoad
	c.byFallback += o.byFallback
	c.polls += o.polls
	c.pollsFailed += o.pollsFailed
	for i := range c.affinity {
		c.affinity[i] += o.affinity[i]
	}
	c.homesMoved += o.homesMoved
}

// routingCounts reads the sglang_load counters from the admin API's metrics.
func (p *caddyProc) routingCounts() (routingCounts, error) {
	var c routingCounts
	resp, err := http.Get("http://" + p.admin + "/metrics")
	if err != nil {
		return c, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return c, err
	}
	for line := range strings.Lines(string(b)) {
		name, value, ok := metricLine(line)
		if !ok {
			continue
		}
		switch {
		case name == `caddy_sglang_load_selections_total{branch="load"}`:
			c.byLoad += value
		case name == `caddy_sglang_load_selections_total{branch="fallback"}`:
			c.byFallback += value
		case strings.HasPrefix(name, "caddy_sglang_load_polls_total{"):
			c.polls += value
			if !strings.Contains(name, `result="ok"`) {
				c.pollsFailed += value
			}
		case name == "caddy_sglang_load_affinity_homes_moved_total":
			c.homesMoved += value
		case strings.HasPrefix(name, "caddy_sglang_load_affinity_decisions_total{"):
			for _, o := range affinity.Outcomes {
				if name == `caddy_sglang_load_affinity_decisions_total{outcome="`+o.String()+`"}` {
					c.affinity[o] += value
				}
			}
		}
	}
	return c, nil
}

// metricLine splits a sample line of the Prometheus text format into its series and value.
func metricLine(line string) (series string, value float64, ok bool) {
	line = strings.TrimSpace(line)
	if line == "" || line[0] == '#' {
		return "", 0, false
	}
	i := strings.LastIndexByte(line, ' ')
	if i < 0 {
		return "", 0, false
	}
	v, err := strconv.ParseFloat(line[i+1:], 64)
	if err != nil {
		return "", 0, false
	}
	return line[:i], v, true
}

// String is empty for an arm without Caddy (a router inside the bench), else the share of selections
// made by the fallback policy, of polls that failed, and the affinity outcomes when there were any.
func (c routingCounts) String() string {
	if c.byLoad+c.byFallback+c.polls == 0 {
		return ""
	}
	s := fmt.Sprintf(" fallback %.1f%% polls failed %.0f/%.0f", 100*c.byFallback/max(c.byLoad+c.byFallback, 1), c.pollsFailed, c.polls)
	var outcomes []string
	for _, o := range affinity.Outcomes {
		if c.affinity[o] > 0 {
			outcomes = append(outcomes, fmt.Sprintf("%s %.0f", o, c.affinity[o]))
		}
	}
	if len(outcomes) > 0 {
		s += " affinity " + strings.Join(outcomes, ", ") + fmt.Sprintf(", homes moved %.0f", c.homesMoved)
	}
	return s
}

// speeds reads, from the admin API, the speeds the policy holds for each of addrs (host:port, in
// order): the decode speed of a request alone and the prefill speed, tokens/s, 0 where not measured.
// A worker starved by a speed measured low shows here.
func (p *caddyProc) speeds(addrs []string) (decodeAlone, prefill []float64, err error) {
	resp, err := http.Get("http://" + p.admin + "/sglang_load/workers")
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	var views []struct {
		Upstreams []string `json:"upstreams"`
		Score     *struct {
			DecodeAlone float64 `json:"decode_alone_tokens_per_sec"`
			Prefill     float64 `json:"prefill_tokens_per_sec"`
		} `json:"score"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&views); err != nil {
		return nil, nil, fmt.Errorf("admin workers view: %w", err)
	}
	decodeAlone, prefill = make([]float64, len(addrs)), make([]float64, len(addrs))
	for _, v := range views {
		for i, a := range addrs {
			if v.Score != nil && slices.Contains(v.Upstreams, a) {
				decodeAlone[i], prefill[i] = v.Score.DecodeAlone, v.Score.Prefill
			}
		}
	}
	return decodeAlone, prefill, nil
}
