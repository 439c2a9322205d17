// Package schedulerpb is the generated protobuf and gRPC code of SGLang's SglangScheduler.GetLoads, from
// sglang_scheduler.proto; regenerate it with `go generate ./grpcload/...` and never edit the .pb.go files.
package schedulerpb
