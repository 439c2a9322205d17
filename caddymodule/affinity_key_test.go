package caddymodule

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddy-sglang/caddy-sglang/affinity"
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
		if st.key.Continues != c.continues || st.key.Session || len(st.key.Blocks) == 0 {
			t.Errorf("%s: continues %t, session %t, with %d blocks; want continues %t, no session, and a key", c.name,
				st.key.Continues, st.key.Session, len(st.key.Blocks), c.continues)
		}
	}
}
