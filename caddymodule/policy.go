package caddymodule

import (
	"cmp"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-sglang/caddy-sglang/affinity"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

func init() {
	caddy.RegisterModule(new(Policy))
}

// Policy is the sglang_load selection policy: it sends each request to the upstream where it would
// take the least time (the cost metric, by default), or that has the most room by a load signal,
// according to the loads the sglang_load app polls from the SGLang workers, corrected by the proxy's
// own requests started since each report. With no fresh loads it falls back to another selection
// policy.
type Policy struct {
	// How to poll each upstream's load: `http` (GET /v1/loads?include=core) or `grpc`
	// (SglangScheduler.GetLoads). Default: http.
	LoadTransport string `json:"load_transport,omitempty"`

	// The port to poll loads on, when it differs from the proxied port. Default: the upstream's port.
	LoadPort int `json:"load_port,omitempty"`

	// Poll loads over TLS. Default: the reverse proxy's transport setting (TLS to the upstreams
	// means TLS to the load endpoint).
	LoadTLS *bool `json:"load_tls,omitempty"`

	// Skip verification of the load endpoint's TLS certificate. Default: false (verify).
	LoadTLSInsecureSkipVerify bool `json:"load_tls_insecure_skip_verify,omitempty"`

	// TLS settings of the load polls, with the fields of the http transport's `tls` settings (ca,
	// root_ca_pem_files, client_certificate_file and client_certificate_key_file, server_name,
	// insecure_skip_verify, ...), built the way the transport builds its own. Setting it turns load_tls
	// on. Default: the reverse proxy's http transport's TLS settings (tls_trust_pool,
	// tls_trusted_ca_certs, tls_client_auth, tls_server_name; not tls_insecure_skip_verify, see
	// load_tls_insecure_skip_verify) when it uses TLS, else Go's defaults (the system roots, no client
	// certificate).
	LoadTLSConfig *reverseproxy.TLSConfig `json:"load_tls_config,omitempty"`

	// A bearer token sent with each load poll, for workers started with --api-key. Placeholders such
	// as {env.SGLANG_API_KEY} are replaced once at provisioning. Never logged or shown.
	APIKey string `json:"api_key,omitempty"`

	// How often to poll this group's upstreams. Default: the app's interval.
	Interval caddy.Duration `json:"interval,omitempty"`

	// What to compare: cost (the time, in seconds, this request would take on each upstream: its wait,
	// prefill and decode, from the upstream's report projected to now), or one of the load signals: auto
	// (the most precise signal both upstreams report), queued_tokens, token_latency, token_usage,
	// used_tokens, waiting or running. Default: cost, which then reads a body only where the signal
	// metrics do (see read_body).
	Metric string `json:"metric,omitempty"`

	// How to pick: power_of_two (compare two random upstreams, take the less loaded), least (the least
	// loaded of all), window (the least loaded of up to 16: all of a small pool, 16 consecutive ones from
	// a random start in a larger one) or auto: window for the cost metric, power_of_two for the signals.
	// Default: auto.
	Choose string `json:"choose,omitempty"`

	// Output tokens the cost metric assumes for a request that does not say (max_tokens,
	// max_completion_tokens or sampling_params.max_new_tokens), or whose body it does not read; none for
	// one that decodes nothing, such as an embedding. Default: the mean answer the workers' reports
	// measure (the output tokens they decode per second over the requests they are sent per second),
	// 256 until some tens of requests are measured.
	DefaultMaxTokens int64 `json:"default_max_tokens,omitempty"`

	// Prefill speed, in prompt tokens/s per worker, that the cost metric assumes for a worker whose
	// reports do not measure it (total_prefill_uncached_tokens and total_prefill_busy_us). Default: the
	// fastest prefill per DP rank that any of this policy's workers measured lately times the worker's
	// ranks, and never less than 8000 (so that such a worker gets prompts, and is measured).
	PrefillTokensPerSec float64 `json:"prefill_tokens_per_sec,omitempty"`

	// Decode speed, in output tokens/s, of a request alone on a worker, that the cost metric assumes
	// for a worker not yet measured (until three reports caught it decoding: gen_throughput with running
	// requests, it is priced at no less than this). Default: the worker's measured prefill speed per
	// rank times the fleet's ratio of decode speed alone to prefill speed per rank; for a worker without
	// a prefill speed, the fastest that any worker has reported lately (so an unmeasured worker gets
	// requests and is measured) and never less than 50, 50 before any has. The fleet is this policy's
	// upstreams.
	DecodeTokensPerSec float64 `json:"decode_tokens_per_sec,omitempty"`

	// Route requests that share a prompt prefix (prefix: chat messages, a completion's prompt, /generate
	// text or input_ids) or a session (header: the value of AffinityHeader) to the worker that has
	// their tokens cached, while its price with those tokens taken off its prefill is the lowest (or
	// within 1.25 times of it: a near tie goes to the key's rendezvous order), and while it carries at
	// most affinity_balance times the mean load or the mean plus 8, whichever is more. Implies the cost
	// metric. Default: off.
	Affinity string `json:"affinity,omitempty"`

	// The request header that names the session, with affinity header.
	AffinityHeader string `json:"affinity_header,omitempty"`

	// How far above the fleet's mean in-flight count affinity may take a worker (as HAProxy's
	// hash-balance-factor; the mean plus 8 is always allowed). Default: 1.25.
	AffinityBalance float64 `json:"affinity_balance,omitempty"`

	// Memory cap of the index of which worker recently received which prompt blocks, in bytes.
	// Default: 16 MiB.
	AffinityIndexSize int `json:"affinity_index_size,omitempty"`

	// How much of a request's body the cost metric reads to size the request (its max_tokens and
	// prompt), in bytes: the head of the body, put back so the upstream receives the same bytes. Only
	// JSON bodies of /v1/chat/completions, /v1/completions and /generate without a Content-Encoding are
	// read. The signal metrics read it only when the Content-Length says the prompt is too long for a
	// worker, or when the body is chunked. -1: never read; the prompt is then estimated from
	// Content-Length and the output is default_max_tokens. Default: 65536, read only as the signal
	// metrics read it where metric, affinity and read_body are all left to their defaults.
	ReadBody int `json:"read_body,omitempty"`

	// How many more requests in a decoding batch halve each one's decode speed, for the cost metric:
	// it carries a worker's measured speed at one batch size to another. Default: 32.
	DecodeBatchHalving float64 `json:"decode_batch_halving,omitempty"`

	// How much of the time a request takes from the requests decoding beside it counts in its price,
	// for the cost metric, 0 to 1: 0 places each request where it finishes first, 1 where the fleet's
	// total time grows least. Default: 1, and 0 with affinity (its hit rates fell with 1; see the README).
	DelayToOthers *float64 `json:"delay_to_others,omitempty"`

	// Whether to count the proxy's own requests started since a worker's last report as load on it
	// (with the cost metric: to project the report to now). Off compares workers on their reports alone, so between two polls every request goes to the
	// worker that looked least loaded; it is there for benchmarks and diagnosis. Default: true (on).
	InflightCorrection *bool `json:"inflight_correction,omitempty"`

	// The selection policy used when no available upstream has fresh loads, or when every one says it
	// refuses the request's prompt (too long for its KV pool). Default: least_conn.
	FallbackRaw json.RawMessage `json:"fallback,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`

	fallback reverseproxy.Selector
	metric   loadpolicy.Metric
	choice   loadpolicy.Choice
	noExtra  bool // inflight_correction off
	costs    loadpolicy.CostParams
	// affinityIndex is nil with affinity off; workers are its workers by upstream dial address.
	affinityIndex *affinity.Index
	homes         *affinity.Homes // where keys that crowd their first worker's cache go
	workers       atomic.Pointer[map[string]affinity.Worker]
	sizes         requestSizes // mean sizes of recent requests, for the cost model
	fleet         fleetSpeed   // what this policy's workers reported of their speeds

	spec   endpointSpec // template for this group's endpoints; address set per upstream
	app    *App
	logger *zap.Logger

	mu        sync.Mutex                           // serialises registration
	endpoints atomic.Pointer[map[string]*endpoint] // by upstream dial address; copy on write
	late      map[string]struct{}                  // dial addresses first seen in Select; guarded by mu
	marked    atomic.Int64                         // Unix ms of Select's last pass over a dynamic pool
	markEvery int64                                // ms between those passes
	// forgetAfter is how long a dynamic upstream stays registered unseen (App.ForgetAfter).
	forgetAfter time.Duration
	index       atomic.Pointer[poolIndex] // the static pool's endpoints by position
	skipped     sync.Map                  // dial addresses that cannot be polled, logged once
}

// CaddyModule returns the Caddy module information.
func (*Policy) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.sglang_load",
		New: func() caddy.Module { return new(Policy) },
	}
}

