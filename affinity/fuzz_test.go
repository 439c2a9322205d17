package affinity

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"unicode/utf8"
)

// reference is what encoding/json makes of a body, by the rules Parse documents; ok is false when the
// body is not one Parse promises to agree on (a type the simulator refuses, a duplicated key).
type reference struct {
	prompt, maxTokens int64
	stream            bool
	key               []byte // the key's byte stream
	shared            int    // bytes of key within the leading system messages
	previous          int    // bytes of key before the last assistant message
	seed              uint64
	ok                bool
}

func referenceParse(path string, body []byte) (ref reference) {
	if !json.Valid(body) || !utf8.Valid(body) || duplicateKeys(body) {
		return ref
	}
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil || top == nil {
		return reference{ok: true} // valid JSON, not an object: nothing
	}
	integer := func(name string) (int64, bool, bool) {
		raw, found := top[name]
		if !found || string(raw) == "null" {
			return 0, false, true
		}
		var v int64
		if json.Unmarshal(raw, &v) != nil {
			return 0, false, false
		}
		return max(0, v), true, true
	}
	isNull := func(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }
	var text []byte
	textBytes := int64(0)
	hasPrompt := false
	ids := func(raw json.RawMessage) bool {
		var v []int64
		if json.Unmarshal(raw, &v) != nil {
			return false
		}
		hasPrompt, ref.seed = true, seedIDs
		for _, id := range v {
			ref.key = binary.LittleEndian.AppendUint32(ref.key, uint32(id))
		}
		ref.prompt = max(1, int64(len(v)))
		return true
	}
	ref.seed = seedText
	if raw, found := top["stream"]; found {
		_ = json.Unmarshal(raw, &ref.stream) // a stream that is not a bool reads as false
	}
	if _, _, ok := integer("prompt_tokens"); !ok {
		return ref
	}
	switch ShapeOf(path) {
	case ShapeNone:
		return reference{ok: true}
	case ShapeChat:
		mt, hasMT, ok1 := integer("max_tokens")
		mct, _, ok2 := integer("max_completion_tokens")
		if !ok1 || !ok2 {
			return ref
		}
		ref.maxTokens = mct
		if hasMT {
			ref.maxTokens = mt
		}
		// The tool definitions, as sent, lead the key and count as text: shared, as system messages are.
		for _, name := range []string{"tools", "functions"} {
			if raw := top[name]; !isNull(raw) {
				text = append(append(text, raw...), 0)
				textBytes += int64(len(raw))
				hasPrompt, ref.shared = true, len(text)
			}
		}
		if raw := top["messages"]; !isNull(raw) {
			var msgs []map[string]json.RawMessage
			if json.Unmarshal(raw, &msgs) != nil {
				return ref
			}
			hasPrompt = true
			leading := true
			for _, m := range msgs {
				system := false
				if r := m["role"]; !isNull(r) {
					system = string(r) == `"system"` || string(r) == `"developer"`
					if string(r) == `"assistant"` {
						ref.previous = len(text)
					}
					if r[0] != '"' {
						return ref
					}
					text = append(text, r[1:len(r)-1]...)
				}
				text = append(text, 0)
				switch c := m["content"]; {
				case isNull(c):
				case c[0] == '"':
					var s string
					if json.Unmarshal(c, &s) != nil {
						return ref
					}
					text = append(text, c[1:len(c)-1]...)
					textBytes += sentBytes(c)
				case c[0] == '[':
					var parts []map[string]json.RawMessage
					if json.Unmarshal(c, &parts) != nil {
						return ref
					}
					for _, part := range parts {
						if t := part["text"]; !isNull(t) {
							var s string
							if json.Unmarshal(t, &s) != nil {
								return ref
							}
							text = append(text, t[1:len(t)-1]...)
							textBytes += sentBytes(t)
						}
					}
				default:
					return ref
				}
				text = append(text, 0)
				if leading = leading && system; leading {
					ref.shared = len(text)
				}
			}
		}
	case ShapeCompletion:
		mt, _, ok := integer("max_tokens")
		if !ok {
			return ref
		}
		ref.maxTokens = mt
		raw := top["prompt"]
		switch {
		case isNull(raw):
		case raw[0] == '"':
			var s string
			if json.Unmarshal(raw, &s) != nil {
				return ref
			}
			hasPrompt, text, textBytes = true, raw[1:len(raw)-1], sentBytes(raw)
		case raw[0] == '[':
			if !ids(raw) {
				var texts []json.RawMessage
				if json.Unmarshal(raw, &texts) != nil {
					return ref
				}
				hasPrompt = true
				for _, t := range texts {
					var s string
					if len(t) == 0 || t[0] != '"' || json.Unmarshal(t, &s) != nil {
						return ref
					}
					text = append(text, t[1:len(t)-1]...)
					textBytes += sentBytes(t)
				}
			}
		default:
			return ref
		}
	case ShapeGenerate:
		if raw := top["sampling_params"]; !isNull(raw) {
			var sp map[string]json.RawMessage
			if json.Unmarshal(raw, &sp) != nil {
				return ref
			}
			if mn := sp["max_new_tokens"]; !isNull(mn) {
				if json.Unmarshal(mn, &ref.maxTokens) != nil {
					return ref
				}
				ref.maxTokens = max(0, ref.maxTokens)
			}
		}
		raw := top["text"]
		switch {
		case !isNull(raw) && raw[0] == '"':
			var s string
			if json.Unmarshal(raw, &s) != nil {
				return ref
			}
			hasPrompt, text, textBytes = true, raw[1:len(raw)-1], sentBytes(raw)
		case !isNull(raw):
			return ref
		default:
			if r := top["input_ids"]; !isNull(r) && !ids(r) {
				return ref
			}
		}
	}
	if ref.seed == seedText {
		ref.key = text
		if hasPrompt {
			ref.prompt = max(1, (textBytes+3)/4)
		}
	}
	ref.ok = true
	return ref
}

