package httpload

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// rawValue is a JSON value kept raw, as json.RawMessage but without its copy: a slice of the body being
// decoded, valid only while that body is. Decoding runs once per poll per worker.
type rawValue []byte

func (r *rawValue) UnmarshalJSON(b []byte) error {
	*r = b
	return nil
}

// wireLoads is the body of GET /v1/loads. Fields are kept raw so that a missing field stays distinguishable
// from a zero, and a wrong type can be reported with the field's name. Older servers also send
// dp_rank_count and aggregate: ranks are counted with len(loads) and totals computed by NewReport.
type wireLoads struct {
	Version rawValue `json:"version"`
	Loads   rawValue `json:"loads"`
}

// wireRank is one element of loads. num_total_reqs (older servers) is running + waiting, so it is not read.
type wireRank struct {
	DPRank                rawValue `json:"dp_rank"`
	Running               rawValue `json:"num_running_reqs"`
	Waiting               rawValue `json:"num_waiting_reqs"`
	WaitingUncachedTokens rawValue `json:"num_waiting_uncached_tokens"`
	UsedTokens            rawValue `json:"num_used_tokens"`
	TotalTokens           rawValue `json:"num_total_tokens"`
	MaxTotalTokens        rawValue `json:"max_total_num_tokens"`
	MaxRunning            rawValue `json:"max_running_requests"`
	TokenUsage            rawValue `json:"token_usage"`
	GenThroughput         rawValue `json:"gen_throughput"`
	CacheHitRate          rawValue `json:"cache_hit_rate"`
	Utilization           rawValue `json:"utilization"`
	PrefillUncachedTokens rawValue `json:"total_prefill_uncached_tokens"`
	PrefillBusyUS         rawValue `json:"total_prefill_busy_us"`
}

// wireLegacyRank is one element of the array GET /get_load answers. ts_tic is a monotonic counter of the
// worker's, useless to another host, so it is not read.
type wireLegacyRank struct {
	DPRank     rawValue `json:"dp_rank"`
	NumReqs    rawValue `json:"num_reqs"`
	NumWaiting rawValue `json:"num_waiting_reqs"`
	NumTokens  rawValue `json:"num_tokens"`
}

// DecodeLoads decodes the body of GET /v1/loads, current or older shape. Every field is optional and
// only the fields present set their loadpolicy.Field bit. An empty, null or missing loads is a report
// with no ranks ("no data yet"), not an error. Errors are *DecodeError.
func DecodeLoads(body []byte, received time.Time) (*loadpolicy.Report, error) {
	if json.Valid(body) {
		if version, wires, ok := scanLoads(body); ok {
			ranks := make([]loadpolicy.Rank, len(wires))
			for i := range wires {
				d := rankDecoder{list: "loads", pos: i, rk: &ranks[i]}
				if !d.loads(&wires[i]) {
					return nil, d.err
				}
			}
			return loadsReport(received, version, ranks)
		}
	}
	return decodeLoadsJSON(body, received)
}

// decodeLoadsJSON is DecodeLoads with encoding/json alone: for bodies that scanLoads leaves, and errors.
func decodeLoadsJSON(body []byte, received time.Time) (*loadpolicy.Report, error) {
	var top wireLoads
	if err := json.Unmarshal(body, &top); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			err = fmt.Errorf("want an object, got %s", jsonKind(body))
		}
		return nil, &DecodeError{Err: err}
	}
	var items []rawValue
	if len(top.Loads) > 0 {
		var err error
		if items, err = unmarshalList(top.Loads, "loads"); err != nil {
			return nil, err
		}
	}
	ranks := make([]loadpolicy.Rank, len(items))
	for i, item := range items {
		var w wireRank
		d := rankDecoder{list: "loads", pos: i, rk: &ranks[i]}
		if !d.object(item, &w) || !d.loads(&w) {
			return nil, d.err
		}
	}
	return loadsReport(received, top.Version, ranks)
}

func loadsReport(received time.Time, version rawValue, ranks []loadpolicy.Rank) (*loadpolicy.Report, error) {
	if err := checkTotals(ranks, "loads"); err != nil {
		return nil, err
	}
	return loadpolicy.NewReport(received, decodeVersion(version), ranks), nil
}