// Provision checks the options, loads the fallback policy and registers the parent reverse proxy's
// static upstreams with the sglang_load app.
func (p *Policy) Provision(ctx caddy.Context) error {
	p.logger = ctx.Logger()
	if err := p.parseOptions(); err != nil {
		return err
	}
	p.makeAffinityIndex()
	if p.FallbackRaw == nil {
		p.FallbackRaw = caddyconfig.JSONModuleObject(reverseproxy.LeastConnSelection{}, "policy", "least_conn", nil)
	}
	mod, err := ctx.LoadModule(p, "FallbackRaw")
	if err != nil {
		return fmt.Errorf("loading fallback selection policy: %w", err)
	}
	p.fallback = mod.(reverseproxy.Selector)

	appIface, err := ctx.App("sglang_load")
	if err != nil {
		return fmt.Errorf("getting sglang_load app: %w", err)
	}
	p.app = appIface.(*App)
	p.endpoints.Store(&map[string]*endpoint{})
	p.late = make(map[string]struct{})
	p.forgetAfter = p.app.forgetAfterFor(cmp.Or(p.spec.interval, p.app.interval))
	p.markEvery = min(p.forgetAfter/4, maxMarkEvery).Milliseconds()
	p.app.addSweeper(p)

	handler := parentHandler(ctx)
	if handler == nil {
		return nil
	}
	transport, _ := handler.Transport.(*reverseproxy.HTTPTransport)
	if p.LoadTLS == nil && transport != nil && transport.TLSEnabled() {
		p.spec.tls = true
	}
	if err := p.provisionTLS(ctx, transport); err != nil {
		return err
	}
	for _, u := range handler.Upstreams {
		if strings.Contains(u.Dial, "{") {
			continue // a placeholder: registered per address on first sight in Select
		}
		if _, err := p.register(u.Dial, false); err != nil {
			return err
		}
	}
	p.index.Store(newPoolIndex(handler.Upstreams, *p.endpoints.Load()))
	return nil
}

