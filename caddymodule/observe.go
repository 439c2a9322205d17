package caddymodule

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc/codes"

	"github.com/caddy-sglang/caddy-sglang/affinity"
	"github.com/caddy-sglang/caddy-sglang/grpcload"
	"github.com/caddy-sglang/caddy-sglang/httpload"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// Poll results, the values of the result label of the metrics, of the admin view's last_error_result
// and of the log lines; pollResult is the one place that assigns them.
const (
	resultOK          = "ok"
	resultTimeout     = "timeout"     // no answer within the poll timeout; gRPC DeadlineExceeded
	resultHTTPStatus  = "http_status" // an HTTP status other than 2xx
	resultGRPCStatus  = "grpc_status" // a gRPC status from the worker, other than the ones below
	resultTooLarge    = "too_large"   // an answer over the size limit: HTTP max body, gRPC MaxResponseSize
	resultDecode      = "decode"      // an answer that is not the documented JSON
	resultUnavailable = "unavailable" // nothing answered: refused, reset, unreachable; gRPC Unavailable, Canceled
)

var pollResults = [...]string{resultOK, resultTimeout, resultHTTPStatus, resultGRPCStatus, resultTooLarge, resultDecode, resultUnavailable}

// pollResult classifies a poll's error into one of a fixed set of label values.
func pollResult(err error) string {
	if err == nil {
		return resultOK // before the targets of errors.As, which escape: five allocations a call
	}
	var (
		timeout  *monitor.TimeoutError
		hstatus  *httpload.StatusError
		gstatus  *grpcload.StatusError
		decode   *httpload.DecodeError
		tooLarge *httpload.TooLargeError
	)
	switch {
	case errors.As(err, &timeout):
		return resultTimeout
	case errors.As(err, &hstatus):
		return resultHTTPStatus
	case errors.As(err, &tooLarge):
		return resultTooLarge
	case errors.As(err, &decode):
		return resultDecode
	case errors.As(err, &gstatus):
		switch {
		case gstatus.Code == codes.DeadlineExceeded:
			return resultTimeout
		case gstatus.Code == codes.Unavailable, gstatus.Code == codes.Canceled:
			return resultUnavailable
		case gstatus.TooLarge():
			return resultTooLarge
		}
		return resultGRPCStatus
	}
	return resultUnavailable // refused, reset, DNS: nothing answered
}

// Metrics shared by every config: counters keep counting across reloads. Each config's registry is new,
// so registering them there again never collides.
var metrics = struct {
	polls        *prometheus.CounterVec
	pollDuration *prometheus.HistogramVec
	selections   *counterVec
	affinity     *counterVec
	homesMoved   prometheus.Counter
	// Pre-resolved counts, so Select counts without a lookup.
	selectedByLoad, selectedByFallback, selectedNone *shardedCount
	affinityOutcomes                                 [len(affinity.Outcomes)]*shardedCount // by affinity.Outcome
}{}

const metricsNamespace, metricsSubsystem = "caddy", "sglang_load"

func init() {
	metrics.polls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace, Subsystem: metricsSubsystem, Name: "polls_total",
		Help: "Load polls by endpoint and result (ok, timeout, http_status, grpc_status, too_large, decode, unavailable).",
	}, []string{"endpoint", "transport", "result"})
	metrics.pollDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metricsNamespace, Subsystem: metricsSubsystem, Name: "poll_duration_seconds",
		Help:    "Duration of load polls, by transport and result.",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	}, []string{"transport", "result"})
	metrics.selections = newCounterVec("selections_total",
		"Upstream selections by branch: load (chosen on loads), fallback (by the fallback policy), none (no upstream).",
		"branch", []string{"load", "fallback", "none"})
	metrics.selectedByLoad = metrics.selections.count("load")
	metrics.selectedByFallback = metrics.selections.count("fallback")
	metrics.selectedNone = metrics.selections.count("none")
	outcomes := make([]string, len(affinity.Outcomes))
	for _, o := range affinity.Outcomes {
		outcomes[o] = o.String()
	}
	metrics.affinity = newCounterVec("affinity_decisions_total",
		"Selections with affinity on, by outcome: followed (sent to the key's home, or to the worker holding a conversation, credited with its cached tokens), yielded (the key is shared but load chose another worker), new (the key is not known to be shared: load chose), no_key (the request had no key).",
		"outcome", outcomes)
	for _, o := range affinity.Outcomes {
		metrics.affinityOutcomes[o] = metrics.affinity.count(o.String())
	}
	metrics.homesMoved = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: metricsNamespace, Subsystem: metricsSubsystem, Name: "affinity_homes_moved_total",
		Help: "Shared prompts (affinity prefix) whose home a placement of homes changed: each is prefilled again at its new home.",
	})
}

