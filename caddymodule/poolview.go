package caddymodule

import (
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// poolView is a pool as one Select sees it: each upstream's endpoint, found by position in the static
// pool and by dial address in a dynamic one, and priced or scored as of now.
type poolView struct {
	p       *Policy
	pool    reverseproxy.UpstreamPool
	eps     map[string]*endpoint
	byIndex []*endpoint  // by position, for the static pool; else nil
	slots   []reportSlot // byIndex's reports
	now     time.Time
	// size and params price the request, with the cost metric.
	size   loadpolicy.Request
	params loadpolicy.CostParams
	// prompt is the request's prompt tokens, with the signal metrics: an upstream whose report says it
	// refuses so long a prompt is passed over. It is first what the Content-Length says (a chunked body,
	// as long as can be); past what an upstream takes, the body is read once (readBody) and prompt is
	// what its text says, since a base64 image counts bytes that are not prompt tokens.
	prompt   int64
	r        *http.Request
	bodyRead bool
	// resized says that the cost metric's size of the request changed when the body was read.
	resized bool
}

// init makes v the pool as Select sees it now; x is p.index if pool is the static one, else nil. In
// place: returning the view copied it twice, a sixth of a Select at 4 upstreams.
func (v *poolView) init(p *Policy, pool reverseproxy.UpstreamPool, x *poolIndex) {
	v.p, v.pool, v.eps, v.now = p, pool, *p.endpoints.Load(), clock.Now()
	if x != nil {
		v.byIndex, v.slots = x.eps, x.slots
	}
}

// endpoint is the endpoint of upstream i, nil if none is registered.
func (v *poolView) endpoint(i int) *endpoint {
	if v.byIndex != nil && v.byIndex[i] != nil {
		return v.byIndex[i]
	}
	return v.eps[v.pool[i].Dial]
}

// upstream returns upstream i's endpoint (nil for one that cannot be polled) and the proxy's in-flight
// count to it, and false when it is unavailable.
func (v *poolView) upstream(i int) (*endpoint, int64, bool) {
	u := v.pool[i]
	if !u.Available() {
		return nil, 0, false
	}
	if v.byIndex != nil && v.byIndex[i] != nil {
		return v.byIndex[i], int64(u.NumRequests()), true // its host was noted once, by poolIndex.noteHosts
	}
	return v.dynamic(u), int64(u.NumRequests()), true
}

// dynamic is the endpoint of an upstream that the static pool's index does not hold, registered on
// first sight; nil for one that cannot be polled.
func (v *poolView) dynamic(u *reverseproxy.Upstream) *endpoint {
	ep := v.eps[u.Dial]
	if ep == nil {
		ep = v.p.registerLate(u.Dial)
	}
	if ep != nil {
		ep.noteHost(u.Host)
	}
	return ep
}

// report is ep's fresh report, ep being upstream i's endpoint: from the static pool's slot if it
// holds ep.
func (v *poolView) report(i int, ep *endpoint) *loadpolicy.Report {
	if v.byIndex != nil && v.byIndex[i] == ep {
		return v.slots[i].fresh(v.now)
	}
	return ep.fresh(v.now)
}

// signals is upstream i for the signal metrics, and whether it is available and takes the request's
// prompt (loadpolicy.Choose's at).
func (v *poolView) signals(i int) (loadpolicy.Candidate, bool) {
	u := v.pool[i]
	if !u.Available() {
		return loadpolicy.Candidate{}, false
	}
	c := loadpolicy.Candidate{Inflight: int64(u.NumRequests())}
	var rep *loadpolicy.Report
	if v.byIndex != nil && v.byIndex[i] != nil { // upstream and report in one call: a pass calls this per upstream
		s := &v.slots[i] // reportSlot.fresh, spelt out: too large to inline
		rep = monitor.FreshReport(s.rep.Load(), v.now, time.Duration(s.staleAfter.Load()))
	} else if ep := v.dynamic(u); ep != nil {
		rep = ep.fresh(v.now)
	}
	if !rep.Admits(v.prompt) {
		// Too long for it by the Content-Length: the body says how long, once read.
		if v.readBody(); !rep.Admits(v.prompt) {
			return loadpolicy.Candidate{}, false // SGLang would refuse it there (400): another may take it
		}
	}
	scored(&c, rep, v.p.noExtra)
	return c, true
}

// readBody sizes the request from its body, once: its head read as the cost metric reads it (and put
// back for the upstream), else the Content-Length again (a body that is not read).
func (v *poolView) readBody() {
	if !v.bodyRead {
		v.bodyRead = true
		size := v.p.sizeOf(v.p.readRequest(v.r), v.r)
		v.resized = size != v.size
		v.size, v.prompt = size, size.PromptTokens
	}
}

// priced is upstream i with the cost model's price of the request, and whether it is available
// (loadpolicy.Choose's at).
func (v *poolView) priced(i int) (loadpolicy.Candidate, bool) {
	ep, inflight, ok := v.upstream(i)
	c := loadpolicy.Candidate{Inflight: inflight}
	if ep != nil {
		rep := v.report(i, ep)
		if !v.bodyRead && rep != nil && !rep.Admits(v.size.PromptTokens) {
			v.readBody() // too long for it by the Content-Length: the body says how long
		}
		ep.priced(rep, &c, v.now, v.size, 0, &v.params, v.p.noExtra)
	}
	return c, ok
}
