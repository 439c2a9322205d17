// Package sglangsim is a simulated SGLang worker for tests, demos and benchmarks: it speaks SGLang's real
// load, metrics and generate wire formats (HTTP and gRPC) on top of a small KV-pool and queue model.
package sglangsim
