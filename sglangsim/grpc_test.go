package sglangsim

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// startGRPC serves w's SglangScheduler on 127.0.0.1:0 and returns a client.
func startGRPC(t *testing.T, w *Worker) schedulerpb.SglangSchedulerClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := w.GRPCServer()
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return schedulerpb.NewSglangSchedulerClient(cc)
}

func getLoads(t *testing.T, c schedulerpb.SglangSchedulerClient, req *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, codes.Code) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	resp, err := c.GetLoads(ctx, req)
	return resp, status.Code(err)
}

func TestGRPCGetLoads(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 1000
	cfg.DPRanks = 2
	cfg.DecodeTokensPerSec = 0.001 // hold the load still while HTTP and gRPC are compared
	w, base := startWorker(t, cfg)
	c := startGRPC(t, w)

	resp, code := getLoads(t, c, &schedulerpb.GetLoadsRequest{})
	if code != codes.OK || len(resp.GetLoads()) != 2 || resp.GetVersion() != w.Config().Version {
		t.Fatalf("GetLoads: %v %v", resp, code)
	}
	if l := resp.GetLoads()[1]; l.GetDpRank() != 1 || l.GetMemory() == nil || l.GetQueues() == nil ||
		l.GetMaxTotalNumTokens() != 1000 || l.GetMemory().GetTokenCapacity() != 1000 {
		t.Fatalf("empty include is all: %v", l)
	}
	if resp.GetDpRankCount() != 0 || resp.GetAggregate() != nil {
		t.Fatalf("current shape carries legacy fields: %v", resp)
	}

	// Load rank 0: one request running (600 tokens), one waiting behind it (prompt 300).
	a := goPost(t.Context(), base+"/generate", map[string]any{"text": "x", "prompt_tokens": 500, "data_parallel_rank": 0, "sampling_params": map[string]any{"max_new_tokens": 100}})
	eventually(t, "first request running", func() bool { return w.Loads()[0].Running == 1 })
	b := goPost(t.Context(), base+"/generate", map[string]any{"text": "x", "prompt_tokens": 300, "data_parallel_rank": 0, "sampling_params": map[string]any{"max_new_tokens": 200}})
	eventually(t, "rank 0 loaded", func() bool {
		l := w.Loads()[0]
		return l.Running == 1 && l.Waiting == 1
	})
	resp, code = getLoads(t, c, &schedulerpb.GetLoadsRequest{Include: []string{"core"}, DpRank: proto.Int32(0)})
	if code != codes.OK || len(resp.GetLoads()) != 1 {
		t.Fatalf("GetLoads dp_rank 0: %v %v", resp, code)
	}
	g := resp.GetLoads()[0]
	h := loads(t, base)
	if g.GetMemory() != nil || g.GetQueues() != nil {
		t.Fatalf("include core sent sections: %v", g)
	}
	if int(g.GetNumRunningReqs()) != h.NumRunningReqs || int(g.GetNumWaitingReqs()) != h.NumWaitingReqs ||
		int64(g.GetNumUsedTokens()) != h.NumUsedTokens || int64(g.GetNumWaitingUncachedTokens()) != *h.NumWaitingUncachedTokens ||
		int(g.GetMaxRunningRequests()) != h.MaxRunningRequests || g.GetTokenUsage() != h.TokenUsage {
		t.Fatalf("gRPC %v != HTTP %+v", g, h)
	}
	if g.GetNumUsedTokens() != 600 || g.GetNumWaitingUncachedTokens() != 300 || g.GetTokenUsage() != 0.6 {
		t.Fatalf("rank 0: %v", g)
	}

	for _, req := range []*schedulerpb.GetLoadsRequest{
		{Include: []string{"core", "bogus"}},
		{DpRank: proto.Int32(2)},
		{DpRank: proto.Int32(-1)},
	} {
		if _, code := getLoads(t, c, req); code != codes.InvalidArgument {
			t.Errorf("%v: code %v, want InvalidArgument", req, code)
		}
	}
	w.Close()
	<-a
	<-b
}

