package sglangsim

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// Whatever a client posts to a generation route, the simulator answers (an answer, or a 4xx error
// that names what is wrong) and never panics. Where the pool check summed the sizes, max_tokens
// 2^63-1 panicked, and prompt_tokens 2^63-1 was admitted and held the request until its deadline.
func FuzzGenerationRequests(f *testing.F) {
	for _, s := range []struct {
		route uint8
		body  string
	}{
		{0, `{"text":"hi","sampling_params":{"max_new_tokens":8}}`},
		{0, `{"input_ids":[1,2,3],"prompt_tokens":9223372036854775807,"sampling_params":{"max_new_tokens":1}}`},
		{1, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":9223372036854775807,"stream":true}`},
		{1, `{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`},
		{2, `{"prompt":["a","b"],"max_tokens":-1}`},
		{2, `{"prompt":"x","max_tokens":4,"data_parallel_rank":0}`},
		{0, `{"text":"hi","sampling_params":{"n":128,"max_new_tokens":4000},"stream":true}`},
		{1, `{"messages":[{"role":"user","content":"hi"}],"n":3,"max_tokens":5000}`},
		{2, `{"prompt":"x","n":9223372036854775807}`},
	} {
		f.Add(s.route, []byte(s.body))
	}
	routes := []string{"/generate", "/v1/chat/completions", "/v1/completions"}
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		// Fast enough that any request the pool admits is answered within the deadline.
		w := New(Config{Name: "fuzz", MaxTotalTokens: 4096, PrefillTokensPerSec: 1e9, DecodeTokensPerSec: 1e9})
		defer w.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r := httptest.NewRequest(http.MethodPost, routes[int(route)%len(routes)], bytes.NewReader(body)).WithContext(ctx)
		rec := httptest.NewRecorder()
		w.Handler().ServeHTTP(rec, r)
		if rec.Code >= 500 {
			t.Fatalf("status %d: %s", rec.Code, rec.Body.Bytes())
		}
	})
}
