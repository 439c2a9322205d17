# The two commands of the README: `make demo` and `make test`. Both work on a fresh clone with Go 1.26.
GO ?= go
BIN := bin

.PHONY: build test demo bench generate check-generated lint

build:
	$(GO) build -o $(BIN)/caddy ./cmd/caddy
	$(GO) build -o $(BIN)/sglang-sim ./cmd/sglang-sim

# The caddytest tests share one in-process Caddy per test binary (admin on localhost:2999); they all
# live in ./caddymodule, so packages may run in parallel.
test:
	$(GO) test -race ./...

generate:
	$(GO) generate ./grpcload/...

check-generated:
	sh grpcload/checkgen.sh

lint:
	$(GO) vet ./...
	test -z "$$(gofmt -l $$(git ls-files '*.go'))"
