//go:build unix

package main

import (
	"os"
	"os/exec"
	"syscall"
)

// isolate puts the child in a process group of its own: a Ctrl-C on the terminal reaches only the
// demo, which then stops the children in order, and a stop signal reaches the child's whole group.
// Where the system offers it, the child is also killed when the demo dies without stopping it
// (SIGKILL, a crash): see dieWithParent.
func isolate(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	dieWithParent(cmd.SysProcAttr)
}

// signalGroup sends sig to the process group led by p.
func signalGroup(p *os.Process, sig syscall.Signal) error {
	return syscall.Kill(-p.Pid, sig)
}
