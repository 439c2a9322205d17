package loadpolicy

import (
	"fmt"
	"math"
	"strings"
)

// Signal is one comparable measure of a worker's load. Signals are listed from the most to the least
// precise predictor of the delay a new request will see.
type Signal uint8

const (
	// QueuedTokens is the queued prompt work in seconds: uncached waiting tokens over decode throughput.
	QueuedTokens Signal = iota
	// TokenLatency is the decode time per output token a new request would see, in seconds: running
	// requests over decode throughput. It tells a slow worker from a fast one where usage cannot.
	TokenLatency
	// TokenUsage is the KV-pool usage of the hottest DP rank (0..1).
	TokenUsage
	// UsedTokens is the number of KV tokens in use, summed over ranks.
	UsedTokens
	// Waiting is the number of queued requests, summed over ranks.
	Waiting
	// Running is the number of running requests, summed over ranks.
	Running
	numSignals
)

var signalNames = [numSignals]string{"queued_tokens", "token_latency", "token_usage", "used_tokens", "waiting", "running"}

func (s Signal) String() string {
	if s < numSignals {
		return signalNames[s]
	}
	return fmt.Sprintf("signal(%d)", s)
}

// SignalSet is a bit set of signals.
type SignalSet uint8

// Has reports whether s is in the set.
func (m SignalSet) Has(s Signal) bool { return m&(1<<s) != 0 }

// Signals are the values a report offers for comparison, and what one more request costs in each unit.
type Signals struct {
	Set   SignalSet
	Value [numSignals]float64
	// Cost is the expected increase of Value per request started after the report; it turns the
	// proxy's own in-flight count into the signal's unit so a stale-ish report does not herd requests.
	Cost [numSignals]float64
}

// Score is the signal's value corrected by extra requests started since the report.
func (s *Signals) Score(sig Signal, extra int64) float64 {
	return s.Value[sig] + float64(extra)*s.Cost[sig]
}

func (s *Signals) set(sig Signal, value, cost float64) {
	s.Set |= 1 << sig
	s.Value[sig] = value
	s.Cost[sig] = cost
}

// deriveSignals computes every signal that all of the report's ranks support.
func deriveSignals(r *Report, usageKnown bool) Signals {
	var s Signals
	if len(r.Ranks) == 0 {
		return s
	}
	all := Field(0xffff)
	for i := range r.Ranks {
		all &= r.Ranks[i].Fields
	}
	ranks := float64(len(r.Ranks))
	has := func(f Field) bool { return all&f == f }

	// Tokens a request holds, from what is running now; used to price requests sent after the report.
	var tokensPerRequest float64
	if has(FieldUsedTokens|FieldRunning) && r.Running > 0 {
		tokensPerRequest = float64(r.UsedTokens) / float64(r.Running)
	}

	if has(FieldWaitingUncachedTokens) {
		throughput := math.Max(r.GenThroughput, 1)
		var queuedPerRequest float64
		if has(FieldWaiting) && r.Waiting > 0 {
			queuedPerRequest = float64(r.WaitingUncachedTokens) / float64(r.Waiting)
		}
		s.set(QueuedTokens, float64(r.WaitingUncachedTokens)/throughput, queuedPerRequest/throughput)
	}
	// Throughput measures a worker's speed only when it decoded lately: a worker idle for a while
	// offers no latency rather than a free zero that would draw every request until its next report.
	if has(FieldRunning|FieldGenThroughput) && r.GenThroughput > 0 {
		// One more request shares the same throughput: priced as if the worker were throughput-bound.
		s.set(TokenLatency, float64(r.Running)/r.GenThroughput, 1/r.GenThroughput)
	}
	if usageKnown && (has(FieldTokenUsage) || has(FieldUsedTokens|FieldMaxTotalTokens)) {
		var cost float64
		switch {
		case tokensPerRequest > 0 && r.MaxTotalTokens > 0:
			cost = tokensPerRequest / (float64(r.MaxTotalTokens) / ranks)
		case has(FieldMaxRunning) && r.MaxRunning > 0:
			cost = ranks / float64(r.MaxRunning)
		}
		s.set(TokenUsage, r.MaxTokenUsage, cost)
	}
	if has(FieldUsedTokens) {
		s.set(UsedTokens, float64(r.UsedTokens), tokensPerRequest)
	}
	if has(FieldWaiting) {
		s.set(Waiting, float64(r.Waiting), 1)
	}
	if has(FieldRunning) {
		s.set(Running, float64(r.Running), 1)
	}
	return s
}

// Metric selects which signals a comparison may use.
type Metric struct {
	set  SignalSet
	cost bool // the cost model, not a signal
	name string
}

// MetricCost prices each request on each worker in seconds (see Report.Cost).
var MetricCost = Metric{cost: true, name: "cost"}

// Cost reports whether the metric is the cost model.
func (m Metric) Cost() bool { return m.cost }

// usable reports whether the candidate offers what this metric compares.
func (m Metric) usable(c *Candidate) bool {
	if m.cost {
		return c.Priced()
	}
	return m.Usable(c.Signals)
}

// MetricAuto compares on the most precise signal both workers share, then on the next ones to break ties.
var MetricAuto = Metric{set: 1<<numSignals - 1, name: "auto"}

// ParseMetric parses a metric name: auto, or one signal name.
func ParseMetric(name string) (Metric, error) {
	switch name {
	case "", "auto":
		return MetricAuto, nil
	case MetricCost.name:
		return MetricCost, nil
	}
	for i, n := range signalNames {
		if n == name {
			return Metric{set: 1 << i, name: name}, nil
		}
	}
	return Metric{}, fmt.Errorf("unknown metric %q: want cost, auto, %s", name, strings.Join(signalNames[:], ", "))
}

func (m Metric) String() string {
	if m.name == "" {
		return MetricAuto.name
	}
	return m.name
}

func (m Metric) signals() SignalSet {
	if m.set == 0 {
		return MetricAuto.set
	}
	return m.set
}

// Usable reports whether s offers a signal this metric can compare.
func (m Metric) Usable(s *Signals) bool { return s != nil && s.Set&m.signals() != 0 }

// Common narrows the metric to the signals s offers, so that a comparison across several workers
// uses only signals all of them have. The zero SignalSet means "nothing in common".
func (m Metric) Common(set SignalSet, s *Signals) SignalSet { return set & s.Set & m.signals() }

// AllSignals is the set to start a Common fold from.
func (m Metric) AllSignals() SignalSet { return m.signals() }

// First returns the most precise signal of the set and whether there is one: the one a score shows.
func (m SignalSet) First() (Signal, bool) {
	for s := Signal(0); s < numSignals; s++ {
		if m.Has(s) {
			return s, true
		}
	}
	return 0, false
}
