package sglangsim

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// processStart anchors ts_tic, which SGLang takes from a monotonic clock (time.perf_counter()).
var processStart = time.Now()

// sections are the optional per-rank sections a load request asked for. spec, lora and disagg are
// accepted but never sent: the simulator has no speculative decoding, LoRA or disaggregation, and
// SGLang leaves a section out when its feature is off.
type sections struct{ memory, queues bool }

// parseInclude parses the include values (each a comma list); none means all.
func parseInclude(values []string) (sections, error) {
	var s sections
	seen := false
	for _, v := range values {
		for _, tok := range strings.Split(v, ",") {
			tok = strings.TrimSpace(tok)
			if tok == "" {
				continue
			}
			seen = true
			switch tok {
			case "core", "spec", "lora", "disagg":
			case "memory":
				s.memory = true
			case "queues":
				s.queues = true
			case "all":
				s.memory, s.queues = true, true
			default:
				return s, fmt.Errorf("unknown include %q: want a comma list of core, memory, spec, lora, disagg, queues, all", tok)
			}
		}
	}
	if !seen {
		s.memory, s.queues = true, true
	}
	return s, nil
}

// selectRanks returns the loads of one rank (dpRank >= 0) or all of them.
func selectRanks(all []RankLoad, dpRank int) ([]RankLoad, error) {
	if dpRank < 0 {
		return all, nil
	}
	if dpRank >= len(all) {
		return nil, fmt.Errorf("dp_rank %d out of range [0, %d)", dpRank, len(all))
	}
	return all[dpRank : dpRank+1], nil
}

// Simulated memory figures of a Llama-3-8B-like model in bf16.
const (
	weightGB        = 14.96
	graphGB         = 0.62
	kvBytesPerToken = 128 << 10 // 32 layers × 8 KV heads × 128 dims × (K+V) × 2 bytes
)

type loadsJSON struct {
	Timestamp       string         `json:"timestamp"`
	Version         string         `json:"version"`
	Accelerator     string         `json:"accelerator"`
	NumAccelerators int            `json:"num_accelerators"`
	DPRankCount     *int           `json:"dp_rank_count,omitempty"`
	Loads           []rankJSON     `json:"loads"`
	Aggregate       *aggregateJSON `json:"aggregate,omitempty"`
}

type rankJSON struct {
	DPRank                   int         `json:"dp_rank"`
	NumRunningReqs           int         `json:"num_running_reqs"`
	NumWaitingReqs           int         `json:"num_waiting_reqs"`
	NumTotalReqs             *int        `json:"num_total_reqs,omitempty"`
	NumWaitingUncachedTokens *int64      `json:"num_waiting_uncached_tokens,omitempty"`
	NumUsedTokens            int64       `json:"num_used_tokens"`
	NumTotalTokens           int64       `json:"num_total_tokens"`
	MaxTotalNumTokens        int64       `json:"max_total_num_tokens"`
	MaxRunningRequests       int         `json:"max_running_requests"`
	TokenUsage               float64     `json:"token_usage"`
	GenThroughput            float64     `json:"gen_throughput"`
	CacheHitRate             float64     `json:"cache_hit_rate"`
	Utilization              float64     `json:"utilization"`
	Timestamp                *float64    `json:"timestamp,omitempty"`
	TotalPrefillUncached     *int64      `json:"total_prefill_uncached_tokens,omitempty"`
	TotalPrefillBusyUs       *int64      `json:"total_prefill_busy_us,omitempty"`
	Memory                   *memoryJSON `json:"memory,omitempty"`
	Queues                   *queuesJSON `json:"queues,omitempty"`
}

type memoryJSON struct {
	WeightGB      float64 `json:"weight_gb"`
	KVCacheGB     float64 `json:"kv_cache_gb"`
	GraphGB       float64 `json:"graph_gb"`
	TokenCapacity int64   `json:"token_capacity"`
}

type queuesJSON struct {
	Waiting   int `json:"waiting"`
	Grammar   int `json:"grammar"`
	Paused    int `json:"paused"`
	Retracted int `json:"retracted"`
}

type aggregateJSON struct {
	TotalRunningReqs int     `json:"total_running_reqs"`
	TotalWaitingReqs int     `json:"total_waiting_reqs"`
	TotalReqs        int     `json:"total_reqs"`
	AvgTokenUsage    float64 `json:"avg_token_usage"`
	AvgThroughput    float64 `json:"avg_throughput"`
	AvgUtilization   float64 `json:"avg_utilization"`
	TotalUsedTokens  int64   `json:"total_used_tokens"`
	TotalTokens      int64   `json:"total_tokens"`
}

