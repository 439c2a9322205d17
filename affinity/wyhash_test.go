package affinity

import (
	"testing"

	"github.com/cespare/xxhash/v2"
)

// The reference's own test vectors (test_vector.cpp: message i hashed with seed i), and, for every
// branch of its code, the reference's hash of the first n bytes of ramp with seed j, printed by the
// reference built with g++ -O2 on x86-64.
func TestWyhashMatchesTheReference(t *testing.T) {
	for i, v := range []struct {
		msg  string
		want uint64
	}{
		{"", 0x93228a4de0eec5a2},
		{"a", 0xc5bac3db178713c4},
		{"abc", 0xa97f2f7b1d9b3314},
		{"message digest", 0x786d1f1df3801df4},
		{"abcdefghijklmnopqrstuvwxyz", 0xdca5a8138ad37c87},
		{"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", 0xb9e734f117cfaf70},
		{"12345678901234567890123456789012345678901234567890123456789012345678901234567890", 0x6cc5eab49a92d617},
	} {
		if got := wyhash([]byte(v.msg), uint64(i)); got != v.want {
			t.Errorf("wyhash(%q, %d) = %#x, want %#x", v.msg, i, got, v.want)
		}
		if got := wyhashString(v.msg, uint64(i)); got != v.want {
			t.Errorf("wyhashString(%q, %d) = %#x, want %#x", v.msg, i, got, v.want)
		}
	}
	ramp := make([]byte, 1024)
	for i := range ramp {
		ramp[i] = byte(i*7 + i>>8)
	}
	for j, v := range []struct {
		n    int
		want uint64
	}{
		{4, 0x311261cca5bf45e0}, {8, 0xe95acd74ccc256e5}, {16, 0x82232667f9378a2f}, {17, 0x251b616824d32ec6},
		{47, 0x573060b55be2a26a}, {48, 0xefa7d569f20277fe}, {49, 0x996a5172f0ae334f}, {64, 0xd782772d401b5eda},
		{96, 0x297703f2adef6bf0}, {255, 0x91136ce8e2fe146b}, {256, 0xa118156ab749f717},
		{257, 0x2f42105e35e95d52}, {1000, 0x746955ee3cc011c1},
	} {
		if got := wyhash(ramp[:v.n], uint64(j)); got != v.want {
			t.Errorf("wyhash(ramp[:%d], %d) = %#x, want %#x", v.n, j, got, v.want)
		}
	}
}

// BenchmarkBlockHash hashes a 16 KiB prompt as keys do, a 256-byte block at a time: wyhash, which keys
// use, and xxhash, which they used.
func BenchmarkBlockHash(b *testing.B) {
	prompt := []byte(chatBody(16<<10, false))[:MaxBlocks*BlockBytes]
	for _, h := range []struct {
		name string
		sum  func([]byte) uint64
	}{{"wyhash", func(p []byte) uint64 { return wyhash(p, 0) }}, {"xxhash", xxhash.Sum64}} {
		b.Run(h.name, func(b *testing.B) {
			b.SetBytes(int64(len(prompt)))
			for b.Loop() {
				for i := 0; i < len(prompt); i += BlockBytes {
					blockHashSink += h.sum(prompt[i : i+BlockBytes])
				}
			}
		})
	}
}

var blockHashSink uint64