// provisionTLS gives the polls the TLS config of load_tls_config, built by Caddy's own construction
// (TLSConfig.MakeTLSClientConfig), else the one the proxy's transport built for itself.
func (p *Policy) provisionTLS(ctx caddy.Context, transport *reverseproxy.HTTPTransport) error {
	if !p.spec.tls {
		return nil
	}
	var cfg *tls.Config
	switch {
	case p.LoadTLSConfig != nil:
		var err error
		if cfg, err = p.LoadTLSConfig.MakeTLSClientConfig(ctx); err != nil {
			return fmt.Errorf("load_tls_config: %w", err)
		}
	case transport != nil && transport.TLS != nil && transport.Transport != nil && transport.Transport.TLSClientConfig != nil:
		cfg = transport.Transport.TLSClientConfig.Clone()
		// The proxy's opt-out of verification does not carry over: polls skip it only with
		// load_tls_insecure_skip_verify, so that a load port is never left unverified unawares.
		cfg.InsecureSkipVerify = false
	}
	if cfg != nil && strings.Contains(cfg.ServerName, "{") {
		cfg.ServerName = "" // a per-request placeholder: a poll is no request, so verify the polled host
	}
	p.spec.tlsConfig = cfg
	return nil
}

// parseOptions validates the options and fills the parsed fields, with an error naming the option
// and its value.
func (p *Policy) parseOptions() error {
	p.spec = endpointSpec{
		transport:          p.LoadTransport,
		apiKey:             caddy.NewReplacer().ReplaceKnown(p.APIKey, ""),
		interval:           time.Duration(p.Interval),
		insecureSkipVerify: p.LoadTLSInsecureSkipVerify,
	}
	switch p.LoadTransport {
	case "":
		p.spec.transport = transportHTTP
	case transportHTTP, transportGRPC:
	default:
		return fmt.Errorf("load_transport: unknown transport %q: want http or grpc", p.LoadTransport)
	}
	if p.LoadPort < 0 || p.LoadPort > 65535 {
		return fmt.Errorf("load_port: %d is not a port number", p.LoadPort)
	}
	if p.Interval < 0 {
		return fmt.Errorf("interval: must be > 0, got %s", time.Duration(p.Interval))
	}
	if p.LoadTLS != nil {
		p.spec.tls = *p.LoadTLS
	}
	if p.LoadTLSConfig != nil {
		if p.LoadTLS != nil && !*p.LoadTLS {
			return errors.New("load_tls_config: set while load_tls is off")
		}
		p.spec.tls = true
	}
	var err error
	if p.metric, err = loadpolicy.ParseMetric(cmp.Or(p.Metric, loadpolicy.MetricCost.String())); err != nil {
		return fmt.Errorf("metric: %w", err)
	}
	if p.choice, err = loadpolicy.ParseChoice(p.Choose); err != nil {
		return fmt.Errorf("choose: %w", err)
	}
	p.noExtra = p.InflightCorrection != nil && !*p.InflightCorrection
	switch {
	case p.DefaultMaxTokens < 0:
		return fmt.Errorf("default_max_tokens: must be > 0, got %d", p.DefaultMaxTokens)
	case p.PrefillTokensPerSec < 0 || math.IsNaN(p.PrefillTokensPerSec) || math.IsInf(p.PrefillTokensPerSec, 0):
		return fmt.Errorf("prefill_tokens_per_sec: must be a finite number > 0, got %v", p.PrefillTokensPerSec)
	case p.DecodeTokensPerSec < 0 || math.IsNaN(p.DecodeTokensPerSec) || math.IsInf(p.DecodeTokensPerSec, 0):
		return fmt.Errorf("decode_tokens_per_sec: must be a finite number > 0, got %v", p.DecodeTokensPerSec)
	case p.ReadBody < -1:
		return fmt.Errorf("read_body: want a size in bytes, or -1 for never, got %d", p.ReadBody)
	case p.DecodeBatchHalving != 0 && !(p.DecodeBatchHalving >= 1) || math.IsInf(p.DecodeBatchHalving, 0):
		return fmt.Errorf("decode_batch_halving: must be a finite number >= 1, got %v", p.DecodeBatchHalving)
	case p.DelayToOthers != nil && !(*p.DelayToOthers >= 0 && *p.DelayToOthers <= 1):
		return fmt.Errorf("delay_to_others: must be a number from 0 to 1, got %v", *p.DelayToOthers)
	}
	d := defaultCostParams()
	p.costs = loadpolicy.CostParams{
		PrefillTokensPerSec: cmp.Or(p.PrefillTokensPerSec, d.PrefillTokensPerSec),
		DecodeTokensPerSec:  cmp.Or(p.DecodeTokensPerSec, d.DecodeTokensPerSec),
		DecodeBatchHalving:  cmp.Or(p.DecodeBatchHalving, d.DecodeBatchHalving),
		MeanOutputTokens:    float64(p.defaultMaxTokens()),
		DelayToOthers:       p.delayToOthers(),
		// With affinity the uncached tokens sent are estimates from the index; the worker prefilling
		// more reads as other senders and made affinity yield: hit rate 0.93 of the ideal against 0.99
		// (results/2026-12-05/affinity-senders.md).
		OtherSenders: p.Affinity == "",
	}
	p.sizes.out.Store(float64(p.defaultMaxTokens()))
	return p.parseAffinity()
}

