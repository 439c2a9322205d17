package httpload

import (
	"fmt"
	"strings"
)

// StatusError is a load endpoint that answered with a non-2xx status.
type StatusError struct {
	Code int    // the HTTP status code
	URL  string // the URL asked; it never carries credentials
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("load endpoint %s answered status %d", e.URL, e.Code)
}

// DecodeError is a load response that is not the JSON the endpoint documents.
type DecodeError struct {
	URL   string // the URL asked; empty when the body did not come from a fetch
	Field string // the offending field, e.g. "loads[2].num_used_tokens"; empty when the body is not JSON
	Err   error
}

func (e *DecodeError) Error() string {
	var b strings.Builder
	b.WriteString("decode load response")
	if e.URL != "" {
		b.WriteString(" from ")
		b.WriteString(e.URL)
	}
	if e.Field != "" {
		b.WriteString(": ")
		b.WriteString(e.Field)
	}
	b.WriteString(": ")
	b.WriteString(e.Err.Error())
	return b.String()
}

func (e *DecodeError) Unwrap() error { return e.Err }

// TooLargeError is a load response body larger than Config.MaxBody. The body is not parsed: a truncated
// load report would read as a smaller load.
type TooLargeError struct {
	Limit int64  // bytes
	URL   string // the URL asked; it never carries credentials
}

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("load response from %s exceeds the %d-byte limit", e.URL, e.Limit)
}
