package trace

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// sharedTraces is the public traces' folder beside the repository.
var sharedTraces = filepath.Join("..", "..", "..", "shared", "traces")

// sharedTrace is one file of it with the figures this package computes of it. Rows are as the folder's
// README gives them. The other figures are this package's of the first halves; the same code on the
// whole public traces gives the README's whole-trace figures (Mooncake conversation: prompt mean 12,035,
// p50 6,909, p99 85,401, max 126,195, 36.6% of blocks hit by an unlimited cache; synthetic: prompt mean
// 15,325, 64.0% of blocks), which is how the hit-rate walk and the percentiles were checked.
type sharedTrace struct {
	file    string
	format  Format
	rows    int
	maxTime time.Duration // the first half's bound on arrival times since the first row

	rate, promptMean, outputMean    float64 // within 1%
	promptP50, promptP99, promptMax float64 // exact
	unlimited, lru1600k, lru6400k   float64 // within 0.001
}

var sharedTraceFiles = []sharedTrace{
	{file: "azure2023_conv_first_half.csv", format: FormatAzure, rows: 10108, maxTime: 1800 * time.Second,
		rate: 5.616, promptMean: 1243.3, outputMean: 217.35, promptP50: 1033, promptP99: 4123, promptMax: 14050},
	{file: "azure2023_code_first_half.csv", format: FormatAzure, rows: 5740, maxTime: 1800 * time.Second,
		rate: 3.210, promptMean: 2027.6, outputMean: 27.36, promptP50: 1459, promptP99: 7436, promptMax: 7437},
	{file: "mooncake_conversation_first_half.jsonl", format: FormatMooncake, rows: 5719, maxTime: 1800 * time.Second,
		rate: 3.183, promptMean: 12870.1, outputMean: 345.73, promptP50: 7640, promptP99: 91305, promptMax: 123192,
		unlimited: 0.3472, lru1600k: 0.0683, lru6400k: 0.2334},
	{file: "mooncake_synthetic_first_half.jsonl", format: FormatMooncake, rows: 1925, maxTime: 511 * time.Second,
		rate: 3.770, promptMean: 12219.4, outputMean: 192.74, promptP50: 3616, promptP99: 56635, promptMax: 134773,
		unlimited: 0.3221, lru1600k: 0.0566, lru6400k: 0.2167},
}

// openShared reads one of the shared trace files, skipping the test only if the folder is absent.
func openShared(t *testing.T, tr sharedTrace) []Request {
	t.Helper()
	if _, err := os.Stat(sharedTraces); os.IsNotExist(err) {
		t.Skipf("the public traces are not beside the repository (%s absent): real files not checked", sharedTraces)
	}
	reqs, f, err := Open(filepath.Join(sharedTraces, tr.file))
	if err != nil {
		t.Fatal(err)
	}
	if f != tr.format {
		t.Errorf("format = %v, want %v", f, tr.format)
	}
	return reqs
}

func TestSharedTraces(t *testing.T) {
	for _, tr := range sharedTraceFiles {
		t.Run(tr.file, func(t *testing.T) {
			reqs := openShared(t, tr)
			s := Summarize(reqs)
			unlimited := UnlimitedHitRate(reqs)
			lru1600k, lru6400k := LRUHitRate(reqs, 1_600_000), LRUHitRate(reqs, 6_400_000)
			t.Logf("%+v unlimited hit %.4f, LRU 1.6M %.4f, 6.4M %.4f", s, unlimited, lru1600k, lru6400k)
			if s.Requests != tr.rows {
				t.Errorf("%d rows, want %d", s.Requests, tr.rows)
			}
			if reqs[0].At != 0 || s.Duration <= tr.maxTime*9/10 || s.Duration >= tr.maxTime {
				t.Errorf("first at %v, duration %v: want 0 and within 10%% below %v", reqs[0].At, s.Duration, tr.maxTime)
			}
			for _, c := range []struct {
				name      string
				got, want float64
				tolerance float64 // relative
			}{
				{"rate", s.Rate, tr.rate, 0.01},
				{"prompt mean", s.PromptMean, tr.promptMean, 0.01},
				{"output mean", s.OutputMean, tr.outputMean, 0.01},
				{"prompt p50", s.PromptP50, tr.promptP50, 0},
				{"prompt p99", s.PromptP99, tr.promptP99, 0},
				{"prompt max", s.PromptMax, tr.promptMax, 0},
			} {
				if math.Abs(c.got-c.want) > c.tolerance*c.want {
					t.Errorf("%s %.4g, want %.4g within %g%%", c.name, c.got, c.want, 100*c.tolerance)
				}
			}
			for _, c := range []struct {
				name      string
				got, want float64
			}{{"unlimited hit rate", unlimited, tr.unlimited}, {"LRU 1.6M hit rate", lru1600k, tr.lru1600k}, {"LRU 6.4M hit rate", lru6400k, tr.lru6400k}} {
				if math.Abs(c.got-c.want) > 0.001 {
					t.Errorf("%s %.4f, want %.4f", c.name, c.got, c.want)
				}
			}
			if tr.format == FormatMooncake {
				// A bigger cache hits more, and none more than one that never evicts.
				if small := LRUHitRate(reqs, 100*BlockTokens); !(small < lru1600k && lru1600k < lru6400k && lru6400k < unlimited) {
					t.Errorf("hit rates not increasing with capacity: 51,200 tokens %.4f, 1.6M %.4f, 6.4M %.4f, unlimited %.4f",
						small, lru1600k, lru6400k, unlimited)
				}
				if unlimited < 0.2 || unlimited > 0.5 {
					t.Errorf("unlimited hit rate %.4f, want 0.2..0.5", unlimited)
				}
				checkSharedPrefixes(t, reqs)
			}
		})
	}
}

// checkSharedPrefixes checks on pairs of a real trace's requests that their prompt texts share exactly
// the tokens their hash ids say: the leading blocks with equal ids (each as far as the shorter of the
// two), and not one token more.
func checkSharedPrefixes(t *testing.T, reqs []Request) {
	t.Helper()
	for _, r := range reqs {
		for _, id := range r.HashIDs {
			if id < 0 || id >= 1<<24 {
				t.Fatalf("line %d: id %d outside [0, 2^24), where PromptText's texts of ids differ from their first bytes", r.Line, id)
			}
		}
	}
	const salt = 7
	var prev []byte
	var buf []byte
	for i := 1; i < len(reqs); i += max(1, len(reqs)/300) {
		a, b := reqs[i-1], reqs[i]
		var want int
		for k := 0; k < min(len(a.HashIDs), len(b.HashIDs)) && a.HashIDs[k] == b.HashIDs[k]; k++ {
			na, nb := blockTokens(a.InputTokens, k), blockTokens(b.InputTokens, k)
			want += min(na, nb)
			if na != nb {
				break
			}
		}
		prev = AppendPromptText(prev[:0], a, salt)
		buf = AppendPromptText(buf[:0], b, salt)
		var got int
		for got*BytesPerToken < min(len(prev), len(buf)) &&
			string(prev[got*BytesPerToken:(got+1)*BytesPerToken]) == string(buf[got*BytesPerToken:(got+1)*BytesPerToken]) {
			got++
		}
		if got != want {
			t.Errorf("lines %d and %d: texts share %d leading tokens, ids %d", a.Line, b.Line, got, want)
		}
	}
}
