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
	// DPRanks is the number of data-parallel ranks; requests go to them round-robin. Default 1.
	DPRanks int
	// LegacyShape answers /v1/loads in the early-2026 shape: top-level dp_rank_count and aggregate,
	// per-rank num_total_reqs, and no num_waiting_uncached_tokens.
	LegacyShape bool
	// APIKey, when set, is required as "Authorization: Bearer <key>" on the load and generate routes
	// (not on /health and /metrics, as in SGLang).
	APIKey string
	// Version is reported as the SGLang version. Default "0.5.0-sim".
	Version string
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
	if c.DPRanks <= 0 {
		c.DPRanks = 1
	}
	if c.Version == "" {
		c.Version = "0.5.0-sim"
	}
	return c
}
