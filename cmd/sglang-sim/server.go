package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// downGrace lets the response to POST /sim/fault?down= leave before the listeners close.
const downGrace = 200 * time.Millisecond

// server is one worker's HTTP (and gRPC) listeners. The Down fault really closes them, so a poller
// sees refused connections, and reopens them on the same ports afterwards.
type server struct {
	w                  *sglangsim.Worker
	log                *log.Logger
	httpAddr, grpcAddr string

	mu      sync.Mutex
	hs      *http.Server // nil while down or stopped
	gs      *grpc.Server
	gen     int // bumped by every Down, so that only the latest one reopens
	stopped bool
	done    chan struct{} // closed by shutdown
}

func (s *server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done = make(chan struct{})
	return s.listenLocked()
}

func (s *server) listenLocked() error {
	hl, err := net.Listen("tcp", s.httpAddr)
	if err != nil {
		return fmt.Errorf("worker %s: %w", s.w.Config().Name, err)
	}
	var gl net.Listener
	if s.grpcAddr != "" {
		if gl, err = net.Listen("tcp", s.grpcAddr); err != nil {
			hl.Close()
			return fmt.Errorf("worker %s: %w", s.w.Config().Name, err)
		}
	}
	hs := &http.Server{Handler: s.w.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := hs.Serve(hl); !errors.Is(err, http.ErrServerClosed) {
			s.log.Printf("worker %s: http: %v", s.w.Config().Name, err)
		}
	}()
	s.hs = hs
	if gl != nil {
		gs := s.w.GRPCServer()
		go func() {
			if err := gs.Serve(gl); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
				s.log.Printf("worker %s: grpc: %v", s.w.Config().Name, err)
			}
		}()
		s.gs = gs
	}
	return nil
}

// bounce is the Down hook: it closes the listeners for d, then reopens them. d <= 0 reopens at once.
func (s *server) bounce(d time.Duration) {
	name := s.w.Config().Name
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return
	}
	s.gen++
	gen := s.gen
	var hs *http.Server
	var gs *grpc.Server
	if d > 0 {
		hs, gs, s.hs, s.gs = s.hs, s.gs, nil, nil
	}
	s.mu.Unlock()

	if d > 0 {
		if hs != nil {
			s.log.Printf("worker %s down for %v", name, d)
			stop(hs, gs, downGrace)
		}
		select {
		case <-time.After(d):
		case <-s.done:
			return
		}
	}
	// The port was ours a moment ago; retry briefly in case the kernel has not let it go yet.
	for range 20 {
		s.mu.Lock()
		if s.stopped || gen != s.gen || s.hs != nil {
			s.mu.Unlock()
			return
		}
		err := s.listenLocked()
		s.mu.Unlock()
		if err == nil {
			s.log.Printf("worker %s back up on http://%s", name, s.httpAddr)
			return
		}
		s.log.Printf("worker %s: reopening: %v", name, err)
		time.Sleep(100 * time.Millisecond)
	}
}

// shutdown closes the listeners, lets running requests finish for up to timeout, then fails the rest.
func (s *server) shutdown(timeout time.Duration) {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return
	}
	s.stopped = true
	close(s.done)
	hs, gs := s.hs, s.gs
	s.hs, s.gs = nil, nil
	s.mu.Unlock()

	s.w.Faults().SetHangLoads(false) // hung polls would hold the shutdown for nothing
	var wg sync.WaitGroup
	wg.Go(func() {
		if hs == nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if hs.Shutdown(ctx) == nil {
			return
		}
		// Requests still running or queued get a 503 from Close; give those answers a moment.
		s.w.Close()
		ctx, cancel = context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if hs.Shutdown(ctx) != nil {
			hs.Close()
		}
	})
	wg.Go(func() { stop(nil, gs, timeout) })
	wg.Wait()
	s.w.Close()
}

// stop closes an HTTP and a gRPC server, each given grace to finish what is in flight.
func stop(hs *http.Server, gs *grpc.Server, grace time.Duration) {
	var wg sync.WaitGroup
	if hs != nil {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), grace)
			defer cancel()
			if hs.Shutdown(ctx) != nil {
				hs.Close()
			}
		})
	}
	if gs != nil {
		wg.Go(func() {
			done := make(chan struct{})
			go func() {
				gs.GracefulStop()
				close(done)
			}()
			select {
			case <-done:
			case <-time.After(grace):
				gs.Stop()
			}
		})
	}
	wg.Wait()
}
