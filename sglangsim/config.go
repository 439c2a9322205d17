package sglangsim

import (
	"fmt"
	"math"
)

// Config describes one simulated worker. Zero values take the defaults noted on each field.
type Config struct {
	// Name identifies the worker in responses (header X-Sglang-Sim-Worker) and stats. Default "sim".
	Name string
	// MaxTotalTokens is the KV pool capacity of each DP rank, in tokens. Default 65536.
	MaxTotalTokens int64
	// DecodeTokensPerSec is the decode speed of one request running alone, in tokens/s. Default 200.
	DecodeTokensPerSec float64
	// PrefillTokensPerSec is the prefill speed of each DP rank, in prompt tokens/s. Default 8000.
	PrefillTokensPerSec float64
	// MaxRunningRequests caps the running batch of each DP rank. Default 64.
	MaxRunningRequests int
	// MaxPrefillTokens is how many uncached prompt tokens one prefill batch takes, as SGLang's
	// --max-prefill-tokens: the admitted requests behind that many report as waiting. Default 16384.
	MaxPrefillTokens int64
	// DPRanks is the number of data-parallel ranks; requests go to them round-robin. Default 1.
	DPRanks int
	// LegacyShape answers /v1/loads in the early-2026 shape: top-level dp_rank_count and aggregate,
	// per-rank num_total_reqs, and no num_waiting_uncached_tokens.
	LegacyShape bool
	// DisablePrefixCache turns the per-rank prefix cache off: every prompt token is prefilled and
	// cache_hit_rate stays 0. The cache is on by default.
	DisablePrefixCache bool
	// OmitPrefillCounters leaves total_prefill_uncached_tokens and total_prefill_busy_us out of
	// /v1/loads and /metrics, as SGLang versions before them do. They are sent by default.
	OmitPrefillCounters bool
	// FinishEarly, in (0, 1), makes answers end before max_tokens as real models do: each answer's
	// length is drawn between FinishEarly × max_tokens and max_tokens (finish_reason "stop" when
	// shorter), from a hash of the request's prompt and sizes, so a request gets the same length on every
	// worker and in every run. 0 (the default) or 1: every answer has max_tokens tokens.
	FinishEarly float64
	// SGLangAdmission admits and retracts requests as SGLang's scheduler does (admission.go): a request
	// takes KV for its prompt when admitted and for each token as it decodes, and is admitted on a guess
	// of how much of their max_tokens the running requests will use; when the guess was wrong, requests
	// are retracted and prefilled again later. num_used_tokens then counts the KV in use, as SGLang's
	// does. By default a request reserves its prompt and its whole max_tokens when admitted, so it is
	// never retracted and num_used_tokens counts the reservations.
	SGLangAdmission bool
	// APIKey, when set, is required as "Authorization: Bearer <key>" on the load and generate routes
	// (not on /health and /metrics, as in SGLang).
	APIKey string
	// Version is reported as the SGLang version. Default "0.5.0-sim".
	Version string

	// Timing selects the timing model: TimingLinear (the default) or TimingStep, SGLang's scheduler
	// step by step (step.go). The Step fields, Speed, ChunkedPrefillSize and MixedChunk apply to
	// TimingStep only; DecodeTokensPerSec and PrefillTokensPerSec to TimingLinear only.
	Timing Timing
	// StepBaseSec is the fixed time of every forward pass, in seconds: reading the model's weights
	// once. Default 0.006 (Llama-3.1-8B-Instruct on one H100 80GB; docs/simulator.md).
	StepBaseSec float64
	// StepPrefillTokenSec is the time of each prompt token a forward pass prefills, in seconds
	// (the linear layers). Default 30e-6.
	StepPrefillTokenSec float64
	// StepAttentionSec is the attention time of one prefilled token per token of context it attends
	// to, in seconds: a chunk of c tokens after s tokens already in the KV cache costs
	// c × (s + c/2) × StepAttentionSec. Default 1e-9.
	StepAttentionSec float64
	// StepDecodeRequestSec is the time each decoding request adds to a forward pass, in seconds.
	// Default 20e-6.
	StepDecodeRequestSec float64
	// StepKVTokenSec is the time of reading one token of KV cache in a decode step, in seconds: each
	// decoding request reads its whole context. Default 49e-9 (128 KiB a token at 2.7 TB/s).
	StepKVTokenSec float64
	// Speed divides every step's compute time: a worker of Speed 2 is a GPU twice as fast. It does not
	// change HostLoadTokensPerSec, which the host's link bounds. Default 1.
	Speed float64
	// ChunkedPrefillSize is how many prompt tokens one forward pass prefills at most, as SGLang's
	// --chunked-prefill-size: a longer prompt is prefilled over several steps. The step also takes no
	// more than MaxPrefillTokens. Default 8192 (SGLang's on an 80 GB GPU).
	ChunkedPrefillSize int64
	// MixedChunk runs the decode batch in the same forward pass as a prefill chunk, as SGLang's
	// --enable-mixed-chunk; the chunk then takes one token less per decoding request. Off by default,
	// as in SGLang: a step prefills while any admitted request waits to, and decoding stalls meanwhile.
	MixedChunk bool

	// HostPoolTokens is the size of each DP rank's host-memory tier of the prefix cache, in tokens, as
	// SGLang's --enable-hierarchical-cache: blocks evicted from the KV pool move there (least recently
	// used first out when it is full), and a prompt that finds its prefix there loads it back rather
	// than prefilling it; such tokens count as cached. It holds only blocks not in the KV pool, so
	// SGLang's default --hicache-ratio 2 is about HostPoolTokens = MaxTotalTokens. Default 0: off.
	HostPoolTokens int64
	// HostLoadTokensPerSec is how fast a prefix loads back from the host tier, in tokens/s. Default
	// 190000: 25 GB/s over PCIe at 128 KiB a token.
	HostLoadTokensPerSec float64
}

