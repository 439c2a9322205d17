package affinity

// A key is the chained hashes of a prompt's leading blocks: Blocks[i] = mix(Blocks[i-1], wyhash of block
// i), starting from a seed for the kind of key, so two prompts share their first n hashes exactly when
// they share their first n blocks (but for 64-bit collisions). A block is BlockTokens tokens of the
// simulator's measure: BlockBytes bytes of prompt text, or BlockTokens token ids. Only whole blocks are
// keyed. wyhash and the seeds are fixed: every process computes the same key, so independent replicas
// agree. A block is four of the simulator's cache blocks: hashing costs per block, and a credit for
// cached tokens up to 63 tokens short prices as well.
const (
	BlockTokens = 64
	BlockBytes  = BlockTokens * bytesPerToken
	// MaxBlocks is a capacity for Request.Blocks that keys the first 64 KiB of prompt text, as much as
	// the policy reads of a body by default: an agent's instructions and tools often run past 16 KiB,
	// and a key that holds nothing else gives every one of its conversations the same key.
	MaxBlocks = 256

	bytesPerToken = 4
)

// Seeds keep the kinds of key apart: text and token ids cannot be related without a tokenizer.
const (
	seedText   = 't'
	seedIDs    = 'i'
	seedHeader = 'h'
)

// HeaderKey appends to dst[:0] the single-block key of a session header's value (empty when the value
// is). Use it for `affinity header NAME`.
func HeaderKey(value string, dst []uint64) []uint64 {
	dst = dst[:0]
	if value == "" {
		return dst
	}
	return append(dst, mix(seedHeader, wyhashString(value, 0)))
}

// mix combines two hashes into one, well spread (MurmurHash3's finalizer of their exclusive or): it
// chains block hashes and weighs workers in the rendezvous order.
func mix(a, b uint64) uint64 {
	h := a ^ b
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// keyWriter cuts a byte stream into blocks and appends each whole block's chained hash, up to the
// capacity of blocks. A block that lies whole in one write is hashed where it is; one that spans writes
// is gathered in buf.
type keyWriter struct {
	prev   uint64
	fill   int
	buf    [BlockBytes]byte
	blocks []uint64
}

func (k *keyWriter) reset(seed uint64, blocks []uint64) {
	k.prev, k.fill, k.blocks = seed, 0, blocks[:0]
}

func (k *keyWriter) full() bool { return len(k.blocks) == cap(k.blocks) }

func (k *keyWriter) write(p []byte) {
	for len(p) > 0 && !k.full() {
		if k.fill == 0 && len(p) >= BlockBytes {
			k.block(p[:BlockBytes])
			p = p[BlockBytes:]
			continue
		}
		n := copy(k.buf[k.fill:], p)
		k.fill += n
		p = p[n:]
		if k.fill == BlockBytes {
			k.block(k.buf[:])
			k.fill = 0
		}
	}
}

func (k *keyWriter) block(b []byte) {
	k.prev = mix(k.prev, wyhash(b, 0))
	k.blocks = append(k.blocks, k.prev)
}

func (k *keyWriter) writeByte(c byte) {
	if !k.full() {
		b := [1]byte{c}
		k.write(b[:])
	}
}
