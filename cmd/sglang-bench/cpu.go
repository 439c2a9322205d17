package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuMark is a moment's CPU counters: this process's, its waited-for children's (the Caddy processes,
// once stopped), and the whole machine's busy and total jiffies from /proc/stat.
type cpuMark struct {
	at               time.Time
	self, children   time.Duration
	busy, total      uint64
	machineAvailable bool
}

func markCPU() cpuMark {
	m := cpuMark{at: time.Now()}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		m.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru) == nil {
		m.children = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line)
		if len(f) > 4 && f[0] == "cpu" {
			for i, v := range f[1:] {
				n, _ := strconv.ParseUint(v, 10, 64)
				m.total += n
				if i != 3 && i != 4 { // idle, iowait
					m.busy += n
				}
			}
			m.machineAvailable = true
		}
	}
	return m
}

// cpuUse is the CPU a span of the run used.
type cpuUse struct {
	wall           time.Duration
	self, children time.Duration
	machineBusy    float64 // fraction of all cores busy, every process of the machine counted; -1 unknown
}

func cpuSince(from cpuMark) cpuUse {
	to := markCPU()
	u := cpuUse{wall: to.at.Sub(from.at), self: to.self - from.self, children: to.children - from.children, machineBusy: -1}
	if from.machineAvailable && to.machineAvailable && to.total > from.total {
		u.machineBusy = float64(to.busy-from.busy) / float64(to.total-from.total)
	}
	return u
}

// String says how much of the machine the bench (client and simulated workers), the Caddy processes and
// everything else used, and warns when the machine was saturated, which stretches latencies.
func (u cpuUse) String() string {
	cores := float64(runtime.NumCPU())
	share := func(d time.Duration) float64 { return d.Seconds() / u.wall.Seconds() / cores * 100 }
	s := fmt.Sprintf("wall %s; bench process (client + simulated workers) %.1f s CPU = %.0f%% of %g cores; Caddy processes %.1f s = %.0f%%",
		u.wall.Round(time.Second), u.self.Seconds(), share(u.self), cores, u.children.Seconds(), share(u.children))
	if u.machineBusy >= 0 {
		s += fmt.Sprintf("; whole machine busy %.0f%%", u.machineBusy*100)
		if u.machineBusy > 0.9 {
			s += " (SATURATED: latencies are stretched by CPU waits, compare ratios only within this run)"
		}
	}
	return s
}
