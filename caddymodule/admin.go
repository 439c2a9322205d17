package caddymodule

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

func init() {
	caddy.RegisterModule(new(Admin))
}

// Admin serves the sglang_load admin API: what the policy sees of each worker.
//
//	GET  /sglang_load/workers            every monitored load endpoint
//	GET  /sglang_load/workers/{address}  one, by upstream dial address or load address (host:port)
//	POST /sglang_load/refresh            poll every worker now; answers with the workers once all polls ended
//
// It finds the running app on each request, so it follows config reloads and works whether the app was
// configured or created by a policy.
type Admin struct{}

// CaddyModule returns the Caddy module information.
func (*Admin) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.sglang_load",
		New: func() caddy.Module { return new(Admin) },
	}
}

// Routes returns the admin routes under /sglang_load/.
func (ad *Admin) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/sglang_load/", Handler: caddy.AdminHandlerFunc(ad.serve)}}
}

// refreshGrace lets each poll's own deadline fire, and be recorded, before the refresh gives up.
const refreshGrace = time.Second

func (*Admin) serve(w http.ResponseWriter, r *http.Request) error {
	route := strings.TrimPrefix(r.URL.Path, "/sglang_load/")
	var method string
	switch {
	case route == "workers", strings.HasPrefix(route, "workers/"):
		method = http.MethodGet
	case route == "refresh":
		method = http.MethodPost
	default:
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no route %s: want /sglang_load/workers, /sglang_load/workers/{address} or /sglang_load/refresh", r.URL.Path)}
	}
	if r.Method != method {
		w.Header().Set("Allow", method)
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed on %s: use %s", r.Method, r.URL.Path, method)}
	}
	app, err := runningApp()
	if err != nil {
		return err
	}
	now := time.Now()
	switch {
	case route == "refresh":
		if err := app.refresh(r.Context()); err != nil {
			return caddy.APIError{HTTPStatus: http.StatusGatewayTimeout, Err: err}
		}
		return writeJSON(w, app.workers(time.Now()))
	case route == "workers":
		return writeJSON(w, app.workers(now))
	}
	addr := strings.TrimPrefix(route, "workers/")
	for _, v := range app.workers(now) {
		if v.LoadAddress == addr || slices.Contains(v.Upstreams, addr) {
			return writeJSON(w, v)
		}
	}
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no monitored worker at %q", addr)}
}

// runningApp is the sglang_load app of the running config.
func runningApp() (*App, error) {
	// AppIfConfigured, not App: the admin API must never create an app in a running config.
	app, err := caddy.ActiveContext().AppIfConfigured("sglang_load")
	if err != nil {
		return nil, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: errors.New("the sglang_load app is not running: no loaded config uses it")}
	}
	return app.(*App), nil
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// refresh polls every endpoint now and waits for the answers, for at most the longest poll timeout.
func (a *App) refresh(ctx context.Context) error {
	var longest time.Duration
	for _, ep := range a.endpointList() {
		longest = max(longest, a.timeoutFor(ep.spec.interval))
	}
	ctx, cancel := context.WithTimeout(ctx, longest+refreshGrace)
	defer cancel()
	if err := a.monitor.Refresh(ctx); err != nil {
		return fmt.Errorf("refresh: not every poll ended within %s: %w", longest+refreshGrace, err)
	}
	return nil
}

