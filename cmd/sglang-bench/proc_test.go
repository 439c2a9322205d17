package main

import (
	"os"
	"testing"
	"time"
)

// procCPU reads this process's own CPU time, and it grows with work done.
func TestProcCPU(t *testing.T) {
	before, err := procCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	self := cpuTime()
	for cpuTime()-self < 50*time.Millisecond {
	}
	after, err := procCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if d := after - before; d < 50*time.Millisecond-clockTick || d > 10*time.Second {
		t.Errorf("CPU time grew by %v over 50ms of spinning", d)
	}
	if _, err := procCPU(-1); err == nil {
		t.Error("no error for a process that does not exist")
	}
}
