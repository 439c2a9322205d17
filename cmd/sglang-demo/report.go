package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/caddy-sglang/caddy-sglang/affinity"
	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// progressBar draws the burst's progress: in place on a terminal (redrawn every 200ms, so the clock
// runs while long requests finish), else one line per tenth.
type progressBar struct {
	w      io.Writer
	tty    bool
	total  int
	start  time.Time
	stop   chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	done   int
	failed int
	shown  int // tenths already printed (not a terminal)
}

func newProgressBar(w io.Writer, tty bool, total int) *progressBar {
	p := &progressBar{w: w, tty: tty, total: total, start: time.Now(), stop: make(chan struct{})}
	if tty {
		p.wg.Go(func() {
			t := time.NewTicker(200 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					p.mu.Lock()
					fmt.Fprintf(p.w, "\r%s", p.line())
					p.mu.Unlock()
				case <-p.stop:
					return
				}
			}
		})
	}
	return p
}

// update is called after every answer, from many goroutines.
func (p *progressBar) update(done, failed int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done, p.failed = max(p.done, done), max(p.failed, failed)
	if !p.tty && p.done*10/p.total > p.shown {
		p.shown = p.done * 10 / p.total
		fmt.Fprintln(p.w, p.line())
	}
}

// finish draws the final state on a terminal and ends its line.
func (p *progressBar) finish() {
	close(p.stop)
	p.wg.Wait()
	if p.tty {
		fmt.Fprintf(p.w, "\r%s\n", p.line())
	}
}

func (p *progressBar) line() string {
	const width = 40
	n := p.done * width / p.total
	return fmt.Sprintf("[%s%s] %d/%d  failed %d  %.1fs", strings.Repeat("#", n), strings.Repeat(".", width-n),
		p.done, p.total, p.failed, time.Since(p.start).Seconds())
}

// workerRow is one line of the table: what the client measured and what the worker reports.
type workerRow struct {
	addr           string
	capacity       int
	decode         float64
	requests, long int
	latencies      []time.Duration
	stats          sglangsim.Stats
	statsErr       error
}

// printTable writes one row per worker and a total; with retracted, the requests each worker
// retracted (-sglang-admission).
func printTable(w io.Writer, rows []*workerRow, unknown int, retracted bool) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := "worker\tKV pool\tdecode\trequests\tlong\tp50\tp99\tpeak KV use\tserved\tprompt cached"
	if retracted {
		header += "\tretracted"
	}
	fmt.Fprintln(tw, header)
	var total, long int
	var all []time.Duration
	var cached, prompt, retractions int64
	for _, r := range rows {
		peak, served, hit, retractedHere := "?", "?", "?", "?"
		if r.statsErr == nil {
			peak = fmt.Sprintf("%d (%.0f%%)", r.stats.PeakUsedTokens, 100*r.stats.PeakTokenUsage)
			served = fmt.Sprint(r.stats.Served)
			hit = cachedShare(r.stats.CachedTokens, r.stats.CachedTokens+r.stats.PrefilledTokens)
			cached, prompt = cached+r.stats.CachedTokens, prompt+r.stats.CachedTokens+r.stats.PrefilledTokens
			retractedHere, retractions = fmt.Sprint(r.stats.Retracted), retractions+r.stats.Retracted
		}
		fmt.Fprintf(tw, "%s\t%d\t%g tok/s\t%d\t%d\t%s\t%s\t%s\t%s\t%s", r.addr, r.capacity, r.decode, r.requests, r.long,
			percentile(r.latencies, 0.50), percentile(r.latencies, 0.99), peak, served, hit)
		if retracted {
			fmt.Fprintf(tw, "\t%s", retractedHere)
		}
		fmt.Fprintln(tw)
		total += r.requests
		long += r.long
		all = append(all, r.latencies...)
	}
	if unknown > 0 {
		fmt.Fprintf(tw, "(no X-Upstream header)\t\t\t%d\n", unknown)
	}
	fmt.Fprintf(tw, "all\t\t\t%d\t%d\t%s\t%s\t\t\t%s", total+unknown, long, percentile(all, 0.50), percentile(all, 0.99),
		cachedShare(cached, prompt))
	if retracted {
		fmt.Fprintf(tw, "\t%d", retractions)
	}
	fmt.Fprintln(tw)
	tw.Flush()
}

// percentile is the nearest-rank percentile of ds, rounded for the table; "-" when there are none.
func percentile(ds []time.Duration, p float64) string {
	if len(ds) == 0 {
		return "-"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := max(0, int(float64(len(s))*p+0.999999)-1)
	return fmt.Sprintf("%.2fs", s[min(i, len(s)-1)].Seconds())
}

// getJSON fetches url and decodes its JSON body into v; the status is returned for any answer.
func getJSON(ctx context.Context, client *http.Client, url string, v any) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return resp.StatusCode, fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	return resp.StatusCode, json.NewDecoder(resp.Body).Decode(v)
}

