package grpcload

// Regenerate schedulerpb with `go generate ./grpcload/...`; checkgen.sh fails when the committed code
// is not what that produces.
//go:generate sh gen.sh