// Timing is a worker's timing model.
type Timing uint8

const (
	// TimingLinear runs prefill as one FIFO stream per rank at PrefillTokensPerSec and decodes every
	// request at once at a speed that falls with the batch (model.go).
	TimingLinear Timing = iota
	// TimingStep runs SGLang's scheduler loop: forward passes one after another, each prefilling a
	// chunk or decoding a token of every running request, timed by the Step fields (step.go).
	TimingStep
)

func (t Timing) String() string {
	if t == TimingStep {
		return "step"
	}
	return "linear"
}

// MarshalText writes the timing's name.
func (t Timing) MarshalText() ([]byte, error) { return []byte(t.String()), nil }

// UnmarshalText reads "linear" or "step".
func (t *Timing) UnmarshalText(b []byte) error {
	switch string(b) {
	case "linear":
		*t = TimingLinear
	case "step":
		*t = TimingStep
	default:
		return fmt.Errorf("unknown timing %q: want linear or step", b)
	}
	return nil
}

// decodeSpeed is each request's decode speed, in tokens/s, in a batch of batch decoding requests.
func (c *Config) decodeSpeed(batch int) float64 {
	return c.DecodeTokensPerSec / (1 + float64(batch-1)/batchSlowdown)
}

func (c Config) withDefaults() Config {
	if c.Name == "" {
		c.Name = "sim"
	}
	if c.MaxTotalTokens <= 0 {
		c.MaxTotalTokens = 65536
	}
	if c.DecodeTokensPerSec <= 0 {
		c.DecodeTokensPerSec = 200
	}
	if c.PrefillTokensPerSec <= 0 {
		c.PrefillTokensPerSec = 8000
	}
	if c.MaxRunningRequests <= 0 {
		c.MaxRunningRequests = 64
	}
	if c.MaxPrefillTokens <= 0 {
		c.MaxPrefillTokens = 16384
	}
	if c.DPRanks <= 0 {
		c.DPRanks = 1
	}
	if !(c.FinishEarly > 0 && c.FinishEarly < 1) {
		c.FinishEarly = 0
	}
	if c.Version == "" {
		c.Version = "0.5.0-sim"
	}
	if c.Timing != TimingStep {
		c.Timing = TimingLinear
	}
	def := func(v *float64, d float64) {
		if !(*v > 0) || math.IsInf(*v, 1) {
			*v = d
		}
	}
	def(&c.StepBaseSec, defaultStepBaseSec)
	def(&c.StepPrefillTokenSec, defaultStepPrefillTokenSec)
	def(&c.StepAttentionSec, defaultStepAttentionSec)
	def(&c.StepDecodeRequestSec, defaultStepDecodeRequestSec)
	def(&c.StepKVTokenSec, defaultStepKVTokenSec)
	def(&c.Speed, 1)
	def(&c.HostLoadTokensPerSec, defaultHostLoadTokensPerSec)
	if c.ChunkedPrefillSize <= 0 {
		c.ChunkedPrefillSize = 8192
	}
	if c.HostPoolTokens < 0 {
		c.HostPoolTokens = 0
	}
	return c
}
