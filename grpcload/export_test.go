package grpcload

import "net"

// DialFrom makes f dial from addr, so that a test can make a dial reach its own socket.
func DialFrom(f *Fetcher, addr *net.TCPAddr) { f.dialer.LocalAddr = addr }
