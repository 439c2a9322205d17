package sglangsim

import (
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// With SGLang's admission a worker whose running request has decoded a while admits on a guess of
// what it will still use, where reserving every max_tokens admits one; the KV it reports is what is
// in use. When the guess proves wrong, requests are retracted, prefilled again and still answered in
// full, and the pool is never over capacity.
func TestSGLangAdmissionGuessesAndRetracts(t *testing.T) {
	const pool = 10000
	for _, sglang := range []bool{false, true} {
		w, now := handDriven(t, Config{PrefillTokensPerSec: 1e9, DecodeTokensPerSec: 100, MaxTotalTokens: pool, SGLangAdmission: sglang})
		rk := w.ranks[0]
		first := queueByHand(w, sized(1000, 5000), now)
		w.admit(rk, now)
		now = now.Add(time.Millisecond)
		w.step(now) // prefilled: its first token
		for range 6 {
			now = now.Add(time.Second)
			w.step(now) // alone at 100 tokens/s: 600 decode steps, the guess down to its least
		}
		emitted := first.emitted.Load()
		wantUsed, wantAdmitted := int64(1000+5000), 1 // the reservation: 6,000 of 10,000 held
		if sglang {
			// In use: the prompt and the output so far. The guess for the running request is its
			// remaining output (at most 4,096) × 0.098; the five requests of 1,000 + 2,000 sum to
			// used + guess + 3,000 = 1,601 + 401 + 3,000, then 2,601 + 597 + 3,000, 3,601 + 793,
			// 4,601 + 989, 5,601 + 1,185 (9,786), all under 10,000; a sixth reads 10,982.
			wantUsed, wantAdmitted = 1000+emitted, 5
		}
		if emitted != 601 || rk.newTokenRatio != minNewTokenRatio && sglang {
			t.Fatalf("sglang %t: first emitted %d, ratio %g", sglang, emitted, rk.newTokenRatio)
		}
		if got := w.loadsLocked(now)[0].UsedTokens; got != wantUsed {
			t.Errorf("sglang %t: used %d, want %d", sglang, got, wantUsed)
		}
		var rest []*request
		for range 8 {
			rest = append(rest, queueByHand(w, sized(1000, 2000), now))
		}
		w.admit(rk, now)
		if got := len(rk.running) - 1; got != wantAdmitted {
			t.Errorf("sglang %t: %d more admitted, want %d", sglang, got, wantAdmitted)
		}

		all := append([]*request{first}, rest...)
		firstTokens := map[*request]time.Time{}
		var sawRetracted int64
		retractedFirst := false
		for step := 0; step < 10000 && w.served < int64(len(all)); step++ {
			now = now.Add(50 * time.Millisecond)
			w.step(now)
			if used := rk.used(); used+rk.cache.evictable > pool {
				t.Fatalf("sglang %t: %d used and %d evictable in a pool of %d", sglang, used, rk.cache.evictable, pool)
			}
			sawRetracted = max(sawRetracted, w.loadsLocked(now)[0].Retracted)
			for _, r := range all {
				if r.state == stateWaiting && !r.admitted.IsZero() && r == first {
					retractedFirst = true
				}
				if ft, ok := firstTokens[r]; !ok && !r.firstToken.IsZero() {
					firstTokens[r] = r.firstToken
				} else if ok && !r.firstToken.Equal(ft) {
					t.Fatalf("sglang %t: a request's first token moved from %v to %v", sglang, ft, r.firstToken)
				}
			}
		}
		for i, r := range all {
			if r.state != stateDone || r.err != nil || r.emitted.Load() != r.output {
				t.Fatalf("sglang %t: request %d: state %d, err %v, %d of %d tokens", sglang, i, r.state, r.err, r.emitted.Load(), r.output)
			}
		}
		w.step(now.Add(time.Millisecond))
		if rk.newTokenRatio != initNewTokenRatio {
			t.Errorf("sglang %t: idle ratio %g, want %g", sglang, rk.newTokenRatio, initNewTokenRatio)
		}
		handBack(w)
		s := w.Stats()
		prompts := int64(len(all)) * 1000
		if !sglang {
			if s.Retracted != 0 || s.PrefilledTokens != prompts || sawRetracted != 0 {
				t.Errorf("reserving: %d retracted, %d prefilled of %d prompt tokens", s.Retracted, s.PrefilledTokens, prompts)
			}
		} else {
			// Each retracted request prefills its prompt again, and the output it had.
			if s.Retracted == 0 || sawRetracted == 0 || s.PrefilledTokens < prompts+s.Retracted*1000 {
				t.Errorf("%d retracted (%d seen waiting), %d prefilled of %d prompt tokens", s.Retracted, sawRetracted, s.PrefilledTokens, prompts)
			}
			if retractedFirst {
				t.Error("the request with the most output was retracted")
			}
		}
		if s.PeakUsedTokens > pool || s.PromptTokens != prompts {
			t.Errorf("sglang %t: peak %d, prompt tokens %d", sglang, s.PeakUsedTokens, s.PromptTokens)
		}
	}
}

// Retractions over the last second are reported in queues.retracted, over HTTP and gRPC, as SGLang
// reports those since its last stats log. Three requests of 100 + 4,000 tokens are admitted on a
// guess of 0.7 of the output of those running (200 + 2 × 2,800 + 4,100 = 9,900 of 10,000) and cannot
// all finish.
func TestRetractedOnTheWire(t *testing.T) {
	w, base := startWorker(t, Config{PrefillTokensPerSec: 1e7, DecodeTokensPerSec: 4000, MaxTotalTokens: 10000, SGLangAdmission: true})
	c := startGRPC(t, w)
	var chans []<-chan result
	for range 3 {
		chans = append(chans, goPost(t.Context(), base+"/generate", gen(100, 4000)))
	}
	eventually(t, "a retraction on both wires", func() bool {
		resp, b := get(t, base+"/v1/loads?include=queues")
		var l wireLoads
		decodeStrict(t, b, &l)
		if resp.StatusCode != http.StatusOK || len(l.Loads) != 1 || l.Loads[0].Queues == nil || l.Loads[0].Queues.Retracted == 0 {
			return false
		}
		g, code := getLoads(t, c, &schedulerpb.GetLoadsRequest{Include: []string{"queues"}})
		return code == codes.OK && len(g.GetLoads()) == 1 && g.GetLoads()[0].GetQueues().GetRetracted() > 0
	})
	for _, ch := range chans {
		mustOK(t, await(t, ch))
	}
	if s := w.Stats(); s.Retracted == 0 || s.PeakUsedTokens > 10000 {
		t.Fatalf("stats: %+v", s)
	}
}

// Whatever requests arrive and however the clock moves, a rank never holds more than its pool, its
// counts never go below zero, and every request is answered in full; with SGLang's admission too,
// where requests that share prefixes are retracted and admitted again. Each 3 bytes of the input are
// a request: its prompt (sharing blocks with others of its family), its max_tokens and answer, and
// how far the clock moves after it.
func FuzzAdmission(f *testing.F) {
	f.Add(false, []byte{10, 200, 3, 40, 250, 9, 90, 255, 1, 3, 30, 200})
	f.Add(true, []byte{10, 200, 3, 40, 250, 9, 90, 255, 1, 3, 30, 200})
	f.Add(true, []byte{255, 255, 255, 254, 253, 0, 1, 1, 1, 128, 255, 64, 200, 255, 2, 201, 255, 2})
	const pool = 8192
	f.Fuzz(func(t *testing.T, sglang bool, in []byte) {
		w, now := handDriven(t, Config{PrefillTokensPerSec: 1e5, DecodeTokensPerSec: 2000, MaxTotalTokens: pool, MaxRunningRequests: 8, SGLangAdmission: sglang})
		defer handBack(w)
		rk := w.ranks[0]
		check := func(when string) {
			if rk.used()+rk.cache.evictable > pool || rk.private < 0 || rk.cache.pinned < 0 || rk.waitingPrompt < 0 || rk.waitingUncached < 0 {
				t.Fatalf("%s: used %d (private %d, pinned %d), evictable %d, queued %d / %d uncached", when,
					rk.used(), rk.private, rk.cache.pinned, rk.cache.evictable, rk.waitingPrompt, rk.waitingUncached)
			}
		}
		var all []*request
		for i := 0; i+2 < len(in) && len(all) < 200; i += 3 {
			prompt := 1 + int64(in[i])*31 // up to 7,906 tokens: the longest prompt taken is pool - 7
			family, maxTokens := uint64(in[i]%4), 1+int64(in[i+1])*40
			j := job{prompt: prompt, maxTokens: min(maxTokens, pool-2-prompt), dpRank: -1}
			j.output = max(1, j.maxTokens*int64(in[i+2]%4+1)/4)
			for end := int64(16); end <= prompt-1; end += 16 {
				j.blocks = append(j.blocks, block{hash: family<<32 | uint64(end), tokens: 16})
			}
			all = append(all, queueByHand(w, j, now))
			w.admit(rk, now)
			check("admitted")
			now = now.Add(time.Duration(in[i+2]) * time.Millisecond)
			w.step(now)
			check("stepped")
		}
		for step := 0; step < 100000 && w.served < int64(len(all)); step++ {
			now = now.Add(20 * time.Millisecond)
			w.step(now)
			check("draining")
		}
		for i, r := range all {
			if r.state != stateDone || r.err != nil || r.emitted.Load() != r.output {
				t.Fatalf("request %d (prompt %d, max %d): state %d, err %v, %d of %d tokens", i, r.prompt, r.maxTokens, r.state, r.err, r.emitted.Load(), r.output)
			}
		}
		if rk.private != 0 || rk.cache.pinned != 0 || rk.waitingPrompt != 0 || rk.waitingUncached != 0 || len(rk.waiting) != 0 {
			t.Fatalf("idle rank holds: private %d, pinned %d, queued %d / %d uncached, %d waiting",
				rk.private, rk.cache.pinned, rk.waitingPrompt, rk.waitingUncached, len(rk.waiting))
		}
	})
}
