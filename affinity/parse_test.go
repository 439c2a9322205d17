package affinity

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// refKey is the key by its definition: each whole block's wyhash chained onto the hash before it.
func refKey(seed uint64, stream []byte, maxBlocks int) []uint64 {
	out := []uint64{}
	h := seed
	for i := 1; i*BlockBytes <= len(stream) && len(out) < maxBlocks; i++ {
		h = mix(h, wyhash(stream[(i-1)*BlockBytes:i*BlockBytes], 0))
		out = append(out, h)
	}
	return out
}

func chatStream(msgs ...string) []byte {
	var b []byte
	for i := 0; i+1 < len(msgs); i += 2 {
		b = append(b, msgs[i]...)
		b = append(b, 0)
		b = append(b, msgs[i+1]...)
		b = append(b, 0)
	}
	return b
}

func idsStream(ids ...uint32) []byte {
	var b []byte
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint32(b, id)
	}
	return b
}

func tokens(textBytes int) int64 { return max(1, (int64(textBytes)+3)/4) }

func parse(path, body string) Request {
	r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
	Parse(path, []byte(body), true, int64(len(body)), &r)
	return r
}

var (
	system = strings.Repeat("You are a helpful assistant. ", 10) // 290 bytes: 4 whole blocks with the role
	user   = "Summarise the following text in three sentences, please."
	ids    = func() (s string, v []uint32) {
		var parts []string
		for i := range 40 {
			parts = append(parts, fmt.Sprint(1000+i))
			v = append(v, uint32(1000+i))
		}
		return "[" + strings.Join(parts, ", ") + "]", v
	}
)

