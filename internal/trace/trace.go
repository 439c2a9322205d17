// Package trace reads public LLM serving traces (Azure 2023 CSV, Mooncake JSONL) for replay, and derives
// what a replay needs from them: arrival times, prompt texts of the traced sizes, and cache bounds.
package trace

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Request is one row of a trace.
type Request struct {
	Line         int           // 1-based line number in the file (the header is line 1 for CSV)
	At           time.Duration // arrival, since the trace's first row (after Slice: since the slice start)
	InputTokens  int
	OutputTokens int
	HashIDs      []int64 // Mooncake: one id per 512-token block, chained; nil for Azure
}

// BlockTokens is the number of prompt tokens one Mooncake hash id stands for.
const BlockTokens = 512

// blocks is the number of BlockTokens blocks a prompt of n tokens spans, the last one partial.
func blocks(n int) int {
	if n <= 0 {
		return 0
	}
	return n/BlockTokens + min(1, n%BlockTokens)
}

// blockTokens is the number of tokens in block i of a prompt of n tokens.
func blockTokens(n, i int) int {
	return min(BlockTokens, n-i*BlockTokens)
}

// Format is a trace file's format.
type Format int

// The formats Read knows.
const (
	FormatAzure    Format = iota + 1 // Azure LLM inference trace 2023: CSV of arrival time and token counts
	FormatMooncake                   // Mooncake FAST'25 trace: JSON lines with token counts and block hash ids
)

// String is the format's short name, as ParseFormat reads it.
func (f Format) String() string {
	switch f {
	case FormatAzure:
		return "azure"
	case FormatMooncake:
		return "mooncake"
	}
	return fmt.Sprintf("Format(%d)", int(f))
}

// ParseFormat reads a format's short name ("azure" or "mooncake").
func ParseFormat(s string) (Format, error) {
	for _, f := range []Format{FormatAzure, FormatMooncake} {
		if strings.EqualFold(s, f.String()) {
			return f, nil
		}
	}
	return 0, fmt.Errorf("trace format %q: want azure or mooncake", s)
}

// Source is the citation of the format's origin and licence, for a benchmark's output.
func (f Format) Source() string {
	switch f {
	case FormatAzure:
		return "Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset, CC BY 4.0); " +
			`Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024`
	case FormatMooncake:
		return "Mooncake trace (github.com/kvcache-ai/Mooncake, Apache-2.0); " +
			`Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST 2025`
	}
	return "unknown trace format " + f.String()
}

// Read reads a whole trace in the given format. Errors name the line and the offending value.
func Read(r io.Reader, f Format) ([]Request, error) {
	switch f {
	case FormatAzure:
		return ReadAzure(r)
	case FormatMooncake:
		return ReadMooncake(r)
	}
	return nil, fmt.Errorf("unknown trace format %v", f)
}

// Open reads a file, its format from its extension (.csv Azure, .jsonl or .json Mooncake) or, failing
// that, its first byte that is not white space ('{' Mooncake, else Azure). Errors carry the path.
func Open(path string) ([]Request, Format, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, 0, err // os errors carry the path already
	}
	f := formatOf(path, b)
	reqs, err := Read(bytes.NewReader(b), f)
	if err != nil {
		return nil, f, fmt.Errorf("%s: %v trace: %w", path, f, err)
	}
	return reqs, f, nil
}

func formatOf(path string, b []byte) Format {
	switch strings.ToLower(filepath.Ext(path)) {
	case ".csv":
		return FormatAzure
	case ".jsonl", ".json":
		return FormatMooncake
	}
	if t := bytes.TrimLeft(b, " \t\r\n\ufeff"); len(t) > 0 && t[0] == '{' {
		return FormatMooncake
	}
	return FormatAzure
}

// errEmpty is the error of a trace without a single row.
var errEmpty = errors.New("empty input: no requests")

// lineError is an error of one line of a trace.
func lineError(line int, format string, args ...any) error {
	return fmt.Errorf("line %d: %s", line, fmt.Sprintf(format, args...))
}
