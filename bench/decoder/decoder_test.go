// Package decoder compares httpload's /v1/loads decoder (fastjson's parser, every field checked and
// named in errors) with encoding/json and with fastjson's bare getters on the same bodies, each
// producing the same loadpolicy.Report. It is a module of its own so that its comparisons stay out of
// the plugin's tests:
//
//	cd bench/decoder && go test -bench . -benchmem
package decoder

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fastjson"

	"github.com/caddy-sglang/caddy-sglang/httpload"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// body is a /v1/loads answer of n ranks, as SGLang sends it.
func body(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"timestamp":"2026-11-30T10:00:00.123456+00:00","version":"0.5.x","accelerator":"NVIDIA H200","num_accelerators":8,"loads":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"dp_rank":%d,"num_running_reqs":12,"num_waiting_reqs":3,"num_waiting_uncached_tokens":5120,`+
			`"num_used_tokens":81234,"num_total_tokens":90000,"max_total_num_tokens":400000,"max_running_requests":256,`+
			`"token_usage":0.2031,"gen_throughput":1834.52,"cache_hit_rate":0.4213,"utilization":0.0,`+
			`"total_prefill_uncached_tokens":123456,"total_prefill_busy_us":987654}`, i)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

var received = time.Unix(1, 0)

// jsonRank decodes with encoding/json into pointers, so that a missing field stays distinguishable.
type jsonRank struct {
	DPRank                *int     `json:"dp_rank"`
	Running               *int64   `json:"num_running_reqs"`
	Waiting               *int64   `json:"num_waiting_reqs"`
	WaitingUncachedTokens *int64   `json:"num_waiting_uncached_tokens"`
	UsedTokens            *int64   `json:"num_used_tokens"`
	TotalTokens           *int64   `json:"num_total_tokens"`
	MaxTotalTokens        *int64   `json:"max_total_num_tokens"`
	MaxRunning            *int64   `json:"max_running_requests"`
	TokenUsage            *float64 `json:"token_usage"`
	GenThroughput         *float64 `json:"gen_throughput"`
	CacheHitRate          *float64 `json:"cache_hit_rate"`
	Utilization           *float64 `json:"utilization"`
	PrefillUncachedTokens *int64   `json:"total_prefill_uncached_tokens"`
	PrefillBusyUS         *int64   `json:"total_prefill_busy_us"`
}

func decodeStd(b []byte) (*loadpolicy.Report, error) {
	var top struct {
		Version string     `json:"version"`
		Loads   []jsonRank `json:"loads"`
	}
	if err := json.Unmarshal(b, &top); err != nil {
		return nil, err
	}
	ranks := make([]loadpolicy.Rank, len(top.Loads))
	for i, w := range top.Loads {
		rk := &ranks[i]
		rk.DPRank = i
		if w.DPRank != nil {
			rk.DPRank = *w.DPRank
		}
		setInt(&rk.Running, w.Running, &rk.Fields, loadpolicy.FieldRunning)
		setInt(&rk.Waiting, w.Waiting, &rk.Fields, loadpolicy.FieldWaiting)
		setInt(&rk.WaitingUncachedTokens, w.WaitingUncachedTokens, &rk.Fields, loadpolicy.FieldWaitingUncachedTokens)
		setInt(&rk.UsedTokens, w.UsedTokens, &rk.Fields, loadpolicy.FieldUsedTokens)
		setInt(&rk.TotalTokens, w.TotalTokens, &rk.Fields, loadpolicy.FieldTotalTokens)
		setInt(&rk.MaxTotalTokens, w.MaxTotalTokens, &rk.Fields, loadpolicy.FieldMaxTotalTokens)
		setInt(&rk.MaxRunning, w.MaxRunning, &rk.Fields, loadpolicy.FieldMaxRunning)
		setFloat(&rk.TokenUsage, w.TokenUsage, &rk.Fields, loadpolicy.FieldTokenUsage)
		setFloat(&rk.GenThroughput, w.GenThroughput, &rk.Fields, loadpolicy.FieldGenThroughput)
		setFloat(&rk.CacheHitRate, w.CacheHitRate, &rk.Fields, loadpolicy.FieldCacheHitRate)
		setFloat(&rk.Utilization, w.Utilization, &rk.Fields, loadpolicy.FieldUtilization)
		if w.PrefillUncachedTokens != nil && w.PrefillBusyUS != nil {
			setInt(&rk.PrefillUncachedTokens, w.PrefillUncachedTokens, &rk.Fields, loadpolicy.FieldPrefillCounters)
			setInt(&rk.PrefillBusyUS, w.PrefillBusyUS, &rk.Fields, loadpolicy.FieldPrefillCounters)
		}
	}
	return loadpolicy.NewReport(received, top.Version, ranks), nil
}

func setInt(dst *int64, v *int64, fields *loadpolicy.Field, f loadpolicy.Field) {
	if v != nil {
		*dst, *fields = *v, *fields|f
	}
}

func setFloat(dst *float64, v *float64, fields *loadpolicy.Field, f loadpolicy.Field) {
	if v != nil {
		*dst, *fields = *v, *fields|f
	}
}

var parsers fastjson.ParserPool

func decodeFast(b []byte) (*loadpolicy.Report, error) {
	p := parsers.Get()
	defer parsers.Put(p)
	v, err := p.ParseBytes(b)
	if err != nil {
		return nil, err
	}
	loads := v.GetArray("loads")
	ranks := make([]loadpolicy.Rank, len(loads))
	for i, l := range loads {
		rk := &ranks[i]
		rk.DPRank = i
		if d := l.Get("dp_rank"); d != nil {
			rk.DPRank = d.GetInt()
		}
		fint := func(name string, dst *int64, f loadpolicy.Field) {
			if x := l.Get(name); x != nil {
				n, err := x.Int64()
				if err == nil {
					*dst, rk.Fields = n, rk.Fields|f
				}
			}
		}
		ffloat := func(name string, dst *float64, f loadpolicy.Field) {
			if x := l.Get(name); x != nil {
				n, err := x.Float64()
				if err == nil {
					*dst, rk.Fields = n, rk.Fields|f
				}
			}
		}
		fint("num_running_reqs", &rk.Running, loadpolicy.FieldRunning)
		fint("num_waiting_reqs", &rk.Waiting, loadpolicy.FieldWaiting)
		fint("num_waiting_uncached_tokens", &rk.WaitingUncachedTokens, loadpolicy.FieldWaitingUncachedTokens)
		fint("num_used_tokens", &rk.UsedTokens, loadpolicy.FieldUsedTokens)
		fint("num_total_tokens", &rk.TotalTokens, loadpolicy.FieldTotalTokens)
		fint("max_total_num_tokens", &rk.MaxTotalTokens, loadpolicy.FieldMaxTotalTokens)
		fint("max_running_requests", &rk.MaxRunning, loadpolicy.FieldMaxRunning)
		ffloat("token_usage", &rk.TokenUsage, loadpolicy.FieldTokenUsage)
		ffloat("gen_throughput", &rk.GenThroughput, loadpolicy.FieldGenThroughput)
		ffloat("cache_hit_rate", &rk.CacheHitRate, loadpolicy.FieldCacheHitRate)
		ffloat("utilization", &rk.Utilization, loadpolicy.FieldUtilization)
		if l.Exists("total_prefill_uncached_tokens") && l.Exists("total_prefill_busy_us") {
			fint("total_prefill_uncached_tokens", &rk.PrefillUncachedTokens, loadpolicy.FieldPrefillCounters)
			fint("total_prefill_busy_us", &rk.PrefillBusyUS, loadpolicy.FieldPrefillCounters)
		}
	}
	return loadpolicy.NewReport(received, string(v.GetStringBytes("version")), ranks), nil
}

var decoders = []struct {
	name   string
	decode func([]byte) (*loadpolicy.Report, error)
}{
	{"httpload", func(b []byte) (*loadpolicy.Report, error) { return httpload.DecodeLoads(b, received) }},
	{"encoding_json", decodeStd},
	{"fastjson_bare", decodeFast},
}

// All three read the same report from the same body.
func TestSameReport(t *testing.T) {
	for _, n := range []int{1, 64} {
		want, err := httpload.DecodeLoads(body(n), received)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range decoders[1:] {
			got, err := d.decode(body(n))
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got.Ranks) != fmt.Sprint(want.Ranks) || got.Version != want.Version || got.Running != want.Running {
				t.Errorf("%s, %d ranks: %+v, want %+v", d.name, n, got.Ranks[0], want.Ranks[0])
			}
		}
	}
}

func BenchmarkDecode(b *testing.B) {
	for _, n := range []int{1, 64} {
		in := body(n)
		for _, d := range decoders {
			b.Run(fmt.Sprintf("%s/ranks=%d", d.name, n), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(in)))
				for b.Loop() {
					if _, err := d.decode(in); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
