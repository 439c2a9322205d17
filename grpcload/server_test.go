package grpcload_test

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// scheduler is a SglangScheduler server whose GetLoads runs handle; a nil handle answers Unimplemented.
type scheduler struct {
	schedulerpb.UnimplementedSglangSchedulerServer
	handle func(ctx context.Context, req *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error)
}

func (s *scheduler) GetLoads(ctx context.Context, req *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
	if s.handle == nil {
		return s.UnimplementedSglangSchedulerServer.GetLoads(ctx, req)
	}
	return s.handle(ctx, req)
}

// countingListener counts the connections it accepts and reports each one's close on closed.
type countingListener struct {
	net.Listener
	accepts atomic.Int64
	closed  chan struct{}
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.accepts.Add(1)
	return &notifyConn{Conn: c, closed: l.closed}, nil
}

type notifyConn struct {
	net.Conn
	once   sync.Once
	closed chan struct{}
}

func (c *notifyConn) Close() error {
	c.once.Do(func() {
		select {
		case c.closed <- struct{}{}:
		default:
		}
	})
	return c.Conn.Close()
}

type testServer struct {
	Addr string
	Srv  *grpc.Server
	Lis  *countingListener
}

// serve runs srv on lis until the test ends.
func serve(t *testing.T, lis net.Listener, srv *grpc.Server) *testServer {
	t.Helper()
	cl := &countingListener{Listener: lis, closed: make(chan struct{}, 64)}
	go func() { _ = srv.Serve(cl) }()
	t.Cleanup(srv.Stop)
	return &testServer{Addr: lis.Addr().String(), Srv: srv, Lis: cl}
}

// startScheduler serves a scheduler with handle on a fresh loopback port (or on addr when given).
func startScheduler(t *testing.T, addr string, handle func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error), opts ...grpc.ServerOption) *testServer {
	t.Helper()
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	srv := grpc.NewServer(opts...)
	schedulerpb.RegisterSglangSchedulerServer(srv, &scheduler{handle: handle})
	return serve(t, lis, srv)
}

func answer(resp *schedulerpb.GetLoadsResponse) func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
	return func(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
		return resp, nil
	}
}
