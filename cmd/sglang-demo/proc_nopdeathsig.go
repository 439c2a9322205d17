//go:build unix && !linux && !freebsd

package main

import "syscall"

// dieWithParent does nothing where there is no parent-death signal: a demo killed with SIGKILL leaves
// its children running there.
func dieWithParent(*syscall.SysProcAttr) {}
