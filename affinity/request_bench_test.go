package affinity

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkRequest is the whole affinity path of one request as Select runs it: read the head of a
// 16 KiB chat body (into a reused buffer), parse it, choose among the candidates and record the choice.
// The chat's system prompt is one of 64 (a shared-prefix workload), so the index knows most prefixes.
func BenchmarkRequest(b *testing.B) {
	bodies := make([][]byte, 64)
	for i := range bodies {
		bodies[i] = []byte(strings.Replace(chatBody(16<<10, false), `"content":"You`, fmt.Sprintf(`"content":"Group %d. You`, i), 1))
	}
	for _, n := range []int{4, 64} {
		b.Run(fmt.Sprintf("chat16KiB-%d", n), func(b *testing.B) {
			x := NewIndex(0)
			f := newFleet(x, n)
			buf := make([]byte, 0, 64<<10)
			req := Request{Blocks: make([]uint64, 0, MaxBlocks)}
			r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
			rd := bytes.NewReader(nil)
			b.ReportAllocs()
			cpu := startCPU()
			i := 0
			for b.Loop() {
				body := bodies[i%len(bodies)]
				rd.Reset(body)
				r.Body, r.ContentLength = io.NopCloser(rd), int64(len(body))
				head, complete := ReadHead(r, 64<<10, buf)
				Parse(r.URL.Path, head, complete, r.ContentLength, &req)
				c := x.Choose(Key{Blocks: req.Blocks, BlockTokens: BlockTokens, PromptTokens: req.PromptTokens}, f, 0)
				x.Record(req.Blocks, f.workers[c.Index])
				i++
			}
			cpu.report(b)
			if len(req.Blocks) != MaxBlocks {
				b.Fatalf("%d blocks", len(req.Blocks))
			}
		})
	}
}
