package caddymodule

import (
	"maps"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Counts from many goroutines at once each count once, whichever lines their requests fall in, and a
// scrape shows every value's count under its label, those never counted at 0.
func TestCounterVecCountsEveryIncrement(t *testing.T) {
	v := newCounterVec("test_total", "Test counts.", "branch", []string{"a", "b", "c"})
	const goroutines, each = 8, 1000
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range each {
				v.counts[0].Inc(httptest.NewRequest("GET", "/", nil))
			}
			v.counts[1].Inc(httptest.NewRequest("GET", "/", nil))
		})
	}
	wg.Wait()
	reg := prometheus.NewRegistry()
	if err := reg.Register(v); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(families) != 1 || families[0].GetName() != "caddy_sglang_load_test_total" || families[0].GetType() != dto.MetricType_COUNTER {
		t.Fatalf("gathered %v, want one counter family caddy_sglang_load_test_total", families)
	}
	got := map[string]float64{}
	for _, m := range families[0].GetMetric() {
		got[m.GetLabel()[0].GetName()+"="+m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
	}
	if want := map[string]float64{"branch=a": goroutines * each, "branch=b": goroutines, "branch=c": 0}; !maps.Equal(got, want) {
		t.Errorf("counts %v, want %v", got, want)
	}
	used := 0
	for i := range v.counts[0].shards {
		if v.counts[0].shards[i].n.Load() > 0 {
			used++
		}
	}
	if used < counterShards/2 {
		t.Errorf("%d requests counted in %d of %d lines, want them spread", goroutines*each, used, counterShards)
	}
}
