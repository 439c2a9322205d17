package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// child is a process the demo started, with its output in a log file.
type child struct {
	name string
	cmd  *exec.Cmd
	log  string        // path of the file that holds its stdout and stderr
	done chan struct{} // closed once the process has exited and been reaped
	err  error         // what Wait returned; read after done
}

// startChild runs path with args in its own process group, its output going to <logDir>/<name>.log.
func startChild(name, logDir, path string, args ...string) (*child, error) {
	logPath := filepath.Join(logDir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer f.Close() // the child holds its own copy of the descriptor
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = f, f
	isolate(cmd)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the child's group, and SIGKILL when it has not exited after grace. It returns
// once the child is reaped.
func (c *child) stop(grace time.Duration) {
	if c.exited() {
		return
	}
	_ = signalGroup(c.cmd.Process, syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-c.done:
		return
	case <-t.C:
	}
	_ = signalGroup(c.cmd.Process, syscall.SIGKILL)
	<-c.done
}

// tail returns the last n lines of the child's log, for error messages.
func (c *child) tail(n int) string {
	b, err := os.ReadFile(c.log)
	if err != nil {
		return ""
	}
	lines := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
