package caddymodule

import (
	"cmp"
	"math/rand/v2"
	"net/http"
	"path"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-sglang/caddy-sglang/affinity"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// Affinity modes.
const (
	affinityPrefix = "prefix"
	affinityHeader = "header"
)

// requestState is what the policy reads of one request, once: kept in the request's variables, so that
// a retry, whose body may be spent, is priced and keyed alike. One allocation holds all of it.
type requestState struct {
	size   loadpolicy.Request
	body   affinity.Request
	key    affinity.Key
	header [1]uint64 // a session header's key
}

// prefixState is a requestState with room for the key of a body of up to 16 KiB, which only `affinity
// prefix` takes; a longer body's key takes a slice of its own, as long as the body needs (room for
// affinity.MaxBlocks took every request's state from 0.8 to 2.4 KiB, and Select 5-15% longer).
type prefixState struct {
	requestState
	blocks [inlineBlocks]uint64
}

// inlineBlocks is how many blocks a prefixState holds in place: a 16 KiB prompt's.
const inlineBlocks = 64

// requestStateVar names the request variable that holds the request's *requestState.
const requestStateVar = "sglang_load.request"

// readRequest sizes r, and keys it when affinity is on: from the head of its body where the policy
// reads it (see read_body), else the prompt from Content-Length and the output from default_max_tokens.
// It returns nil, allocating nothing, when there is nothing to read and no key to take: a prefix key
// is in the body, and a session key is taken from a POST with a body only (a GET, such as a model
// list, carries no prompt to cache, and recording it would credit its worker with the session).
func (p *Policy) readRequest(r *http.Request) *requestState {
	limit := cmp.Or(p.ReadBody, defaultReadBody)
	posted := r.Method == http.MethodPost && hasBody(r)
	readBody := limit > 0 && posted && affinity.ShapeOf(r.URL.Path) != affinity.ShapeNone
	if !readBody && (p.Affinity != affinityHeader || !posted) {
		return nil
	}
	if st, ok := caddyhttp.GetVar(r.Context(), requestStateVar).(*requestState); ok {
		return st
	}
	var st *requestState
	if p.Affinity == affinityPrefix {
		ps := new(prefixState)
		st = &ps.requestState
		st.body.Blocks = ps.blocks[:0]
		if n := keyBlocks(r.ContentLength, limit); n > inlineBlocks {
			st.body.Blocks = make([]uint64, 0, n)
		}
	} else {
		st = new(requestState) // no blocks: Parse keys nothing
	}
	st.size = p.unreadSize(r)
	if readBody {
		affinity.ReadRequest(r, limit, &st.body)
		if st.body.PromptTokens > 0 {
			st.size.PromptTokens = st.body.PromptTokens
		}
		if st.body.DeclaredPromptTokens > 0 {
			st.size.PromptTokens = st.body.DeclaredPromptTokens
		}
		if st.body.MaxTokens > 0 {
			st.size.OutputTokens = st.body.MaxTokens
		}
		st.size = st.size.Bounded()
	}
	switch p.Affinity {
	case affinityPrefix:
		// A chat with an answer in its history is a conversation that continues: it follows its cache. A
		// chat's system prompt is shared from its first request.
		st.key = affinity.Key{Blocks: st.body.Blocks, BlockTokens: affinity.BlockTokens, PromptTokens: st.size.PromptTokens,
			Continues: st.body.Continues, SharedBlocks: st.body.SharedBlocks, PreviousBlocks: st.body.PreviousBlocks}
	case affinityHeader:
		// A session's earlier turns are cached where it went: all of this prompt but its new message,
		// which the model cannot know, so the whole prompt is credited. A prompt of unknown size (a
		// chunked body not read) is credited a token: its session's home takes a near tie.
		blocks := affinity.HeaderKey(r.Header.Get(p.AffinityHeader), st.header[:0])
		st.key = affinity.Key{Blocks: blocks, BlockTokens: max(st.size.PromptTokens, 1), PromptTokens: st.size.PromptTokens, Session: true, Continues: true}
	}
	caddyhttp.SetVar(r.Context(), requestStateVar, st)
	return st
}

// hasBody reports whether r carries a body, of whatever length.
func hasBody(r *http.Request) bool { return r.Body != nil && r.Body != http.NoBody }

// unknownLength reports whether r carries a body whose length no Content-Length says (chunked).
func unknownLength(r *http.Request) bool { return r.ContentLength < 0 && hasBody(r) }

// work is what a request asks of a worker, as the cost model prices it.
type work uint8

const (
	// workNone is answered without the model: a model list, a health check, a GetLoads call, tokenizing.
	// Counted as a generation of default_max_tokens, as once, each held its worker busy in the model
	// until the next poll.
	workNone work = iota
	// workPrefill is a prompt read and answered without decoding: embeddings, scores, reranking,
	// classification.
	workPrefill
	// workGenerate is a prompt prefilled and an answer decoded; what a request is when its path does
	// not say otherwise.
	workGenerate
)

// workOf is what r asks of a worker: no work unless it is a POST with a body. Over gRPC (HTTP/2 with a
// gRPC Content-Type), SGLang's scheduler generates for Generate, embeds for Embed and does no model
// work for its other methods, nor does the gRPC health service. Over HTTP the path says: a generation
// API, one that decodes nothing (prefillPaths), the tokenizer's routes; any other is a generation.
func workOf(r *http.Request) work {
	if r.Method != http.MethodPost || !hasBody(r) || r.ContentLength == 0 {
		return workNone
	}
	if r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") {
		service, method := path.Split(r.URL.Path)
		switch {
		case strings.HasSuffix(service, ".SglangScheduler/"):
			switch method {
			case "Generate":
				return workGenerate
			case "Embed":
				return workPrefill
			}
			return workNone
		case service == "/grpc.health.v1.Health/":
			return workNone
		}
		return workGenerate // another service's call, whose work is not known
	}
	if affinity.ShapeOf(r.URL.Path) != affinity.ShapeNone {
		return workGenerate
	}
	for _, p := range prefillPaths {
		if strings.HasSuffix(r.URL.Path, p) {
			return workPrefill
		}
	}
	if strings.HasSuffix(r.URL.Path, "/tokenize") || strings.HasSuffix(r.URL.Path, "/detokenize") {
		return workNone
	}
	return workGenerate
}

