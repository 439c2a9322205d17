package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
	"github.com/caddy-sglang/caddy-sglang/internal/testports"
	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"-count", "4", "-capacity", "1000, 2000", "-grpc-base-port", "31000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.count != 4 || len(o.capacities) != 2 || o.capacities[1] != 2000 || o.basePort != 30000 || o.listen != "127.0.0.1" {
		t.Fatalf("%+v", o)
	}
	if !o.prefixCache || !o.prefillCounters || o.finishEarly != 0 || !o.sglangAdmission || o.timing != sglangsim.TimingLinear ||
		len(o.speeds) != 1 || o.speeds[0] != 1 || o.chunkedPrefill != 8192 || o.mixedChunk || o.hostPool != 0 || o.hostLoadSpeed != 190000 {
		t.Fatalf("model defaults: %+v", o)
	}
	if o, err := parseFlags([]string{"-sglang-admission=false"}, io.Discard); err != nil || o.sglangAdmission {
		t.Errorf("-sglang-admission=false: admission %t, %v; want reserving", o.sglangAdmission, err)
	}
	for _, args := range [][]string{
		{"-finish-early", "-0.1"},
		{"-finish-early", "1"},
		{"-finish-early", "NaN"},
		{"-count", "0"},
		{"-capacity", "1000,x"},
		{"-capacity", "0"},
		{"-base-port", "65535", "-count", "2"},
		{"-grpc-base-port", "30001"},
		{"-decode-speed", "0"},
		{"-dp-ranks", "0"},
		{"-timing", "fast"},
		{"-speed", "1,0"},
		{"-speed", "1,,2"},
		{"-speed", "Inf"},
		{"-chunked-prefill-size", "0"},
		{"-host-pool", "-1"},
		{"-host-load-speed", "0"},
		{"-step-base", "-0.001"},
		{"-step-attention", "NaN"},
		{"-step-kv-token", "+Inf"},
		{"-listen", "0.0.0.0"},
		{"extra"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	if _, err := parseFlags([]string{"-listen", "0.0.0.0", "-allow-remote"}, io.Discard); err != nil {
		t.Errorf("-allow-remote: %v", err)
	}
	for _, h := range []string{"localhost", "::1", "127.0.0.2"} {
		if _, err := parseFlags([]string{"-listen", h}, io.Discard); err != nil {
			t.Errorf("-listen %s: %v", h, err)
		}
	}
}

// syncBuffer collects the log output of run, which writes from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestRunDownAndShutdown(t *testing.T) {
	port, grpcPort := testports.Free(t, 1), testports.Free(t, 1)
	base := "http://127.0.0.1:" + strconv.Itoa(port)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var logs syncBuffer
	ready := make(chan []*server, 1)
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"-count", "1", "-base-port", strconv.Itoa(port), "-grpc-base-port", strconv.Itoa(grpcPort),
			"-decode-speed", "100000", "-prefill-speed", "1e7"}, &logs, ready)
	}()
	select {
	case <-ready:
	case err := <-errc:
		t.Fatalf("run: %v\n%s", err, logs.String())
	}
	if !strings.Contains(logs.String(), "worker sim-0 listening on "+base) {
		t.Fatalf("log: %s", logs.String())
	}
	resp, err := http.Get(base + "/health")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("health: %v %v", resp, err)
	}
	resp.Body.Close()

	resp, err = http.Post(base+"/sim/fault?down=300ms", "", nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("fault: %v %v", resp, err)
	}
	resp.Body.Close()
	refused := false
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second)
		if err != nil {
			refused = true
		} else {
			c.Close()
			if refused {
				break // back up
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !refused {
		t.Fatal("listener never closed")
	}
	for {
		resp, err = http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"hello","sampling_params":{"max_new_tokens":4}}`))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker did not come back: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Sglang-Sim-Worker") != "sim-0" {
		t.Fatalf("generate after down: %d %v", resp.StatusCode, resp.Header)
	}

	// gRPC came back too, on a fresh server.
	cc, err := grpc.NewClient("127.0.0.1:"+strconv.Itoa(grpcPort), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
	lr, err := schedulerpb.NewSglangSchedulerClient(cc).GetLoads(gctx, &schedulerpb.GetLoadsRequest{Include: []string{"core"}})
	gcancel()
	if err != nil || len(lr.GetLoads()) != 1 || lr.GetLoads()[0].GetMaxTotalNumTokens() != 65536 {
		t.Fatalf("GetLoads after down: %v %v", lr, err)
	}

	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return")
	}
	if _, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second); err == nil {
		t.Fatal("listener open after shutdown")
	}
	if !strings.Contains(logs.String(), "served=1") {
		t.Fatalf("final stats missing: %s", logs.String())
	}
}

// The model flags reach every worker's Config.
func TestRunPassesModelFlags(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ready := make(chan []*server, 1)
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"-count", "2", "-base-port", strconv.Itoa(testports.Free(t, 2)), "-prefix-cache=false",
			"-prefill-counters=false", "-finish-early", "0.3", "-timing", "step", "-speed", "1,2.5", "-step-base", "0.004",
			"-step-prefill-token", "2e-5", "-step-attention", "2e-9", "-step-decode-request", "1e-5", "-step-kv-token", "3e-8",
			"-chunked-prefill-size", "4096", "-mixed-chunk", "-host-pool", "50000", "-host-load-speed", "380000"}, io.Discard, ready)
	}()
	select {
	case servers := <-ready:
		for i, s := range servers {
			c := s.w.Config()
			if !c.DisablePrefixCache || !c.OmitPrefillCounters || c.FinishEarly != 0.3 {
				t.Fatalf("config: %+v", c)
			}
			if c.Timing != sglangsim.TimingStep || c.Speed != []float64{1, 2.5}[i] || c.StepBaseSec != 0.004 ||
				c.StepPrefillTokenSec != 2e-5 || c.StepAttentionSec != 2e-9 || c.StepDecodeRequestSec != 1e-5 ||
				c.StepKVTokenSec != 3e-8 || c.ChunkedPrefillSize != 4096 || !c.MixedChunk || c.HostPoolTokens != 50000 ||
				c.HostLoadTokensPerSec != 380000 {
				t.Fatalf("worker %d step config: %+v", i, c)
			}
		}
	case err := <-errc:
		t.Fatalf("run: %v", err)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}
