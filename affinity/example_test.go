package affinity_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/caddy-sglang/caddy-sglang/affinity"
)

// workers is how a caller might present its upstreams: their index workers, loads and a cost model
// (here: the seconds queued ahead plus the uncached prefill at 10,000 tokens/s).
type workers struct {
	ws       []affinity.Worker
	inflight []float64
	queued   []float64
	prompt   int64
}

func (w *workers) Len() int { return len(w.ws) }
func (w *workers) Candidate(i int) (affinity.Worker, float64, float64) {
	return w.ws[i], w.inflight[i], 1
}
func (w *workers) Alone(int) float64 { return float64(w.prompt) / 10000 }
func (w *workers) Cost(i int, cached int64) (float64, bool) {
	return w.queued[i] + float64(w.prompt-cached)/10000, true
}

// The path of one request: read the head of its body, parse it, choose a worker, record the choice.
func Example() {
	index := affinity.NewIndex(affinity.DefaultMaxBytes)
	fleet := &workers{inflight: make([]float64, 3), queued: make([]float64, 3)}
	for _, addr := range []string{"10.0.0.1:30000", "10.0.0.2:30000", "10.0.0.3:30000"} {
		fleet.ws = append(fleet.ws, index.Worker(addr))
	}
	system := strings.Repeat("You are a terse assistant. ", 100)
	route := func(question string) affinity.Choice {
		body := fmt.Sprintf(`{"messages":[{"role":"system","content":%q},{"role":"user","content":%q}],"max_tokens":64}`, system, question)
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		head, complete := affinity.ReadHead(r, 64<<10, nil)
		req := affinity.Request{Blocks: make([]uint64, 0, affinity.MaxBlocks)}
		affinity.Parse(r.URL.Path, head, complete, r.ContentLength, &req)
		fleet.prompt = req.PromptTokens
		c := index.Choose(affinity.Key{Blocks: req.Blocks, BlockTokens: affinity.BlockTokens, PromptTokens: req.PromptTokens}, fleet, 0)
		index.Record(req.Blocks, fleet.ws[c.Index])
		return c
	}
	first := route("What is a KV cache?")
	fleet.queued[first.Index] = 0.05 // busier now, by less than the prefill the cache saves
	second := route("What is prefill?")
	fmt.Println(first.Index == second.Index, second.Outcome, second.CachedTokens)
	fleet.queued[first.Index] = 5 // swamped
	third := route("What is decode?")
	fmt.Println(third.Index == first.Index, third.Outcome)
	// Output:
	// true followed 640
	// false yielded
}
