package trace

import (
	"math"
	"reflect"
	"testing"
	"time"
)

func TestSlice(t *testing.T) {
	s := time.Second
	reqs := []Request{{Line: 1, At: 0}, {Line: 2, At: 1 * s}, {Line: 3, At: 2 * s}, {Line: 4, At: 2 * s}, {Line: 5, At: 5 * s}}
	tests := []struct {
		name         string
		from, length time.Duration
		want         []Request
	}{
		{"all", 0, 0, reqs},
		{"middle, half-open", 1 * s, 1 * s, []Request{{Line: 2, At: 0}}},
		{"equal times together", 1500 * time.Millisecond, 3 * s,
			[]Request{{Line: 3, At: 500 * time.Millisecond}, {Line: 4, At: 500 * time.Millisecond}}},
		{"to the end", 2 * s, -1, []Request{{Line: 3, At: 0}, {Line: 4, At: 0}, {Line: 5, At: 3 * s}}},
		{"past the end", 6 * s, 0, []Request{}},
		{"before the start", -2 * s, 3500 * time.Millisecond, []Request{{Line: 1, At: 2 * s}, {Line: 2, At: 3 * s}}},
		{"huge length", 5 * s, math.MaxInt64, []Request{{Line: 5, At: 0}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Slice(reqs, tt.from, tt.length)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Slice(%v, %v) = %+v, want %+v", tt.from, tt.length, got, tt.want)
			}
		})
	}
	if reqs[2].At != 2*s {
		t.Error("Slice changed its input")
	}
}

func TestCompress(t *testing.T) {
	reqs := []Request{{Line: 1, At: 0}, {Line: 2, At: 4 * time.Second}, {Line: 3, At: 10 * time.Second}}
	tests := []struct {
		factor float64
		want   []time.Duration
	}{
		{4, []time.Duration{0, time.Second, 2500 * time.Millisecond}},
		{0.5, []time.Duration{0, 8 * time.Second, 20 * time.Second}},
		{1e-300, []time.Duration{0, math.MaxInt64, math.MaxInt64}},
		{0, []time.Duration{0, 4 * time.Second, 10 * time.Second}},
		{-2, []time.Duration{0, 4 * time.Second, 10 * time.Second}},
		{math.NaN(), []time.Duration{0, 4 * time.Second, 10 * time.Second}},
		{math.Inf(1), []time.Duration{0, 4 * time.Second, 10 * time.Second}},
	}
	for _, tt := range tests {
		got := Compress(reqs, tt.factor)
		for i, r := range got {
			if r.At != tt.want[i] || r.Line != reqs[i].Line {
				t.Errorf("Compress(%v): request %d at %v, want %v", tt.factor, i, r.At, tt.want[i])
			}
		}
	}
	if reqs[1].At != 4*time.Second {
		t.Error("Compress changed its input")
	}
}

func TestSummarize(t *testing.T) {
	s := time.Second
	reqs := []Request{
		{At: 1 * s, InputTokens: 30, OutputTokens: 3},
		{At: 2 * s, InputTokens: 10, OutputTokens: 100},
		{At: 3 * s, InputTokens: 40, OutputTokens: 1},
		{At: 5 * s, InputTokens: 20, OutputTokens: 2},
	}
	want := Stats{
		Requests: 4, Duration: 4 * s, Rate: 1,
		PromptMean: 25, PromptP50: 20, PromptP99: 40, PromptMax: 40, // nearest rank: 2nd and 4th of 4
		OutputMean: 26.5, OutputP99: 100,
	}
	if got := Summarize(reqs); got != want {
		t.Errorf("Summarize = %+v\nwant        %+v", got, want)
	}
	if got := Summarize(nil); got != (Stats{}) {
		t.Errorf("Summarize(nil) = %+v, want zero", got)
	}
	if got := Summarize(reqs[:1]); got.Rate != 0 || got.Duration != 0 || got.PromptP99 != 30 {
		t.Errorf("Summarize of one request = %+v, want rate 0, duration 0, p99 30", got)
	}
}