// parseAffinity checks the affinity options; affinity makes the index and implies the cost metric.
func (p *Policy) parseAffinity() error {
	switch p.Affinity {
	case "":
		return nil
	case affinityPrefix:
	case affinityHeader:
		if p.AffinityHeader == "" {
			return fmt.Errorf("affinity: header needs a header name")
		}
	default:
		return fmt.Errorf("affinity: unknown mode %q: want prefix or header", p.Affinity)
	}
	switch {
	case p.Metric != "" && p.Metric != loadpolicy.MetricCost.String():
		return fmt.Errorf("metric: affinity prices requests with the cost metric, got %q", p.Metric)
	case p.AffinityBalance != 0 && !(p.AffinityBalance >= 1) || math.IsInf(p.AffinityBalance, 0):
		return fmt.Errorf("affinity_balance: must be a finite number >= 1, got %v", p.AffinityBalance)
	case p.AffinityIndexSize < 0:
		return fmt.Errorf("affinity_index_size: must be > 0, got %d", p.AffinityIndexSize)
	}
	p.metric = loadpolicy.MetricCost
	return nil
}

// makeAffinityIndex makes the affinity index when affinity is on; at provisioning, not at parsing,
// since the index takes its memory cap up front.
func (p *Policy) makeAffinityIndex() {
	empty := map[string]affinity.Worker{}
	p.workers.Store(&empty)
	if p.Affinity != "" {
		p.affinityIndex = affinity.NewIndex(p.AffinityIndexSize)
		p.homes = affinity.NewHomes()
	}
}

