#!/bin/sh
# Proxy overhead: the same Caddy binary with lb_policy sglang_load and with least_conn, in front of the
# same four fast loopback backends, loaded with wrk in alternating runs (PAIRS pairs of DURATION each).
# Prints each run's requests/s and the ratio sglang_load ÷ least_conn of the summed throughput.
set -eu
cd "$(dirname "$0")/.."
PAIRS=${PAIRS:-3}
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-32}
OUT=${OUT:-}

if ! command -v wrk >/dev/null 2>&1; then
	if [ "$(id -u)" = 0 ]; then apt-get install -y wrk >/dev/null; else sudo apt-get install -y wrk >/dev/null; fi
fi
[ -x bin/caddy ] || go build -o bin/caddy ./cmd/caddy
[ -x bin/sglang-bench ] || go build -o bin/sglang-bench ./cmd/sglang-bench

work=$(mktemp -d)
pids=""
cleanup() {
	for p in $pids; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT INT TERM

backends=""
for i in 1 2 3 4; do
	bin/sglang-bench -mode backend >"$work/backend$i" 2>&1 &
	pids="$pids $!"
done
for i in 1 2 3 4; do
	n=0
	until [ -s "$work/backend$i" ]; do n=$((n + 1)); [ $n -lt 100 ] || { echo "backend $i did not start" >&2; exit 1; }; sleep 0.1; done
	backends="$backends $(head -n1 "$work/backend$i")"
done

start_caddy() { # name, lb_policy block, global options
	port=$(bin/sglang-bench -mode port)
	admin=$(bin/sglang-bench -mode port)
	mkdir -p "$work/$1"
	cat >"$work/$1/Caddyfile" <<CADDYFILE
{
	admin 127.0.0.1:$admin
	auto_https off
	persist_config off
	$3
}
http://127.0.0.1:$port {
	reverse_proxy $backends {
		$2
	}
}
CADDYFILE
	XDG_DATA_HOME="$work/$1" XDG_CONFIG_HOME="$work/$1" HOME="$work/$1" \
		bin/caddy run --config "$work/$1/Caddyfile" --adapter caddyfile >"$work/$1/log" 2>&1 &
	pids="$pids $!"
	n=0
	until curl -fsS -o /dev/null "http://127.0.0.1:$admin/config/" 2>/dev/null; do
		n=$((n + 1)); [ $n -lt 200 ] || { echo "caddy $1 did not start:" >&2; cat "$work/$1/log" >&2; exit 1; }; sleep 0.1
	done
	echo "http://127.0.0.1:$port/v1/chat/completions"
}
url_sglang=$(start_caddy sglang "lb_policy sglang_load" "sglang_load {
		interval 1s
	}")
url_least=$(start_caddy least "lb_policy least_conn" "")
# One short warm-up each: connections opened, first loads polled.
wrk -t2 -c"$CONNECTIONS" -d2s "$url_sglang" >/dev/null
wrk -t2 -c"$CONNECTIONS" -d2s "$url_least" >/dev/null

rps() { wrk -t2 -c"$CONNECTIONS" -d"$DURATION" "$1" | awk '/^Requests\/sec:/ { print $2 }'; }
total_s=0; total_l=0
table="| run | sglang_load req/s | least_conn req/s | ratio |
|---:|---:|---:|---:|"
i=1
while [ $i -le "$PAIRS" ]; do
	# Alternate which goes first, so drift in the machine's load does not favour one.
	if [ $((i % 2)) = 1 ]; then s=$(rps "$url_sglang"); l=$(rps "$url_least"); else l=$(rps "$url_least"); s=$(rps "$url_sglang"); fi
	table="$table
| $i | $s | $l | $(awk -v a="$s" -v b="$l" 'BEGIN { printf "%.3f", a / b }') |"
	total_s=$(awk -v a="$total_s" -v b="$s" 'BEGIN { print a + b }')
	total_l=$(awk -v a="$total_l" -v b="$l" 'BEGIN { print a + b }')
	i=$((i + 1))
done
ratio=$(awk -v a="$total_s" -v b="$total_l" 'BEGIN { printf "%.3f", a / b }')
result="### Proxy overhead, $(date +%F)

Machine: $(nproc) cores (nproc), $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo).
wrk -t2 -c$CONNECTIONS -d$DURATION against Caddy with 4 loopback backends (small JSON answers), $PAIRS alternating pairs.

$table

Throughput ratio sglang_load ÷ least_conn: **$ratio** (target ≥ 0.97: $(awk -v r="$ratio" 'BEGIN { print (r >= 0.97) ? "met" : "missed" }'))."
echo "$result"
if [ -n "$OUT" ]; then mkdir -p "$OUT/$(date +%F)" && echo "$result" >"$OUT/$(date +%F)/overhead.md"; fi
