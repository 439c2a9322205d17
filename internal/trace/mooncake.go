package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"strconv"
	"time"
)

// maxMooncakeLine bounds one JSON line: the longest real lines hold a few hundred ids (a few KiB).
const maxMooncakeLine = 16 << 20

// maxTimestampMs keeps a timestamp's Duration (and the difference of two) from overflowing.
const maxTimestampMs = math.MaxInt64 / int64(time.Millisecond)

// mooncakeRow is one line of a Mooncake trace. Numbers are read as json.Number so that an error can
// quote the value, and an absent field is told from a zero.
type mooncakeRow struct {
	Timestamp    json.Number `json:"timestamp"`
	InputLength  json.Number `json:"input_length"`
	OutputLength json.Number `json:"output_length"`
	HashIDs      []int64     `json:"hash_ids"`
}

// ReadMooncake reads a Mooncake trace: one JSON object a line with timestamp (ms), input_length,
// output_length and hash_ids (ceil(input_length/512) ids). Blank lines are skipped. At is the time since
// the first row.
func ReadMooncake(r io.Reader) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxMooncakeLine)
	var (
		reqs        []Request
		first, prev int
		line        int
	)
	for sc.Scan() {
		line++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		var row mooncakeRow
		if err := json.Unmarshal(text, &row); err != nil {
			return nil, lineError(line, "%v", err)
		}
		ts, err := jsonInt(line, "timestamp", row.Timestamp)
		if err != nil {
			return nil, err
		}
		if int64(ts) > maxTimestampMs {
			return nil, lineError(line, "timestamp %d: above %d ms", ts, maxTimestampMs)
		}
		if len(reqs) == 0 {
			first, prev = ts, ts
		}
		if ts < prev {
			return nil, lineError(line, "timestamp %d: before the previous row's %d", ts, prev)
		}
		prev = ts
		in, err := jsonInt(line, "input_length", row.InputLength)
		if err != nil {
			return nil, err
		}
		out, err := jsonInt(line, "output_length", row.OutputLength)
		if err != nil {
			return nil, err
		}
		if row.HashIDs == nil {
			return nil, lineError(line, "hash_ids: missing")
		}
		if want := blocks(in); len(row.HashIDs) != want {
			return nil, lineError(line, "hash_ids has %d ids, want ceil(%d/%d) = %d",
				len(row.HashIDs), in, BlockTokens, want)
		}
		reqs = append(reqs, Request{
			Line:         line,
			At:           time.Duration(ts-first) * time.Millisecond,
			InputTokens:  in,
			OutputTokens: out,
			HashIDs:      row.HashIDs,
		})
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, lineError(line+1, "longer than %d bytes", maxMooncakeLine)
		}
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, errEmpty
	}
	return reqs, nil
}

// jsonInt reads a required non-negative integer field.
func jsonInt(line int, field string, n json.Number) (int, error) {
	if n == "" {
		return 0, lineError(line, "%s: missing", field)
	}
	v, err := strconv.ParseInt(string(n), 10, 64)
	if err != nil || v != int64(int(v)) {
		return 0, lineError(line, "%s %s: not an integer", field, strconv.Quote(string(n)))
	}
	if v < 0 {
		return 0, lineError(line, "%s %s: negative", field, strconv.Quote(string(n)))
	}
	return int(v), nil
}
