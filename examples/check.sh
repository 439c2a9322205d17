#!/bin/sh
# Checks the shipped configs with the project's own Caddy (./cmd/caddy): every Caddyfile of examples/
# and Caddyfile.example adapts and validates and is left unchanged by `caddy fmt`; the Kubernetes
# ConfigMap holds exactly examples/kubernetes/Caddyfile; every metric the Grafana dashboard queries is
# one the plugin exports. Needs go and jq. Run from anywhere: sh examples/check.sh
set -eu
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Caddy's storage and autosave go to the temp dir, not the user's.
export XDG_CONFIG_HOME="$tmp/config" XDG_DATA_HOME="$tmp/data"

go build -o "$tmp/caddy" ./cmd/caddy
caddy="$tmp/caddy"
fail=0

for f in Caddyfile.example $(find examples -name 'Caddyfile*' -type f | sort); do
	if ! "$caddy" adapt --validate --adapter caddyfile --config "$f" >"$tmp/adapt.json" 2>"$tmp/adapt.log"; then
		echo "FAIL $f: caddy adapt --validate:"; cat "$tmp/adapt.log"; fail=1
	elif ! "$caddy" fmt "$f" 2>/dev/null | cmp -s - "$f"; then
		echo "FAIL $f: not as caddy fmt formats it:"; "$caddy" fmt --diff "$f" 2>/dev/null | grep '^[-+]' || true; fail=1
	else
		echo "ok   $f"
	fi
done

configmap=examples/kubernetes/configmap.yaml
if sh examples/kubernetes/configmap.sh | cmp -s - "$configmap"; then
	echo "ok   $configmap holds examples/kubernetes/Caddyfile"
else
	echo "FAIL $configmap differs from what examples/kubernetes/configmap.sh prints from the Caddyfile:"
	sh examples/kubernetes/configmap.sh | diff "$configmap" - || true
	fail=1
fi

# The metric names the plugin registers (the Name of each metric in metricsSubsystem, each gaugeDesc and
# each newCounterVec), and the names every dashboard query uses; a histogram's series carry _bucket,
# _sum or _count.
dashboard=examples/grafana/caddy-sglang.json
grep -ohE '(Subsystem: metricsSubsystem, Name: +"|gaugeDesc\("|newCounterVec\(")[a-z_]+"' caddymodule/*.go | sed -E 's/.*"([a-z_]+)"$/caddy_sglang_load_\1/' | sort -u >"$tmp/exported"
if ! jq -r '.. | objects | select(has("expr")) | .expr' "$dashboard" >"$tmp/exprs"; then
	echo "FAIL $dashboard: not JSON"; fail=1
elif [ ! -s "$tmp/exprs" ]; then
	echo "FAIL $dashboard: no queries"; fail=1
else
	unknown=$(grep -ohE 'caddy_sglang_load_[a-z_]+' "$tmp/exprs" | sed -E 's/_(bucket|sum|count)$//' | sort -u | comm -23 - "$tmp/exported")
	if [ -n "$unknown" ]; then
		echo "FAIL $dashboard queries metrics the plugin does not export: $unknown"; fail=1
	else
		echo "ok   $dashboard: $(grep -c . "$tmp/exprs") queries, all on exported metrics"
	fi
fi

exit $fail