// registerMetrics adds the shared metrics and the app's gauges to the config's registry.
func (a *App) registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{metrics.polls, metrics.pollDuration, metrics.selections, metrics.affinity, metrics.homesMoved, gauges{a}} {
		if err := reg.Register(c); err != nil {
			if already := (prometheus.AlreadyRegisteredError{}); !errors.As(err, &already) {
				return err
			}
		}
	}
	return nil
}

// pollSeries are an endpoint's poll counters and duration histograms, one per result in the order of
// pollResults, resolved once: a label lookup hashes the labels, and an endpoint is polled every second.
type pollSeries struct {
	counts    [len(pollResults)]prometheus.Counter
	durations [len(pollResults)]prometheus.Observer
}

// newPollSeries makes every result's counter of an endpoint exist at 0, so a rate over the first
// failure is not lost for want of an earlier sample.
func newPollSeries(key, transport string) *pollSeries {
	s := new(pollSeries)
	for i, r := range pollResults {
		s.counts[i] = metrics.polls.WithLabelValues(key, transport, r)
		s.durations[i] = metrics.pollDuration.WithLabelValues(transport, r)
	}
	return s
}

// count counts one poll of the endpoint.
func (s *pollSeries) count(result string, took time.Duration) {
	for i, r := range pollResults {
		if r == result {
			s.counts[i].Inc()
			s.durations[i].Observe(took.Seconds())
			return
		}
	}
}

// deletePollCounters drops an endpoint's series once no config monitors it.
func deletePollCounters(key string) {
	metrics.polls.DeletePartialMatch(prometheus.Labels{"endpoint": key})
}

// Per-endpoint gauges, computed from the latest reports at scrape time: a report's age is always
// current, and an endpoint that is no longer monitored has no series.
var (
	gaugeLabels    = []string{"endpoint", "transport"}
	tokenUsageDesc = gaugeDesc("token_usage", "KV-pool usage of the worker's hottest DP rank (0..1), from its last report.")
	runningDesc    = gaugeDesc("running_requests", "Running requests over the worker's DP ranks, from its last report.")
	waitingDesc    = gaugeDesc("waiting_requests", "Queued requests over the worker's DP ranks, from its last report.")
	reportAgeDesc  = gaugeDesc("report_age_seconds", "Age of the worker's last load report.")
	gaugeDescs     = [...]*prometheus.Desc{tokenUsageDesc, runningDesc, waitingDesc, reportAgeDesc}
)

func gaugeDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, name), help, gaugeLabels, nil)
}

// gauges collects the per-endpoint gauges of one app.
type gauges struct{ app *App }

func (gauges) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range gaugeDescs {
		ch <- d
	}
}

func (g gauges) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	for _, ep := range g.app.endpointList() {
		snap := ep.state.Load()
		if snap == nil || snap.Report == nil {
			continue
		}
		rep := snap.Report
		labels := []string{ep.key, ep.spec.transport}
		ch <- prometheus.MustNewConstMetric(reportAgeDesc, prometheus.GaugeValue, now.Sub(rep.Received).Seconds(), labels...)
		// Only what every rank sent: a field a worker does not send must not read as zero load.
		set := rep.Signals().Set
		if set.Has(loadpolicy.TokenUsage) {
			ch <- prometheus.MustNewConstMetric(tokenUsageDesc, prometheus.GaugeValue, rep.MaxTokenUsage, labels...)
		}
		if set.Has(loadpolicy.Running) {
			ch <- prometheus.MustNewConstMetric(runningDesc, prometheus.GaugeValue, float64(rep.Running), labels...)
		}
		if set.Has(loadpolicy.Waiting) {
			ch <- prometheus.MustNewConstMetric(waitingDesc, prometheus.GaugeValue, float64(rep.Waiting), labels...)
		}
	}
}

