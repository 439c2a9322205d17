package sglangsim

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/grpcload"
	"github.com/caddy-sglang/caddy-sglang/httpload"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// The repository's own fetchers read the simulator, including its 404 and hang faults.
func TestFetchersReadSimulator(t *testing.T) {
	cfg := fastConfig()
	cfg.APIKey = "k"
	cfg.MaxTotalTokens = 1000
	cfg.DecodeTokensPerSec = 0.001
	w, base := startWorker(t, cfg)
	if _, err := w.submit(sized(300, 100)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "request running", func() bool { return w.Loads()[0].UsedTokens == 400 })

	hf, err := httpload.New(httpload.Config{URL: base, APIKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	defer hf.Close()
	rep, err := hf.Fetch(t.Context())
	if err != nil || rep.UsedTokens != 400 || rep.Running != 1 || !rep.Ranks[0].Has(loadpolicy.FieldWaitingUncachedTokens) {
		t.Fatalf("httpload: %+v %v", rep, err)
	}
	w.Faults().SetNotFoundLoads(true)
	rep, err = hf.Fetch(t.Context())
	if err != nil || !hf.Legacy() || rep.Running != 1 || rep.Ranks[0].TotalTokens != 400 {
		t.Fatalf("httpload /get_load fallback: %+v %v", rep, err)
	}
	w.Faults().SetNotFoundLoads(false)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := w.GRPCServer()
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	gf, err := grpcload.New(grpcload.Config{Target: lis.Addr().String(), APIKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	defer gf.Close()
	rep, err = gf.Fetch(t.Context())
	if err != nil || rep.UsedTokens != 400 || rep.MaxTotalTokens != 1000 || rep.Running != 1 {
		t.Fatalf("grpcload: %+v %v", rep, err)
	}
	w.Faults().SetHangLoads(true)
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	_, err = gf.Fetch(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("grpcload on a hung worker: %v", err)
	}
	w.Faults().SetHangLoads(false)
}

// httpload reads the prefill counters the simulator sends, and their absence when it omits them.
func TestFetcherReadsPrefillCounters(t *testing.T) {
	for _, omit := range []bool{false, true} {
		cfg := fastConfig()
		cfg.PrefillTokensPerSec = 20000
		cfg.OmitPrefillCounters = omit
		w, base := startWorker(t, cfg)
		r, err := w.submit(sized(2000, 1))
		if err != nil {
			t.Fatal(err)
		}
		<-r.done
		hf, err := httpload.New(httpload.Config{URL: base})
		if err != nil {
			t.Fatal(err)
		}
		rep, err := hf.Fetch(t.Context())
		hf.Close()
		if err != nil {
			t.Fatal(err)
		}
		rk := rep.Ranks[0]
		if omit {
			if rk.Has(loadpolicy.FieldPrefillCounters) {
				t.Fatalf("omitted counters decoded: %+v", rk)
			}
			continue
		}
		if !rk.Has(loadpolicy.FieldPrefillCounters) || rk.PrefillUncachedTokens != 2000 || rk.PrefillBusyUS != 100_000 {
			t.Fatalf("counters: %+v", rk)
		}
	}
}