// prefillPaths end the paths of SGLang's APIs that read a prompt and decode nothing (/classify also
// ends /v1/classify).
var prefillPaths = [...]string{"/v1/embeddings", "/encode", "/v1/rerank", "/v1/score", "/classify"}

// noWork is the size of a request that asks no work (workNone): priced as a one-token answer, the wait
// on each worker, and counted in no totals. A request that asks work is never of this size: it
// decodes at least a token (max_tokens or default_max_tokens), or prefills at least one.
var noWork loadpolicy.Request

// keyBlocks is the most blocks a prefix key takes from a body of contentLength bytes (-1: unknown) of
// which limit are read.
func keyBlocks(contentLength int64, limit int) int {
	n := int64(limit)
	if contentLength >= 0 {
		n = min(n, contentLength)
	}
	return int(min((n+affinity.BlockBytes-1)/affinity.BlockBytes, affinity.MaxBlocks))
}

// unreadSize is r's size where its body is not read: the prompt from Content-Length, the output from
// default_max_tokens, or none for a request that decodes nothing (workPrefill, whose prompt is at least
// a token); Bounded, as every size the policy takes from a request.
func (p *Policy) unreadSize(r *http.Request) loadpolicy.Request {
	size := loadpolicy.Request{PromptTokens: unreadPrompt(r), OutputTokens: p.defaultMaxTokens()}
	if workOf(r) == workPrefill {
		size = loadpolicy.Request{PromptTokens: max(size.PromptTokens, 1)}
	}
	return size.Bounded()
}

// unreadPrompt is r's prompt tokens where its body is not read, from its Content-Length; Bounded.
func unreadPrompt(r *http.Request) int64 {
	return min(max(r.ContentLength, 0)/bytesPerToken, loadpolicy.MaxRequestTokens)
}

// sizeOf is the size of the request st was read from, r.
func (p *Policy) sizeOf(st *requestState, r *http.Request) loadpolicy.Request {
	if st != nil {
		return st.size
	}
	return p.unreadSize(r)
}

// selectByAffinity is Select with affinity on: each available upstream is priced by the cost model with
// the request's tokens cached there taken off its prefill, within the balance bound. A request without
// a key is chosen for as the cost metric chooses without affinity: pricing every upstream instead took
// 67 µs a request at 1,024 upstreams.
func (p *Policy) selectByAffinity(pool reverseproxy.UpstreamPool, x *poolIndex, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	st := p.readRequest(r)
	if st == nil || len(st.key.Blocks) == 0 {
		return p.selectByCost(pool, x, p.sizeOf(st, r), true, r, w)
	}
	c := candidatesPool.Get().(*affinityCandidates)
	defer candidatesPool.Put(c)
	c.reset(p, pool, x)
	c.size = st.size
	p.costParams(&c.params)
	c.look()
	st.key.Home = p.homes.Of(st.key)
	choice := p.affinityIndex.Choose(st.key, c, p.AffinityBalance)
	if choice.Index < 0 {
		return p.selectFallback(pool, r, w)
	}
	metrics.selectedByLoad.Inc(r)
	metrics.affinityOutcomes[choice.Outcome].Inc(r)
	if ep := c.endpoint(choice.Index); ep == nil || ep.placed(st.size, choice.CachedTokens, c.now, &c.params) {
		chosen, _, _ := c.Candidate(choice.Index)
		p.affinityIndex.Record(st.key.Blocks, chosen)
	}
	now := c.now.UnixMilli()
	p.sizes.gather(now, c.eps)
	p.homes.Note(st.key, now)
	if p.homes.Due(now) {
		workers := c.homeWorkers() // c goes back to its pool when Select returns
		go func() { metrics.homesMoved.Add(float64(p.homes.Place(workers, now))) }()
	}
	return pool[choice.Index]
}