func aggregate(loads []RankLoad) aggregateJSON {
	var a aggregateJSON
	for _, l := range loads {
		a.TotalRunningReqs += l.Running
		a.TotalWaitingReqs += l.Waiting
		a.AvgTokenUsage += l.TokenUsage
		a.AvgThroughput += l.GenThroughput
		a.AvgUtilization += l.Utilization
		a.TotalUsedTokens += l.UsedTokens
		a.TotalTokens += l.TotalTokens
	}
	a.TotalReqs = a.TotalRunningReqs + a.TotalWaitingReqs
	if n := float64(len(loads)); n > 0 {
		a.AvgTokenUsage = round(a.AvgTokenUsage/n, 4)
		a.AvgThroughput = round(a.AvgThroughput/n, 2)
		a.AvgUtilization = round(a.AvgUtilization/n, 4)
	}
	return a
}

func (w *Worker) loadsBody(loads []RankLoad, sec sections, now time.Time) loadsJSON {
	body := loadsJSON{
		Timestamp:       isoTime(now),
		Version:         w.cfg.Version,
		Accelerator:     "sim",
		NumAccelerators: w.cfg.DPRanks,
		Loads:           make([]rankJSON, len(loads)),
	}
	stamp := round(float64(now.UnixMicro())/1e6, 6)
	for i := range loads {
		l := &loads[i]
		r := rankJSON{
			DPRank:             l.DPRank,
			NumRunningReqs:     l.Running,
			NumWaitingReqs:     l.Waiting,
			NumUsedTokens:      l.UsedTokens,
			NumTotalTokens:     l.TotalTokens,
			MaxTotalNumTokens:  l.MaxTotalTokens,
			MaxRunningRequests: l.MaxRunning,
			TokenUsage:         l.TokenUsage,
			GenThroughput:      l.GenThroughput,
			CacheHitRate:       l.CacheHitRate,
			Utilization:        l.Utilization,
		}
		if w.cfg.LegacyShape {
			total := l.Running + l.Waiting
			r.NumTotalReqs = &total
		} else {
			uncached := l.WaitingUncachedTokens
			r.NumWaitingUncachedTokens = &uncached
			r.Timestamp = &stamp
			if !w.cfg.OmitPrefillCounters {
				r.TotalPrefillUncached, r.TotalPrefillBusyUs = &l.PrefillUncachedTokens, &l.PrefillBusyMicros
			}
		}
		if sec.memory {
			r.Memory = &memoryJSON{
				WeightGB:      weightGB,
				KVCacheGB:     round(float64(l.MaxTotalTokens)*kvBytesPerToken/(1<<30), 2),
				GraphGB:       graphGB,
				TokenCapacity: l.MaxTotalTokens,
			}
		}
		if sec.queues {
			r.Queues = &queuesJSON{Waiting: l.Waiting, Retracted: int(l.Retracted)}
		}
		body.Loads[i] = r
	}
	if w.cfg.LegacyShape {
		n := w.cfg.DPRanks
		agg := aggregate(loads)
		body.DPRankCount, body.Aggregate = &n, &agg
	}
	return body
}

// isoTime formats t like Python's datetime.isoformat() on an aware UTC time.
func isoTime(t time.Time) string {
	return t.UTC().Format("2006-01-02T15:04:05.000000-07:00")
}

// waitHang blocks while the HangLoads fault is on; it returns false if ctx ended first.
func (w *Worker) waitHang(ctx context.Context) bool {
	c := w.faults.hangChan()
	if c == nil {
		return true
	}
	w.faults.hung.Add(1)
	defer w.faults.hung.Add(-1)
	select {
	case <-c:
		return true
	case <-ctx.Done():
		return false
	}
}

// garbageBody is what a broken worker or a captive portal might answer instead of JSON.
const garbageBody = "<html><body>502 upstream \x00\x01 {\"loads\": [ garbage"

// handleLoads serves GET /v1/loads.
func (w *Worker) handleLoads(rw http.ResponseWriter, r *http.Request) {
	if w.faults.NotFoundLoads() {
		writeJSON(rw, http.StatusNotFound, map[string]string{"detail": "Not Found"})
		return
	}
	if !w.waitHang(r.Context()) {
		return
	}
	if w.faults.GarbageLoads() {
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusOK)
		_, _ = rw.Write([]byte(garbageBody))
		return
	}
	q := r.URL.Query()
	sec, err := parseInclude(q["include"])
	if err != nil {
		writeDetail(rw, http.StatusBadRequest, err.Error())
		return
	}
	dpRank := -1
	if q.Has("dp_rank") {
		if dpRank, err = strconv.Atoi(q.Get("dp_rank")); err != nil || dpRank < 0 {
			writeDetail(rw, http.StatusBadRequest, fmt.Sprintf("invalid dp_rank %q", q.Get("dp_rank")))
			return
		}
	}
	format := q.Get("format")
	if format != "" && format != "json" && format != "prometheus" {
		writeDetail(rw, http.StatusBadRequest, fmt.Sprintf("unknown format %q: want json or prometheus", format))
		return
	}
	now := time.Now()
	loads, err := selectRanks(w.Loads(), dpRank)
	if err != nil {
		writeDetail(rw, http.StatusBadRequest, err.Error())
		return
	}
	if format == "prometheus" {
		w.writePrometheus(rw, loads, "")
		return
	}
	writeJSON(rw, http.StatusOK, w.loadsBody(loads, sec, now))
}

