//go:build unix

package main

import (
	"os"
	"os/exec"
	"syscall"
)

// isolate puts the child in a process group of its own: a Ctrl-C on the terminal reaches only the
// demo, which then stops the children in order, and a stop signal reaches the child's whole group.
func isolate(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
}

// signalGroup sends sig to the process group led by p.
func signalGroup(p *os.Process, sig syscall.Signal) error {
	return syscall.Kill(-p.Pid, sig)
}