// affinityCandidates are a pool's upstreams as affinity.Index.Choose sees them. The first len(cands)
// positions are looked up once per request: Choose asks for each one's worker and report more than once.
type affinityCandidates struct {
	poolView
	known []workerSlot // the static pool's workers by position (poolIndex.workers), else nil
	cands [64]affinityCandidate
	// meanWeight is the weight of positions past len(cands): the fleet's mean batch cap times its mean
	// prefill speed.
	meanWeight float64
}

type affinityCandidate struct {
	// worker is the zero Worker, which Choose skips, for an unavailable upstream; load is the proxy's
	// requests in flight to it.
	worker affinity.Worker
	load   float64
	// ep is the endpoint whose fresh report fresh found, and rep that report (nil if none): a priced
	// candidate's report is read for its cost and again for its cost alone.
	ep  *endpoint
	rep *loadpolicy.Report
	// weight is the worker's share of the keys (see look), and speed its lifetime prefill speed per
	// rank (0 if unknown), which look weighs it by.
	weight, speed float64
}

// candidatesPool keeps the candidates of a Select for the next one: they are 3.7 KiB, which a
// request would otherwise allocate and the collector trace.
var candidatesPool = sync.Pool{New: func() any { return new(affinityCandidates) }}

// reset makes c the pool as Select sees it now, with nothing looked up yet.
func (c *affinityCandidates) reset(p *Policy, pool reverseproxy.UpstreamPool, x *poolIndex) {
	clear(c.cands[:min(len(pool), len(c.cands))]) // look fills the positions it reads
	c.poolView, c.known, c.meanWeight = poolView{}, nil, 0
	c.init(p, pool, x)
	if x != nil {
		c.known = x.workers
	}
}

// look notes each position's worker and load, and its weight: one pass over the pool, which Choose's
// pass over every candidate then reads without looking again.
//
// A worker's weight, its share of the keys, is what it serves at once (its batch cap) times how fast
// it serves each (its lifetime prefill speed per rank, which the cost model's fleet ratio carries to
// decode too). Weighed by batch cap alone, the benchmark's 1x worker, at a quarter of the 4x one's
// batch and speed, was home to a seventh of the shared prefixes where it does a twenty-first of the
// work, and its decode made the p99. A worker whose report lacks either takes the fleet's mean of it;
// with no batch cap known, every worker weighs alike.
func (c *affinityCandidates) look() {
	n := min(len(c.pool), len(c.cands))
	now := c.now.UnixNano()
	var capSum, speedSum float64
	caps, speeds := 0, 0
	for i := range n {
		cand := &c.cands[i]
		if u := c.pool[i]; u.Available() {
			cand.worker, cand.load = c.workerOf(i), float64(u.NumRequests())
		}
		batchCap, speed := c.capacity(i, now)
		if batchCap > 0 {
			cand.weight = float64(batchCap)
			capSum += cand.weight
			caps++
		}
		if speed > 0 {
			cand.speed = speed
			speedSum += speed
			speeds++
		}
	}
	if caps == 0 {
		return
	}
	meanCap, meanSpeed := capSum/float64(caps), 1.0
	if speeds > 0 {
		meanSpeed = speedSum / float64(speeds)
	}
	c.meanWeight = meanCap * meanSpeed
	for i := range n {
		cand := &c.cands[i]
		cand.weight = cmp.Or(cand.weight, meanCap) * cmp.Or(cand.speed, meanSpeed)
	}
}

// capacity is upstream i's batch cap and lifetime prefill speed per rank from its fresh report, zeros
// if none: from the static pool's slot, without the report, where it has one.
func (c *affinityCandidates) capacity(i int, now int64) (int64, float64) {
	if c.byIndex != nil && c.byIndex[i] != nil {
		return c.slots[i].capacity(now)
	}
	if ep := c.endpoint(i); ep != nil {
		if rep := c.report(i, ep); rep != nil {
			return rep.MaxRunning, rep.LifetimePrefillPerRank
		}
	}
	return 0, 0
}

