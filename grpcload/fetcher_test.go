package grpcload_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math"
	"math/big"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/caddy-sglang/caddy-sglang/grpcload"
	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
	"github.com/caddy-sglang/caddy-sglang/monitor"

	"github.com/caddy-sglang/caddy-sglang/internal/testports"
)

var (
	_ monitor.Fetcher            = (*grpcload.Fetcher)(nil)
	_ interface{ Close() error } = (*grpcload.Fetcher)(nil)
)

// guard bounds a wait that should end promptly, so that a bug fails the test instead of hanging it.
const guard = 10 * time.Second

func newFetcher(t *testing.T, cfg grpcload.Config) *grpcload.Fetcher {
	t.Helper()
	f, err := grpcload.New(cfg)
	if err != nil {
		t.Fatalf("New(%+v): %v", cfg, err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func fetch(t *testing.T, f *grpcload.Fetcher) (*loadpolicy.Report, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), guard)
	defer cancel()
	return f.Fetch(ctx)
}

func TestFetchParsesLoadsAndSumsInInt64(t *testing.T) {
	type seen struct {
		req  *schedulerpb.GetLoadsRequest
		auth []string
	}
	got := make(chan seen, 1)
	const big = math.MaxInt32
	resp := &schedulerpb.GetLoadsResponse{Version: "0.5.6", Timestamp: "2026-11-30T10:00:00+00:00"}
	for r := range int32(4) {
		resp.Loads = append(resp.Loads, &schedulerpb.SchedulerLoad{
			DpRank: r, NumRunningReqs: 10 + r, NumWaitingReqs: 2, NumTotalReqs: 12 + r,
			NumUsedTokens: big, MaxTotalNumTokens: big, TokenUsage: 0.25 * float64(r+1),
			GenThroughput: 1000.5, CacheHitRate: 0.5, Utilization: 0.75, MaxRunningRequests: 256,
			NumWaitingUncachedTokens: 5120,
		})
	}
	srv := startScheduler(t, "", func(ctx context.Context, req *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		got <- seen{req: req, auth: md.Get("authorization")}
		return resp, nil
	})
	f := newFetcher(t, grpcload.Config{Target: srv.Addr, APIKey: "s3cret"})
	if f.Target() != srv.Addr {
		t.Errorf("Target() = %q, want %q", f.Target(), srv.Addr)
	}

	rep, err := fetch(t, f)
	if err != nil {
		t.Fatalf("Fetch: %v", err)
	}
	s := <-got
	if !slices.Equal(s.req.GetInclude(), []string{"core"}) {
		t.Errorf("include = %q, want [core]", s.req.GetInclude())
	}
	if s.req.DpRank != nil {
		t.Errorf("dp_rank sent as %d, want unset (all ranks)", *s.req.DpRank)
	}
	if !slices.Equal(s.auth, []string{"Bearer s3cret"}) {
		t.Errorf("authorization metadata = %q, want [Bearer s3cret]", s.auth)
	}

	if rep.Empty() || len(rep.Ranks) != 4 {
		t.Fatalf("report has %d ranks, want 4", len(rep.Ranks))
	}
	if rep.Version != "0.5.6" {
		t.Errorf("Version = %q", rep.Version)
	}
	if rep.Received.IsZero() || time.Since(rep.Received) > guard {
		t.Errorf("Received = %v, want the local time of the answer", rep.Received)
	}
	if want := int64(4 * big); rep.UsedTokens != want || rep.MaxTotalTokens != want {
		t.Errorf("UsedTokens, MaxTotalTokens = %d, %d; want %d each (int64 sums)", rep.UsedTokens, rep.MaxTotalTokens, want)
	}
	if rep.Running != 10+11+12+13 || rep.Waiting != 8 || rep.WaitingUncachedTokens != 4*5120 || rep.MaxRunning != 4*256 {
		t.Errorf("totals running=%d waiting=%d uncached=%d maxRunning=%d", rep.Running, rep.Waiting, rep.WaitingUncachedTokens, rep.MaxRunning)
	}
	if rep.MaxTokenUsage != 1 {
		t.Errorf("MaxTokenUsage = %v, want the hottest rank's 1", rep.MaxTokenUsage)
	}
	r3 := rep.Ranks[3]
	want := loadpolicy.Rank{
		DPRank: 3, Running: 13, Waiting: 2, WaitingUncachedTokens: 5120, UsedTokens: big, MaxTotalTokens: big,
		MaxRunning: 256, TokenUsage: 1, GenThroughput: 1000.5, CacheHitRate: 0.5, Utilization: 0.75,
		Fields: loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldWaitingUncachedTokens |
			loadpolicy.FieldUsedTokens | loadpolicy.FieldMaxTotalTokens | loadpolicy.FieldMaxRunning |
			loadpolicy.FieldTokenUsage | loadpolicy.FieldGenThroughput | loadpolicy.FieldCacheHitRate |
			loadpolicy.FieldUtilization,
	}
	if r3 != want {
		t.Errorf("rank 3 = %+v\nwant     %+v", r3, want)
	}
	if !rep.Signals().Set.Has(loadpolicy.QueuedTokens) {
		t.Errorf("signals %b lack queued_tokens although every rank sent num_waiting_uncached_tokens", rep.Signals().Set)
	}
}

func TestFetchWithoutAPIKeySendsNoAuthorization(t *testing.T) {
	got := make(chan []string, 1)
	srv := startScheduler(t, "", func(ctx context.Context, _ *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		got <- md.Get("authorization")
		return &schedulerpb.GetLoadsResponse{}, nil
	})
	if _, err := fetch(t, newFetcher(t, grpcload.Config{Target: srv.Addr})); err != nil {
		t.Fatalf("Fetch: %v", err)
	}
	if auth := <-got; len(auth) != 0 {
		t.Errorf("authorization metadata = %q, want none", auth)
	}
}

func TestFetchEmptyLoadsIsNoDataYet(t *testing.T) {
	srv := startScheduler(t, "", answer(&schedulerpb.GetLoadsResponse{Version: "0.5.6", Loads: []*schedulerpb.SchedulerLoad{}}))
	rep, err := fetch(t, newFetcher(t, grpcload.Config{Target: srv.Addr}))
	if err != nil {
		t.Fatalf("Fetch: %v", err)
	}
	if rep == nil || !rep.Empty() || rep.Signals().Set != 0 {
		t.Errorf("report = %+v, want an empty report with no signals", rep)
	}
}

func TestFetchAppliesDefaultDeadline(t *testing.T) {
	deadlines := make(chan time.Duration, 1)
	srv := startScheduler(t, "", func(ctx context.Context, _ *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
		d, ok := ctx.Deadline()
		if !ok {
			deadlines <- -1
		} else {
			deadlines <- time.Until(d)
		}
		return &schedulerpb.GetLoadsResponse{}, nil
	})
	f := newFetcher(t, grpcload.Config{Target: srv.Addr})
	if _, err := f.Fetch(context.Background()); err != nil {
		t.Fatalf("Fetch: %v", err)
	}
	if d := <-deadlines; d <= 0 || d > grpcload.DefaultTimeout {
		t.Errorf("server saw a deadline %v away, want one within the %v default", d, grpcload.DefaultTimeout)
	}
}

// A hung worker is cut by the poll's deadline, and a poll of another worker meanwhile is not held up.
func TestHungWorkerDelaysNobodyElse(t *testing.T) {
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	hung := startScheduler(t, "", func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
		entered <- struct{}{}
		<-release // ignores its context: a worker stuck for good
		return &schedulerpb.GetLoadsResponse{}, nil
	})
	t.Cleanup(func() { close(release) }) // runs before the servers stop
	healthy := startScheduler(t, "", answer(&schedulerpb.GetLoadsResponse{
		Loads: []*schedulerpb.SchedulerLoad{{NumRunningReqs: 3}},
	}))
	fHung := newFetcher(t, grpcload.Config{Target: hung.Addr})
	fHealthy := newFetcher(t, grpcload.Config{Target: healthy.Addr})

	const timeout = 1500 * time.Millisecond
	hungErr := make(chan error, 1)
	start := time.Now()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		_, err := fHung.Fetch(ctx)
		hungErr <- err
	}()
	select {
	case <-entered:
	case <-time.After(guard):
		t.Fatal("the hung worker never received the call")
	}

	for range 3 {
		rep, err := fetch(t, fHealthy)
		if err != nil || rep.Running != 3 {
			t.Fatalf("healthy Fetch = %+v, %v", rep, err)
		}
	}
	select {
	case err := <-hungErr:
		t.Fatalf("the hung poll ended (%v) before the healthy polls did: they were not independent", err)
	default:
	}

	var err error
	select {
	case err = <-hungErr:
	case <-time.After(guard):
		t.Fatal("the hung poll outlived its deadline")
	}
	if took := time.Since(start); took < timeout {
		t.Errorf("hung poll ended after %v, before its %v deadline", took, timeout)
	}
	var se *grpcload.StatusError
	if !errors.As(err, &se) || se.Code != codes.DeadlineExceeded || se.Target != hung.Addr {
		t.Fatalf("hung poll error = %#v, want a DeadlineExceeded StatusError for %s", err, hung.Addr)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("errors.Is(%v, context.DeadlineExceeded) = false, want true for a poll cut by its deadline", err)
	}
}

