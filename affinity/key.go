package affinity

import "github.com/cespare/xxhash/v2"

// A key is the chained hashes of a prompt's leading blocks: Blocks[i] hashes everything from the
// prompt's start to the end of block i, so two prompts share their first n hashes exactly when they
// share their first n blocks. A block is BlockTokens tokens of the simulator's measure: BlockBytes bytes
// of prompt text, or BlockTokens token ids. Only whole blocks are keyed. xxhash with fixed seeds: every
// process computes the same key, so independent replicas agree. A block is four of the simulator's
// cache blocks: hashing costs per block, and a credit for cached tokens that is up to 63 tokens short is
// as good for pricing.
const (
	BlockTokens = 64
	BlockBytes  = BlockTokens * bytesPerToken
	// MaxBlocks is a capacity for Request.Blocks that keys the first 16 KiB of prompt text.
	MaxBlocks = 64

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
	var d xxhash.Digest
	d.ResetWithSeed(seedHeader)
	d.WriteString(value)
	return append(dst, d.Sum64())
}

// keyWriter cuts a byte stream into blocks and appends each whole block's chained hash, up to the
// capacity of blocks.
type keyWriter struct {
	d      xxhash.Digest
	fill   int
	blocks []uint64
}

func (k *keyWriter) reset(seed uint64, blocks []uint64) {
	k.d.ResetWithSeed(seed)
	k.fill = 0
	k.blocks = blocks[:0]
}

func (k *keyWriter) full() bool { return len(k.blocks) == cap(k.blocks) }

func (k *keyWriter) write(p []byte) {
	for len(p) > 0 && !k.full() {
		take := min(len(p), BlockBytes-k.fill)
		k.d.Write(p[:take])
		k.fill += take
		p = p[take:]
		if k.fill == BlockBytes {
			k.blocks = append(k.blocks, k.d.Sum64())
			k.fill = 0
		}
	}
}

func (k *keyWriter) writeByte(c byte) {
	if !k.full() {
		b := [1]byte{c}
		k.write(b[:])
	}
}
