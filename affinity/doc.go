// Package affinity routes a request by what it carries: it reads a bounded head of the body (and puts it
// back), extracts the prompt's size and a key of chained block hashes, remembers which worker received
// which blocks, and chooses a worker by rendezvous hashing bounded by load. It does not import Caddy.
package affinity
