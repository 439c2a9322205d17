//go:build linux || freebsd

package main

import "syscall"

// dieWithParent asks the kernel to SIGKILL the child when the demo dies. Linux sends it when
// the thread that started the child exits; Go's runtime keeps its threads for the life of the process
// (the demo locks no goroutine to a thread), so in practice that is when the demo exits.
func dieWithParent(attr *syscall.SysProcAttr) {
	attr.Pdeathsig = syscall.SIGKILL
}
