package monitor

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// Snapshot is an endpoint's polling state at one moment. It is immutable once published.
type Snapshot struct {
	// Report is the last good report, kept across failed polls until it goes stale; nil if none yet.
	Report *loadpolicy.Report
	// Err is the error of the last poll, nil if it succeeded; ErrAt is when it happened.
	Err   error
	ErrAt time.Time
	// LastPoll is when the last poll finished.
	LastPoll time.Time
	// OK and Failed count polls; Failures counts consecutive failed polls.
	OK, Failed uint64
	Failures   int
}

// Fresh returns the report if there is one younger than staleAfter at now, or nil.
func (s *Snapshot) Fresh(now time.Time, staleAfter time.Duration) *loadpolicy.Report {
	if s == nil {
		return nil
	}
	return FreshReport(s.Report, now, staleAfter)
}

// FreshReport returns r if it is younger than staleAfter at now, else nil: Fresh's rule, for a caller
// that keeps a snapshot's report without the snapshot.
func FreshReport(r *loadpolicy.Report, now time.Time, staleAfter time.Duration) *loadpolicy.Report {
	if r == nil || now.Sub(r.Received) > staleAfter {
		return nil
	}
	return r
}

// State holds an endpoint's latest snapshot. Readers are lock-free; it may be shared by several
// monitors, as the old and the new config are during a reload.
type State struct {
	mu   sync.Mutex // serialises publishers
	snap atomic.Pointer[Snapshot]
}

// Load returns the latest snapshot, or nil before the first poll.
func (s *State) Load() *Snapshot { return s.snap.Load() }

func (s *State) publish(report *loadpolicy.Report, err error, now time.Time) (prev, next *Snapshot) {
	s.mu.Lock()
	defer s.mu.Unlock()
	prev = s.snap.Load()
	n := Snapshot{LastPoll: now}
	if prev != nil {
		n.Report, n.OK, n.Failed, n.Failures = prev.Report, prev.OK, prev.Failed, prev.Failures
		n.ErrAt = prev.ErrAt
	}
	if err != nil {
		n.Err, n.ErrAt = err, now
		n.Failed++
		n.Failures++
	} else {
		n.Report = report
		n.OK++
		n.Failures = 0
	}
	s.snap.Store(&n)
	return prev, &n
}

// TimeoutError is a poll that did not answer within its deadline.
type TimeoutError struct {
	Timeout time.Duration
	Err     error
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("no answer within the %s poll timeout: %v", e.Timeout, e.Err)
}

func (e *TimeoutError) Unwrap() error { return e.Err }
