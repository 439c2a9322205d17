package httpload

import "bytes"

// The fast path of DecodeLoads: a /v1/loads body is decoded on every poll of every worker, and
// encoding/json validates and walks the body once per nesting level. scanLoads walks it once, after a
// single validation, and gives up on anything that is not the plain shape, leaving it (and every
// error) to the encoding/json path; both must agree, which FuzzDecodeLoads checks.

// scanLoads splits a /v1/loads body that json.Valid accepted into its version, and its ranks' fields, as the encoding/json
// path would. ok is false when the body is not an object whose loads is null, absent or an array of
// objects, or when a key has escapes or non-ASCII bytes or matches a field only case-insensitively:
// encoding/json unescapes keys and matches them without regard to case.
func scanLoads(body []byte) (version rawValue, ranks []wireRank, ok bool) {
	var loads rawValue
	ok = members(body, func(key, val []byte) bool {
		switch {
		case string(key) == "version":
			version = val
		case string(key) == "loads":
			loads = val
		case foldsTo(key, "version", "loads"):
			return false
		}
		return true
	})
	if !ok || absent(loads) {
		return version, nil, ok
	}
	s := jsonScanner{b: loads}
	s.ws()
	if s.b[s.i] != '[' {
		return nil, nil, false
	}
	s.i++
	for {
		s.ws()
		switch s.b[s.i] {
		case ']':
			return version, ranks, true
		case ',':
			s.i++
			continue
		}
		item := s.value()
		ranks = append(ranks, wireRank{})
		if jsonKind(item) != "object" || !scanRank(item, &ranks[len(ranks)-1]) {
			return nil, nil, false
		}
	}
}

// rankKeys are wireRank's JSON names, in field order.
var rankKeys = []string{"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
	"num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
	"gen_throughput", "cache_hit_rate", "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us"}

func scanRank(raw []byte, w *wireRank) bool {
	fields := []*rawValue{&w.DPRank, &w.Running, &w.Waiting, &w.WaitingUncachedTokens, &w.UsedTokens,
		&w.TotalTokens, &w.MaxTotalTokens, &w.MaxRunning, &w.TokenUsage, &w.GenThroughput, &w.CacheHitRate,
		&w.Utilization, &w.PrefillUncachedTokens, &w.PrefillBusyUS}
	return members(raw, func(key, val []byte) bool {
		for i, name := range rankKeys {
			if string(key) == name {
				*fields[i] = val
				return true
			}
		}
		return !foldsTo(key, rankKeys...)
	})
}

// foldsTo reports whether key matches one of names case-insensitively.
func foldsTo(key []byte, names ...string) bool {
	for _, n := range names {
		if bytes.EqualFold(key, []byte(n)) {
			return true
		}
	}
	return false
}

// members calls f with each key and value of the valid JSON object raw, in order, while f returns true.
// It returns false when raw is not an object, when a key has an escape or a non-ASCII byte,
// or when f returned false.
func members(raw []byte, f func(key, val []byte) bool) bool {
	s := jsonScanner{b: raw}
	s.ws()
	if s.b[s.i] != '{' {
		return false
	}
	s.i++
	for {
		s.ws()
		switch s.b[s.i] {
		case '}':
			return true
		case ',':
			s.i++
			s.ws()
		}
		start := s.i + 1
		s.skipString()
		key := s.b[start : s.i-1]
		for _, c := range key {
			if c == '\\' || c >= 0x80 {
				return false
			}
		}
		s.ws()
		s.i++ // the colon
		if !f(key, s.value()) {
			return false
		}
	}
}

// jsonScanner walks JSON that json.Valid accepted, so it checks no syntax.
type jsonScanner struct {
	b []byte
	i int
}

func (s *jsonScanner) ws() {
	for s.i < len(s.b) && isJSONSpace(s.b[s.i]) {
		s.i++
	}
}

// skipString moves past the string that starts at s.i.
func (s *jsonScanner) skipString() {
	for s.i++; s.i < len(s.b); s.i++ {
		switch s.b[s.i] {
		case '\\':
			s.i++
		case '"':
			s.i++
			return
		}
	}
}

// value moves past the value that starts at or after s.i and returns it.
func (s *jsonScanner) value() []byte {
	s.ws()
	start, depth := s.i, 0
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case '"':
			s.skipString()
			if depth == 0 {
				return s.b[start:s.i]
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return s.b[start:s.i]
			}
			if depth--; depth == 0 {
				s.i++
				return s.b[start:s.i]
			}
		case ',', ' ', '\t', '\r', '\n':
			if depth == 0 {
				return s.b[start:s.i]
			}
		}
		s.i++
	}
	return s.b[start:s.i]
}