func TestStatusErrors(t *testing.T) {
	const key = "k3y-that-must-not-leak"
	tests := []struct {
		name    string
		handle  func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error)
		code    codes.Code
		explain string
	}{
		{"invalid argument", statusHandler(codes.InvalidArgument, "unknown include section"), codes.InvalidArgument, "rejected the request"},
		{"internal", statusHandler(codes.Internal, "scheduler crashed"), codes.Internal, "failed while collecting"},
		{"worker deadline", statusHandler(codes.DeadlineExceeded, "scheduler too slow"), codes.DeadlineExceeded, "no answer before the deadline"},
		{"unimplemented method", nil, codes.Unimplemented, "does not serve SglangScheduler.GetLoads"},
		{"permission denied", statusHandler(codes.PermissionDenied, "no"), codes.PermissionDenied, "check the api key"},
		{"unauthenticated, key echoed", func(ctx context.Context, _ *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
			md, _ := metadata.FromIncomingContext(ctx)
			return nil, status.Errorf(codes.Unauthenticated, "bad authorization %q", md.Get("authorization"))
		}, codes.Unauthenticated, "check the api key"},
		{"response too large", answer(&schedulerpb.GetLoadsResponse{Version: strings.Repeat("x", grpcload.MaxResponseSize+1)}), codes.ResourceExhausted, "exceeds the 4194304-byte limit"},
		{"worker exhausted", statusHandler(codes.ResourceExhausted, "too many requests"), codes.ResourceExhausted, "an overloaded worker"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := startScheduler(t, "", tt.handle)
			f := newFetcher(t, grpcload.Config{Target: srv.Addr, APIKey: key})
			rep, err := fetch(t, f)
			checkStatusError(t, rep, err, tt.code, srv.Addr, tt.explain)
			if strings.Contains(err.Error(), key) {
				t.Errorf("error %q leaks the api key", err)
			}
			var se *grpcload.StatusError
			if errors.As(err, &se) && se.TooLarge() != (tt.name == "response too large") {
				t.Errorf("TooLarge() = %v for %v", se.TooLarge(), err)
			}
			if tt.code == codes.DeadlineExceeded && errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("a worker's own DeadlineExceeded reads as the poll's timeout: %v", err)
			}
		})
	}

	t.Run("service not registered", func(t *testing.T) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := serve(t, lis, grpc.NewServer())
		rep, err := fetch(t, newFetcher(t, grpcload.Config{Target: srv.Addr}))
		checkStatusError(t, rep, err, codes.Unimplemented, srv.Addr, "does not serve SglangScheduler.GetLoads")
	})

	t.Run("nobody listening", func(t *testing.T) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := lis.Addr().String()
		_ = lis.Close()
		rep, err := fetch(t, newFetcher(t, grpcload.Config{Target: addr}))
		checkStatusError(t, rep, err, codes.Unavailable, addr, "unreachable")
	})
}

