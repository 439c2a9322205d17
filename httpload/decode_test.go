package httpload

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

var received = time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)

const allFields = loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldWaitingUncachedTokens |
	loadpolicy.FieldUsedTokens | loadpolicy.FieldTotalTokens | loadpolicy.FieldMaxTotalTokens |
	loadpolicy.FieldMaxRunning | loadpolicy.FieldTokenUsage | loadpolicy.FieldGenThroughput |
	loadpolicy.FieldCacheHitRate | loadpolicy.FieldUtilization

// oldFields are what servers of early 2026 send: no uncached waiting tokens, no num_total_tokens.
const oldFields = allFields &^ (loadpolicy.FieldWaitingUncachedTokens | loadpolicy.FieldTotalTokens)

func readFixture(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeLoadsFixtures(t *testing.T) {
	const counterFields = loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldWaitingUncachedTokens |
		loadpolicy.FieldUsedTokens | loadpolicy.FieldMaxTotalTokens | loadpolicy.FieldMaxRunning |
		loadpolicy.FieldTokenUsage | loadpolicy.FieldGenThroughput
	tests := []struct {
		file    string
		version string
		ranks   []loadpolicy.Rank
		totals  [6]int64 // running, waiting, uncached, used, capacity, max running
		maxUse  float64
	}{
		{
			file: "loads_current.json", version: "0.5.x",
			ranks: []loadpolicy.Rank{{
				DPRank: 0, Running: 12, Waiting: 3, WaitingUncachedTokens: 5120, UsedTokens: 81234,
				TotalTokens: 90000, MaxTotalTokens: 400000, MaxRunning: 256, TokenUsage: 0.2031,
				GenThroughput: 1834.52, CacheHitRate: 0.4213, Utilization: 0, Fields: allFields,
			}},
			totals: [6]int64{12, 3, 5120, 81234, 400000, 256},
			maxUse: 0.2031,
		},
		{
			file: "loads_old.json", version: "0.4.x",
			ranks: []loadpolicy.Rank{
				{DPRank: 0, Running: 10, Waiting: 2, UsedTokens: 60000, MaxTotalTokens: 200000, MaxRunning: 128,
					TokenUsage: 0.3, GenThroughput: 900.5, CacheHitRate: 0.25, Utilization: 0.5, Fields: oldFields},
				{DPRank: 1, Running: 4, Waiting: 0, UsedTokens: 20000, MaxTotalTokens: 200000, MaxRunning: 128,
					TokenUsage: 0.1, GenThroughput: 450.25, CacheHitRate: 0.5, Utilization: 0.25, Fields: oldFields},
			},
			totals: [6]int64{14, 2, 0, 80000, 400000, 256},
			maxUse: 0.3,
		},
		{
			// Newer servers' prefill counters; a rank that sends one of the two has neither.
			file: "loads_counters.json", version: "0.5.x",
			ranks: []loadpolicy.Rank{
				{DPRank: 0, Running: 2, UsedTokens: 4096, MaxTotalTokens: 65536, MaxRunning: 64, TokenUsage: 0.0625,
					GenThroughput: 210.5, PrefillUncachedTokens: 1234567, PrefillBusyUS: 98765432, Fields: counterFields | loadpolicy.FieldPrefillCounters},
				{DPRank: 1, Running: 1, UsedTokens: 1024, MaxTotalTokens: 65536, MaxRunning: 64, TokenUsage: 0.0156,
					GenThroughput: 100, Fields: counterFields},
			},
			totals: [6]int64{3, 0, 0, 5120, 131072, 128},
			maxUse: 0.0625,
		},
		{file: "loads_starting.json", version: "0.5.x"},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			rep, err := DecodeLoads(readFixture(t, tt.file), received)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Version != tt.version || !rep.Received.Equal(received) {
				t.Errorf("version %q received %v, want %q %v", rep.Version, rep.Received, tt.version, received)
			}
			if len(rep.Ranks) != len(tt.ranks) || rep.Empty() != (len(tt.ranks) == 0) {
				t.Fatalf("%d ranks (empty %v), want %d", len(rep.Ranks), rep.Empty(), len(tt.ranks))
			}
			for i := range tt.ranks {
				if rep.Ranks[i] != tt.ranks[i] {
					t.Errorf("rank %d:\n got %+v\nwant %+v", i, rep.Ranks[i], tt.ranks[i])
				}
			}
			got := [6]int64{rep.Running, rep.Waiting, rep.WaitingUncachedTokens, rep.UsedTokens, rep.MaxTotalTokens, rep.MaxRunning}
			if got != tt.totals {
				t.Errorf("totals %v, want %v", got, tt.totals)
			}
			if rep.MaxTokenUsage != tt.maxUse {
				t.Errorf("max token usage %v, want %v", rep.MaxTokenUsage, tt.maxUse)
			}
			checkReport(t, rep)
		})
	}
}