// Worker freshness, as the policy sees it.
const (
	stateFresh   = "fresh"   // a non-empty report younger than stale_after: the policy routes on it
	stateStale   = "stale"   // the last report is too old: the policy ignores it
	stateMissing = "missing" // no report yet, or an empty one (a worker still starting)
	// stateUnreachable: the last poll found nobody answering; the policy ignores the report, whatever
	// its age (sharedState.usable).
	stateUnreachable = "unreachable"
)

// freshness classifies snap at now with the policy's own tests (endpoint.fresh); result is its last
// poll's (pollResult).
func freshness(snap *monitor.Snapshot, result string, now time.Time, staleAfter time.Duration) string {
	fresh := !snap.Fresh(now, staleAfter).Empty()
	switch {
	case fresh && result == resultUnavailable:
		return stateUnreachable
	case fresh:
		return stateFresh
	case snap != nil && !snap.Report.Empty():
		return stateStale
	}
	return stateMissing
}

// health is what a state-change log line compares: the freshness after a poll and the poll's result.
type health struct{ state, result string }

func healthAt(snap *monitor.Snapshot, staleAfter time.Duration) health {
	if snap == nil {
		return health{stateMissing, resultOK}
	}
	result := pollResult(snap.Err)
	return health{freshness(snap, result, snap.LastPoll, staleAfter), result}
}

// observePoll records one poll: its metrics, a debug line, and, when the worker's health changed, one
// log line and possibly a sglang_load_stale or sglang_load_recovered event.
func (a *App) observePoll(key string, prev, next *monitor.Snapshot, took time.Duration) {
	ep := a.endpointByKey(key)
	result := pollResult(next.Err)
	if ce := a.logger.Check(zapcore.DebugLevel, "poll"); ce != nil {
		ce.Write(zap.String("endpoint", key), zap.String("result", result), zap.Duration("took", took), zap.Error(next.Err))
	}
	if ep == nil {
		return // unregistered while the poll ran: its series may be gone, and counting would bring them back
	}
	ep.series.count(result, took)
	if unreachable := result == resultUnavailable; ep.state.unreachable.Swap(unreachable) != unreachable {
		ep.state.refresh()
	}
	staleAfter := time.Duration(ep.staleness.Load())
	from, to := healthAt(prev, staleAfter), healthAt(next, staleAfter)
	if from == to {
		return
	}
	level := zapcore.WarnLevel
	if to == (health{stateFresh, resultOK}) {
		level = zapcore.InfoLevel
	}
	if ce := a.logger.Check(level, "worker load state changed"); ce != nil {
		fields := []zap.Field{
			zap.String("endpoint", key),
			zap.String("from", from.state), zap.String("state", to.state),
			zap.String("from_result", from.result), zap.String("result", to.result),
			zap.Int("consecutive_failures", next.Failures),
		}
		if next.Report != nil {
			fields = append(fields, zap.Duration("report_age", next.LastPoll.Sub(next.Report.Received)))
		}
		ce.Write(append(fields, zap.Error(next.Err))...)
	}
	// The flag lives in the shared state, so the old and the new config of a reload emit one event.
	switch {
	case from.state == stateFresh && to.state != stateFresh && ep.state.down.CompareAndSwap(false, true):
		a.emit("sglang_load_stale", ep, next)
	case to.state == stateFresh && ep.state.down.CompareAndSwap(true, false):
		a.emit("sglang_load_recovered", ep, next)
	}
}

// emit sends an event through Caddy's events app, for handlers that subscribe to it.
func (a *App) emit(name string, ep *endpoint, snap *monitor.Snapshot) {
	if a.events == nil {
		return
	}
	data := map[string]any{"endpoint": ep.key, "transport": ep.spec.transport, "upstreams": a.upstreamsOf(ep)}
	if snap.Err != nil {
		data["error"] = snap.Err.Error()
	}
	a.events.Emit(a.ctx, name, data)
}

// endpointList returns the app's endpoints.
func (a *App) endpointList() []*endpoint {
	a.mu.Lock()
	defer a.mu.Unlock()
	eps := make([]*endpoint, 0, len(a.endpoints))
	for _, ep := range a.endpoints {
		eps = append(eps, ep)
	}
	return eps
}

func (a *App) endpointByKey(key string) *endpoint {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.endpoints[key]
}