func statusHandler(c codes.Code, msg string) func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
	return func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
		return nil, status.Error(c, msg)
	}
}

func checkStatusError(t *testing.T, rep *loadpolicy.Report, err error, code codes.Code, target, explain string) {
	t.Helper()
	if err == nil {
		t.Fatalf("Fetch = %+v, nil; want a %v error", rep, code)
	}
	if rep != nil {
		t.Errorf("Fetch returned a report with its error: %+v", rep)
	}
	var se *grpcload.StatusError
	if !errors.As(err, &se) {
		t.Fatalf("error %T %q is not a *StatusError", err, err)
	}
	if se.Code != code || se.Target != target {
		t.Errorf("StatusError{Code: %v, Target: %q}, want {%v, %q}", se.Code, se.Target, code, target)
	}
	if status.Code(err) != code {
		t.Errorf("status.Code(err) = %v, want %v", status.Code(err), code)
	}
	msg := err.Error()
	if !strings.Contains(msg, target) || !strings.Contains(msg, code.String()) || !strings.Contains(msg, explain) {
		t.Errorf("error %q should name the target %s, the code %v and say %q", msg, target, code, explain)
	}
}

// The same Fetcher fails while its worker is down and recovers when it comes back on the same address.
func TestWorkerGoesAwayAndComesBack(t *testing.T) {
	resp := answer(&schedulerpb.GetLoadsResponse{Loads: []*schedulerpb.SchedulerLoad{{NumRunningReqs: 1}}})
	first := startScheduler(t, "", resp)
	f := newFetcher(t, grpcload.Config{Target: first.Addr})
	if _, err := fetch(t, f); err != nil {
		t.Fatalf("Fetch before the worker went away: %v", err)
	}

	first.Srv.Stop()
	rep, err := fetch(t, f)
	checkStatusError(t, rep, err, codes.Unavailable, first.Addr, "unreachable")

	second := startScheduler(t, first.Addr, resp)
	deadline := time.Now().Add(guard)
	tick := time.NewTicker(50 * time.Millisecond) // paces the retries while gRPC reconnects
	defer tick.Stop()
	for {
		rep, err = fetch(t, f)
		if err == nil {
			break
		}
		if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
			t.Fatalf("Fetch after the worker came back: %v", err)
		}
		<-tick.C
	}
	if rep.Running != 1 {
		t.Errorf("report after the comeback = %+v", rep)
	}
	if n := second.Lis.accepts.Load(); n != 1 {
		t.Errorf("the returned worker accepted %d connections, want 1", n)
	}
}

