package caddymodule

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// With affinity prefix, Select places the prompts it has seen within each worker's KV pool: once a
// placement has run, the system prompts that the placement moved off the small-pool worker are sent
// where it moved them.
func TestSelectSendsCrowdedPromptsToTheirPlacedHome(t *testing.T) {
	pool := UpstreamsForTest(3)
	const all = loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldUsedTokens |
		loadpolicy.FieldMaxTotalTokens | loadpolicy.FieldMaxRunning | loadpolicy.FieldGenThroughput
	kvPool := []int64{2048, 1 << 20, 1 << 20} // worker 0's budget holds none of the prompts below
	p := &Policy{Metric: "cost", Affinity: affinityPrefix}
	err := ProvisionWithReports(p, pool, func(i int) *loadpolicy.Report {
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Running: 1, MaxTotalTokens: kvPool[i], MaxRunning: 64,
			GenThroughput: 100, Fields: all}})
	})
	if err != nil {
		t.Fatal(err)
	}
	bodies := make([]string, 24)
	for i := range bodies {
		system := strings.Repeat(fmt.Sprintf("You are assistant number %d; answer briefly. ", i), 200)
		bodies[i] = `{"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"}]}`
	}
	sendAll := func() (moved, wrong int) {
		for _, body := range bodies {
			st := p.readRequest(httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)))
			want := p.homes.Of(st.key)
			got := p.Select(pool, httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)), nil)
			if want == 0 {
				continue
			}
			moved++
			if got == nil || p.workerOf(got.Dial).ID != want {
				wrong++
			}
		}
		return moved, wrong
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		moved, wrong := sendAll()
		if moved > 0 && wrong == 0 {
			if moved >= len(bodies)-1 {
				t.Fatalf("%d of %d prompts moved: the placement moved more than the small pool's", moved, len(bodies))
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10 s: %d prompts placed off their first worker, %d of them sent elsewhere", moved, wrong)
		}
		time.Sleep(20 * time.Millisecond) // a placement runs every PlaceEvery
	}
}
