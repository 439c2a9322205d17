package caddymodule

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// tlsLoadServer starts a loopback load endpoint with a self-signed certificate for transport and
// returns its host:port.
func tlsLoadServer(t *testing.T, transport string) string {
	t.Helper()
	hs := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"version":"tls","loads":[{"dp_rank":0,"num_running_reqs":3,"num_waiting_reqs":0,` +
			`"num_used_tokens":10,"max_total_num_tokens":100,"token_usage":0.1}]}`))
	}))
	t.Cleanup(hs.Close)
	if transport == transportHTTP {
		return hs.Listener.Addr().String()
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewServerTLSFromCert(&hs.TLS.Certificates[0])))
	schedulerpb.RegisterSglangSchedulerServer(gs, fixedLoads{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return lis.Addr().String()
}

type fixedLoads struct {
	schedulerpb.UnimplementedSglangSchedulerServer
}

func (fixedLoads) GetLoads(context.Context, *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
	return &schedulerpb.GetLoadsResponse{Version: "tls", Loads: []*schedulerpb.SchedulerLoad{{NumRunningReqs: 3}}}, nil
}

// Polls over TLS verify the worker's certificate unless the config opts out; a certificate that does not
// verify fails the poll with an error that says so.
func TestFetchersOverTLS(t *testing.T) {
	for _, transport := range []string{transportHTTP, transportGRPC} {
		t.Run(transport, func(t *testing.T) {
			addr := tlsLoadServer(t, transport)
			fetch := func(spec endpointSpec) error {
				t.Helper()
				spec.transport, spec.address = transport, addr
				f, err := newFetcher(spec)
				if err != nil {
					t.Fatal(err)
				}
				defer stampingFetcher{Fetcher: f}.Close()
				ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
				defer cancel()
				rep, err := f.Fetch(ctx)
				if err == nil && rep.Running != 3 {
					t.Errorf("report over TLS: running %d, want 3", rep.Running)
				}
				return err
			}

			err := fetch(endpointSpec{tls: true})
			if err == nil || !strings.Contains(err.Error(), "certificate") || !strings.Contains(err.Error(), addr) {
				t.Errorf("unverifiable certificate: err = %v, want a certificate error naming %s", err, addr)
			}
			t.Logf("unverified: %v", err)
			if err := fetch(endpointSpec{tls: true, insecureSkipVerify: true}); err != nil {
				t.Errorf("with load_tls_insecure_skip_verify: %v", err)
			}
			if err := fetch(endpointSpec{}); err == nil {
				t.Error("plaintext poll of a TLS worker succeeded")
			} else {
				t.Logf("plaintext: %v", err)
			}
		})
	}
}
