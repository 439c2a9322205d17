package affinity

import (
	"syscall"
	"testing"
	"time"
)

// cpuTimer reports the process's CPU time per op beside the wall time: on a shared machine the wall
// time of a benchmark says more about the neighbours than about the code.
type cpuTimer struct{ start time.Duration }

func cpuNow() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func startCPU() cpuTimer { return cpuTimer{cpuNow()} }

func (c cpuTimer) report(b *testing.B) {
	if b.N > 0 {
		b.ReportMetric(float64(cpuNow()-c.start)/float64(b.N), "cpu-ns/op")
	}
}