func TestParseShapes(t *testing.T) {
	idsJSON, idsVals := ids()
	sysJSON, _ := json.Marshal(system)
	userJSON, _ := json.Marshal(user)
	chatKey := refKey(seedText, chatStream("system", system, "user", user), MaxBlocks)
	escaped := `line one\nline \"two\"\t\u00e9 \ud83d\ude00 \ud800 end \/`
	longJSON := strings.Repeat("0123456789abcdef", 8) + escaped // the escapes fall in whole blocks

	tests := []struct {
		name, path, body string
		want             Request
	}{
		{
			name: "chat, string contents",
			path: "/v1/chat/completions",
			body: fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":%s},{"role":"user","content":%s}],"max_tokens":256,"stream":true}`, sysJSON, userJSON),
			want: Request{Shape: ShapeChat, PromptTokens: tokens(len(system) + len(user)), MaxTokens: 256, Stream: true, Blocks: chatKey},
		},
		{
			name: "chat, content before role, unknown fields everywhere",
			path: "/v1/chat/completions",
			body: fmt.Sprintf(`{"response_format":[{"type":"json_schema","json_schema":{"name":"f","description":"a \"quoted\" ]} string","schema":{"a":[1,2,{"b":null}]}}}],
				"messages":[{"content":%s,"name":"x","role":"system"},{"role":"user","extra":{"k":[true,false]},"content":%s}],
				"temperature":0.7,"max_completion_tokens":99,"stream":false}`, sysJSON, userJSON),
			want: Request{Shape: ShapeChat, PromptTokens: tokens(len(system) + len(user)), MaxTokens: 99, Blocks: chatKey},
		},
		{
			name: "chat, content parts",
			path: "/v1/chat/completions",
			body: fmt.Sprintf(`{"messages":[{"role":"system","content":[{"type":"text","text":%s}]},{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":%s}]}]}`,
				sysJSON, userJSON),
			want: Request{Shape: ShapeChat, PromptTokens: tokens(len(system) + len(user)), Blocks: chatKey},
		},
		{
			name: "chat with an answer in its history continues a conversation",
			path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"hi"},{"content":"hello","role":"assistant"},{"role":"user","content":"and?"}]}`,
			want: Request{Shape: ShapeChat, PromptTokens: 3, Continues: true, Blocks: []uint64{}},
		},
		{
			name: "chat, an assistant's name in a user message is not an answer",
			path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"\"assistant\""},{"role":"assistants","content":"x"}]}`,
			want: Request{Shape: ShapeChat, PromptTokens: 3, Blocks: []uint64{}},
		},
		{
			name: "chat, max_tokens wins over max_completion_tokens",
			path: "/v1/chat/completions",
			body: `{"max_completion_tokens":7,"messages":[{"role":"user","content":"hi"}],"max_tokens":5}`,
			want: Request{Shape: ShapeChat, PromptTokens: 1, MaxTokens: 5, Blocks: []uint64{}},
		},
		{
			name: "chat, escapes are keyed and counted as sent, less a byte per backslash",
			path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"` + longJSON + `"}]}`,
			want: Request{Shape: ShapeChat, PromptTokens: tokens(len(longJSON) - strings.Count(longJSON, `\`)),
				Blocks: refKey(seedText, chatStream("user", longJSON), MaxBlocks)},
		},
		{
			name: "chat, a null content and an assistant turn",
			path: "/prefix/v1/chat/completions",
			body: fmt.Sprintf(`{"messages":[{"role":"system","content":%s},{"role":"assistant","content":null,"tool_calls":[]},{"role":"user","content":%s}]}`, sysJSON, userJSON),
			want: Request{Shape: ShapeChat, PromptTokens: tokens(len(system) + len(user)), Continues: true,
				Blocks: refKey(seedText, chatStream("system", system, "assistant", "", "user", user), MaxBlocks)},
		},
		{
			name: "chat, declared prompt_tokens",
			path: "/v1/chat/completions",
			body: `{"model":"bench","messages":[{"role":"user","content":"hi"}],"prompt_tokens":2048,"max_tokens":64,"stream":false}`,
			want: Request{Shape: ShapeChat, PromptTokens: 1, MaxTokens: 64, DeclaredPromptTokens: 2048, Blocks: []uint64{}},
		},
		{
			name: "completions, string",
			path: "/v1/completions",
			body: fmt.Sprintf(`{"model":"m","prompt":%s,"max_tokens":12}`, sysJSON),
			want: Request{Shape: ShapeCompletion, PromptTokens: tokens(len(system)), MaxTokens: 12, Blocks: refKey(seedText, []byte(system), MaxBlocks)},
		},
		{
			name: "completions, list of one string",
			path: "/v1/completions",
			body: fmt.Sprintf(`{"prompt":[%s],"stream":true}`, sysJSON),
			want: Request{Shape: ShapeCompletion, PromptTokens: tokens(len(system)), Stream: true, Blocks: refKey(seedText, []byte(system), MaxBlocks)},
		},
		{
			name: "completions, token ids",
			path: "/v1/completions",
			body: `{"prompt": ` + idsJSON + `,"max_tokens":3}`,
			want: Request{Shape: ShapeCompletion, PromptTokens: 40, MaxTokens: 3, Blocks: refKey(seedIDs, idsStream(idsVals...), MaxBlocks)},
		},
		{
			name: "generate, text",
			path: "/generate",
			body: fmt.Sprintf(`{"text":%s,"sampling_params":{"temperature":0,"max_new_tokens":32},"stream":true}`, sysJSON),
			want: Request{Shape: ShapeGenerate, PromptTokens: tokens(len(system)), MaxTokens: 32, Stream: true, Blocks: refKey(seedText, []byte(system), MaxBlocks)},
		},
		{
			name: "generate, input_ids",
			path: "/generate",
			body: `{"input_ids":` + idsJSON + `,"sampling_params":{"max_new_tokens":8}}`,
			want: Request{Shape: ShapeGenerate, PromptTokens: 40, MaxTokens: 8, Blocks: refKey(seedIDs, idsStream(idsVals...), MaxBlocks)},
		},
		{
			name: "generate, text wins over earlier input_ids",
			path: "/generate",
			body: fmt.Sprintf(`{"input_ids":%s,"text":%s}`, idsJSON, sysJSON),
			want: Request{Shape: ShapeGenerate, PromptTokens: tokens(len(system)), Blocks: refKey(seedText, []byte(system), MaxBlocks)},
		},
		{
			name: "generate, text wins over later input_ids",
			path: "/generate",
			body: fmt.Sprintf(`{"text":%s,"input_ids":%s}`, sysJSON, idsJSON),
			want: Request{Shape: ShapeGenerate, PromptTokens: tokens(len(system)), Blocks: refKey(seedText, []byte(system), MaxBlocks)},
		},
		{
			name: "generate, max_tokens is not its field",
			path: "/generate",
			body: `{"text":"hello","max_tokens":9}`,
			want: Request{Shape: ShapeGenerate, PromptTokens: 2, Blocks: []uint64{}},
		},
		{
			name: "negative and fractional sizes read as absent",
			path: "/v1/chat/completions",
			body: `{"messages":[],"max_tokens":-4,"prompt_tokens":1.5}`,
			want: Request{Shape: ShapeChat, PromptTokens: 1, Blocks: []uint64{}},
		},
		{name: "unknown path", path: "/v1/embeddings", body: `{"input":"x"}`, want: Request{Blocks: []uint64{}}},
		{name: "not JSON", path: "/v1/chat/completions", body: `messages=hello`, want: Request{Blocks: []uint64{}}},
		{name: "not an object", path: "/generate", body: `["text"]`, want: Request{Blocks: []uint64{}}},
		{name: "cut short though complete", path: "/generate", body: `{"text":"abc`, want: Request{Blocks: []uint64{}}},
		{name: "a bad escape is not checked", path: "/generate", body: `{"text":"a\qb"}`, want: Request{Shape: ShapeGenerate, PromptTokens: 1, Blocks: []uint64{}}},
		{name: "empty", path: "/generate", body: ``, want: Request{Blocks: []uint64{}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := parse(tt.path, tt.body)
			assertRequest(t, got, tt.want)
		})
	}
}

