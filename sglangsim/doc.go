// Package sglangsim is a simulated SGLang worker for tests, demos and benchmarks: it speaks SGLang's real
// load, metrics and generate wire formats (HTTP and gRPC) on top of a small KV-pool and queue model.
//
// Its time follows one of two models (Config.Timing). TimingLinear, the default, prefills at
// PrefillTokensPerSec and decodes at DecodeTokensPerSec shared by the batch (model.go). TimingStep runs
// SGLang's scheduler loop pass by pass (step.go): a prefill chunk of up to ChunkedPrefillSize tokens,
// which stalls decoding unless MixedChunk, or one decode token per running request, each pass timed
// from the tokens it prefills, the context they attend to, the requests it decodes and the KV they read.
// The step costs default to Llama-3.1-8B-Instruct in bf16 on one H100 80GB SXM, derived from the model's
// shape (8.03e9 parameters; 32 layers, 8 KV heads of 128 dims: 128 KiB of KV a token) and the GPU's
// datasheet (989 TFLOP/s dense bf16 at about 55% in prefill, 3.35 TB/s HBM3 at 80% in decode), checked
// against NVIDIA's published NIM figures for the model (4.6-7.6 ms a token at 1-100 concurrent
// requests): a lone request decodes at about 165 tokens/s, a prompt of 8k tokens prefills at 28,700
// tokens/s. HostPoolTokens adds SGLang's hierarchical cache: a host-memory tier for evicted prefix
// blocks, loaded back at HostLoadTokensPerSec (25 GB/s over PCIe). docs/simulator.md has the derivation
// and sources.
package sglangsim