func TestDecodeLegacyLoadsFixture(t *testing.T) {
	rep, err := DecodeLegacyLoads(readFixture(t, "get_load.json"), received)
	if err != nil {
		t.Fatal(err)
	}
	const fields = loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldTotalTokens
	want := []loadpolicy.Rank{
		{DPRank: 0, Running: 12, Waiting: 3, TotalTokens: 86354, Fields: fields},
		// waiting above the total: counts read at different moments; running clamps at zero
		{DPRank: 1, Running: 0, Waiting: 4, TotalTokens: 1024, Fields: fields},
	}
	if len(rep.Ranks) != len(want) {
		t.Fatalf("%d ranks, want %d", len(rep.Ranks), len(want))
	}
	for i := range want {
		if rep.Ranks[i] != want[i] {
			t.Errorf("rank %d:\n got %+v\nwant %+v", i, rep.Ranks[i], want[i])
		}
	}
	if rep.Running != 12 || rep.Waiting != 7 || rep.UsedTokens != 0 || rep.Version != "" {
		t.Errorf("running %d waiting %d used %d version %q", rep.Running, rep.Waiting, rep.UsedTokens, rep.Version)
	}
	checkReport(t, rep)
}

func TestDecodeLoadsFields(t *testing.T) {
	tests := []struct {
		name   string
		body   string
		fields loadpolicy.Field
		check  func(*loadpolicy.Rank) bool
	}{
		{"no fields", `{"loads":[{}]}`, 0, nil},
		{"only running", `{"loads":[{"num_running_reqs":5}]}`, loadpolicy.FieldRunning,
			func(r *loadpolicy.Rank) bool { return r.Running == 5 }},
		{"zero is present", `{"loads":[{"num_waiting_reqs":0}]}`, loadpolicy.FieldWaiting, nil},
		{"null is absent", `{"loads":[{"num_used_tokens":null,"token_usage":null}]}`, 0, nil},
		{"integral float", `{"loads":[{"num_used_tokens":12.0,"max_total_num_tokens":4e5}]}`,
			loadpolicy.FieldUsedTokens | loadpolicy.FieldMaxTotalTokens,
			func(r *loadpolicy.Rank) bool { return r.UsedTokens == 12 && r.MaxTotalTokens == 400000 }},
		{"max int64", `{"loads":[{"num_used_tokens":9223372036854775807}]}`, loadpolicy.FieldUsedTokens,
			func(r *loadpolicy.Rank) bool { return r.UsedTokens == math.MaxInt64 }},
		{"negative dropped", `{"loads":[{"num_running_reqs":-1,"num_waiting_reqs":2}]}`, loadpolicy.FieldWaiting,
			func(r *loadpolicy.Rank) bool { return r.Running == 0 }},
		{"float beyond float64 dropped", `{"loads":[{"gen_throughput":1e999,"token_usage":0.5}]}`,
			loadpolicy.FieldTokenUsage, nil},
		{"integer ratio", `{"loads":[{"token_usage":1}]}`, loadpolicy.FieldTokenUsage,
			func(r *loadpolicy.Rank) bool { return r.TokenUsage == 1 }},
		{"dp_rank defaults to position", `{"loads":[{"dp_rank":7},{}]}`, 0, nil},
		{"key sent twice: the last counts", `{"loads":[{"num_running_reqs":"x","num_running_reqs":5}]}`, loadpolicy.FieldRunning,
			func(r *loadpolicy.Rank) bool { return r.Running == 5 }},
		{"escaped key", `{"lo\u0061ds":[{"num_running_r\u0065qs":5}]}`, loadpolicy.FieldRunning,
			func(r *loadpolicy.Rank) bool { return r.Running == 5 }},
		{"key in another case is another key", `{"loads":[{"NUM_RUNNING_REQS":5}]}`, 0, nil},
		{"unknown sections ignored", `{"loads":[{"memory":{"weight_gb":"x"},"queues":[],"num_total_reqs":"x"}],
			"aggregate":"x","dp_rank_count":"x","version":3}`, 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep, err := DecodeLoads([]byte(tt.body), received)
			if err != nil {
				t.Fatal(err)
			}
			if len(rep.Ranks) == 0 {
				t.Fatal("no ranks")
			}
			rk := &rep.Ranks[0]
			if rk.Fields != tt.fields {
				t.Errorf("fields %b, want %b", rk.Fields, tt.fields)
			}
			if tt.check != nil && !tt.check(rk) {
				t.Errorf("rank %+v", *rk)
			}
			checkReport(t, rep)
		})
	}

	rep, err := DecodeLoads([]byte(`{"loads":[{"dp_rank":7},{}]}`), received)
	if err != nil || rep.Ranks[0].DPRank != 7 || rep.Ranks[1].DPRank != 1 {
		t.Errorf("dp ranks: %+v, %v", rep, err)
	}
}