func assertRequest(t *testing.T, got, want Request) {
	t.Helper()
	if got.Shape != want.Shape || got.PromptTokens != want.PromptTokens || got.MaxTokens != want.MaxTokens ||
		got.Stream != want.Stream || got.DeclaredPromptTokens != want.DeclaredPromptTokens || got.Continues != want.Continues {
		t.Errorf("got shape %d prompt %d max %d stream %t declared %d continues %t, want %d %d %d %t %d %t",
			got.Shape, got.PromptTokens, got.MaxTokens, got.Stream, got.DeclaredPromptTokens, got.Continues,
			want.Shape, want.PromptTokens, want.MaxTokens, want.Stream, want.DeclaredPromptTokens, want.Continues)
	}
	if fmt.Sprint(got.Blocks) != fmt.Sprint(want.Blocks) {
		t.Errorf("blocks\n got %x\nwant %x", got.Blocks, want.Blocks)
	}
}

func TestParseMeasuresTextAsSent(t *testing.T) {
	for _, tt := range []struct {
		name, sent string
		bytes      int // what sent counts as, by hand
	}{
		{"no escapes", "plain caf\u00e9 ", 12},
		{"two-byte escapes count as decoded", `line\none\t\"two\"\/ \r\b\f`, 19},
		{"an escaped backslash counts a byte short", `C:\\dir\\file `, 10},                   // decodes to 12
		{"a \\u escape counts five bytes", `\u003cb\u003e caf\u00e9 \ud83d\ude00 `, 7 + 5*5}, // decodes to 15
	} {
		t.Run(tt.name, func(t *testing.T) {
			sent := strings.Repeat(tt.sent, 64) // keyed as well as counted
			r := parse("/generate", `{"text":"`+sent+`"}`)
			if want := tokens(64 * tt.bytes); r.PromptTokens != want || len(r.Blocks) != len(sent)/BlockBytes {
				t.Errorf("%d tokens, %d blocks; want %d tokens, %d blocks", r.PromptTokens, len(r.Blocks), want, len(sent)/BlockBytes)
			}
		})
	}
}

