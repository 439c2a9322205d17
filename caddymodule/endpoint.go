package caddymodule

import (
	"context"
	"crypto/tls"
	"fmt"
	"maps"
	"math"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-sglang/caddy-sglang/affinity"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// states keeps each load endpoint's last snapshot across config reloads: the new config's policy reads
// the old config's last loads until its own first poll answers.
var states = caddy.NewUsagePool()

type sharedState struct {
	monitor.State
	// down is set when a sglang_load_stale event was emitted and no sglang_load_recovered since; shared,
	// so that the old and the new config of a reload emit each event once.
	down atomic.Bool
	// unreachable is set while the last poll found nobody answering (refused, reset): the last report
	// then describes a worker that is gone, and routing on it until it goes stale would send requests
	// to a dead address. A worker that is only slow to answer keeps its report until stale_after.
	unreachable atomic.Bool

	// watchers are the static pools' slots that mirror this state for Select (reportSlot).
	watchersMu sync.Mutex
	watchers   []watcher
}

type watcher struct {
	slot *reportSlot
	ep   *endpoint // whose staleness the slot holds
}

// usable is the last report unless it cannot be routed on whatever its age: nil while unreachable,
// before the first report, and when empty.
func (s *sharedState) usable() *loadpolicy.Report {
	if s.unreachable.Load() {
		return nil
	}
	if snap := s.Load(); snap != nil && !snap.Report.Empty() {
		return snap.Report
	}
	return nil
}

// watch keeps slot, a static pool's entry for ep, equal to ep's usable report and staleness until
// unwatch.
func (s *sharedState) watch(slot *reportSlot, ep *endpoint) {
	s.watchersMu.Lock()
	defer s.watchersMu.Unlock()
	w := watcher{slot, ep}
	s.watchers = append(s.watchers, w)
	w.fill(s.usable())
}

func (s *sharedState) unwatch(slot *reportSlot) {
	s.watchersMu.Lock()
	defer s.watchersMu.Unlock()
	s.watchers = slices.DeleteFunc(s.watchers, func(w watcher) bool { return w.slot == slot })
}

// refresh rewrites the slots after what endpoint.fresh reads changed: a published poll, the
// unreachable flag, a staleness.
func (s *sharedState) refresh() {
	s.watchersMu.Lock()
	defer s.watchersMu.Unlock()
	rep := s.usable()
	for _, w := range s.watchers {
		w.fill(rep)
	}
}

func (w watcher) fill(rep *loadpolicy.Report) {
	staleAfter := w.ep.staleness.Load()
	w.slot.rep.Store(rep)
	w.slot.staleAfter.Store(staleAfter)
	capUntil, maxRunning, prefill := int64(0), int64(0), 0.0
	if rep != nil {
		capUntil, maxRunning, prefill = rep.Received.UnixNano()+staleAfter, rep.MaxRunning, rep.LifetimePrefillPerRank
	}
	w.slot.maxRunning.Store(maxRunning)
	w.slot.prefillPerRank.Store(math.Float64bits(prefill))
	w.slot.capUntil.Store(capUntil)
}

// reportSlot is an upstream's entry in its static pool's index: what endpoint.fresh finds through the
// endpoint, its state and its snapshot, kept where Select walks the pool in order.
type reportSlot struct {
	rep        atomic.Pointer[loadpolicy.Report] // sharedState.usable
	staleAfter atomic.Int64                      // endpoint.staleness
	// maxRunning and prefillPerRank are rep's batch cap and lifetime prefill speed per rank (float64
	// bits), and capUntil when rep goes stale (Unix nanoseconds; 0 for no rep): affinity weighs every
	// upstream by them, and reads them here in order without rep.
	maxRunning, capUntil atomic.Int64
	prefillPerRank       atomic.Uint64
}

// capacity is the fresh report's batch cap and lifetime prefill speed per rank at now (Unix
// nanoseconds), zeros if none.
func (s *reportSlot) capacity(now int64) (int64, float64) {
	if now > s.capUntil.Load() {
		return 0, 0
	}
	return s.maxRunning.Load(), math.Float64frombits(s.prefillPerRank.Load())
}

// fresh is endpoint.fresh on the slot's copy.
func (s *reportSlot) fresh(now time.Time) *loadpolicy.Report {
	return monitor.FreshReport(s.rep.Load(), now, time.Duration(s.staleAfter.Load()))
}

func (*sharedState) Destruct() error { return nil }

// Load transports.
const (
	transportHTTP = "http"
	transportGRPC = "grpc"
)

// endpointSpec says how to poll one worker's load.
type endpointSpec struct {
	transport          string // transportHTTP or transportGRPC
	address            string // host:port of the load endpoint
	tls                bool
	tlsConfig          *tls.Config // nil: Go's defaults; shared, never modified
	insecureSkipVerify bool
	apiKey             string
	interval           time.Duration
}

// key identifies an endpoint in the app and in states; it never holds the API key.
func (s endpointSpec) key() string {
	scheme := s.transport
	if s.tls {
		scheme += "s"
	}
	return scheme + "://" + s.address
}

// endpoint is one polled load endpoint as the policies of one config see it.
type endpoint struct {
	key       string
	spec      endpointSpec
	state     *sharedState
	refs      int
	interval  atomic.Int64 // nanoseconds
	staleness atomic.Int64 // nanoseconds after which a report is ignored
	series    *pollSeries

	// host is the proxy's shared per-address state of the upstream this endpoint measures, from which
	// in-flight counts are read. Set by Select, read when a poll answers.
	host atomic.Pointer[reverseproxy.Host]

	// seen is when, in Unix milliseconds of Select's clock, a policy last found this endpoint's
	// upstream in a dynamic pool; a policy forgets its dynamic upstreams unseen for forget_after.
	seen atomic.Int64

	// upstreams counts the registrations of each upstream dial address measured here; guarded by App.mu.
	upstreams map[string]int

	// sent totals the requests the cost model placed here and their sizes; each report is stamped
	// with them, so the requests sent since are the difference. sentUncachedSq sums the squares of
	// their uncached prompt tokens, for the policies' mean sizes (requestSizes).
	sentRequests, sentPrompt, sentOutput, sentWeighted, sentUncached, sentUncachedSq atomic.Int64
	// backlog is the worker's prefill queue as the cost model projects it from its report and the
	// prompts placed here since.
	backlog loadpolicy.Backlog

	// poke asks the monitor for a poll within a tenth of the interval (monitor.Target.Poke).
	poke chan struct{}

	// affinity lists the affinity indexes that know this endpoint's upstream, for the admin view.
	affinityMu sync.Mutex
	affinity   []indexedWorker

	// fleetRefs counts the registrations of each policy's fleet figures (guarded by App.mu); fleets is
	// its keys, which every report is noted in.
	fleetRefs map[*fleetSpeed]int
	fleets    atomic.Pointer[[]*fleetSpeed]
}

// joinFleetLocked counts one more registration of f; App.mu must be held.
func (ep *endpoint) joinFleetLocked(f *fleetSpeed) {
	if ep.fleetRefs == nil {
		ep.fleetRefs = make(map[*fleetSpeed]int)
	}
	ep.fleetRefs[f]++
	ep.publishFleetsLocked()
}

// leaveFleetLocked drops a registration of f; App.mu must be held.
func (ep *endpoint) leaveFleetLocked(f *fleetSpeed) {
	if ep.fleetRefs[f]--; ep.fleetRefs[f] <= 0 {
		delete(ep.fleetRefs, f)
	}
	ep.publishFleetsLocked()
}

func (ep *endpoint) publishFleetsLocked() {
	fs := slices.Collect(maps.Keys(ep.fleetRefs))
	ep.fleets.Store(&fs)
}

type indexedWorker struct {
	index  *affinity.Index
	homes  *affinity.Homes
	worker affinity.Worker
}

// indexed notes that an affinity index, whose keys homes places, knows the upstream as w.
func (ep *endpoint) indexed(x *affinity.Index, homes *affinity.Homes, w affinity.Worker) {
	ep.affinityMu.Lock()
	defer ep.affinityMu.Unlock()
	ep.affinity = append(ep.affinity, indexedWorker{x, homes, w})
}

// affinityCounts is how many prompt blocks the affinity indexes hold for this upstream and how many
// keys their placements make it home to, and whether any index knows it.
func (ep *endpoint) affinityCounts() (blocks, homeKeys int64, ok bool) {
	ep.affinityMu.Lock()
	defer ep.affinityMu.Unlock()
	for _, iw := range ep.affinity {
		blocks += iw.index.Blocks(iw.worker)
		homeKeys += int64(iw.homes.Keys(iw.worker))
	}
	return blocks, homeKeys, len(ep.affinity) > 0
}

// sentTotals sets t to the running totals of the requests sent here; in place, as SetSince.
func (ep *endpoint) sentTotals(t *loadpolicy.SentTotals) {
	t.Requests, t.PromptTokens, t.OutputTokens = ep.sentRequests.Load(), ep.sentPrompt.Load(), ep.sentOutput.Load()
	t.Weighted, t.Uncached = ep.sentWeighted.Load(), ep.sentUncached.Load()
}

// sentSince sets s to what was sent here after rep arrived, elapsed ago, with the proxy's in-flight
// count to the worker changed by extra since; in place, as SetSince.
func (ep *endpoint) sentSince(s *loadpolicy.Since, rep *loadpolicy.Report, elapsed time.Duration, extra int64) {
	var totals loadpolicy.SentTotals
	ep.sentTotals(&totals)
	totals.SetSince(s, &rep.Sent, elapsed, extra)
}

// placed counts a request the cost model sent here at now, cached of whose prompt tokens it holds, at
// the size the worker holds (Report.Held), and reports whether it holds the request: one it refuses
// caches nothing there. params price its prefill in the worker's backlog.
func (ep *endpoint) placed(req loadpolicy.Request, cached int64, now time.Time, params *loadpolicy.CostParams) (held bool) {
	rep := ep.state.usable()
	req, held = rep.Held(req)
	var d loadpolicy.SentTotals
	d.Add(req, cached)
	if rep != nil {
		ep.backlog.Add(rep, now.Sub(rep.Received), d.Uncached, params)
	}
	ep.sentRequests.Add(d.Requests)
	ep.sentPrompt.Add(d.PromptTokens)
	ep.sentOutput.Add(d.OutputTokens)
	ep.sentWeighted.Add(d.Weighted)
	ep.sentUncached.Add(d.Uncached)
	ep.sentUncachedSq.Add(d.Uncached * d.Uncached)
	if rep != nil && !rep.Measured(req.OutputTokens > 0) {
		// Priced at the stand-ins, a slow worker can look as fast as the fastest until a poll measures
		// the requests now sent to it: at the next interval, that is up to an interval of mispricing.
		// A worker that only embeds is never caught decoding: its embeddings poke no poll for that.
		select {
		case ep.poke <- struct{}{}:
		default:
		}
	}
	return held
}

// minCost is the least price: a Candidate's zero cost means not priced.
const minCost = 1e-9

// priced sets c's price of req on this worker by the cost model from rep, the worker's fresh report
// at now (nil if none), cached of whose prompt tokens the worker holds; c.Inflight is the proxy's
// in-flight count to it. reportOnly prices it on the report as it came, without what happened since
// (inflight_correction off).
func (ep *endpoint) priced(rep *loadpolicy.Report, c *loadpolicy.Candidate, now time.Time, req loadpolicy.Request, cached int64, params *loadpolicy.CostParams, reportOnly bool) {
	if rep == nil || !rep.Priced() {
		return
	}
	var since loadpolicy.Since
	if !reportOnly {
		ep.sentSince(&since, rep, now.Sub(rep.Received), c.Inflight-rep.Inflight)
		since.Backlog = &ep.backlog
	}
	c.Cost = max(rep.Cost(req, cached, &since, params), minCost)
}

// fresh returns the endpoint's report if it is usable at now, or nil if missing, empty or stale.
func (ep *endpoint) fresh(now time.Time) *loadpolicy.Report {
	return monitor.FreshReport(ep.state.usable(), now, time.Duration(ep.staleness.Load()))
}

// scored sets c's signals from rep, the worker's fresh report (nil if none), and the requests started
// since it (none with reportOnly: inflight_correction off); c.Inflight is the proxy's in-flight count
// to the worker.
func scored(c *loadpolicy.Candidate, rep *loadpolicy.Report, reportOnly bool) {
	if rep == nil {
		return
	}
	c.Signals = rep.Signals()
	if !reportOnly && c.Inflight > rep.Inflight {
		c.Extra = c.Inflight - rep.Inflight
	}
}

// noteHost remembers the upstream's host so polls can record the proxy's in-flight count.
func (ep *endpoint) noteHost(h *reverseproxy.Host) {
	if h != nil && ep.host.Load() != h {
		ep.host.Store(h)
	}
}

// markSeen notes that the upstream was in a pool at ms; stored only when it changed, so that the
// Select calls of one clock tick do not write the same cache line over and over.
func (ep *endpoint) markSeen(ms int64) {
	if ep.seen.Load() != ms {
		ep.seen.Store(ms)
	}
}

// stampingFetcher records, with each report, how many requests the proxy had in flight to the
// worker when the worker measured its load; Select counts only the requests started since.
type stampingFetcher struct {
	monitor.Fetcher
	ep *endpoint
}

// fleetSpeed is what a policy's workers have reported of their decode speed: the cost model's
// stand-ins for a worker not yet measured. One per policy: two reverse_proxy blocks may serve models
// whose speeds differ tenfold. The fastest speed alone reported lately is optimistic
// on purpose: a worker priced at a slow stand-in would get no request, so never decode, so never be
// measured. The decode to prefill ratio, pooled over the workers' readings, prices instead a worker
// whose prefill speed is measured.
type fleetSpeed struct {
	fastest, ratio atomicFloat
	// fastestPrefill is the fastest prefill speed per rank measured lately, for the same reason: a
	// worker whose prefill is not measured is priced at no slower.
	fastestPrefill atomicFloat
	mu             sync.Mutex
	decode         loadpolicy.FleetDecode // guarded by mu; ratio is its PerPrefill
	// output is the mean answer the workers' reports measure (guarded by mu), meanOutput its Mean.
	output     loadpolicy.FleetOutput
	meanOutput atomicFloat
}

// fleetSpeedMemory is how much of the fastest speed each report keeps, so a fleet that lost its
// fastest worker forgets it within some tens of polls.
const fleetSpeedMemory = 0.98

// note notes rep, whose worker's previous report is prev (nil if none).
func (f *fleetSpeed) note(rep, prev *loadpolicy.Report) {
	alone := rep.DecodeAloneTokensPerSec()
	f.fastest.update(func(old float64) float64 { return max(alone, old*fleetSpeedMemory) })
	var prefill float64
	if speed, ok := rep.PrefillPerRankTokensPerSec(); ok {
		prefill = speed
	}
	f.fastestPrefill.update(func(old float64) float64 { return max(prefill, old*fleetSpeedMemory) })
	f.mu.Lock()
	f.decode.Add(rep)
	f.ratio.Store(f.decode.PerPrefill())
	f.output.Add(rep, prev)
	f.meanOutput.Store(f.output.Mean())
	f.mu.Unlock()
}

func (f *fleetSpeed) load() (fastest, ratio, fastestPrefill float64) {
	return f.fastest.Load(), f.ratio.Load(), f.fastestPrefill.Load()
}

func (f stampingFetcher) Fetch(ctx context.Context) (*loadpolicy.Report, error) {
	var before int64
	if h := f.ep.host.Load(); h != nil {
		before = int64(h.NumRequests())
	}
	var sent loadpolicy.SentTotals
	f.ep.sentTotals(&sent)
	rep, err := f.Fetcher.Fetch(ctx)
	if rep != nil {
		rep.Sent = sent
		var prevRep *loadpolicy.Report
		if prev := f.ep.state.Load(); prev != nil {
			prevRep = prev.Report
			rep.Follow(prevRep)
		}
		if fs := f.ep.fleets.Load(); fs != nil {
			for _, fleet := range *fs {
				fleet.note(rep, prevRep)
			}
		}
		// The worker measured somewhere between the two readings; the smaller one does not undercount
		// requests it could not have seen yet.
		rep.Inflight = before
		if h := f.ep.host.Load(); h != nil {
			rep.Inflight = min(before, int64(h.NumRequests()))
		}
	}
	return rep, err
}

func (f stampingFetcher) Close() error {
	if c, ok := f.Fetcher.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// register adds a reference to the endpoint spec describes for the upstream dialled at dial, creating
// and scheduling it on first use.
func (a *App) register(spec endpointSpec, dial string, fleet *fleetSpeed) (*endpoint, error) {
	if spec.interval <= 0 {
		spec.interval = a.interval
	}
	key := spec.key()
	a.mu.Lock()
	defer a.mu.Unlock()
	if ep, ok := a.endpoints[key]; ok {
		ep.refs++
		ep.upstreams[dial]++
		ep.joinFleetLocked(fleet)
		if int64(spec.interval) < ep.interval.Load() {
			ep.setInterval(a, spec.interval)
			a.monitor.SetInterval(key, spec.interval)
		}
		return ep, nil
	}
	fetcher, err := newFetcher(spec)
	if err != nil {
		return nil, err
	}
	val, _, err := states.LoadOrNew(key, func() (caddy.Destructor, error) { return new(sharedState), nil })
	if err != nil {
		_ = stampingFetcher{Fetcher: fetcher}.Close() // a gRPC fetcher holds a connection from New on
		return nil, err
	}
	ep := &endpoint{key: key, spec: spec, state: val.(*sharedState), refs: 1, upstreams: map[string]int{dial: 1},
		poke: make(chan struct{}, 1)}
	ep.joinFleetLocked(fleet)
	ep.setInterval(a, spec.interval)
	stamped := stampingFetcher{Fetcher: fetcher, ep: ep}
	err = a.monitor.Add(monitor.Target{
		Key:       key,
		Fetcher:   stamped,
		Interval:  spec.interval,
		Timeout:   a.timeoutFor(spec.interval),
		State:     &ep.state.State,
		Published: ep.state.refresh,
		// A worker new to this process is measured within an interval; one that an earlier config
		// polled has its measurements.
		WarmUp: ep.state.Load() == nil,
		Poke:   ep.poke,
	})
	if err != nil {
		_ = stamped.Close()
		releaseState(key)
		return nil, err
	}
	ep.series = newPollSeries(key, spec.transport) // before observePoll can look ep up (a.mu is held)
	a.endpoints[key] = ep
	a.logger.Debug("monitoring worker load", zap.String("endpoint", key), zap.Duration("interval", spec.interval))
	return ep, nil
}

func (ep *endpoint) setInterval(a *App, d time.Duration) {
	ep.interval.Store(int64(d))
	ep.staleness.Store(int64(a.staleAfterFor(d)))
	ep.state.refresh()
}

// unregister drops the reference register took for dial; the last one stops polling the endpoint.
func (a *App) unregister(ep *endpoint, dial string, fleet *fleetSpeed) {
	a.mu.Lock()
	cur, ok := a.endpoints[ep.key]
	if !ok || cur != ep {
		a.mu.Unlock()
		return
	}
	ep.refs--
	ep.leaveFleetLocked(fleet)
	if ep.upstreams[dial]--; ep.upstreams[dial] <= 0 {
		delete(ep.upstreams, dial)
	}
	last := ep.refs == 0
	if last {
		delete(a.endpoints, ep.key)
	}
	a.mu.Unlock()
	if last {
		// Its series go before the wait for its poller to stop, so that they leave the metrics with
		// the admin view; a poll that ends later finds no endpoint and counts nothing.
		releaseState(ep.key)
		a.monitor.Remove(ep.key)
	}
}

// releaseState drops a reference to the endpoint's shared state; the last one, once no config
// monitors the endpoint, also drops its metric series.
func releaseState(key string) {
	if deleted, _ := states.Delete(key); deleted {
		deletePollCounters(key)
	}
}

// upstreamsOfLocked returns the dial addresses of the upstreams ep measures, sorted; a.mu must be held.
func (a *App) upstreamsOfLocked(ep *endpoint) []string {
	return slices.Sorted(maps.Keys(ep.upstreams))
}

// upstreamsOf is upstreamsOfLocked for callers that do not hold a.mu.
func (a *App) upstreamsOf(ep *endpoint) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.upstreamsOfLocked(ep)
}

// loadAddress is the host:port to poll for an upstream dialled at dial, or an error when the dial
// address cannot name one worker (a unix socket, a port range, a placeholder).
func loadAddress(dial string, loadPort int) (string, error) {
	addr, err := caddy.ParseNetworkAddress(dial)
	if err != nil {
		return "", fmt.Errorf("upstream %q: %w", dial, err)
	}
	if addr.IsUnixNetwork() || addr.IsFdNetwork() {
		return "", fmt.Errorf("upstream %q: a socket upstream has no host to poll", dial)
	}
	if addr.PortRangeSize() != 1 {
		return "", fmt.Errorf("upstream %q: a port range is not one worker", dial)
	}
	port := addr.StartPort
	if loadPort > 0 {
		port = uint(loadPort)
	}
	return net.JoinHostPort(addr.Host, fmt.Sprint(port)), nil
}