// workerView is one monitored load endpoint in the admin API. It never carries the API key.
type workerView struct {
	Upstreams   []string `json:"upstreams"`    // dial addresses of the upstreams this endpoint measures
	Endpoint    string   `json:"endpoint"`     // the load endpoint, as in the metrics' endpoint label
	LoadAddress string   `json:"load_address"` // host:port polled
	Transport   string   `json:"transport"`
	Interval    string   `json:"interval"`
	StaleAfter  string   `json:"stale_after"`

	State            string      `json:"state"`                        // fresh, stale, unreachable or missing
	ReportAgeSeconds *float64    `json:"report_age_seconds,omitempty"` // absent without a report
	Report           *reportView `json:"report"`

	LastPoll            *time.Time `json:"last_poll,omitempty"`
	LastError           string     `json:"last_error,omitempty"`        // the last poll's error; absent when it succeeded
	LastErrorResult     string     `json:"last_error_result,omitempty"` // its class, as in the polls_total result label
	LastErrorAt         *time.Time `json:"last_error_at,omitempty"`     // when a poll last failed
	ConsecutiveFailures int        `json:"consecutive_failures"`
	PollsOK             uint64     `json:"polls_ok"`
	PollsFailed         uint64     `json:"polls_failed"`

	Inflight int64      `json:"inflight"` // the proxy's requests in flight to the upstream now
	Score    *scoreView `json:"score"`    // null when the policy has no usable load for it
	// AffinityBlocks is how many prompt blocks the affinity indexes remember sending to this worker
	// (64 tokens each), and AffinityHomeKeys how many of the shared prompts seen in the last five
	// minutes the policies' latest placements make it home to; both absent when no policy with
	// affinity knows the worker.
	AffinityBlocks   *int64 `json:"affinity_blocks,omitempty"`
	AffinityHomeKeys *int64 `json:"affinity_home_keys,omitempty"`
}

type reportView struct {
	Received         time.Time  `json:"received"`
	Version          string     `json:"version,omitempty"`
	InflightAtReport int64      `json:"inflight_at_report"` // the proxy's in-flight count when the report came
	Totals           rankView   `json:"totals"`             // sums over ranks; token_usage is the hottest rank's
	Ranks            []rankView `json:"ranks"`
}

// rankView has SGLang's field names; a field the worker did not send is absent, never 0.
type rankView struct {
	DPRank                *int     `json:"dp_rank,omitempty"`
	Running               *int64   `json:"num_running_reqs,omitempty"`
	Waiting               *int64   `json:"num_waiting_reqs,omitempty"`
	WaitingUncachedTokens *int64   `json:"num_waiting_uncached_tokens,omitempty"`
	UsedTokens            *int64   `json:"num_used_tokens,omitempty"`
	TotalTokens           *int64   `json:"num_total_tokens,omitempty"`
	MaxTotalTokens        *int64   `json:"max_total_num_tokens,omitempty"`
	MaxRunning            *int64   `json:"max_running_requests,omitempty"`
	TokenUsage            *float64 `json:"token_usage,omitempty"`
	GenThroughput         *float64 `json:"gen_throughput,omitempty"`
	CacheHitRate          *float64 `json:"cache_hit_rate,omitempty"`
	Utilization           *float64 `json:"utilization,omitempty"`
}

// scoreView is what the policy would compare for this worker now.
type scoreView struct {
	Signal string `json:"signal"` // the most precise signal the report offers
	// Value is the signal as Select compares it: corrected by the requests started since the report,
	// and counting the request being placed.
	Value               float64            `json:"value"`
	RequestsSinceReport int64              `json:"requests_since_report"`
	Signals             map[string]float64 `json:"signals"` // every offered signal, as Value
	// CostSeconds is the cost metric's price, now, of CostRequest with the default stand-in speeds;
	// absent when the report lacks request counts.
	CostSeconds *float64 `json:"cost_seconds,omitempty"`
	// CostRequest is the request CostSeconds prices (referenceRequest); present with it.
	CostRequest *requestView `json:"cost_request,omitempty"`
	// SentSinceReport is what the cost model counted as sent to the worker since the report, which its
	// price adds to the report: requests that ask work, their prompt tokens and their output tokens.
	// Zero under the signal metrics, which count nothing.
	SentSinceReport sentView `json:"sent_since_report"`
	// PrefillTokensPerSec is the prefill speed measured from the worker's counters (between two reports, else
	// over its life); absent when not measured.
	PrefillTokensPerSec *float64 `json:"prefill_tokens_per_sec,omitempty"`
	// PrefillLifetimePerRank is one rank's prefill speed over the worker's life, from its cumulative
	// counters: with affinity, the worker's share of the keys is its batch cap times this. Absent
	// without the counters.
	PrefillLifetimePerRank *float64 `json:"prefill_lifetime_tokens_per_sec_per_rank,omitempty"`
	// DecodeAloneTokensPerSec is the decode speed of a request alone that the worker's recent reports
	// support; absent until a report caught it decoding.
	DecodeAloneTokensPerSec *float64 `json:"decode_alone_tokens_per_sec,omitempty"`
	// Senders is how much more work the worker received than this Caddy sent it lately (the prefill
	// counters' tokens over its own): about the number of replicas sharing the traffic. Absent until
	// two reports with the counters, and with a policy that does not count what it sends (the signal
	// metrics).
	Senders *float64 `json:"senders,omitempty"`
}