// DecodeLegacyLoads decodes the body of the deprecated GET /get_load: a bare array of per-rank
// {dp_rank, num_reqs, num_waiting_reqs, num_tokens, ts_tic}. num_reqs counts running and waiting
// requests; num_tokens counts KV tokens in use plus the queued requests' sequence lengths, which is
// what num_total_tokens means on /v1/loads, so it is not reported as used tokens. Errors are *DecodeError.
func DecodeLegacyLoads(body []byte, received time.Time) (*loadpolicy.Report, error) {
	items, err := unmarshalList(body, "")
	if err != nil {
		return nil, err
	}
	ranks := make([]loadpolicy.Rank, len(items))
	for i, item := range items {
		var w wireLegacyRank
		d := rankDecoder{pos: i, rk: &ranks[i]}
		if !d.object(item, &w) {
			return nil, d.err
		}
		d.dpRank(w.DPRank, i)
		var reqs int64
		d.int(w.NumReqs, "num_reqs", &reqs, 0)
		d.int(w.NumWaiting, "num_waiting_reqs", &d.rk.Waiting, loadpolicy.FieldWaiting)
		d.int(w.NumTokens, "num_tokens", &d.rk.TotalTokens, loadpolicy.FieldTotalTokens)
		if d.err != nil {
			return nil, d.err
		}
		// Running is known only from both counts, both sane. They are read at slightly different
		// moments, so waiting can exceed the total by a little.
		if !absent(w.NumReqs) && d.rk.Has(loadpolicy.FieldWaiting) && reqs >= 0 && d.rk.Waiting >= 0 {
			d.rk.Running = max(reqs-d.rk.Waiting, 0)
			d.rk.Fields |= loadpolicy.FieldRunning
		}
	}
	if err := checkTotals(ranks, ""); err != nil {
		return nil, err
	}
	return loadpolicy.NewReport(received, "", ranks), nil
}

// unmarshalList decodes a JSON array into its elements; null is no elements. field names the array
// in errors, empty for the whole body.
func unmarshalList(raw []byte, field string) ([]rawValue, error) {
	var items []rawValue
	if err := json.Unmarshal(raw, &items); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			err = fmt.Errorf("want an array, got %s", jsonKind(raw))
		}
		return nil, &DecodeError{Field: field, Err: err}
	}
	return items, nil
}

// decodeVersion returns the version string; it is informational, so a wrong type is ignored.
func decodeVersion(raw rawValue) string {
	raw = trimJSON(raw)
	if len(raw) >= 2 && raw[0] == '"' && bytes.IndexByte(raw, '\\') < 0 && utf8.Valid(raw) {
		return string(raw[1 : len(raw)-1]) // nothing to unescape
	}
	var s string
	if jsonKind(raw) != "string" || json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return s
}

// rankDecoder fills one Rank, element pos of the array named list, and keeps the first error.
type rankDecoder struct {
	list string // "" for a bare array
	pos  int
	rk   *loadpolicy.Rank
	err  error
}

// prefix names the element in errors, e.g. "loads[2]"; it is built only for an error.
func (d *rankDecoder) prefix() string {
	return d.list + "[" + strconv.Itoa(d.pos) + "]"
}

func (d *rankDecoder) fail(name string, err error) {
	if d.err == nil {
		d.err = &DecodeError{Field: d.prefix() + "." + name, Err: err}
	}
}

func (d *rankDecoder) object(raw rawValue, v any) bool {
	if k := jsonKind(raw); k != "object" {
		d.err = &DecodeError{Field: d.prefix(), Err: fmt.Errorf("want an object, got %s", k)}
		return false
	}
	if err := json.Unmarshal(raw, v); err != nil {
		d.err = &DecodeError{Field: d.prefix(), Err: err}
		return false
	}
	return true
}

// loads fills the rank from one element of /v1/loads; false means d.err is set.
func (d *rankDecoder) loads(w *wireRank) bool {
	d.dpRank(w.DPRank, d.pos)
	d.int(w.Running, "num_running_reqs", &d.rk.Running, loadpolicy.FieldRunning)
	d.int(w.Waiting, "num_waiting_reqs", &d.rk.Waiting, loadpolicy.FieldWaiting)
	d.int(w.WaitingUncachedTokens, "num_waiting_uncached_tokens", &d.rk.WaitingUncachedTokens, loadpolicy.FieldWaitingUncachedTokens)
	d.int(w.UsedTokens, "num_used_tokens", &d.rk.UsedTokens, loadpolicy.FieldUsedTokens)
	d.int(w.TotalTokens, "num_total_tokens", &d.rk.TotalTokens, loadpolicy.FieldTotalTokens)
	d.int(w.MaxTotalTokens, "max_total_num_tokens", &d.rk.MaxTotalTokens, loadpolicy.FieldMaxTotalTokens)
	d.int(w.MaxRunning, "max_running_requests", &d.rk.MaxRunning, loadpolicy.FieldMaxRunning)
	d.float(w.TokenUsage, "token_usage", &d.rk.TokenUsage, loadpolicy.FieldTokenUsage)
	d.float(w.GenThroughput, "gen_throughput", &d.rk.GenThroughput, loadpolicy.FieldGenThroughput)
	d.float(w.CacheHitRate, "cache_hit_rate", &d.rk.CacheHitRate, loadpolicy.FieldCacheHitRate)
	d.float(w.Utilization, "utilization", &d.rk.Utilization, loadpolicy.FieldUtilization)
	// The prefill counters count only as a pair.
	if !absent(w.PrefillUncachedTokens) && !absent(w.PrefillBusyUS) {
		d.int(w.PrefillUncachedTokens, "total_prefill_uncached_tokens", &d.rk.PrefillUncachedTokens, loadpolicy.FieldPrefillCounters)
		d.int(w.PrefillBusyUS, "total_prefill_busy_us", &d.rk.PrefillBusyUS, loadpolicy.FieldPrefillCounters)
	}
	return d.err == nil
}