// A chat's tool definitions lead its key as the chat template writes them, wherever they stand in the
// body, and count as prompt text at their JSON's length; their blocks are the application's, shared.
func TestParseToolDefinitions(t *testing.T) {
	tools := `[{"type":"function","function":{"name":"lookup","description":"` + strings.Repeat("Find an order by its number. ", 20) +
		`","parameters":{"type":"object","properties":{"number":{"type":"string"}}}}}]`
	functions := `[{"name":"old_style","parameters":{}}]`
	msgs := fmt.Sprintf(`[{"role":"system","content":%q},{"role":"user","content":%q}]`, system, user)
	defsText := len(tools) + len(functions)
	msgStream := chatStream("system", system, "user", user)
	stream := append(append(append([]byte(tools), 0), append([]byte(functions), 0)...), msgStream...)
	want := Request{Shape: ShapeChat, PromptTokens: tokens(defsText + len(system) + len(user)), Blocks: refKey(seedText, stream, MaxBlocks)}
	for _, body := range []string{
		`{"messages":` + msgs + `,"tools":` + tools + `,"functions":` + functions + `}`, // as the OpenAI SDK orders them
		`{"functions":` + functions + `,"tools":` + tools + `,"messages":` + msgs + `}`,
		`{"tools":` + tools + `,"messages":` + msgs + `,"functions":` + functions + `}`,
	} {
		got := parse("/v1/chat/completions", body)
		assertRequest(t, got, want)
		// The definitions, the separators after them and the system message: all shared.
		if sharedBytes := defsText + 2 + len("system") + 2 + len(system); got.SharedBlocks != sharedBytes/BlockBytes {
			t.Errorf("shared blocks %d, want %d", got.SharedBlocks, sharedBytes/BlockBytes)
		}
	}

	// null is none; without a system message the definitions alone are shared.
	body := `{"tools":null,"functions":` + functions + `,"messages":[{"role":"user","content":"` + strings.Repeat("q", 300) + `"}]}`
	got := parse("/v1/chat/completions", body)
	stream = append(append([]byte(functions), 0), chatStream("user", strings.Repeat("q", 300))...)
	assertRequest(t, got, Request{Shape: ShapeChat, PromptTokens: tokens(len(functions) + 300), Blocks: refKey(seedText, stream, MaxBlocks)})
	if got.SharedBlocks != (len(functions)+1)/BlockBytes {
		t.Errorf("shared blocks %d, want %d", got.SharedBlocks, (len(functions)+1)/BlockBytes)
	}

	// Requests that differ in their tools only share no block; with the same tools, their messages' blocks.
	other := strings.Replace(tools, "lookup", "search", 1)
	a := parse("/v1/chat/completions", `{"messages":`+msgs+`,"tools":`+tools+`}`)
	b := parse("/v1/chat/completions", `{"messages":`+msgs+`,"tools":`+other+`}`)
	if len(a.Blocks) == 0 || a.Blocks[0] == b.Blocks[0] {
		t.Errorf("different tools share their first block: %x, %x", a.Blocks[:1], b.Blocks[:1])
	}
}

// A head that ends inside the tool definitions ends inside the prompt: the rest of the body counts as
// prompt text, and the key is the definitions' whole blocks, with nothing behind them.
func TestParseCutInsideToolDefinitions(t *testing.T) {
	tools := `[{"type":"function","function":{"name":"f","description":"` + strings.Repeat("d", 4*BlockBytes) + `"}}]`
	body := `{"messages":[{"role":"user","content":"hi"}],"tools":` + tools + `}`
	cut := strings.Index(body, `"tools":`) + len(`"tools":`) + 2*BlockBytes + 10
	r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
	Parse("/v1/chat/completions", []byte(body[:cut]), false, int64(len(body)), &r)
	start := strings.Index(body, `"tools":`) + len(`"tools":`)
	if want := tokens(len(body) - start + len("hi")); r.PromptTokens != want {
		t.Errorf("prompt %d tokens, want %d: the definitions as sent, cut or not, and the message", r.PromptTokens, want)
	}
	if want := refKey(seedText, []byte(body[start:cut]), MaxBlocks); fmt.Sprint(r.Blocks) != fmt.Sprint(want) {
		t.Errorf("blocks\n got %x\nwant %x", r.Blocks, want)
	}
	if r.SharedBlocks != 2 {
		t.Errorf("shared blocks %d, want 2", r.SharedBlocks)
	}
}