// One connection serves every poll, and Close releases it.
func TestConnectionReusedAndClosed(t *testing.T) {
	srv := startScheduler(t, "", answer(&schedulerpb.GetLoadsResponse{Loads: []*schedulerpb.SchedulerLoad{{}}}))
	f, err := grpcload.New(grpcload.Config{Target: srv.Addr})
	if err != nil {
		t.Fatal(err)
	}
	if n := srv.Lis.accepts.Load(); n != 0 {
		t.Errorf("New dialled %d times, want a lazy connection", n)
	}
	const polls = 20
	for i := range polls {
		if _, err := fetch(t, f); err != nil {
			t.Fatalf("poll %d: %v", i, err)
		}
	}
	if n := srv.Lis.accepts.Load(); n != 1 {
		t.Errorf("%d polls dialled %d connections, want 1", polls, n)
	}

	if err := f.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case <-srv.Lis.closed:
	case <-time.After(guard):
		t.Fatal("the server's connection stayed open after Close")
	}
	if err := f.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := fetch(t, f); err == nil {
		t.Error("Fetch after Close succeeded")
	}
	if n := srv.Lis.accepts.Load(); n != 1 {
		t.Errorf("Fetch after Close dialled again (%d connections)", n)
	}
}

func TestFetchOverTLS(t *testing.T) {
	cert, pool := selfSigned(t)
	srv := startScheduler(t, "", answer(&schedulerpb.GetLoadsResponse{Loads: []*schedulerpb.SchedulerLoad{{NumWaitingReqs: 4}}}),
		grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))

	f := newFetcher(t, grpcload.Config{Target: srv.Addr, TLS: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}})
	rep, err := fetch(t, f)
	if err != nil || rep.Waiting != 4 {
		t.Fatalf("Fetch over TLS = %+v, %v", rep, err)
	}

	plain := newFetcher(t, grpcload.Config{Target: srv.Addr})
	if _, err := fetch(t, plain); status.Code(err) != codes.Unavailable {
		t.Errorf("plaintext Fetch from a TLS worker = %v, want Unavailable", err)
	}

	untrusted := newFetcher(t, grpcload.Config{Target: srv.Addr, TLS: &tls.Config{MinVersion: tls.VersionTLS12}})
	rep, err = fetch(t, untrusted)
	checkStatusError(t, rep, err, codes.Unavailable, srv.Addr, "the TLS handshake failed")
}

func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "sglang-test"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:         true,

		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}

func TestNewRejectsBadTargets(t *testing.T) {
	for _, target := range []string{"", "localhost", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:0", "127.0.0.1:70000", "a b:1", "dns:///x:1"} {
		f, err := grpcload.New(grpcload.Config{Target: target})
		if err == nil {
			_ = f.Close()
			t.Errorf("New(%q) succeeded, want an error", target)
			continue
		}
		if !strings.Contains(err.Error(), strconv.Quote(target)) {
			t.Errorf("New(%q) error %q does not name the target", target, err)
		}
	}
	for _, target := range []string{"127.0.0.1:30000", "[::1]:30000", "sglang-0.sglang.svc:30000"} {
		f, err := grpcload.New(grpcload.Config{Target: target})
		if err != nil {
			t.Errorf("New(%q): %v", target, err)
			continue
		}
		_ = f.Close()
	}
}

// A poll whose connection reaches its own socket (nothing listens on the port, and the kernel picked
// it as the source) fails as unreachable, says why, and leaves the port free for the worker. Binding
// the source port to the target's makes the self-connection certain.
func TestPollThatReachesItselfIsRefused(t *testing.T) {
	addr := testports.Unused(t)
	f, err := grpcload.New(grpcload.Config{Target: addr.String()})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	grpcload.DialFrom(f, addr)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = f.Fetch(ctx)
	var se *grpcload.StatusError
	if !errors.As(err, &se) || se.Code != codes.Unavailable || !strings.Contains(err.Error(), "connected to itself") {
		t.Fatalf("poll of %s from %s: %v; want Unavailable, saying it connected to itself", addr, addr, err)
	}
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatalf("the worker's port after the poll: %v", err)
	}
	_ = ln.Close()
}