// workerView holds the fields of GET /sglang_load/workers that the demo shows; absent fields print "-".
type workerView struct {
	Upstreams   []string `json:"upstreams"`
	State       string   `json:"state"`
	ReportAge   *float64 `json:"report_age_seconds"`
	PollsOK     *uint64  `json:"polls_ok"`
	PollsFailed *uint64  `json:"polls_failed"`
	Inflight    *int64   `json:"inflight"`
	LastError   string   `json:"last_error"`
	Report      *struct {
		Totals totalsView `json:"totals"`
	} `json:"report"`
	Score *struct {
		Signal      string   `json:"signal"`
		Value       float64  `json:"value"`
		CostSeconds *float64 `json:"cost_seconds"`
		CostRequest *struct {
			PromptTokens int64 `json:"prompt_tokens"`
			MaxTokens    int64 `json:"max_tokens"`
		} `json:"cost_request"`
	} `json:"score"`
	AffinityBlocks *int64 `json:"affinity_blocks"`
}

type totalsView struct {
	Running    *int64   `json:"num_running_reqs"`
	Waiting    *int64   `json:"num_waiting_reqs"`
	TokenUsage *float64 `json:"token_usage"`
}

// show formats a value of the view, "-" when it is absent.
func show[T any](v *T, format string) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf(format, *v)
}

// printAdmin shows what Caddy's admin API knows about the workers: the plugin's own view when the
// build has it, else the reverse proxy's upstream list.
func printAdmin(ctx context.Context, w io.Writer, client *http.Client, admin string) {
	var raw json.RawMessage
	url := admin + "/sglang_load/workers"
	status, err := getJSON(ctx, client, url, &raw)
	if err == nil {
		fmt.Fprintf(w, "  GET %s (what the load-aware policy sees):\n", url)
		var views []workerView
		if json.Unmarshal(raw, &views) != nil {
			// Not the shape this demo knows: show it as it is.
			var b bytes.Buffer
			if json.Indent(&b, raw, "  ", "  ") == nil {
				raw = b.Bytes()
			}
			fmt.Fprintf(w, "  %s\n", raw)
			return
		}
		errCol, blocksCol := "", ""
		for _, v := range views {
			if v.LastError != "" {
				errCol = "\tlast error"
			}
			if v.AffinityBlocks != nil {
				blocksCol = "\tprompt blocks"
			}
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintf(tw, "  worker\tstate\treport age\tpolls ok/failed\trunning\twaiting\tKV use\tin flight\tprice\tscore%s%s\n", blocksCol, errCol)
		for _, v := range views {
			var t totalsView
			if v.Report != nil {
				t = v.Report.Totals
			}
			price, score := "-", "-"
			if v.Score != nil {
				price, score = show(v.Score.CostSeconds, "%.2fs"), fmt.Sprintf("%s %.4g", v.Score.Signal, v.Score.Value)
			}
			blocks := ""
			if blocksCol != "" {
				blocks = "\t" + show(v.AffinityBlocks, "%d")
			}
			var usage *float64
			if u := t.TokenUsage; u != nil {
				usage = new(100 * *u)
			}
			lastErr := ""
			if errCol != "" {
				lastErr = "\t" + v.LastError
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s/%s\t%s\t%s\t%s\t%s\t%s\t%s%s%s\n", strings.Join(v.Upstreams, " "), v.State,
				show(v.ReportAge, "%.1fs"), show(v.PollsOK, "%d"), show(v.PollsFailed, "%d"),
				show(t.Running, "%d"), show(t.Waiting, "%d"), show(usage, "%.0f%%"),
				show(v.Inflight, "%d"), price, score, blocks, lastErr)
		}
		tw.Flush()
		request := "a reference request"
		for _, v := range views {
			if v.Score != nil && v.Score.CostRequest != nil {
				request = fmt.Sprintf("a request of %d prompt and %d output tokens", v.Score.CostRequest.PromptTokens, v.Score.CostRequest.MaxTokens)
				break
			}
		}
		fmt.Fprintf(w, "  price: what %s would take there now (the cost metric);\n", request)
		fmt.Fprintln(w, "  score: the most precise load signal the worker reports (the signal metrics); lower wins both")
		if blocksCol != "" {
			fmt.Fprintf(w, "  prompt blocks: the %d-token prompt blocks the affinity index remembers sending there\n", affinity.BlockTokens)
		}
		return
	}
	why := err.Error()
	if status != 0 {
		why = fmt.Sprintf("answered %d", status)
	}
	type upstream struct {
		Address     string `json:"address"`
		NumRequests int    `json:"num_requests"`
		Fails       int    `json:"fails"`
	}
	var ups []upstream
	url2 := admin + "/reverse_proxy/upstreams"
	if _, err := getJSON(ctx, client, url2, &ups); err != nil {
		fmt.Fprintf(w, "  GET %s %s; %v\n", url, why, err)
		return
	}
	fmt.Fprintf(w, "  GET %s %s (a build without the plugin's admin routes); the reverse proxy's view instead,\n  GET %s:\n", url, why, url2)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	slices.SortFunc(ups, func(a, b upstream) int { return strings.Compare(a.Address, b.Address) })
	fmt.Fprintln(tw, "  upstream\tin flight\tfails")
	for _, u := range ups {
		fmt.Fprintf(tw, "  %s\t%d\t%d\n", u.Address, u.NumRequests, u.Fails)
	}
	tw.Flush()
}

// cachedShare is the share of prompt tokens the prefix cache covered, for the table.
func cachedShare(cached, prompt int64) string {
	if prompt <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", 100*float64(cached)/float64(prompt))
}
