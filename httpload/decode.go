package httpload

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/valyala/fastjson"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// decoder is what decoding reuses across polls: the parser's tree, so a poll allocates none, and room
// for a number's text. The tree refers into the body it was parsed from; everything is copied out
// before the decoder goes back to the pool.
type decoder struct {
	parser fastjson.Parser
	num    []byte
}

var decoders = sync.Pool{New: func() any { return new(decoder) }}

// DecodeLoads decodes the body of GET /v1/loads, current or older shape. Every field is optional and
// only the fields present set their loadpolicy.Field bit. An empty, null or missing loads is a report
// with no ranks ("no data yet"), not an error. Keys match as SGLang writes them, exactly. Errors are
// *DecodeError.
func DecodeLoads(body []byte, received time.Time) (*loadpolicy.Report, error) {
	dec := decoders.Get().(*decoder)
	defer decoders.Put(dec)
	top, err := parse(&dec.parser, body)
	if err != nil {
		return nil, err
	}
	var version, loads *fastjson.Value
	switch top.Type() {
	case fastjson.TypeNull:
	case fastjson.TypeObject:
		obj, _ := top.Object()
		obj.Visit(func(key []byte, v *fastjson.Value) {
			switch string(key) {
			case "version":
				version = v
			case "loads":
				loads = v
			}
		})
	default:
		return nil, &DecodeError{Err: fmt.Errorf("want an object, got %s", kindOf(top))}
	}
	items, err := list(loads, "loads")
	if err != nil {
		return nil, err
	}
	ranks := make([]loadpolicy.Rank, len(items))
	for i, item := range items {
		d := rankDecoder{list: "loads", pos: i, rk: &ranks[i], num: &dec.num}
		if !d.loads(item) {
			return nil, d.err
		}
	}
	if err := checkTotals(ranks, "loads"); err != nil {
		return nil, err
	}
	return loadpolicy.NewReport(received, decodeVersion(version), ranks), nil
}

// DecodeLegacyLoads decodes the body of the deprecated GET /get_load: a bare array of per-rank
// {dp_rank, num_reqs, num_waiting_reqs, num_tokens, ts_tic}. num_reqs counts running and waiting
// requests; num_tokens counts KV tokens in use plus the queued requests' sequence lengths, which is
// what num_total_tokens means on /v1/loads, so it is not reported as used tokens. ts_tic is a monotonic
// counter of the worker's, useless to another host, so it is not read. Errors are *DecodeError.
func DecodeLegacyLoads(body []byte, received time.Time) (*loadpolicy.Report, error) {
	dec := decoders.Get().(*decoder)
	defer decoders.Put(dec)
	top, err := parse(&dec.parser, body)
	if err != nil {
		return nil, err
	}
	items, err := list(top, "")
	if err != nil {
		return nil, err
	}
	ranks := make([]loadpolicy.Rank, len(items))
	for i, item := range items {
		d := rankDecoder{pos: i, rk: &ranks[i], num: &dec.num}
		obj := d.object(item)
		if obj == nil {
			return nil, d.err
		}
		var dpRank, numReqs, numWaiting, numTokens *fastjson.Value
		obj.Visit(func(key []byte, v *fastjson.Value) {
			switch string(key) {
			case "dp_rank":
				dpRank = v
			case "num_reqs":
				numReqs = v
			case "num_waiting_reqs":
				numWaiting = v
			case "num_tokens":
				numTokens = v
			}
		})
		d.dpRank(dpRank)
		var reqs int64
		d.int(numReqs, "num_reqs", &reqs, 0)
		d.int(numWaiting, "num_waiting_reqs", &d.rk.Waiting, loadpolicy.FieldWaiting)
		d.int(numTokens, "num_tokens", &d.rk.TotalTokens, loadpolicy.FieldTotalTokens)
		if d.err != nil {
			return nil, d.err
		}
		// Running is known only from both counts, both sane. They are read at slightly different
		// moments, so waiting can exceed the total by a little.
		if !absent(numReqs) && d.rk.Has(loadpolicy.FieldWaiting) && reqs >= 0 && d.rk.Waiting >= 0 {
			d.rk.Running = max(reqs-d.rk.Waiting, 0)
			d.rk.Fields |= loadpolicy.FieldRunning
		}
	}
	if err := checkTotals(ranks, ""); err != nil {
		return nil, err
	}
	return loadpolicy.NewReport(received, "", ranks), nil
}

