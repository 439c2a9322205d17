package loadpolicy

import "time"

// FleetOutput estimates the mean length of the answers a fleet gives, which the proxy does not read:
// the output tokens its workers decoded between two reports (their gen_throughput over the time
// between) over the requests they were sent in that time (this proxy's, times the worker's senders
// factor, see Senders). Each request decodes its answer once, so over a while the ratio is the mean
// answer. Sums weigh, as the decode readings do, half for every decodeMemory. The zero value is ready;
// it is not safe for concurrent use.
type FleetOutput struct {
	decoded, requests float64
	last              time.Time
}

// minOutputRequests is how many requests the sums must count before Mean says anything: fewer, and a
// few long answers still decoding, or a burst not yet decoded, decide it.
const minOutputRequests = 32

// Add adds what r's worker decoded, and was sent, since its previous report prev.
func (f *FleetOutput) Add(r, prev *Report) {
	if prev == nil || !r.work.readsDecode || !prev.work.readsDecode {
		return
	}
	gap := r.Received.Sub(prev.Received)
	sent := r.Sent.Requests - prev.Sent.Requests
	if gap <= 0 || sent < 0 || r.Sent.Requests == 0 {
		return // a clock that stepped back, totals that began again, or a proxy that counts nothing
	}
	kept := keptSince(&f.last, r.Received)
	f.decoded, f.requests = f.decoded*kept, f.requests*kept
	f.decoded += (max(r.GenThroughput, 0) + max(prev.GenThroughput, 0)) / 2 * gap.Seconds()
	f.requests += float64(sent) * max(r.work.senders, 1)
}

// Mean is the mean answer in tokens, 0 until enough requests were counted.
func (f *FleetOutput) Mean() float64 {
	if f.requests < minOutputRequests {
		return 0
	}
	return f.decoded / f.requests
}
