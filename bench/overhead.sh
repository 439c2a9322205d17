#!/bin/sh
# Proxy overhead by CPU: Caddy's CPU time per proxied request with lb_policy sglang_load (the default,
# and metric cost) against least_conn, at a fixed request rate well below saturation, in rounds (sglang-bench
# -mode overhead). Extra flags go to it, e.g. sh bench/overhead.sh -overhead-rounds 9; -policies adds
# study rows (first, random, "sglang_load choose least", "sglang_load metric auto").
set -eu
cd "$(dirname "$0")/.."
[ -x bin/caddy ] || go build -o bin/caddy ./cmd/caddy
[ -x bin/sglang-bench ] || go build -o bin/sglang-bench ./cmd/sglang-bench
exec bin/sglang-bench -mode overhead -caddy bin/caddy -out "${OUT:-results}" "$@"
