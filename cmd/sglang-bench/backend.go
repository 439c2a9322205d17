package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"
)

// loadsJSON is a /v1/loads answer of one rank decoding one request, stamped with the time so that every
// poll is fresh. Decoding, as a worker that answers requests is: the cost metric polls a worker that
// reports none ten times as often while it sends it requests, until a poll catches it decoding.
func loadsJSON(now time.Time) []byte {
	return []byte(`{"timestamp":"` + now.UTC().Format(time.RFC3339Nano) + `","version":"0.5.0-bench",` +
		`"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":0,"num_waiting_uncached_tokens":0,` +
		`"num_used_tokens":0,"num_total_tokens":0,"max_total_num_tokens":65536,"max_running_requests":64,` +
		`"token_usage":0.0,"gen_throughput":50.0,"cache_hit_rate":0.0,"utilization":0.0}]}`)
}

// fastHandler answers /v1/loads with a fresh load (loadsJSON) and anything else with a small body: a backend
// so fast that a benchmark through the proxy measures the proxy.
func fastHandler() http.Handler {
	body := []byte(`{"ok":true}`)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/loads" {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(loadsJSON(time.Now()))
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
}

// runBackend serves fastHandler on addr and prints the address it listens on.
func runBackend(ctx context.Context, addr string, stdout io.Writer) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: fastHandler(), ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintln(stdout, ln.Addr())
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.Serve(ln); err != http.ErrServerClosed {
		return err
	}
	return nil
}
