#!/bin/sh
# Micro-benchmarks of the sglang_load policy's Select next to Caddy's own selection policies, and of
# the loadpolicy choosers. Prints a Markdown table of median ns/op over COUNT runs and each policy's
# ratio to least_conn on the same pool (the machines are noisy: compare ratios, not absolute times);
# "parallel" rows call Select on every core at once, against least_conn called so.
# The benchmarks start no Caddy (-run '^$' runs no test), so they may run beside the caddytest tests.
set -eu
cd "$(dirname "$0")/.."
count=${COUNT:-5}
raw=$(go test -run '^$' -bench 'BenchmarkSelect' -benchmem -count "$count" ./caddymodule/
	go test -run '^$' -bench 'BenchmarkChoose' -benchmem -count "$count" ./loadpolicy/)
printf '%s\n' "$raw" | awk '
function median(key,   n, i, j, t, v) {
	n = split(vals[key], v, " ")
	for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j-1] + 0 > v[j] + 0; j--) { t = v[j]; v[j] = v[j-1]; v[j-1] = t }
	return n % 2 ? v[(n+1)/2] : (v[n/2] + v[n/2+1]) / 2
}
/^Benchmark(Select|SelectParallel|Choose)\// {
	name = $1; sub(/-[0-9]+$/, "", name)
	split(name, part, "/"); bench = part[1]; n = part[2]; pol = part[3]; sub(/^n=/, "", n)
	if (bench == "BenchmarkChoose") pol = "Choose " pol
	if (bench == "BenchmarkSelectParallel") pol = "parallel " pol
	key = n SUBSEP pol
	if (!(key in vals)) { order[++k] = key }
	vals[key] = vals[key] " " $3
	allocs[key] = $7
}
END {
	print "| upstreams | policy | ns/op (median of " '"$count"' ") | ÷ least_conn | allocs/op |"
	print "|---:|---|---:|---:|---:|"
	for (i = 1; i <= k; i++) {
		split(order[i], p, SUBSEP)
		lc = p[1] SUBSEP (p[2] ~ /^parallel / ? "parallel " : "") "least_conn"
		m = median(order[i]); base = lc in vals ? median(lc) : 0
		ratio = (base > 0 && p[2] !~ /^Choose/) ? sprintf("%.2f", m / base) : ""
		printf "| %s | %s | %.0f | %s | %s |\n", p[1], p[2], m, ratio, allocs[order[i]]
	}
}'