// Defaults of the cost model's stand-ins.
const (
	defaultMaxTokens           = 256
	defaultPrefillTokensPerSec = 8000
	defaultDecodeTokensPerSec  = 50
	defaultDecodeBatchHalving  = 32
	defaultDelayToOthers       = 1
	defaultReadBody            = 64 << 10
)

// costParams sets params to the cost model's stand-ins for this Select: the options, the mean output
// size of recent requests, and the fleet's decode speeds for a worker not yet measured. In place:
// returning them copied 64 bytes twice, 5% of a Select with the cost metric at 4 upstreams.
func (p *Policy) costParams(params *loadpolicy.CostParams) {
	*params = p.costs
	params.MeanOutputTokens = p.sizes.out.Load()
	if mean := p.sizes.prompt.Load(); mean > 0 {
		params.ResidualPromptTokens = p.sizes.promptSq.Load() / (2 * mean)
	}
	if p.app == nil {
		return
	}
	fastest, ratio, fastestPrefill := p.fleet.load()
	if p.DecodeTokensPerSec == 0 {
		params.DecodeTokensPerSec, params.DecodePerPrefill = max(params.DecodeTokensPerSec, fastest), ratio
	}
	if p.PrefillTokensPerSec == 0 {
		params.PrefillPerRankFloor = fastestPrefill
	}
}

// defaultCostParams are the cost model's stand-ins with every option at its default, pricing a
// request alone (no delay to others): what it would take on the worker.
func defaultCostParams() loadpolicy.CostParams {
	return loadpolicy.CostParams{PrefillTokensPerSec: defaultPrefillTokensPerSec, DecodeTokensPerSec: defaultDecodeTokensPerSec,
		DecodeBatchHalving: defaultDecodeBatchHalving, MeanOutputTokens: defaultMaxTokens}
}

// delayToOthers is the option, else its default. Pricing the delay a request brings its batch sends
// work where the fleet's total time grows least: at 24/s it took p50 from 1.09× least_conn to 0.97×,
// p99 kept (results/2026-12-05/quality-others.md). With affinity it makes a key's home, usually
// busier than the fleet's mean, dearer, and hit rates fell from 0.91–0.96 of the ideal to 0.84–0.88
// (results/2026-12-04/affinity-delay.md), so affinity prices a request alone.
func (p *Policy) delayToOthers() float64 {
	switch {
	case p.DelayToOthers != nil:
		return *p.DelayToOthers
	case p.Affinity != "":
		return 0
	}
	return defaultDelayToOthers
}

func (p *Policy) defaultMaxTokens() int64 {
	if p.DefaultMaxTokens > 0 {
		return p.DefaultMaxTokens
	}
	if m := p.fleet.meanOutput.Load(); m >= 1 {
		return min(int64(math.Round(m)), loadpolicy.MaxRequestTokens)
	}
	return defaultMaxTokens
}