func TestParseSharedPrefixSharesBlocks(t *testing.T) {
	turn1 := parse("/v1/chat/completions", fmt.Sprintf(`{"messages":[{"role":"system","content":%q},{"role":"user","content":"first question"}]}`, system))
	turn2 := parse("/v1/chat/completions", fmt.Sprintf(`{"messages":[{"role":"system","content":%q},{"role":"user","content":"another one"}]}`, system))
	whole := (len("system") + 1 + len(system)) / BlockBytes
	if len(turn1.Blocks) < whole || len(turn2.Blocks) < whole {
		t.Fatalf("blocks %d and %d, want at least %d", len(turn1.Blocks), len(turn2.Blocks), whole)
	}
	for i := range whole {
		if turn1.Blocks[i] != turn2.Blocks[i] {
			t.Fatalf("block %d differs within the shared system prompt", i)
		}
	}
	if fmt.Sprint(turn1.Blocks) == fmt.Sprint(turn2.Blocks) && len(turn1.Blocks) > whole {
		t.Fatal("different questions, same key")
	}
}

func TestParseBlockCapacity(t *testing.T) {
	body := fmt.Sprintf(`{"text":%q}`, strings.Repeat("x", 100*BlockBytes))
	for _, c := range []int{0, 1, 7, MaxBlocks} {
		r := Request{Blocks: make([]uint64, 0, c)}
		Parse("/generate", []byte(body), true, int64(len(body)), &r)
		if want := min(c, 100); len(r.Blocks) != want {
			t.Errorf("capacity %d: %d blocks, want %d", c, len(r.Blocks), want)
		}
		if r.PromptTokens != 100*BlockTokens {
			t.Errorf("capacity %d: prompt tokens %d, want %d", c, r.PromptTokens, 100*BlockTokens)
		}
	}
}

func TestParseTruncatedHead(t *testing.T) {
	text := strings.Repeat("abcd", 4096) // 16 KiB, 4,096 tokens
	body := fmt.Sprintf(`{"messages":[{"role":"user","content":%q}],"max_tokens":100}`, text)
	full := parse("/v1/chat/completions", body)
	for _, headLen := range []int{1000, 4000, 8000} {
		for _, cl := range []int64{int64(len(body)), -1} {
			r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
			Parse("/v1/chat/completions", []byte(body[:headLen]), false, cl, &r)
			if r.Shape != ShapeChat || r.MaxTokens != 0 {
				t.Errorf("head %d: shape %d, max tokens %d (cut off, so unknown)", headLen, r.Shape, r.MaxTokens)
			}
			inHead := int64(headLen - len(`{"messages":[{"role":"user","content":"`))
			want := (inHead + 3) / 4
			if cl > 0 {
				want = (inHead + cl - int64(headLen) + 3) / 4
			}
			if r.PromptTokens != want {
				t.Errorf("head %d, content length %d: prompt tokens %d, want %d", headLen, cl, r.PromptTokens, want)
			}
			if n := len(r.Blocks); n == 0 || fmt.Sprint(r.Blocks) != fmt.Sprint(full.Blocks[:n]) {
				t.Errorf("head %d: %d blocks, not a prefix of the whole body's", headLen, n)
			}
		}
	}
	// Cut after the prompt: the rest is not prompt text.
	cut := len(body) - len(`100}`)
	r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
	Parse("/v1/chat/completions", []byte(body[:cut]), false, int64(len(body)), &r)
	if r.PromptTokens != full.PromptTokens {
		t.Errorf("cut after the prompt: %d tokens, want %d", r.PromptTokens, full.PromptTokens)
	}
}

func TestHeaderKey(t *testing.T) {
	buf := make([]uint64, 0, 4)
	a := HeaderKey("session-1", buf)
	if len(a) != 1 {
		t.Fatalf("got %d blocks, want 1", len(a))
	}
	first := a[0]
	if b := HeaderKey("session-2", buf); b[0] == first {
		t.Fatal("two sessions, one key")
	}
	if c := HeaderKey("session-1", buf); c[0] != first {
		t.Fatal("one session, two keys")
	}
	if len(HeaderKey("", buf)) != 0 {
		t.Fatal("an empty header has a key")
	}
}