type legacyLoadJSON struct {
	DPRank         int     `json:"dp_rank"`
	NumReqs        int     `json:"num_reqs"`
	NumWaitingReqs int     `json:"num_waiting_reqs"`
	NumTokens      int64   `json:"num_tokens"`
	TsTic          float64 `json:"ts_tic"`
}

// handleGetLoad serves the deprecated GET /get_load. num_tokens is used plus queued tokens, as SGLang
// computes it.
func (w *Worker) handleGetLoad(rw http.ResponseWriter, r *http.Request) {
	if !w.waitHang(r.Context()) {
		return
	}
	if w.faults.GarbageLoads() {
		rw.Header().Set("Content-Type", "application/json")
		_, _ = rw.Write([]byte(garbageBody))
		return
	}
	loads := w.Loads()
	tic := round(time.Since(processStart).Seconds(), 6)
	out := make([]legacyLoadJSON, len(loads))
	for i, l := range loads {
		out[i] = legacyLoadJSON{
			DPRank:         l.DPRank,
			NumReqs:        l.Running + l.Waiting,
			NumWaitingReqs: l.Waiting,
			NumTokens:      l.TotalTokens,
			TsTic:          tic,
		}
	}
	writeJSON(rw, http.StatusOK, out)
}

// handleMetrics serves GET /metrics in the Prometheus text format.
func (w *Worker) handleMetrics(rw http.ResponseWriter, r *http.Request) {
	w.writePrometheus(rw, w.Loads(), `model_name="`+modelName+`",`)
}

// modelName is the simulated served model.
const modelName = "sglang-sim"

// promFamilies are the load fields as Prometheus families; counter marks the prefill counters.
var promFamilies = []struct {
	name, help string
	counter    bool
	value      func(*RankLoad) string
}{
	{"num_running_reqs", "The number of running requests.", false, func(l *RankLoad) string { return strconv.Itoa(l.Running) }},
	{"num_queue_reqs", "The number of requests in the waiting queue.", false, func(l *RankLoad) string { return strconv.Itoa(l.Waiting) }},
	{"num_waiting_uncached_tokens", "Prompt tokens of queued requests not covered by the prefix cache.", false, func(l *RankLoad) string { return strconv.FormatInt(l.WaitingUncachedTokens, 10) }},
	{"num_used_tokens", "The number of used KV cache tokens.", false, func(l *RankLoad) string { return strconv.FormatInt(l.UsedTokens, 10) }},
	{"max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", false, func(l *RankLoad) string { return strconv.FormatInt(l.MaxTotalTokens, 10) }},
	{"max_running_requests", "Maximum number of running requests.", false, func(l *RankLoad) string { return strconv.Itoa(l.MaxRunning) }},
	{"token_usage", "The token usage.", false, func(l *RankLoad) string { return promFloat(l.TokenUsage) }},
	{"gen_throughput", "The generation throughput (token/s).", false, func(l *RankLoad) string { return promFloat(l.GenThroughput) }},
	{"cache_hit_rate", "The prefix cache hit rate.", false, func(l *RankLoad) string { return promFloat(l.CacheHitRate) }},
	{"utilization", "Fraction of the last second with a non-empty batch.", false, func(l *RankLoad) string { return promFloat(l.Utilization) }},
	{"total_prefill_uncached_tokens", "Prompt tokens prefilled (not covered by the prefix cache) since start.", true, func(l *RankLoad) string { return strconv.FormatInt(l.PrefillUncachedTokens, 10) }},
	{"total_prefill_busy_us", "Microseconds the prefill stream was busy since start.", true, func(l *RankLoad) string { return strconv.FormatInt(l.PrefillBusyMicros, 10) }},
}

func promFloat(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }

// writePrometheus writes one family per load field, one series per DP rank; labels is a prefix of
// extra labels, each followed by a comma.
func (w *Worker) writePrometheus(rw http.ResponseWriter, loads []RankLoad, labels string) {
	var b bytes.Buffer
	for _, g := range promFamilies {
		typ := "gauge"
		if g.counter {
			if w.cfg.OmitPrefillCounters {
				continue
			}
			typ = "counter"
		}
		fmt.Fprintf(&b, "# HELP sglang:%s %s\n# TYPE sglang:%s %s\n", g.name, g.help, g.name, typ)
		for i := range loads {
			fmt.Fprintf(&b, "sglang:%s{%sdp_rank=\"%d\"} %s\n", g.name, labels, loads[i].DPRank, g.value(&loads[i]))
		}
	}
	rw.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = rw.Write(b.Bytes())
}