// parse parses body with p. The parser is lenient where it costs nothing here (it does not check
// strings' escapes, and reads NaN as a number), so every value read is checked again by kind; a body
// it refuses is described with encoding/json's words, which name the offending character.
func parse(p *fastjson.Parser, body []byte) (*fastjson.Value, error) {
	v, err := p.ParseBytes(body)
	if err == nil {
		return v, nil
	}
	var raw json.RawMessage
	if stdErr := json.Unmarshal(body, &raw); stdErr != nil {
		err = stdErr
	}
	return nil, &DecodeError{Err: err}
}

// list returns the elements of an array; null or absent is no elements. field names the array in
// errors, empty for the whole body.
func list(v *fastjson.Value, field string) ([]*fastjson.Value, error) {
	if absent(v) {
		return nil, nil
	}
	items, err := v.Array()
	if err != nil {
		return nil, &DecodeError{Field: field, Err: fmt.Errorf("want an array, got %s", kindOf(v))}
	}
	return items, nil
}

// decodeVersion returns the version string; it is informational, so a wrong type or a string that
// is not UTF-8 is ignored.
func decodeVersion(v *fastjson.Value) string {
	if v == nil || v.Type() != fastjson.TypeString {
		return ""
	}
	b, _ := v.StringBytes()
	if !utf8.Valid(b) {
		return ""
	}
	return string(b)
}