func TestGRPCFaultsAndAuth(t *testing.T) {
	cfg := fastConfig()
	cfg.APIKey = "k"
	cfg.LegacyShape = true
	w := New(cfg)
	defer w.Close()
	c := startGRPC(t, w)
	f := w.Faults()

	if _, code := getLoads(t, c, &schedulerpb.GetLoadsRequest{}); code != codes.Unauthenticated {
		t.Fatalf("without key: %v", code)
	}
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer k")
	call := func(timeout time.Duration) (*schedulerpb.GetLoadsResponse, codes.Code) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		resp, err := c.GetLoads(ctx, &schedulerpb.GetLoadsRequest{Include: []string{"core"}})
		return resp, status.Code(err)
	}
	resp, code := call(5 * time.Second)
	if code != codes.OK || resp.GetDpRankCount() != 1 || resp.GetAggregate() == nil || resp.GetLoads()[0].GetNumWaitingUncachedTokens() != 0 {
		t.Fatalf("legacy GetLoads: %v %v", resp, code)
	}

	f.SetHangLoads(true)
	if _, code := call(50 * time.Millisecond); code != codes.DeadlineExceeded {
		t.Fatalf("hung GetLoads: %v", code)
	}
	done := make(chan codes.Code, 1)
	go func() {
		_, code := call(5 * time.Second)
		done <- code
	}()
	eventually(t, "GetLoads hanging", func() bool { return f.State().Hung == 1 })
	f.SetHangLoads(false)
	if code := <-done; code != codes.OK {
		t.Fatalf("released GetLoads: %v", code)
	}

	for _, tc := range []struct {
		set  func(bool)
		want codes.Code
	}{
		{f.SetGarbageLoads, codes.Internal},
		{f.SetNotFoundLoads, codes.Unimplemented},
		{func(on bool) {
			if on {
				f.Down(time.Hour)
			} else {
				f.Down(0)
			}
		}, codes.Unavailable},
	} {
		tc.set(true)
		if _, code := call(5 * time.Second); code != tc.want {
			t.Errorf("fault: %v, want %v", code, tc.want)
		}
		tc.set(false)
		if _, code := call(5 * time.Second); code != codes.OK {
			t.Errorf("fault cleared: %v", code)
		}
	}
}

// GetLoads reports the prefix cache as /v1/loads does.
func TestGRPCCacheFields(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxTotalTokens = 1000
	cfg.MaxRunningRequests = 1
	cfg.DecodeTokensPerSec = 0.001
	w, base := startWorker(t, cfg)
	c := startGRPC(t, w)
	a := map[string]any{"text": strings.Repeat("a", 260), "sampling_params": map[string]any{"max_new_tokens": 1}}
	postGenerate(t, base, a) // 65 tokens, none cached
	postGenerate(t, base, a) // 64 cached: hit rate 64/130
	slow := goPost(t.Context(), base+"/generate", gen(800, 100))
	eventually(t, "slow request running", func() bool { return w.Loads()[0].Running == 1 })
	queued := goPost(t.Context(), base+"/generate", a)
	eventually(t, "request queued", func() bool { return w.Loads()[0].Waiting == 1 })
	resp, code := getLoads(t, c, &schedulerpb.GetLoadsRequest{Include: []string{"core"}})
	if code != codes.OK {
		t.Fatal(code)
	}
	// The slow request's 800 uncached tokens count too: 64 / 930.
	g, h := resp.GetLoads()[0], loads(t, base)
	if g.GetNumWaitingUncachedTokens() != 1 || g.GetCacheHitRate() != round(64.0/930, 4) || g.GetCacheHitRate() != h.CacheHitRate {
		t.Fatalf("gRPC %v, HTTP %+v", g, h)
	}
	w.Close()
	await(t, slow)
	await(t, queued)
}
