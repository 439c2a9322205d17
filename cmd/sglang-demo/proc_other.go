//go:build !unix

package main

import (
	"os"
	"os/exec"
	"syscall"
)

// isolate is a no-op where there are no process groups.
func isolate(*exec.Cmd) {}

// signalGroup has no graceful signal to send here: every stop is a kill.
func signalGroup(p *os.Process, _ syscall.Signal) error {
	return p.Kill()
}
