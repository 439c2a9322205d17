package trace

import (
	"encoding/json"
	"strings"
	"testing"
)

const blockBytes = BlockTokens * BytesPerToken

func TestPromptTextLength(t *testing.T) {
	for _, n := range []int{-1, 0, 1, 2, 3, 511, 512, 513, 1024, 1500, 100_000} {
		withIDs := Request{Line: 2, InputTokens: n, HashIDs: make([]int64, blocks(n))}
		for i := range withIDs.HashIDs {
			withIDs.HashIDs[i] = int64(i * 7)
		}
		for _, r := range []Request{withIDs, {Line: 2, InputTokens: n}} {
			text := PromptText(r, 1)
			if want := max(0, n) * BytesPerToken; len(text) != want {
				t.Errorf("%d tokens, %d ids: %d bytes, want %d", n, len(r.HashIDs), len(text), want)
			}
			checkWords(t, text)
		}
	}
}

// checkWords checks that text embeds in JSON as it is and is made of printable ASCII.
func checkWords(t *testing.T, text string) {
	t.Helper()
	b, err := json.Marshal(text)
	if err != nil || string(b) != `"`+text+`"` {
		t.Errorf("json.Marshal(%.40q...) = %.40s..., %v: want the text in quotes", text, b, err)
	}
	for i := range len(text) {
		if c := text[i]; c < ' ' || c > '~' {
			t.Fatalf("byte %d is %q, want printable ASCII", i, c)
		}
	}
}

func TestPromptTextBlocks(t *testing.T) {
	const salt = 42
	a := PromptText(Request{Line: 1, InputTokens: 1500, HashIDs: []int64{7, 9, 11}}, salt)
	b := PromptText(Request{Line: 5, InputTokens: 1024, HashIDs: []int64{11, 7}}, salt)
	block := func(s string, i int) string { return s[i*blockBytes : min(len(s), (i+1)*blockBytes)] }
	if block(a, 0) != block(b, 1) {
		t.Error("id 7 gives different text as block 0 and as block 1")
	}
	// a's last block is id 11 cut to 1500-1024 = 476 tokens: b's first block up to there.
	if got, want := block(a, 2), block(b, 0)[:476*BytesPerToken]; got != want {
		t.Errorf("the last block, cut: %.40q..., want %.40q...", got, want)
	}
	if block(a, 1)[:4] == block(a, 0)[:4] || block(a, 1)[:4] == block(a, 2)[:4] {
		t.Error("different ids share their first 4 bytes")
	}
	if again := PromptText(Request{Line: 9, InputTokens: 1500, HashIDs: []int64{7, 9, 11}}, salt); again != a {
		t.Error("the same ids give a different text on another line")
	}
	if other := PromptText(Request{Line: 1, InputTokens: 1500, HashIDs: []int64{7, 9, 11}}, salt+1); other[:4] == a[:4] {
		t.Errorf("another salt gives the same first bytes %q", a[:4])
	}
	// Ids alike in their low 24 bits still give different texts.
	hi := PromptText(Request{InputTokens: 512, HashIDs: []int64{7 + 1<<24}}, salt)
	if hi == block(a, 0) {
		t.Error("ids 7 and 7+2^24 give the same text")
	}
}

func TestPromptTextFirstBytes(t *testing.T) {
	// Any two of the first 100,000 ids (the real traces' first halves use fewer) or lines differ in the
	// first 4 bytes of their text.
	for _, salt := range []uint64{0, 1, 1 << 63} {
		ids := map[string]int64{}
		lines := map[string]int{}
		for i := range 100_000 {
			first := PromptText(Request{InputTokens: 1, HashIDs: []int64{int64(i)}}, salt)
			if j, ok := ids[first]; ok {
				t.Fatalf("salt %d: ids %d and %d both begin %q", salt, j, i, first)
			}
			ids[first] = int64(i)
			first = PromptText(Request{Line: i, InputTokens: 1}, salt)
			if j, ok := lines[first]; ok {
				t.Fatalf("salt %d: lines %d and %d both begin %q", salt, j, i, first)
			}
			lines[first] = i
		}
	}
}

func TestPromptTextWithoutIDs(t *testing.T) {
	const salt = 3
	a := PromptText(Request{Line: 2, InputTokens: 2000}, salt)
	b := PromptText(Request{Line: 3, InputTokens: 2000}, salt)
	if a != PromptText(Request{Line: 2, InputTokens: 2000, At: 5}, salt) {
		t.Error("the same line gives a different text")
	}
	// No block of one line's prompt begins any block of the other's.
	for i := 0; i < len(a); i += blockBytes {
		for j := 0; j < len(b); j += blockBytes {
			if a[i:i+4] == b[j:j+4] {
				t.Errorf("line 2's block %d and line 3's block %d both begin %q", i/blockBytes, j/blockBytes, a[i:i+4])
			}
		}
	}
	// A request with too few ids has its ids' blocks, then blocks of its line.
	short := PromptText(Request{Line: 2, InputTokens: 2000, HashIDs: []int64{4}}, salt)
	if short[:blockBytes] != PromptText(Request{InputTokens: 512, HashIDs: []int64{4}}, salt) ||
		short[blockBytes:] != a[blockBytes:] {
		t.Error("a request with too few ids: not its id's block followed by its line's blocks")
	}
}

func TestAppendPromptText(t *testing.T) {
	r := Request{Line: 4, InputTokens: 700, HashIDs: []int64{1, 2}}
	got := AppendPromptText([]byte("prefix "), r, 9)
	if want := "prefix " + PromptText(r, 9); string(got) != want {
		t.Errorf("AppendPromptText = %.40q..., want %.40q...", got, want)
	}
	if !strings.HasPrefix(PromptText(r, 9), string(AppendPromptText(nil, Request{InputTokens: 100, HashIDs: []int64{1}}, 9))) {
		t.Error("a shorter prompt of the same first id is not a prefix")
	}
}

func BenchmarkAppendPromptText100k(b *testing.B) {
	r := Request{Line: 2, InputTokens: 100_000, HashIDs: make([]int64, blocks(100_000))}
	for i := range r.HashIDs {
		r.HashIDs[i] = int64(i)
	}
	b.SetBytes(int64(r.InputTokens * BytesPerToken))
	var buf []byte
	for b.Loop() {
		buf = AppendPromptText(buf[:0], r, 1)
	}
}

func FuzzPromptText(f *testing.F) {
	f.Add(1500, int64(7), int64(9), 3, uint64(1))
	f.Add(1, int64(-1), int64(0), 0, uint64(0))
	f.Fuzz(func(t *testing.T, n int, id0, id1 int64, line int, salt uint64) {
		n %= 3000 // bounded prompts
		r := Request{Line: line, InputTokens: n, HashIDs: []int64{id0, id1}}
		text := PromptText(r, salt)
		if want := max(0, n) * BytesPerToken; len(text) != want {
			t.Fatalf("%d bytes, want %d", len(text), want)
		}
		checkWords(t, text)
		if n > BlockTokens && id0 != id1 && uint32(id0)<<8 != uint32(id1)<<8 && text[:4] == text[blockBytes:blockBytes+4] {
			t.Fatalf("ids %d and %d both begin %q", id0, id1, text[:4])
		}
	})
}