// referenceRequest is the request the admin view prices: 512 prompt tokens, 256 output tokens.
var referenceRequest = loadpolicy.Request{PromptTokens: 512, OutputTokens: defaultMaxTokens}

// sentView is what was sent to a worker: requests and their tokens.
type sentView struct {
	Requests     int64 `json:"requests"`
	PromptTokens int64 `json:"prompt_tokens"`
	OutputTokens int64 `json:"output_tokens"`
}

// requestView is a request's size: its prompt, and the most output it asks for.
type requestView struct {
	PromptTokens int64 `json:"prompt_tokens"`
	MaxTokens    int64 `json:"max_tokens"`
}

// workers returns the view of every endpoint, ordered by endpoint key.
func (a *App) workers(now time.Time) []workerView {
	type entry struct {
		ep        *endpoint
		upstreams []string
	}
	a.mu.Lock()
	entries := make([]entry, 0, len(a.endpoints))
	for _, ep := range a.endpoints {
		entries = append(entries, entry{ep, a.upstreamsOfLocked(ep)})
	}
	a.mu.Unlock()
	slices.SortFunc(entries, func(x, y entry) int { return strings.Compare(x.ep.key, y.ep.key) })
	views := make([]workerView, len(entries))
	for i, e := range entries {
		views[i] = e.ep.view(now, e.upstreams)
	}
	return views
}

func (ep *endpoint) view(now time.Time, upstreams []string) workerView {
	staleAfter := time.Duration(ep.staleness.Load())
	snap := ep.state.Load()
	result := resultOK
	if snap != nil {
		result = pollResult(snap.Err)
	}
	v := workerView{
		Upstreams:   upstreams,
		Endpoint:    ep.key,
		LoadAddress: ep.spec.address,
		Transport:   ep.spec.transport,
		Interval:    time.Duration(ep.interval.Load()).String(),
		StaleAfter:  staleAfter.String(),
		State:       freshness(snap, result, now, staleAfter),
	}
	if h := ep.host.Load(); h != nil {
		v.Inflight = int64(h.NumRequests())
	}
	if blocks, homeKeys, ok := ep.affinityCounts(); ok {
		v.AffinityBlocks, v.AffinityHomeKeys = &blocks, &homeKeys
	}
	if snap == nil {
		return v
	}
	v.LastPoll = &snap.LastPoll
	v.PollsOK, v.PollsFailed, v.ConsecutiveFailures = snap.OK, snap.Failed, snap.Failures
	if !snap.ErrAt.IsZero() {
		v.LastErrorAt = &snap.ErrAt
	}
	if snap.Err != nil {
		v.LastError, v.LastErrorResult = snap.Err.Error(), result
	}
	if rep := snap.Report; rep != nil {
		age := now.Sub(rep.Received).Seconds()
		v.ReportAgeSeconds = &age
		v.Report = newReportView(rep)
	}
	fresh := ep.fresh(now) // once: the score, the price and the speed describe the same report
	c := loadpolicy.Candidate{Inflight: v.Inflight}
	if scored(&c, fresh, false); c.Signals != nil {
		if sig, ok := c.Signals.Set.First(); ok {
			v.Score = &scoreView{Signal: sig.String(), Value: c.Signals.Score(sig, c.Extra+1), RequestsSinceReport: c.Extra,
				Signals: make(map[string]float64)}
			for s := loadpolicy.Signal(0); s <= loadpolicy.Running; s++ {
				if c.Signals.Set.Has(s) {
					v.Score.Signals[s.String()] = c.Signals.Score(s, c.Extra+1)
				}
			}
			var since loadpolicy.Since
			ep.sentSince(&since, fresh, 0, 0)
			v.Score.SentSinceReport = sentView{since.Sent, since.SentPrompt, since.SentOutput}
			params := defaultCostParams()
			pc := loadpolicy.Candidate{Inflight: v.Inflight}
			if ep.priced(fresh, &pc, now, referenceRequest, 0, &params, false); pc.Priced() {
				v.Score.CostSeconds = &pc.Cost
				v.Score.CostRequest = &requestView{referenceRequest.PromptTokens, referenceRequest.OutputTokens}
			}
			if speed, ok := fresh.PrefillTokensPerSec(); ok {
				v.Score.PrefillTokensPerSec = &speed
			}
			if speed := fresh.LifetimePrefillPerRank; speed > 0 {
				v.Score.PrefillLifetimePerRank = &speed
			}
			if speed := fresh.DecodeAloneTokensPerSec(); speed > 0 {
				v.Score.DecodeAloneTokensPerSec = &speed
			}
			if f := fresh.Senders(); f > 0 {
				v.Score.Senders = &f
			}
		}
	}
	return v
}

