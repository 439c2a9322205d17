#!/bin/sh
# checkgen.sh regenerates schedulerpb into a temp dir and exits non-zero if the committed generated
# code differs from it (a .proto edited without regenerating, or generated code edited by hand).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sh "$here/gen.sh" "$tmp"
status=0
for f in "$tmp"/*.go; do
	name=$(basename "$f")
	if ! diff -u "$here/schedulerpb/$name" "$f"; then
		status=1
	fi
done
for f in "$here"/schedulerpb/*.pb.go; do
	if [ ! -e "$tmp/$(basename "$f")" ]; then
		echo "checkgen: $f is not generated from sglang_scheduler.proto any more" >&2
		status=1
	fi
done
if [ "$status" -ne 0 ]; then
	echo "checkgen: grpcload/schedulerpb is out of date: run go generate ./grpcload/..." >&2
else
	echo "checkgen: grpcload/schedulerpb is up to date"
fi
exit "$status"
