// Package grpcload polls an SGLang worker's load over gRPC (SglangScheduler.GetLoads) and turns each
// answer into a loadpolicy.Report; it is the gRPC implementation of monitor.Fetcher.
package grpcload

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
	"github.com/caddy-sglang/caddy-sglang/internal/tcpdial"
	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// DefaultTimeout bounds a Fetch whose context has no deadline, so that no call can hang forever.
const DefaultTimeout = 5 * time.Second

// MaxResponseSize is the largest GetLoads answer accepted, in bytes; a larger one fails with
// ResourceExhausted. Core loads take well under 100 bytes per DP rank.
const MaxResponseSize = 4 << 20

// Config says how to reach one worker's SglangScheduler service.
type Config struct {
	// Target is the worker's gRPC address, host:port.
	Target string
	// TLS secures the connection when set; nil means plaintext.
	TLS *tls.Config
	// APIKey, when set, is sent on every call as "authorization: Bearer <key>" metadata.
	APIKey string
}

// Fetcher polls one worker over a single gRPC connection, opened on the first Fetch and reused (and
// re-established by gRPC when lost) until Close. It is safe for concurrent use.
type Fetcher struct {
	target string
	apiKey string
	auth   string // the authorization metadata value, empty without an API key
	conn   *grpc.ClientConn
	client schedulerpb.SglangSchedulerClient
	dialer net.Dialer

	// uncachedVersion is the last server version seen sending num_waiting_uncached_tokens.
	uncachedVersion atomic.Pointer[string]

	closeOnce sync.Once
	closeErr  error
}

// reconnect paces reconnection after the worker went away. gRPC's default backoff grows to two
// minutes, which would hide a restarted worker for many poll intervals.
var reconnect = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 250 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
	MinConnectTimeout: 5 * time.Second,
}

// New returns a Fetcher for cfg. It does not connect: the connection is made by the first Fetch.
func New(cfg Config) (*Fetcher, error) {
	if err := checkTarget(cfg.Target); err != nil {
		return nil, err
	}
	creds := insecure.NewCredentials()
	if cfg.TLS != nil {
		creds = credentials.NewTLS(cfg.TLS)
	}
	f := &Fetcher{
		target: cfg.Target,
		apiKey: cfg.APIKey,
		dialer: net.Dialer{KeepAlive: 30 * time.Second},
	}
	// The worker is dialled directly, as the HTTP poller does, whatever a proxy variable says.
	conn, err := grpc.NewClient(cfg.Target,
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return tcpdial.Dial(ctx, &f.dialer, addr)
		}),
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxResponseSize)),
		grpc.WithConnectParams(reconnect),
		grpc.WithUserAgent("caddy-sglang"),
	)
	if err != nil {
		return nil, fmt.Errorf("grpc client for %s: %w", cfg.Target, err)
	}
	f.conn, f.client = conn, schedulerpb.NewSglangSchedulerClient(conn)
	if cfg.APIKey != "" {
		f.auth = "Bearer " + cfg.APIKey
	}
	return f, nil
}

func checkTarget(target string) error {
	host, port, err := net.SplitHostPort(target)
	if err != nil {
		return fmt.Errorf("invalid grpc target %q: want host:port: %w", target, err)
	}
	if strings.ContainsAny(host, "/ ") {
		return fmt.Errorf("invalid grpc target %q: host %q", target, host)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("invalid grpc target %q: port %q is not a number in 1..65535", target, port)
	}
	return nil
}

// Target returns the worker's address, as configured.
func (f *Fetcher) Target() string { return f.target }

// Fetch asks the worker for its core loads. It honours ctx's deadline, and applies DefaultTimeout when
// ctx has none. A worker that reports no ranks yet yields an empty report. Errors carrying a gRPC status
// are *StatusError.
func (f *Fetcher) Fetch(ctx context.Context) (*loadpolicy.Report, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultTimeout)
		defer cancel()
	}
	if f.auth != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", f.auth)
	}
	resp, err := f.client.GetLoads(ctx, &schedulerpb.GetLoadsRequest{Include: []string{"core"}})
	received := time.Now()
	if err != nil {
		return nil, f.callError(ctx, err)
	}
	return f.report(resp, received), nil
}

