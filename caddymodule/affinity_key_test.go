package caddymodule

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/affinity"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// With affinity prefix, a chat that has an answer in its history is keyed as a conversation that
// continues; a first turn is not. Neither is a Session key, which only a session header makes: a
// conversation's first turn went where a one-off prompt goes.
func TestPrefixKeyOfAConversationContinues(t *testing.T) {
	p := &Policy{Affinity: affinityPrefix, affinityIndex: affinity.NewIndex(0)}
	system := strings.Repeat("Answer briefly and cite your sources. ", 20) // blocks to key
	for _, c := range []struct {
		name, body string
		continues  bool
	}{
		{"first turn", `{"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"}]}`, false},
		{"later turn", `{"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"},` +
			`{"role":"assistant","content":"hello"},{"role":"user","content":"and?"}]}`, true},
	} {
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(c.body))
		st := p.readRequest(r)
		if st == nil {
			t.Fatalf("%s: no request state", c.name)
		}
		if st.key.PreviousBlocks != st.body.PreviousBlocks || (st.key.PreviousBlocks > 0) != c.continues {
			t.Errorf("%s: previous blocks %d, the body's %d; want some exactly when it continues", c.name, st.key.PreviousBlocks, st.body.PreviousBlocks)
		}
		if st.key.Continues != c.continues || st.key.Session || len(st.key.Blocks) == 0 {
			t.Errorf("%s: continues %t, session %t, with %d blocks; want continues %t, no session, and a key", c.name,
				st.key.Continues, st.key.Session, len(st.key.Blocks), c.continues)
		}
	}
}

// With affinity header, the key is the session header's value alone, whatever the body; without the
// header there is no key. The cost metric alone reads the body's size and keys nothing.
func TestHeaderKeyAndCostMetricKeyNothingFromTheBody(t *testing.T) {
	system := strings.Repeat("Answer briefly and cite your sources. ", 20)
	body := `{"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"}],"max_tokens":33}`
	read := func(p *Policy, session string) *requestState {
		t.Helper()
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
		if session != "" {
			r.Header.Set("X-Session-ID", session)
		}
		st := p.readRequest(r)
		if st == nil {
			t.Fatal("no request state")
		}
		if st.size.OutputTokens != 33 {
			t.Errorf("output tokens %d, want max_tokens 33", st.size.OutputTokens)
		}
		return st
	}

	header := &Policy{Affinity: affinityHeader, AffinityHeader: "X-Session-ID", affinityIndex: affinity.NewIndex(0)}
	want := affinity.HeaderKey("s-1", nil)
	for range 2 {
		st := read(header, "s-1")
		if len(st.key.Blocks) != 1 || st.key.Blocks[0] != want[0] || !st.key.Session || !st.key.Continues {
			t.Errorf("session key %+v, want the header's one block %x, a session that continues", st.key, want[0])
		}
	}
	if other := read(header, "s-2"); len(other.key.Blocks) != 1 || other.key.Blocks[0] == want[0] {
		t.Errorf("another session's key %x, want one block other than %x", other.key.Blocks, want[0])
	}
	if none := read(header, ""); len(none.key.Blocks) != 0 {
		t.Errorf("no header: key %x, want none", none.key.Blocks)
	}

	if st := read(&Policy{Metric: "cost"}, ""); len(st.key.Blocks) != 0 || len(st.body.Blocks) != 0 {
		t.Errorf("cost metric: key %x, body blocks %x; want none", st.key.Blocks, st.body.Blocks)
	}
}

// A session whose request's size is not known (a chunked body, with read_body off) still follows its
// session: it goes where the same session's request with a Content-Length goes, and sessions spread
// over the workers. Keyed with no prompt tokens, such a request was chosen for on cost alone, every
// session on the first of equally loaded workers.
func TestHeaderSessionOfUnknownSizeFollowsItsSession(t *testing.T) {
	pool := UpstreamsForTest(16)
	report := func(int) *loadpolicy.Report {
		return loadpolicy.NewReport(time.Now(), "", []loadpolicy.Rank{{Running: 4, MaxRunning: 64, GenThroughput: 800,
			Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldMaxRunning | loadpolicy.FieldGenThroughput}})
	}
	p := &Policy{Affinity: affinityHeader, AffinityHeader: "X-Session-ID", ReadBody: -1}
	if err := ProvisionWithReports(p, pool, report); err != nil {
		t.Fatal(err)
	}
	const body = `{"messages":[{"role":"user","content":"hi"}]}`
	send := func(session string, chunked bool) *reverseproxy.Upstream {
		t.Helper()
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
		if chunked {
			r.ContentLength, r.TransferEncoding = -1, []string{"chunked"}
		}
		r.Header.Set("X-Session-ID", session)
		u := p.Select(pool, r, nil)
		if u == nil {
			t.Fatalf("session %s: no upstream selected", session)
		}
		return u
	}
	used := map[*reverseproxy.Upstream]bool{}
	for s := range 32 {
		session := fmt.Sprintf("s-%d", s)
		want := send(session, false)
		for range 3 {
			if got := send(session, true); got != want {
				t.Fatalf("session %s, chunked: went to %s, want %s, where it goes with a Content-Length", session, got.Dial, want.Dial)
			}
		}
		used[want] = true
	}
	if len(used) < 4 {
		t.Errorf("32 sessions went to %d of 16 workers, want them spread by their keys", len(used))
	}
}

// A prefix key has room for as many blocks as the body read can hold, up to affinity.MaxBlocks.
func TestKeyBlocks(t *testing.T) {
	for _, c := range []struct {
		contentLength int64
		limit, want   int
	}{
		{0, 64 << 10, 0},
		{100, 64 << 10, 1},
		{16 << 10, 64 << 10, 64},
		{16<<10 + 1, 64 << 10, 65},
		{40 << 10, 64 << 10, 160},
		{1 << 30, 64 << 10, 256},
		{-1, 64 << 10, 256}, // chunked: as much as is read
		{-1, 4 << 10, 16},
		{1 << 30, 1 << 30, affinity.MaxBlocks},
	} {
		if got := keyBlocks(c.contentLength, c.limit); got != c.want {
			t.Errorf("keyBlocks(%d, %d) = %d, want %d", c.contentLength, c.limit, got, c.want)
		}
	}
}