func TestParseAllocs(t *testing.T) {
	body := []byte(chatBody(16<<10, true))
	r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
	if n := testing.AllocsPerRun(100, func() { Parse("/v1/chat/completions", body, true, int64(len(body)), &r) }); n != 0 {
		t.Fatalf("Parse allocates %.1f times", n)
	}
}

// chatBody is a chat request of about size bytes: a long system prompt, a question. escapes picks
// text with an escape every 22 bytes (quotes and newlines), else prose with a newline per 80 bytes.
func chatBody(size int, escapes bool) string {
	line := "You are a careful assistant.\nAnswer \"briefly\" and cite sources. "
	if !escapes {
		line = "You are a careful assistant who answers briefly, cites sources and avoids jargon.\n"
	}
	var sys strings.Builder
	for sys.Len() < size-300 {
		sys.WriteString(line)
	}
	return fmt.Sprintf(`{"model":"default","messages":[{"role":"system","content":%q},{"role":"user","content":"What is the capital of France?"}],"max_tokens":256,"temperature":0.2,"stream":true}`,
		sys.String())
}

func BenchmarkParse(b *testing.B) {
	for _, bc := range []struct {
		name    string
		escapes bool
	}{{"chat16KiB-prose", false}, {"chat16KiB-escapes", true}} {
		body := []byte(chatBody(16<<10, bc.escapes))
		b.Run(bc.name, func(b *testing.B) {
			r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				Parse("/v1/chat/completions", body, true, int64(len(body)), &r)
			}
			cpu.report(b)
			if r.PromptTokens == 0 || len(r.Blocks) == 0 {
				b.Fatal("nothing parsed")
			}
		})
		// The yardstick: encoding/json decoding just the fields Parse reads.
		b.Run(bc.name+"-encoding-json", func(b *testing.B) {
			var v struct {
				Messages []struct {
					Role    string          `json:"role"`
					Content json.RawMessage `json:"content"`
				} `json:"messages"`
				MaxTokens *int64 `json:"max_tokens"`
				Stream    bool   `json:"stream"`
			}
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				v.Messages = v.Messages[:0]
				if err := json.Unmarshal(body, &v); err != nil {
					b.Fatal(err)
				}
			}
			cpu.report(b)
		})
	}
}

func TestParseSharedBlocks(t *testing.T) {
	sys := strings.Repeat("Answer as the manual says. ", 45) // 1,215 bytes: 4 whole blocks with the role
	sysJSON, _ := json.Marshal(sys)
	userJSON, _ := json.Marshal(user)
	one := len(chatStream("system", sys)) / BlockBytes
	two := len(chatStream("system", sys, "system", sys)) / BlockBytes
	msg := func(role string, content []byte) string {
		return fmt.Sprintf(`{"role":%q,"content":%s}`, role, content)
	}
	chat := func(msgs ...string) string { return `{"messages":[` + strings.Join(msgs, ",") + `]}` }
	for _, tt := range []struct {
		name, path, body string
		want             int
	}{
		{"system, user", "/v1/chat/completions", chat(msg("system", sysJSON), msg("user", userJSON)), one},
		{"developer, user", "/v1/chat/completions", chat(msg("developer", sysJSON), msg("user", userJSON)),
			len(chatStream("developer", sys)) / BlockBytes},
		{"two system messages", "/v1/chat/completions", chat(msg("system", sysJSON), msg("system", sysJSON), msg("user", userJSON)), two},
		{"system alone", "/v1/chat/completions", chat(msg("system", sysJSON)), one},
		{"content before role", "/v1/chat/completions", chat(fmt.Sprintf(`{"content":%s,"role":"system"}`, sysJSON), msg("user", userJSON)), one},
		{"content parts", "/v1/chat/completions", chat(fmt.Sprintf(`{"role":"system","content":[{"type":"text","text":%s}]}`, sysJSON), msg("user", userJSON)), one},
		{"system after a user message", "/v1/chat/completions", chat(msg("user", userJSON), msg("system", sysJSON)), 0},
		{"no system message", "/v1/chat/completions", chat(msg("user", sysJSON)), 0},
		{"a completion's prompt", "/v1/completions", fmt.Sprintf(`{"prompt":%s}`, sysJSON), 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := parse(tt.path, tt.body); got.SharedBlocks != tt.want || got.SharedBlocks > len(got.Blocks) {
				t.Errorf("shared blocks %d of %d, want %d", got.SharedBlocks, len(got.Blocks), tt.want)
			}
		})
	}
	// A head that ends inside the system message: its blocks are not known to be its.
	body := chat(msg("system", sysJSON), msg("user", userJSON))
	r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
	Parse("/v1/chat/completions", []byte(body[:900]), false, int64(len(body)), &r)
	if r.SharedBlocks != 0 || len(r.Blocks) == 0 {
		t.Errorf("head cut inside the system message: shared blocks %d of %d, want 0 of some", r.SharedBlocks, len(r.Blocks))
	}
}

