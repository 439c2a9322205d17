package grpcload

import (
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// StatusError is a GetLoads call that failed with a gRPC status, from the worker or from the client.
type StatusError struct {
	Code   codes.Code
	Target string // the worker's address
	Msg    string // the status message, with the API key removed should the server echo it
	cause  error  // ctx's error when the call was cut by its context
}

func (e *StatusError) Error() string {
	s := fmt.Sprintf("grpc GetLoads on %s failed with %s: %s", e.Target, e.Code, explain(e.Code, e.Msg))
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Unwrap returns context.DeadlineExceeded or context.Canceled when the caller's context cut the call,
// and nil when the status came from the worker.
func (e *StatusError) Unwrap() error { return e.cause }

// TooLarge reports whether the call failed because the answer exceeded MaxResponseSize: grpc-go's own
// ResourceExhausted ("received message larger than max"), as opposed to a worker reporting itself
// exhausted, which has the same code.
func (e *StatusError) TooLarge() bool {
	return e.Code == codes.ResourceExhausted && strings.Contains(e.Msg, "larger than max")
}

// GRPCStatus lets status.Code and status.FromError read the code through wrapping.
func (e *StatusError) GRPCStatus() *status.Status { return status.New(e.Code, e.Msg) }

func explain(c codes.Code, msg string) string {
	switch c {
	case codes.Unavailable:
		// gRPC reports a failed TLS handshake as Unavailable too; it is a configuration problem, not a
		// worker that is down.
		if strings.Contains(msg, "authentication handshake failed") {
			return "the TLS handshake failed (the worker's certificate is not trusted, or it does not serve TLS)"
		}
		return "the worker is unreachable (not listening, restarting, or the network is down)"
	case codes.DeadlineExceeded:
		return "no answer before the deadline"
	case codes.Unimplemented:
		return "the worker does not serve SglangScheduler.GetLoads (an SGLang version without it, or not an SGLang scheduler)"
	case codes.InvalidArgument:
		return "the worker rejected the request as invalid"
	case codes.Internal:
		return "the worker failed while collecting its loads"
	case codes.Unauthenticated:
		return "the worker did not accept the credentials: check the api key"
	case codes.PermissionDenied:
		return "the worker denied access: check the api key"
	case codes.ResourceExhausted:
		if strings.Contains(msg, "larger than max") {
			return fmt.Sprintf("the answer exceeds the %d-byte limit", MaxResponseSize)
		}
		return "resource exhausted (an overloaded worker)"
	case codes.Canceled:
		return "the call was cancelled"
	default:
		return "unexpected status"
	}
}