// homeWorkers is the pool as a placement of homes sees it.
func (c *affinityCandidates) homeWorkers() []affinity.HomeWorker {
	workers := make([]affinity.HomeWorker, len(c.pool))
	for i := range workers {
		w := &workers[i]
		w.Worker, _, w.Weight = c.Candidate(i)
		if ep := c.endpoint(i); ep != nil && w.Worker.ID != 0 {
			if rep := c.fresh(i, ep); rep != nil {
				w.Pool = rep.MaxTotalTokens
			}
		}
	}
	return workers
}

// fresh is ep's fresh report, ep being upstream i's endpoint, found once per Select.
func (c *affinityCandidates) fresh(i int, ep *endpoint) *loadpolicy.Report {
	if i >= len(c.cands) {
		return c.report(i, ep)
	}
	cand := &c.cands[i]
	if cand.ep != ep {
		cand.ep, cand.rep = ep, c.report(i, ep)
	}
	return cand.rep
}

func (c *affinityCandidates) Len() int { return len(c.pool) }

// Candidate is the upstream's worker, the zero Worker (which Choose skips) for an unavailable one; the
// proxy's requests in flight to it; and its share of the keys (see look), 0, which Choose counts as 1
// for every worker alike, when no fresh report has a batch cap. A position look noted is read from
// there.
func (c *affinityCandidates) Candidate(i int) (affinity.Worker, float64, float64) {
	if i < len(c.cands) {
		cand := &c.cands[i]
		return cand.worker, cand.load, cand.weight
	}
	var w affinity.Worker
	if u := c.pool[i]; u.Available() {
		w = c.workerOf(i)
	}
	return w, float64(c.pool[i].NumRequests()), c.meanWeight
}

// workerOf is upstream i's worker, kept by position for the static pool so that it is found without
// hashing the dial address.
func (c *affinityCandidates) workerOf(i int) affinity.Worker {
	if c.known == nil {
		return c.p.workerOf(c.pool[i].Dial)
	}
	if w, ok := c.known[i].load(); ok {
		return w
	}
	w := c.p.workerOf(c.pool[i].Dial)
	c.known[i].store(w)
	return w
}

func (c *affinityCandidates) Alone(i int) float64 {
	if ep := c.endpoint(i); ep != nil {
		if rep := c.fresh(i, ep); rep != nil {
			return rep.AloneCost(c.size, &c.params)
		}
	}
	return 0
}

func (c *affinityCandidates) Cost(i int, cached int64) (float64, bool) {
	ep, inflight, ok := c.upstream(i)
	if !ok || ep == nil {
		return 0, false
	}
	cand := loadpolicy.Candidate{Inflight: inflight}
	ep.priced(c.fresh(i, ep), &cand, c.now, c.size, cached, &c.params, c.p.noExtra)
	return cand.Cost, cand.Priced()
}

// workerOf is the affinity worker of the upstream dialled at dial, made on first use.
func (p *Policy) workerOf(dial string) affinity.Worker {
	if w, ok := (*p.workers.Load())[dial]; ok {
		return w
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	cur := *p.workers.Load()
	if w, ok := cur[dial]; ok {
		return w
	}
	w := p.affinityIndex.Worker(dial)
	next := make(map[string]affinity.Worker, len(cur)+1)
	for k, v := range cur {
		next[k] = v
	}
	next[dial] = w
	p.workers.Store(&next)
	if ep := (*p.endpoints.Load())[dial]; ep != nil {
		ep.indexed(p.affinityIndex, p.homes, w)
	}
	return w
}

// selectByCost is Select with the cost metric for a request of size: without affinity, or with it for a
// request without a key.
func (p *Policy) selectByCost(pool reverseproxy.UpstreamPool, x *poolIndex, size loadpolicy.Request, bodyRead bool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	var v poolView
	v.init(p, pool, x)
	v.size, v.r, v.bodyRead = size, r, bodyRead
	p.costParams(&v.params)
	idx, ok := loadpolicy.Choose(p.choice, p.metric, len(pool), v.priced, rand.IntN)
	if v.resized {
		// Priced by the Content-Length until a worker refused that: choose again, all at the body's size.
		idx, ok = loadpolicy.Choose(p.choice, p.metric, len(pool), v.priced, rand.IntN)
	}
	if !ok {
		return p.selectFallback(pool, r, w)
	}
	metrics.selectedByLoad.Inc(r)
	if p.affinityIndex != nil {
		metrics.affinityOutcomes[affinity.NoKey].Inc(r)
	}
	if ep := v.endpoint(idx); ep != nil && v.size != noWork {
		ep.placed(v.size, 0, v.now, &v.params)
	}
	p.sizes.gather(v.now.UnixMilli(), v.eps)
	return pool[idx]
}