func TestDecodeLoadsEmpty(t *testing.T) {
	for _, body := range []string{`{"loads":[]}`, `{"loads":null}`, `{}`, `null`, ` {"version":"0.5.x"} `} {
		rep, err := DecodeLoads([]byte(body), received)
		if err != nil {
			t.Errorf("%s: %v", body, err)
			continue
		}
		if rep == nil || !rep.Empty() || rep.Running != 0 || rep.Signals().Set != 0 {
			t.Errorf("%s: want an empty report, got %+v", body, rep)
		}
	}
	for _, body := range []string{`[]`, `null`} {
		rep, err := DecodeLegacyLoads([]byte(body), received)
		if err != nil || rep == nil || !rep.Empty() {
			t.Errorf("legacy %s: %+v, %v", body, rep, err)
		}
	}
}

func TestDecodeLoadsManyHugeRanks(t *testing.T) {
	const ranks, used, capacity = 64, 2_000_000_000, 2_100_000_000
	var b strings.Builder
	b.WriteString(`{"loads":[`)
	for i := range ranks {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"dp_rank":%d,"num_used_tokens":%d,"max_total_num_tokens":%d,"num_running_reqs":%d}`,
			i, used, capacity, used)
	}
	b.WriteString(`]}`)
	rep, err := DecodeLoads([]byte(b.String()), received)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Ranks) != ranks {
		t.Fatalf("%d ranks", len(rep.Ranks))
	}
	if want := int64(ranks) * used; rep.UsedTokens != want || rep.Running != want {
		t.Errorf("used %d running %d, want %d", rep.UsedTokens, rep.Running, want)
	}
	if want := int64(ranks) * capacity; rep.MaxTotalTokens != want {
		t.Errorf("capacity %d, want %d", rep.MaxTotalTokens, want)
	}
	checkReport(t, rep)
}

func TestDecodeLoadsErrors(t *testing.T) {
	tests := []struct {
		name, body, field, msg string
	}{
		{"empty body", ``, "", "unexpected end of JSON input"},
		{"html", `<html><body>502 Bad Gateway</body></html>`, "", "invalid character"},
		{"truncated", `{"loads":[{"num_running_reqs":1`, "", "unexpected end"},
		{"top-level array", `[{"num_running_reqs":1}]`, "", "want an object, got array"},
		{"top-level string", `"ok"`, "", "want an object, got string"},
		{"top-level number", `42`, "", "want an object, got number"},
		{"loads object", `{"loads":{"0":{}}}`, "loads", "want an array, got object"},
		{"loads string", `{"loads":"none"}`, "loads", "want an array, got string"},
		{"rank number", `{"loads":[{},3]}`, "loads[1]", "want an object, got number"},
		{"rank null", `{"loads":[null]}`, "loads[0]", "want an object, got null"},
		{"string count", `{"loads":[{"num_running_reqs":"12"}]}`, "loads[0].num_running_reqs", "want an integer, got string"},
		{"bool count", `{"loads":[{"num_waiting_reqs":true}]}`, "loads[0].num_waiting_reqs", "got boolean"},
		{"object count", `{"loads":[{},{"num_used_tokens":{}}]}`, "loads[1].num_used_tokens", "got object"},
		{"fraction count", `{"loads":[{"max_running_requests":1.5}]}`, "loads[0].max_running_requests", "fraction"},
		{"count beyond int64", `{"loads":[{"num_used_tokens":9223372036854775808}]}`, "loads[0].num_used_tokens", "int64"},
		{"float count beyond int64", `{"loads":[{"num_used_tokens":1e19}]}`, "loads[0].num_used_tokens", "int64"},
		{"count beyond float64", `{"loads":[{"num_used_tokens":1e999}]}`, "loads[0].num_used_tokens", "int64"},
		{"string ratio", `{"loads":[{"token_usage":"0.5"}]}`, "loads[0].token_usage", "want a number, got string"},
		{"array ratio", `{"loads":[{"gen_throughput":[1]}]}`, "loads[0].gen_throughput", "got array"},
		{"string dp_rank", `{"loads":[{"dp_rank":"0"}]}`, "loads[0].dp_rank", "got string"},
		{"NaN", `{"loads":[{"token_usage":NaN}]}`, "loads[0].token_usage", "malformed number"},
		{"infinity", `{"loads":[{"gen_throughput":-inf}]}`, "loads[0].gen_throughput", "malformed number"},
		{"leading zero", `{"loads":[{"num_running_reqs":01}]}`, "loads[0].num_running_reqs", "malformed number"},
		{"no exponent digits", `{"loads":[{"num_running_reqs":1e}]}`, "loads[0].num_running_reqs", "malformed number"},
		{"trailing garbage", `{"loads":[]} x`, "", "invalid character 'x' after top-level value"},
		{"sum beyond int64", `{"loads":[{"num_used_tokens":9223372036854775807},{"num_used_tokens":1}]}`, "loads", "used tokens over 2 ranks sum beyond int64"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep, err := DecodeLoads([]byte(tt.body), received)
			checkDecodeError(t, rep, err, tt.field, tt.msg)
		})
	}
}

func TestDecodeLegacyLoadsErrors(t *testing.T) {
	tests := []struct {
		name, body, field, msg string
	}{
		{"html", `<!doctype html>`, "", "invalid character"},
		{"object", `{"loads":[]}`, "", "want an array, got object"},
		{"element string", `["x"]`, "[0]", "want an object, got string"},
		{"string count", `[{"num_reqs":"3"}]`, "[0].num_reqs", "got string"},
		{"fraction", `[{},{"num_tokens":0.5}]`, "[1].num_tokens", "fraction"},
		{"beyond int64", `[{"num_waiting_reqs":-9223372036854775809}]`, "[0].num_waiting_reqs", "int64"},
		{"sum beyond int64", `[{"num_reqs":9223372036854775807,"num_waiting_reqs":0},{"num_reqs":9,"num_waiting_reqs":0}]`, "", "running requests over 2 ranks"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep, err := DecodeLegacyLoads([]byte(tt.body), received)
			checkDecodeError(t, rep, err, tt.field, tt.msg)
		})
	}
}

func TestDecodeLegacyLoadsRunning(t *testing.T) {
	tests := []struct {
		body    string
		running int64
		has     bool
	}{
		{`[{"num_reqs":5,"num_waiting_reqs":2}]`, 3, true},
		{`[{"num_reqs":5}]`, 0, false}, // a total without the waiting part says nothing about running
		{`[{"num_waiting_reqs":2}]`, 0, false},
		{`[{"num_reqs":5,"num_waiting_reqs":-2}]`, 0, false},
		{`[{"num_reqs":-9223372036854775808,"num_waiting_reqs":1}]`, 0, false},
		{`[{"num_reqs":1.0,"num_waiting_reqs":3}]`, 0, true},
	}
	for _, tt := range tests {
		rep, err := DecodeLegacyLoads([]byte(tt.body), received)
		if err != nil {
			t.Errorf("%s: %v", tt.body, err)
			continue
		}
		rk := rep.Ranks[0]
		if rk.Running != tt.running || rk.Has(loadpolicy.FieldRunning) != tt.has {
			t.Errorf("%s: running %d (sent %v), want %d (%v)", tt.body, rk.Running, rk.Has(loadpolicy.FieldRunning), tt.running, tt.has)
		}
		checkReport(t, rep)
	}
}

func checkDecodeError(t *testing.T, rep *loadpolicy.Report, err error, field, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, report %+v", rep)
	}
	if rep != nil {
		t.Errorf("report %+v with error", rep)
	}
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("%T %v, want *DecodeError", err, err)
	}
	if de.Field != field {
		t.Errorf("field %q, want %q (%v)", de.Field, field, err)
	}
	if !strings.Contains(err.Error(), msg) {
		t.Errorf("error %q does not contain %q", err, msg)
	}
	if de.Err == nil || errors.Unwrap(err) != de.Err {
		t.Errorf("error does not wrap its cause: %v", err)
	}
}

// checkReport checks what a decoded report promises: totals are the sums of its ranks, the counts sum
// without overflow, and every value is one a sender could mean.
func checkReport(t testing.TB, rep *loadpolicy.Report) {
	t.Helper()
	if rep == nil {
		t.Fatal("nil report without error")
	}
	var sums [6]int64
	var throughput, maxUse float64
	for i := range rep.Ranks {
		rk := &rep.Ranks[i]
		for j, v := range []int64{rk.Running, rk.Waiting, rk.WaitingUncachedTokens, rk.UsedTokens, rk.MaxTotalTokens, rk.MaxRunning} {
			if v < 0 {
				t.Fatalf("rank %d: negative count %d", i, v)
			}
			if sums[j] > math.MaxInt64-v {
				t.Fatalf("rank %d: totals overflow int64", i)
			}
			sums[j] += v
		}
		for _, v := range []float64{rk.TokenUsage, rk.GenThroughput, rk.CacheHitRate, rk.Utilization} {
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				t.Fatalf("rank %d: ratio %v", i, v)
			}
		}
		if rk.Fields&^(allFields|loadpolicy.FieldPrefillCounters) != 0 {
			t.Fatalf("rank %d: unknown field bits %b", i, rk.Fields)
		}
		throughput += rk.GenThroughput
		if rk.Has(loadpolicy.FieldTokenUsage) {
			maxUse = math.Max(maxUse, rk.TokenUsage)
		}
	}
	got := [6]int64{rep.Running, rep.Waiting, rep.WaitingUncachedTokens, rep.UsedTokens, rep.MaxTotalTokens, rep.MaxRunning}
	if got != sums {
		t.Fatalf("totals %v, sums of ranks %v", got, sums)
	}
	if rep.GenThroughput != throughput {
		t.Fatalf("throughput %v, sum of ranks %v", rep.GenThroughput, throughput)
	}
	if rep.MaxTokenUsage < maxUse {
		t.Fatalf("max token usage %v below a rank's %v", rep.MaxTokenUsage, maxUse)
	}
}
