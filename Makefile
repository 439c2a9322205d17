# The two commands of the README: `make demo` and `make test`. Both work on a fresh clone with Go 1.26.
GO ?= go
BIN := bin

.PHONY: build test demo bench generate check-generated lint

build:
	$(GO) build -o $(BIN)/caddy ./cmd/caddy
	$(GO) build -o $(BIN)/sglang-sim ./cmd/sglang-sim

# Three simulated workers behind Caddy with Caddyfile.example, a burst of requests, a report; stops
# everything on exit or Ctrl-C. More flags: make demo DEMO_FLAGS="-requests 500 -concurrency 64".
demo: build
	$(GO) build -o $(BIN)/sglang-demo ./cmd/sglang-demo
	$(BIN)/sglang-demo -caddy $(BIN)/caddy -sim $(BIN)/sglang-sim -config Caddyfile.example $(DEMO_FLAGS)

# The caddytest tests share one in-process Caddy per test binary (admin on localhost:2999); they all
# live in ./caddymodule, so packages may run in parallel.
test:
	$(GO) test -race ./...

# Micro-benchmarks, proxy overhead (Caddy CPU per request), routing quality, 1 against 3 instances, the
# affinity workloads and monitor scale through real Caddy processes; over an hour on 2 cores. Tables (and
# charts) go to results/<date>/.
bench: build
	$(GO) build -o $(BIN)/sglang-bench ./cmd/sglang-bench
	sh bench/all.sh

generate:
	$(GO) generate ./grpcload/...

check-generated:
	sh grpcload/checkgen.sh

lint:
	$(GO) vet ./...
	test -z "$$(gofmt -l $$(git ls-files '*.go'))"
