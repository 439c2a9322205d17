#!/bin/sh
# Everything `make bench` runs, in order; each writes its table into results/<date>/.
set -eu
cd "$(dirname "$0")/.."
out=results/$(date +%F)
mkdir -p "$out"
start=$(date +%s)
echo "== micro-benchmarks" >&2
sh bench/microbench.sh | tee "$out/microbench.md"
echo "== proxy overhead" >&2
OUT=results sh bench/overhead.sh
echo "== routing quality" >&2
bin/sglang-bench -mode quality -out results
echo "== several Caddy instances" >&2
bin/sglang-bench -mode replicas -out results
echo "== prefix affinity" >&2
bin/sglang-bench -mode affinity -out results
echo "== monitor scale" >&2
bin/sglang-bench -mode monitor -out results
echo "== done in $(($(date +%s) - start))s; tables in $out" >&2