// dpRank reads dp_rank, defaulting to the position in the array.
func (d *rankDecoder) dpRank(raw rawValue, pos int) {
	d.rk.DPRank = pos
	if d.err != nil || absent(raw) {
		return
	}
	v, err := parseInt(raw)
	if err == nil && int64(int(v)) != v {
		err = errOutOfRange
	}
	if err != nil {
		d.fail("dp_rank", err)
		return
	}
	d.rk.DPRank = int(v)
}

func (d *rankDecoder) int(raw rawValue, name string, dst *int64, f loadpolicy.Field) {
	if d.err != nil || absent(raw) {
		return
	}
	v, err := parseInt(raw)
	if err != nil {
		d.fail(name, err)
		return
	}
	*dst = v
	d.rk.Fields |= f
}

func (d *rankDecoder) float(raw rawValue, name string, dst *float64, f loadpolicy.Field) {
	if d.err != nil || absent(raw) {
		return
	}
	v, err := parseFloat(raw)
	if err != nil {
		d.fail(name, err)
		return
	}
	*dst = v
	d.rk.Fields |= f
}

var (
	errOutOfRange = errors.New("integer out of int64 range")
	errNotInteger = errors.New("want an integer, got a fraction")
	errNotANumber = errors.New("malformed number")
)

const (
	twoPow63 = 1 << 63 // the first float64 beyond int64
)

// parseInt reads a JSON number holding an integer. Some servers serialise counts as floats (12.0),
// so an integral float is accepted too.
func parseInt(raw rawValue) (int64, error) {
	if k := jsonKind(raw); k != "number" {
		return 0, fmt.Errorf("want an integer, got %s", k)
	}
	s := string(trimJSON(raw))
	v, err := strconv.ParseInt(s, 10, 64)
	if err == nil {
		return v, nil
	}
	if errors.Is(err, strconv.ErrRange) {
		return 0, errOutOfRange
	}
	f, err := strconv.ParseFloat(s, 64)
	switch {
	case errors.Is(err, strconv.ErrRange):
		return 0, errOutOfRange
	case err != nil:
		return 0, errNotANumber
	case f != math.Trunc(f):
		return 0, errNotInteger
	case f >= twoPow63 || f < -twoPow63:
		return 0, errOutOfRange
	}
	return int64(f), nil
}

// parseFloat reads a JSON number. A value beyond float64 reads as an infinity, which NewReport drops as
// not sent.
func parseFloat(raw rawValue) (float64, error) {
	if k := jsonKind(raw); k != "number" {
		return 0, fmt.Errorf("want a number, got %s", k)
	}
	f, err := strconv.ParseFloat(string(trimJSON(raw)), 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, errNotANumber
	}
	return f, nil
}

func absent(raw rawValue) bool {
	k := jsonKind(raw)
	return k == "nothing" || k == "null"
}

// trimJSON cuts JSON whitespace from both ends; bytes.Trim would build its cutset on every call.
func trimJSON(raw []byte) []byte {
	for len(raw) > 0 && isJSONSpace(raw[0]) {
		raw = raw[1:]
	}
	for len(raw) > 0 && isJSONSpace(raw[len(raw)-1]) {
		raw = raw[:len(raw)-1]
	}
	return raw
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

// jsonKind names the kind of a valid JSON value from its first byte.
func jsonKind(raw []byte) string {
	raw = trimJSON(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "boolean"
	case 'n':
		return "null"
	}
	return "number"
}

// summed are the counts NewReport sums over ranks.
var summed = []struct {
	name string
	get  func(*loadpolicy.Rank) int64
}{
	{"running requests", func(r *loadpolicy.Rank) int64 { return r.Running }},
	{"waiting requests", func(r *loadpolicy.Rank) int64 { return r.Waiting }},
	{"uncached waiting tokens", func(r *loadpolicy.Rank) int64 { return r.WaitingUncachedTokens }},
	{"used tokens", func(r *loadpolicy.Rank) int64 { return r.UsedTokens }},
	{"token capacity", func(r *loadpolicy.Rank) int64 { return r.MaxTotalTokens }},
	{"running request caps", func(r *loadpolicy.Rank) int64 { return r.MaxRunning }},
}

// checkTotals rejects ranks whose counts cannot be summed in int64: a wrapped total would read as a
// small or negative load. Negative counts are skipped, as NewReport drops them.
func checkTotals(ranks []loadpolicy.Rank, field string) error {
	for _, c := range summed {
		var sum int64
		for i := range ranks {
			v := c.get(&ranks[i])
			if v <= 0 {
				continue
			}
			if sum > math.MaxInt64-v {
				return &DecodeError{Field: field, Err: fmt.Errorf("%s over %d ranks sum beyond int64", c.name, len(ranks))}
			}
			sum += v
		}
	}
	return nil
}
