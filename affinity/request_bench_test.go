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
// With tools, 8 KiB of tool definitions follow the messages, as the OpenAI SDK sends them: the messages
// are walked twice, to key them behind the tools.
func BenchmarkRequest(b *testing.B) {
	plain := make([][]byte, 64)
	withTools := make([][]byte, 64)
	tools := `,"tools":[{"type":"function","function":{"name":"lookup","description":"` + strings.Repeat("Find an order by its number. ", 280) + `"}}]}`
	for i := range plain {
		plain[i] = []byte(strings.Replace(chatBody(16<<10, false), `"content":"You`, fmt.Sprintf(`"content":"Group %d. You`, i), 1))
		withTools[i] = append(bytes.TrimSuffix(bytes.Clone(plain[i]), []byte("}")), tools...)
	}
	for _, v := range []struct {
		name   string
		bodies [][]byte
		n      int
	}{{"chat16KiB-4", plain, 4}, {"chat16KiB-64", plain, 64}, {"chat16KiB-tools8KiB-4", withTools, 4}} {
		bodies, n := v.bodies, v.n
		b.Run(v.name, func(b *testing.B) {
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
