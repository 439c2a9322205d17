package caddymodule

import (
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// With affinity, a request without a key is chosen for as the cost metric chooses without affinity:
// from a window of the pool, allocating nothing. A GET has no body to key, and carries no prompt for a
// session header to key. Pricing every upstream instead took 67 µs a request at 1,024 upstreams.
func TestAffinityRequestWithoutKeyIsChosenAsByCost(t *testing.T) {
	pool := UpstreamsForTest(1024)
	const cheapest = 500
	report := func(i int) *loadpolicy.Report {
		running := int64(40)
		if i == cheapest {
			running = 0
		}
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Running: running, MaxRunning: 64, GenThroughput: 800,
			Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldMaxRunning | loadpolicy.FieldGenThroughput}})
	}
	for _, mode := range []string{affinityPrefix, affinityHeader} {
		p := &Policy{Affinity: mode, AffinityHeader: "X-Session-ID"}
		if err := ProvisionWithReports(p, pool, report); err != nil {
			t.Fatal(err)
		}
		req := httptest.NewRequest("GET", "/v1/models", nil)
		req.Header.Set("X-Session-ID", "s-1")
		elsewhere := 0
		for range 200 {
			u := p.Select(pool, req, nil)
			if u == nil {
				t.Fatalf("affinity %s: no upstream selected", mode)
			}
			if u != pool[cheapest] {
				elsewhere++
			}
		}
		// Each upstream priced, every request would go to the cheapest; a window of 16 holds it for 16
		// of the 1,024 starts.
		if elsewhere == 0 {
			t.Errorf("affinity %s: 200 requests without a key all went to the cheapest of 1,024 upstreams: priced on every one", mode)
		}
		if allocs := testing.AllocsPerRun(100, func() { p.Select(pool, req, nil) }); allocs != 0 {
			t.Errorf("affinity %s: a GET allocated %v times, want 0", mode, allocs)
		}
		if n := p.affinityIndex.Len(); n != 0 {
			t.Errorf("affinity %s: the index holds %d blocks after GETs alone, want none", mode, n)
		}
	}
}