// sizesFromBody reports whether the cost metric reads each request's body to size it. The default
// policy (metric, affinity and read_body unset) reads it only where the signal metrics do, where the
// Content-Length says a worker would refuse the prompt or the body is chunked: the default leaves the
// client's body alone, and unread the cost metric keeps most of its win (p99 0.41× least_conn against
// 0.39× at 24/s, results/2026-12-07/quality-unread.md).
func (p *Policy) sizesFromBody() bool {
	return p.ReadBody > 0 || p.ReadBody == 0 && (p.Metric != "" || p.Affinity != "")
}

// parentHandler is the reverse proxy handler being provisioned around this policy, if any.
func parentHandler(ctx caddy.Context) *reverseproxy.Handler {
	mods := ctx.Modules()
	for i := len(mods) - 1; i >= 0; i-- {
		if h, ok := mods[i].(*reverseproxy.Handler); ok {
			return h
		}
	}
	return nil
}

// maxMarkEvery bounds how long Select waits between passes over a dynamic pool (a quarter of
// forget_after when shorter): a pass registers addresses that power-of-two has not sampled yet, so
// they are polled at once, and marks the known ones seen.
const maxMarkEvery = time.Second

// register starts monitoring the upstream dialled at dial, once per policy. A late registration is of
// an upstream first seen in Select, which is forgotten once it is unseen for forget_after.
func (p *Policy) register(dial string, late bool) (*endpoint, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur := *p.endpoints.Load()
	if ep, ok := cur[dial]; ok {
		return ep, nil
	}
	spec := p.spec
	addr, err := loadAddress(dial, p.LoadPort)
	if err != nil {
		return nil, err
	}
	spec.address = addr
	ep, err := p.app.register(spec, dial, &p.fleet)
	if err != nil {
		return nil, err
	}
	if st := ep.state.Load(); st != nil && st.Report != nil {
		p.fleet.note(st.Report, nil) // a worker another config measured: its speed is known before our first poll
	}
	if late {
		ep.markSeen(clock.Now().UnixMilli())
		p.late[dial] = struct{}{}
	}
	next := maps.Clone(cur)
	next[dial] = ep
	p.endpoints.Store(&next)
	return ep, nil
}

// Select picks an available upstream by load; see Policy.
func (p *Policy) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	x := p.index.Load().of(pool)
	if x == nil {
		p.markPool(pool, clock.Now()) // a dynamic pool: register new addresses, mark known ones seen
	} else {
		x.noteHosts()
	}
	switch {
	case (p.affinityIndex != nil || p.metric.Cost()) && workOf(r) == workNone:
		return p.selectByCost(pool, x, noWork, true, r, w)
	case p.affinityIndex != nil:
		return p.selectByAffinity(pool, x, r, w)
	case p.metric.Cost():
		var st *requestState
		read := p.sizesFromBody() || unknownLength(r)
		if read {
			st = p.readRequest(r)
		}
		return p.selectByCost(pool, x, p.sizeOf(st, r), read, r, w)
	}
	var v poolView
	v.init(p, pool, x)
	v.prompt, v.r = unreadPrompt(r), r // the signals weigh no output, and need not know the work
	if unknownLength(r) {
		v.prompt = loadpolicy.MaxRequestTokens // a chunked body's size is unknown: past any pool, until read
	}
	// When every available upstream refuses the prompt, the fallback sends it to one, whose refusal
	// the client then reads.
	idx, byLoad := loadpolicy.Choose(p.choice, p.metric, len(pool), v.signals, rand.IntN)
	if byLoad {
		metrics.selectedByLoad.Inc(r)
		return pool[idx]
	}
	return p.selectFallback(pool, r, w)
}

// selectFallback asks the fallback policy, when no available upstream has loads to choose on.
func (p *Policy) selectFallback(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	u := p.fallback.Select(pool, r, w)
	if u == nil {
		metrics.selectedNone.Inc(r)
	} else {
		metrics.selectedByFallback.Inc(r)
	}
	return u
}

// bytesPerToken is the prompt's bytes per token where only the body's length is known.
const bytesPerToken = 4

// atomicFloat is a float64 that concurrent writers update without losing one another's changes.
type atomicFloat struct{ bits atomic.Uint64 }

