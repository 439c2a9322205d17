#!/bin/sh
# gen.sh [OUTDIR] regenerates the Go code of schedulerpb/sglang_scheduler.proto into OUTDIR (default
# schedulerpb) with /usr/bin/protoc and the protoc-gen-go and protoc-gen-go-grpc versions pinned in go.mod.
# Run it through `go generate ./grpcload/...`; checkgen.sh runs it into a temp dir to diff.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:-$here/schedulerpb}" && cd "${1:-$here/schedulerpb}" && pwd)
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
cd "$here"
go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bin/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
protoc --proto_path=schedulerpb \
	--plugin=protoc-gen-go="$bin/protoc-gen-go" --plugin=protoc-gen-go-grpc="$bin/protoc-gen-go-grpc" \
	--go_out="$out" --go_opt=paths=source_relative \
	--go-grpc_out="$out" --go-grpc_opt=paths=source_relative \
	sglang_scheduler.proto