// sentBytes is the prompt text that the JSON string raw counts as: its bytes as sent less a byte per
// backslash.
func sentBytes(raw json.RawMessage) int64 {
	inner := raw[1 : len(raw)-1]
	return int64(len(inner) - bytes.Count(inner, []byte{'\\'}))
}

// duplicateKeys reports whether any object in the JSON document has a key twice.
func duplicateKeys(body []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(body))
	var walk func() bool // reports a duplicate
	walk = func() bool {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		switch tok {
		case json.Delim('{'):
			seen := map[string]bool{}
			for dec.More() {
				k, _ := dec.Token()
				if s, _ := k.(string); seen[s] {
					return true
				} else {
					seen[s] = true
				}
				if walk() {
					return true
				}
			}
			dec.Token()
		case json.Delim('['):
			for dec.More() {
				if walk() {
					return true
				}
			}
			dec.Token()
		}
		return false
	}
	dup := walk()
	_, err := dec.Token()
	return dup || !errors.Is(err, io.EOF)
}

func FuzzParse(f *testing.F) {
	for _, s := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"messages":[{"role":"system","content":"be brief\n\"ok\""},{"content":[{"type":"text","text":"hi \u00e9\ud83d\ude00"}],"role":"user"}],"max_tokens":12,"stream":true}`},
		{"/v1/chat/completions", `{"max_completion_tokens":5,"messages":[],"tools":[{"a":["]}",{"b":null}]}]}`},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"` + strings.Repeat("q", 300) + `"}],"tools":[{"type":"function","function":{"name":"` + strings.Repeat("f", 300) + `"}}],"functions":null}`},
		{"/v1/chat/completions", `{"messages":[{"role":"developer","content":"` + strings.Repeat("Cite the manual. ", 20) + `"},{"role":"system","content":"x"},{"role":"user","content":"hi"}]}`},
		{"/v1/completions", `{"prompt":["abc","def"],"max_tokens":-1}`},
		{"/v1/completions", `{"prompt":[1,2,3],"prompt_tokens":4}`},
		{"/generate", `{"input_ids":[5,6],"text":"x","sampling_params":{"max_new_tokens":9}}`},
		{"/generate", `{"text":"\\\"\\u0041","stream":false}`},
		{"/generate", `not json`},
	} {
		f.Add(s.path, []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, path string, body []byte) {
		r := Request{Blocks: make([]uint64, 0, 4)}
		Parse(path, body, true, int64(len(body)), &r)
		for cut := 0; cut < len(body); cut += 1 + len(body)/8 { // a head cut anywhere never panics
			var c Request
			Parse(path, body[:cut], false, int64(len(body)), &c)
		}
		ref := referenceParse(path, body)
		if !ref.ok {
			return
		}
		if r.PromptTokens != ref.prompt || r.MaxTokens != ref.maxTokens || (r.Shape != ShapeNone && r.Stream != ref.stream) {
			t.Fatalf("Parse: prompt %d max %d stream %t; encoding/json: %d %d %t", r.PromptTokens, r.MaxTokens, r.Stream, ref.prompt, ref.maxTokens, ref.stream)
		}
		if want := refKey(ref.seed, ref.key, 4); len(want) != len(r.Blocks) || len(want) > 0 && want[len(want)-1] != r.Blocks[len(r.Blocks)-1] {
			t.Fatalf("key %x, want %x", r.Blocks, want)
		}
		if want := min(ref.shared/BlockBytes, cap(r.Blocks)); r.SharedBlocks != want {
			t.Fatalf("shared blocks %d, want %d", r.SharedBlocks, want)
		}
		if want := min(ref.previous/BlockBytes, cap(r.Blocks)); r.PreviousBlocks != want {
			t.Fatalf("previous blocks %d, want %d", r.PreviousBlocks, want)
		}
	})
}
