package httpload

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// Seed corpora live in testdata/fuzz/<FuzzName>/; the fixtures seed both targets too.

func FuzzDecodeLoads(f *testing.F) {
	for _, name := range []string{"loads_current.json", "loads_old.json", "loads_starting.json"} {
		f.Add(readFixture(f, name))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		rep, err := DecodeLoads(body, received)
		checkFuzzResult(t, rep, err)
		// The parser must read a body as encoding/json does: the body as encoding/json re-encodes it
		// (its whitespace, escapes, key order and duplicate keys resolved) decodes the same.
		canon, ok := reencode(body)
		if !ok || (err != nil && strings.Contains(err.Error(), "too big depth")) {
			return // not JSON, or nested deeper than the parser goes
		}
		want, wantErr := DecodeLoads(canon, received)
		if rep != nil && want != nil && !utf8.Valid(body) {
			want.Version = rep.Version // encoding/json replaces the bytes that are not UTF-8
		}
		if fmt.Sprint(err) != fmt.Sprint(wantErr) || !reflect.DeepEqual(rep, want) {
			t.Fatalf("DecodeLoads = %+v, %v; of %s: %+v, %v", rep, err, canon, want, wantErr)
		}
	})
}

func FuzzDecodeLegacyLoads(f *testing.F) {
	f.Add(readFixture(f, "get_load.json"))
	f.Fuzz(func(t *testing.T, body []byte) {
		rep, err := DecodeLegacyLoads(body, received)
		checkFuzzResult(t, rep, err)
	})
}

// reencode is body decoded and encoded again by encoding/json, numbers as written; ok is false when
// body is not JSON.
func reencode(body []byte) (canon []byte, ok bool) {
	if !json.Valid(body) {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if dec.Decode(&v) != nil {
		return nil, false
	}
	canon, err := json.Marshal(v)
	return canon, err == nil
}

// checkFuzzResult: an error is a *DecodeError and comes without a report; no error means a report
// whose totals are the sums of its ranks.
func checkFuzzResult(t *testing.T, rep *loadpolicy.Report, err error) {
	t.Helper()
	if err != nil {
		var de *DecodeError
		if !errors.As(err, &de) {
			t.Fatalf("%T %v, want *DecodeError", err, err)
		}
		if rep != nil {
			t.Fatalf("report with error %v", err)
		}
		return
	}
	checkReport(t, rep)
}
