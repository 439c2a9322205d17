package caddymodule

import (
	"math"
	"testing"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// The prefill queueing term reads E[P²]/2E[P] of recent uncached prompts: 20% of 2,000-token prompts
// among 200-token ones give 832,000 / 1,120 = 743 tokens. A prompt's cached part is not prefilled,
// so it does not count.
func TestCostParamsFollowRecentPromptSizes(t *testing.T) {
	p := &Policy{}
	if err := p.parseOptions(); err != nil {
		t.Fatal(err)
	}
	if got := p.costParams().ResidualPromptTokens; got != 0 {
		t.Fatalf("before any request: residual %v, want 0", got)
	}
	for range 1000 {
		for range 4 {
			p.noteSize(loadpolicy.Request{PromptTokens: 200, OutputTokens: 64}, 0)
		}
		p.noteSize(loadpolicy.Request{PromptTokens: 3800, OutputTokens: 512}, 1800)
	}
	if got, want := p.costParams().ResidualPromptTokens, 832000.0/1120; math.Abs(got-want) > 0.05*want {
		t.Errorf("residual prompt %.0f tokens, want %.0f within 5%%", got, want)
	}
	if got, want := p.costParams().MeanOutputTokens, (4*64+512)/5.0; math.Abs(got-want) > 0.05*want {
		t.Errorf("mean output %.1f tokens, want %.1f within 5%%", got, want)
	}
}
