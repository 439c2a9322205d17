package grpcload

import (
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// num_waiting_uncached_tokens has no presence on the wire: a 0 counts as sent only when it cannot be an
// old server's silence.
func TestUncachedTokensPresence(t *testing.T) {
	type rank struct{ waiting, uncached int32 }
	type poll struct {
		version string
		ranks   []rank
		present []bool // per rank
	}
	tests := []struct {
		name  string
		polls []poll // in order, on one Fetcher
	}{
		{"old server with a queue", []poll{
			{"0.4.0", []rank{{3, 0}, {0, 0}}, []bool{false, true}},
		}},
		{"idle server", []poll{
			{"0.4.0", []rank{{0, 0}, {0, 0}}, []bool{true, true}},
		}},
		{"one rank non-zero vouches for all", []poll{
			{"0.5.6", []rank{{3, 0}, {2, 700}}, []bool{true, true}},
		}},
		{"same version remembered", []poll{
			{"0.5.6", []rank{{2, 700}}, []bool{true}},
			{"0.5.6", []rank{{4, 0}}, []bool{true}},
		}},
		{"only that version trusted", []poll{
			{"0.5.6", []rank{{2, 700}}, []bool{true}},
			{"0.4.0", []rank{{4, 0}}, []bool{false}},
			{"0.5.6", []rank{{4, 0}}, []bool{true}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &Fetcher{target: "test:1"}
			for i, p := range tt.polls {
				resp := &schedulerpb.GetLoadsResponse{Version: p.version}
				for _, r := range p.ranks {
					resp.Loads = append(resp.Loads, &schedulerpb.SchedulerLoad{NumWaitingReqs: r.waiting, NumWaitingUncachedTokens: r.uncached})
				}
				rep := f.report(resp, time.Now())
				all := true
				for j, rk := range rep.Ranks {
					got := rk.Has(loadpolicy.FieldWaitingUncachedTokens)
					if got != p.present[j] {
						t.Errorf("poll %d rank %d: num_waiting_uncached_tokens present = %v, want %v", i, j, got, p.present[j])
					}
					if !rk.Has(coreFields) || rk.Has(loadpolicy.FieldTotalTokens) {
						t.Errorf("poll %d rank %d: fields %b, want the core fields and no num_total_tokens", i, j, rk.Fields)
					}
					all = all && got
				}
				if got := rep.Signals().Set.Has(loadpolicy.QueuedTokens); got != all {
					t.Errorf("poll %d: queued_tokens signal = %v, want %v", i, got, all)
				}
			}
		})
	}
}
