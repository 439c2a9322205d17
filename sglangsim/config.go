package sglangsim

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
	return c
}