// Close closes the connection. Fetch fails after it; further calls return the first one's result.
func (f *Fetcher) Close() error {
	f.closeOnce.Do(func() {
		if err := f.conn.Close(); err != nil {
			f.closeErr = fmt.Errorf("closing grpc connection to %s: %w", f.target, err)
		}
	})
	return f.closeErr
}

// coreFields are the core per-rank fields of the gRPC wire. proto3 gives these plain scalars no
// presence, and every server version sends them, so they are always taken as sent. num_total_tokens is
// not on this wire.
const coreFields = loadpolicy.FieldRunning | loadpolicy.FieldWaiting | loadpolicy.FieldUsedTokens |
	loadpolicy.FieldMaxTotalTokens | loadpolicy.FieldMaxRunning | loadpolicy.FieldTokenUsage |
	loadpolicy.FieldGenThroughput | loadpolicy.FieldCacheHitRate | loadpolicy.FieldUtilization

func (f *Fetcher) report(resp *schedulerpb.GetLoadsResponse, received time.Time) *loadpolicy.Report {
	loads := resp.GetLoads()
	if len(loads) == 0 {
		return loadpolicy.NewReport(received, resp.GetVersion(), nil)
	}
	carried := f.carriesUncached(resp)
	ranks := make([]loadpolicy.Rank, len(loads))
	for i, l := range loads {
		ranks[i] = loadpolicy.Rank{
			DPRank:                int(l.GetDpRank()),
			Running:               int64(l.GetNumRunningReqs()),
			Waiting:               int64(l.GetNumWaitingReqs()),
			WaitingUncachedTokens: int64(l.GetNumWaitingUncachedTokens()),
			UsedTokens:            int64(l.GetNumUsedTokens()),
			MaxTotalTokens:        int64(l.GetMaxTotalNumTokens()),
			MaxRunning:            int64(l.GetMaxRunningRequests()),
			TokenUsage:            l.GetTokenUsage(),
			GenThroughput:         l.GetGenThroughput(),
			CacheHitRate:          l.GetCacheHitRate(),
			Utilization:           l.GetUtilization(),
			Fields:                coreFields,
		}
		// With nothing waiting, no prompt tokens are queued, so 0 is the true value whether or not the
		// server knows the field.
		if carried || l.GetNumWaitingReqs() == 0 {
			ranks[i].Fields |= loadpolicy.FieldWaitingUncachedTokens
		}
	}
	return loadpolicy.NewReport(received, resp.GetVersion(), ranks)
}

// carriesUncached reports whether num_waiting_uncached_tokens can be taken as sent on every rank of
// resp. Old servers never send it and proto3 reads its absence as 0, so it can only when some rank sends
// a non-zero value, or a server of the same version string did before. Taking every 0 as sent would make
// an old server with a long queue look as if it had no queued work.
func (f *Fetcher) carriesUncached(resp *schedulerpb.GetLoadsResponse) bool {
	version := resp.GetVersion()
	for _, l := range resp.GetLoads() {
		if l.GetNumWaitingUncachedTokens() != 0 {
			if v := f.uncachedVersion.Load(); v == nil || *v != version {
				f.uncachedVersion.Store(&version)
			}
			return true
		}
	}
	v := f.uncachedVersion.Load()
	return v != nil && *v == version
}

// callError turns a failed call into a *StatusError, keeping the context's error as the cause when the
// call was cut by ctx, so that errors.Is(err, context.DeadlineExceeded) holds for a poll timeout.
func (f *Fetcher) callError(ctx context.Context, err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return fmt.Errorf("grpc GetLoads on %s: %w", f.target, err)
	}
	msg := st.Message()
	if f.apiKey != "" {
		msg = strings.ReplaceAll(msg, f.apiKey, "<api key>")
	}
	cause := ctx.Err()
	// The worker's own deadline timer can end the call an instant before ctx's timer has fired.
	if d, ok := ctx.Deadline(); cause == nil && st.Code() == codes.DeadlineExceeded && ok && !time.Now().Before(d) {
		cause = context.DeadlineExceeded
	}
	return &StatusError{Code: st.Code(), Target: f.target, Msg: msg, cause: cause}
}