func (a *atomicFloat) Load() float64   { return math.Float64frombits(a.bits.Load()) }
func (a *atomicFloat) Store(v float64) { a.bits.Store(math.Float64bits(v)) }

// update sets the value to next(the value), retrying when another writer came between.
func (a *atomicFloat) update(next func(old float64) float64) {
	for {
		bits := a.bits.Load()
		if a.bits.CompareAndSwap(bits, math.Float64bits(next(math.Float64frombits(bits)))) {
			return
		}
	}
}

// registerLate registers an upstream first seen in Select (a dynamic upstream); it logs once and
// returns nil for one that cannot be polled.
func (p *Policy) registerLate(dial string) *endpoint {
	if _, bad := p.skipped.Load(dial); bad {
		return nil
	}
	ep, err := p.register(dial, true)
	switch {
	case errors.Is(err, monitor.ErrRegistered):
		return nil // forgotten as it came back, its poller not yet stopped: the next pass registers it
	case errors.Is(err, monitor.ErrClosed):
		return nil // a request a reload left running, new to this replaced config: routed without its load
	}
	if err != nil {
		p.skipped.Store(dial, struct{}{})
		p.logger.Warn("not monitoring upstream load", zap.String("upstream", dial), zap.Error(err))
		return nil
	}
	return ep
}

// markPool marks every upstream of a dynamic pool seen, and registers the new ones, at most once
// every markEvery: a walk over the pool, without allocating unless an address is new.
func (p *Policy) markPool(pool reverseproxy.UpstreamPool, now time.Time) {
	ms := now.UnixMilli()
	last := p.marked.Load()
	if ms-last < p.markEvery || !p.marked.CompareAndSwap(last, ms) {
		return
	}
	eps := *p.endpoints.Load()
	for _, u := range pool {
		if ep := eps[u.Dial]; ep != nil {
			ep.markSeen(ms)
		} else {
			p.registerLate(u.Dial)
		}
	}
}

// sweep forgets the dynamic upstreams absent from the pools Select was offered over the last
// forget_after: their polling stops, and they leave the admin view and the metrics once no other policy
// or config monitors them. The span is measured up to Select's last pass, not to now, so a proxy
// without traffic keeps polling the addresses it last saw.
func (p *Policy) sweep(now time.Time) {
	limit := p.marked.Load() - p.forgetAfter.Milliseconds()
	p.mu.Lock()
	cur := *p.endpoints.Load()
	var gone []string
	for dial := range p.late {
		if ep := cur[dial]; ep == nil || ep.seen.Load() < limit {
			gone = append(gone, dial)
		}
	}
	if len(gone) == 0 {
		p.mu.Unlock()
		return
	}
	next := maps.Clone(cur)
	for _, dial := range gone {
		delete(next, dial)
		delete(p.late, dial)
	}
	p.endpoints.Store(&next)
	p.mu.Unlock()
	for _, dial := range gone {
		if ep := cur[dial]; ep != nil {
			p.app.unregister(ep, dial, &p.fleet)
			p.logger.Info("forgetting upstream that left the pool", zap.String("upstream", dial),
				zap.String("endpoint", ep.key), zap.Duration("unseen_for", now.Sub(time.UnixMilli(ep.seen.Load())).Round(time.Millisecond)))
		}
	}
}

// Cleanup stops monitoring this policy's upstreams.
func (p *Policy) Cleanup() error {
	if p.app == nil {
		return nil
	}
	p.app.removeSweeper(p)
	p.mu.Lock()
	// The endpoints stay for the requests a reload left running, which may still retry: they read
	// the last reports, which the next config goes on updating for the workers it keeps polling.
	eps := p.endpoints.Load()
	if x := p.index.Swap(nil); x != nil {
		x.release()
	}
	clear(p.late)
	p.mu.Unlock()
	if eps != nil {
		for dial, ep := range *eps {
			p.app.unregister(ep, dial, &p.fleet)
		}
	}
	return nil
}

// Interface guards.
var (
	_ reverseproxy.Selector = (*Policy)(nil)
	_ caddy.Provisioner     = (*Policy)(nil)
	_ caddy.CleanerUpper    = (*Policy)(nil)
)
