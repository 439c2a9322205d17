package trace

import (
	"os"
	"path/filepath"
	"testing"
)

// sharedTraces is the public traces' folder beside the repository.
var sharedTraces = filepath.Join("..", "..", "..", "shared", "traces")

// sharedTrace is one file of it with the figures this package computes of it.
type sharedTrace struct {
	file   string
	format Format
	rows   int // as the folder's README gives them
}

var sharedTraceFiles = []sharedTrace{
	{file: "azure2023_conv_first_half.csv", format: FormatAzure, rows: 10108},
	{file: "azure2023_code_first_half.csv", format: FormatAzure, rows: 5740},
	{file: "mooncake_conversation_first_half.jsonl", format: FormatMooncake, rows: 5719},
	{file: "mooncake_synthetic_first_half.jsonl", format: FormatMooncake, rows: 1925},
}

// openShared reads one of the shared trace files, skipping the test only if the folder is absent.
func openShared(t *testing.T, tr sharedTrace) []Request {
	t.Helper()
	if _, err := os.Stat(sharedTraces); os.IsNotExist(err) {
		t.Skipf("the public traces are not beside the repository (%s absent): real files not checked", sharedTraces)
	}
	reqs, f, err := Open(filepath.Join(sharedTraces, tr.file))
	if err != nil {
		t.Fatal(err)
	}
	if f != tr.format {
		t.Errorf("format = %v, want %v", f, tr.format)
	}
	return reqs
}

func TestSharedTraces(t *testing.T) {
	for _, tr := range sharedTraceFiles {
		t.Run(tr.file, func(t *testing.T) {
			reqs := openShared(t, tr)
			if len(reqs) != tr.rows {
				t.Errorf("%d rows, want %d", len(reqs), tr.rows)
			}
		})
	}
}