// rankDecoder fills one Rank, element pos of the array named list, and keeps the first error.
type rankDecoder struct {
	list string // "" for a bare array
	pos  int
	rk   *loadpolicy.Rank
	num  *[]byte // the decoder's room for a number's text
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

// object returns the element as an object, or nil with d.err set.
func (d *rankDecoder) object(v *fastjson.Value) *fastjson.Object {
	obj, err := v.Object()
	if err != nil {
		d.err = &DecodeError{Field: d.prefix(), Err: fmt.Errorf("want an object, got %s", kindOf(v))}
		return nil
	}
	return obj
}

// The fields of one element of /v1/loads, as indexes into rankValues. num_total_reqs (older servers)
// is running + waiting, so it is not read; nor are dp_rank_count and aggregate, which NewReport
// computes from the ranks.
const (
	keyDPRank = iota
	keyRunning
	keyWaiting
	keyWaitingUncached
	keyUsedTokens
	keyTotalTokens
	keyMaxTotalTokens
	keyMaxRunning
	keyTokenUsage
	keyGenThroughput
	keyCacheHitRate
	keyUtilization
	keyPrefillUncached
	keyPrefillBusy
	rankKeys
)

func rankKey(key []byte) int {
	switch string(key) {
	case "dp_rank":
		return keyDPRank
	case "num_running_reqs":
		return keyRunning
	case "num_waiting_reqs":
		return keyWaiting
	case "num_waiting_uncached_tokens":
		return keyWaitingUncached
	case "num_used_tokens":
		return keyUsedTokens
	case "num_total_tokens":
		return keyTotalTokens
	case "max_total_num_tokens":
		return keyMaxTotalTokens
	case "max_running_requests":
		return keyMaxRunning
	case "token_usage":
		return keyTokenUsage
	case "gen_throughput":
		return keyGenThroughput
	case "cache_hit_rate":
		return keyCacheHitRate
	case "utilization":
		return keyUtilization
	case "total_prefill_uncached_tokens":
		return keyPrefillUncached
	case "total_prefill_busy_us":
		return keyPrefillBusy
	}
	return -1
}

// loads fills the rank from one element of /v1/loads; false means d.err is set. A key sent twice
// counts as its last value, as encoding/json reads it.
func (d *rankDecoder) loads(item *fastjson.Value) bool {
	obj := d.object(item)
	if obj == nil {
		return false
	}
	var w [rankKeys]*fastjson.Value
	obj.Visit(func(key []byte, v *fastjson.Value) {
		if k := rankKey(key); k >= 0 {
			w[k] = v
		}
	})
	d.dpRank(w[keyDPRank])
	d.int(w[keyRunning], "num_running_reqs", &d.rk.Running, loadpolicy.FieldRunning)
	d.int(w[keyWaiting], "num_waiting_reqs", &d.rk.Waiting, loadpolicy.FieldWaiting)
	d.int(w[keyWaitingUncached], "num_waiting_uncached_tokens", &d.rk.WaitingUncachedTokens, loadpolicy.FieldWaitingUncachedTokens)
	d.int(w[keyUsedTokens], "num_used_tokens", &d.rk.UsedTokens, loadpolicy.FieldUsedTokens)
	d.int(w[keyTotalTokens], "num_total_tokens", &d.rk.TotalTokens, loadpolicy.FieldTotalTokens)
	d.int(w[keyMaxTotalTokens], "max_total_num_tokens", &d.rk.MaxTotalTokens, loadpolicy.FieldMaxTotalTokens)
	d.int(w[keyMaxRunning], "max_running_requests", &d.rk.MaxRunning, loadpolicy.FieldMaxRunning)
	d.float(w[keyTokenUsage], "token_usage", &d.rk.TokenUsage, loadpolicy.FieldTokenUsage)
	d.float(w[keyGenThroughput], "gen_throughput", &d.rk.GenThroughput, loadpolicy.FieldGenThroughput)
	d.float(w[keyCacheHitRate], "cache_hit_rate", &d.rk.CacheHitRate, loadpolicy.FieldCacheHitRate)
	d.float(w[keyUtilization], "utilization", &d.rk.Utilization, loadpolicy.FieldUtilization)
	// The prefill counters count only as a pair.
	if !absent(w[keyPrefillUncached]) && !absent(w[keyPrefillBusy]) {
		d.int(w[keyPrefillUncached], "total_prefill_uncached_tokens", &d.rk.PrefillUncachedTokens, loadpolicy.FieldPrefillCounters)
		d.int(w[keyPrefillBusy], "total_prefill_busy_us", &d.rk.PrefillBusyUS, loadpolicy.FieldPrefillCounters)
	}
	return d.err == nil
}

// dpRank reads dp_rank, defaulting to the position in the array.
func (d *rankDecoder) dpRank(v *fastjson.Value) {
	d.rk.DPRank = d.pos
	if d.err != nil || absent(v) {
		return
	}
	n, err := d.parseInt(v)
	if err == nil && int64(int(n)) != n {
		err = errOutOfRange
	}
	if err != nil {
		d.fail("dp_rank", err)
		return
	}
	d.rk.DPRank = int(n)
}

func (d *rankDecoder) int(v *fastjson.Value, name string, dst *int64, f loadpolicy.Field) {
	if d.err != nil || absent(v) {
		return
	}
	n, err := d.parseInt(v)
	if err != nil {
		d.fail(name, err)
		return
	}
	*dst = n
	d.rk.Fields |= f
}

func (d *rankDecoder) float(v *fastjson.Value, name string, dst *float64, f loadpolicy.Field) {
	if d.err != nil || absent(v) {
		return
	}
	x, err := d.parseFloat(v)
	if err != nil {
		d.fail(name, err)
		return
	}
	*dst = x
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
func (d *rankDecoder) parseInt(v *fastjson.Value) (int64, error) {
	b, err := d.numberText(v, "an integer")
	if err != nil {
		return 0, err
	}
	s := string(b)
	n, err := strconv.ParseInt(s, 10, 64)
	if err == nil {
		return n, nil
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
func (d *rankDecoder) parseFloat(v *fastjson.Value) (float64, error) {
	b, err := d.numberText(v, "a number")
	if err != nil {
		return 0, err
	}
	f, err := strconv.ParseFloat(string(b), 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, errNotANumber
	}
	return f, nil
}

// numberText returns the text of a number value, checked against JSON's grammar: the parser also
// passes NaN, Inf, 01 or 1e, which strconv would read or mis-read. want names the kind expected, for
// the error. The text is valid until the next call.
func (d *rankDecoder) numberText(v *fastjson.Value, want string) ([]byte, error) {
	if v.Type() != fastjson.TypeNumber {
		return nil, fmt.Errorf("want %s, got %s", want, kindOf(v))
	}
	b := v.MarshalTo((*d.num)[:0])
	*d.num = b
	if !jsonNumber(b) {
		return nil, errNotANumber
	}
	return b, nil
}

// jsonNumber reports whether b is a number as JSON spells one: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
func jsonNumber(b []byte) bool {
	i := 0
	digits := func() int {
		n := 0
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
			n++
		}
		return n
	}
	if i < len(b) && b[i] == '-' {
		i++
	}
	if i < len(b) && b[i] == '0' {
		i++
	} else if digits() == 0 {
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if digits() == 0 {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if digits() == 0 {
			return false
		}
	}
	return i == len(b)
}

func absent(v *fastjson.Value) bool {
	return v == nil || v.Type() == fastjson.TypeNull
}

// kindOf names the kind of a JSON value, in encoding/json's words.
func kindOf(v *fastjson.Value) string {
	switch v.Type() {
	case fastjson.TypeObject:
		return "object"
	case fastjson.TypeArray:
		return "array"
	case fastjson.TypeString:
		return "string"
	case fastjson.TypeTrue, fastjson.TypeFalse:
		return "boolean"
	case fastjson.TypeNull:
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