func TestParsePreviousBlocks(t *testing.T) {
	first := strings.Repeat("Tell me about the tides. ", 50) // 1,250 bytes: 4 whole blocks with the role
	answer := strings.Repeat("The moon pulls the sea. ", 30)
	firstJSON, _ := json.Marshal(first)
	answerJSON, _ := json.Marshal(answer)
	msg := func(role string, content []byte) string {
		return fmt.Sprintf(`{"role":%q,"content":%s}`, role, content)
	}
	chat := func(msgs ...string) string { return `{"messages":[` + strings.Join(msgs, ",") + `]}` }
	for _, tt := range []struct {
		name, body string
		want       int
	}{
		{"first turn", chat(msg("user", firstJSON)), 0},
		{"second turn", chat(msg("user", firstJSON), msg("assistant", answerJSON), msg("user", []byte(`"and?"`))),
			len(chatStream("user", first)) / BlockBytes},
		{"third turn", chat(msg("user", firstJSON), msg("assistant", answerJSON), msg("user", firstJSON),
			msg("assistant", answerJSON), msg("user", []byte(`"and?"`))),
			len(chatStream("user", first, "assistant", answer, "user", first)) / BlockBytes},
		{"content before role", chat(msg("user", firstJSON), fmt.Sprintf(`{"content":%s,"role":"assistant"}`, answerJSON),
			msg("user", []byte(`"and?"`))), len(chatStream("user", first)) / BlockBytes},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := parse("/v1/chat/completions", tt.body); got.PreviousBlocks != tt.want || got.PreviousBlocks > len(got.Blocks) {
				t.Errorf("previous blocks %d of %d, want %d", got.PreviousBlocks, len(got.Blocks), tt.want)
			}
		})
	}
}

// A head cut inside a part that is not text (an image's base64 data, say) says nothing of the
// prompt's text past it: the bytes past the head must not count as prompt text, or a 1 MiB image
// would price its request as a quarter of a million tokens.
func TestParseCutInsideMedia(t *testing.T) {
	image := strings.Repeat("iVBORw0K", 1<<17) // 1 MiB of base64
	text := strings.Repeat("abcd", 100)        // 100 tokens
	for _, tc := range []struct{ name, content string }{
		{"image url", fmt.Sprintf(`[{"type":"text","text":%q},{"type":"image_url","image_url":{"url":"data:image/png;base64,%s"}}]`, text, image)},
		{"audio", fmt.Sprintf(`[{"type":"text","text":%q},{"type":"input_audio","input_audio":{"data":"%s","format":"wav"}}]`, text, image)},
	} {
		body := `{"messages":[{"role":"user","content":` + tc.content + `}],"max_tokens":100}`
		full := parse("/v1/chat/completions", body)
		const headLen = 64 << 10
		r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
		Parse("/v1/chat/completions", []byte(body[:headLen]), false, int64(len(body)), &r)
		if full.PromptTokens != 100 || r.PromptTokens != full.PromptTokens {
			t.Errorf("%s: head cut in the media: %d prompt tokens, whole body %d, want 100 each", tc.name, r.PromptTokens, full.PromptTokens)
		}
	}
}
