package httpload

import (
	"errors"
	"fmt"
	"reflect"
	"testing"

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
		// The fast path must decode exactly as encoding/json does.
		want, wantErr := decodeLoadsJSON(body, received)
		if fmt.Sprint(err) != fmt.Sprint(wantErr) || !reflect.DeepEqual(rep, want) {
			t.Fatalf("DecodeLoads = %+v, %v; encoding/json alone = %+v, %v", rep, err, want, wantErr)
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