func newReportView(rep *loadpolicy.Report) *reportView {
	rv := &reportView{Received: rep.Received, Version: rep.Version, InflightAtReport: rep.Inflight, Ranks: make([]rankView, len(rep.Ranks))}
	all := loadpolicy.Field(0)
	for i := range rep.Ranks {
		rk := &rep.Ranks[i]
		if i == 0 {
			all = rk.Fields
		}
		all &= rk.Fields
		rv.Ranks[i] = rankView{
			DPRank:                &rk.DPRank,
			Running:               opt(rk.Has(loadpolicy.FieldRunning), rk.Running),
			Waiting:               opt(rk.Has(loadpolicy.FieldWaiting), rk.Waiting),
			WaitingUncachedTokens: opt(rk.Has(loadpolicy.FieldWaitingUncachedTokens), rk.WaitingUncachedTokens),
			UsedTokens:            opt(rk.Has(loadpolicy.FieldUsedTokens), rk.UsedTokens),
			TotalTokens:           opt(rk.Has(loadpolicy.FieldTotalTokens), rk.TotalTokens),
			MaxTotalTokens:        opt(rk.Has(loadpolicy.FieldMaxTotalTokens), rk.MaxTotalTokens),
			MaxRunning:            opt(rk.Has(loadpolicy.FieldMaxRunning), rk.MaxRunning),
			TokenUsage:            opt(rk.Has(loadpolicy.FieldTokenUsage), rk.TokenUsage),
			GenThroughput:         opt(rk.Has(loadpolicy.FieldGenThroughput), rk.GenThroughput),
			CacheHitRate:          opt(rk.Has(loadpolicy.FieldCacheHitRate), rk.CacheHitRate),
			Utilization:           opt(rk.Has(loadpolicy.FieldUtilization), rk.Utilization),
		}
	}
	// A total is shown only when every rank sent the field: a sum over some ranks would understate.
	has := func(f loadpolicy.Field) bool { return len(rep.Ranks) > 0 && all&f == f }
	rv.Totals = rankView{
		Running:               opt(has(loadpolicy.FieldRunning), rep.Running),
		Waiting:               opt(has(loadpolicy.FieldWaiting), rep.Waiting),
		WaitingUncachedTokens: opt(has(loadpolicy.FieldWaitingUncachedTokens), rep.WaitingUncachedTokens),
		UsedTokens:            opt(has(loadpolicy.FieldUsedTokens), rep.UsedTokens),
		MaxTotalTokens:        opt(has(loadpolicy.FieldMaxTotalTokens), rep.MaxTotalTokens),
		MaxRunning:            opt(has(loadpolicy.FieldMaxRunning), rep.MaxRunning),
		TokenUsage:            opt(rep.Signals().Set.Has(loadpolicy.TokenUsage), rep.MaxTokenUsage),
		GenThroughput:         opt(has(loadpolicy.FieldGenThroughput), rep.GenThroughput),
	}
	return rv
}

// opt returns &v when the field was sent, else nil.
func opt[T any](sent bool, v T) *T {
	if !sent {
		return nil
	}
	return &v
}

// Interface guards.
var _ caddy.AdminRouter = (*Admin)(nil)
