package affinity

import (
	"fmt"
	"strings"
	"testing"
)

// Keys are what Caddy instances that share nothing agree by, so a version that keys a prompt otherwise
// sends it elsewhere than the version before until every instance runs one version. These are the
// keys of this version: a change to them (the hash, the seeds, the block size, what a key's bytes are)
// must be deliberate, and said in its release.
func TestKeysAreStable(t *testing.T) {
	system := strings.Repeat("You are a careful assistant who answers briefly.\\n", 12)
	body := `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"Hi"}]}`
	r := Request{Blocks: make([]uint64, 0, MaxBlocks)}
	Parse("/v1/chat/completions", []byte(body), true, int64(len(body)), &r)
	got := fmt.Sprintf("%x", r.Blocks)
	const want = "[288a34aa9bc4f011 12e2d8dcac33acef]"
	if got != want {
		t.Errorf("chat keys %s, want %s", got, want)
	}
	if got, want := fmt.Sprintf("%x", HeaderKey("session-1", nil)), "[86bfe073d0d6829e]"; got != want {
		t.Errorf("session key %s, want %s", got, want)
	}
	if got, want := fmt.Sprintf("%x", NewIndex(0).Worker("10.0.0.1:30000").Hash), "c1c8f1d1b52042f"; got != want {
		t.Errorf("worker hash %s, want %s", got, want)
	}
}
