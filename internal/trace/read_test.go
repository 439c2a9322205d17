package trace

import (
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestReadAzure(t *testing.T) {
	const header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	tests := []struct {
		name    string
		in      string
		want    []Request
		wantErr []string // substrings of the error; nil for success
	}{
		{
			name: "rows",
			in: header +
				"2023-11-16 18:15:46.6805900,374,44\n" +
				"2023-11-16 18:15:50.9951690,396,109\n" +
				"2023-11-16 18:15:50.9951690,0,0\n",
			want: []Request{
				{Line: 2, At: 0, InputTokens: 374, OutputTokens: 44},
				{Line: 3, At: 4314579 * time.Microsecond, InputTokens: 396, OutputTokens: 109},
				{Line: 4, At: 4314579 * time.Microsecond, InputTokens: 0, OutputTokens: 0},
			},
		},
		{
			name: "CRLF, no final newline, BOM",
			in:   "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.9799600,4808,10\r\n2023-11-16 18:17:04.0319600,3180,8",
			want: []Request{
				{Line: 2, At: 0, InputTokens: 4808, OutputTokens: 10},
				{Line: 3, At: 52 * time.Millisecond, InputTokens: 3180, OutputTokens: 8},
			},
		},
		{
			name: "fewer fractional digits",
			in:   header + "2023-11-16 18:17:03,1,2\n2023-11-16 18:17:03.5,3,4\n",
			want: []Request{
				{Line: 2, At: 0, InputTokens: 1, OutputTokens: 2},
				{Line: 3, At: 500 * time.Millisecond, InputTokens: 3, OutputTokens: 4},
			},
		},
		{name: "empty", in: "", wantErr: []string{"empty input"}},
		{name: "header only", in: header, wantErr: []string{"empty input"}},
		{name: "wrong header", in: "time,in,out\n2023-11-16 18:17:03,1,2\n",
			wantErr: []string{"line 1:", `header "time,in,out"`}},
		{name: "short header", in: "TIMESTAMP,ContextTokens\n", wantErr: []string{"line 1:", "header"}},
		{name: "ContextTokens not an integer", in: header + "2023-11-16 18:17:03.9799600,1,2\n2023-11-16 18:17:04.9799600,abc,2\n",
			wantErr: []string{"line 3:", `ContextTokens "abc": not an integer`}},
		{name: "GeneratedTokens negative", in: header + "2023-11-16 18:17:03.9799600,1,-2\n",
			wantErr: []string{"line 2:", `GeneratedTokens "-2": negative`}},
		{name: "bad timestamp", in: header + "16/11/2023 18:17,1,2\n",
			wantErr: []string{"line 2:", `TIMESTAMP "16/11/2023 18:17": not a time`}},
		{name: "timestamps backwards", in: header + "2023-11-16 18:17:04.0000000,1,2\n2023-11-16 18:17:03.9999999,1,2\n",
			wantErr: []string{"line 3:", `TIMESTAMP "2023-11-16 18:17:03.9999999": before`}},
		{name: "too many fields", in: header + "2023-11-16 18:17:04.0000000,1,2,3\n",
			wantErr: []string{"line 2:", "4 fields"}},
		{name: "bad quote", in: header + "2023-11-16 18:17:04.0000000,\"1,2\n",
			wantErr: []string{"line 2:"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ReadAzure(strings.NewReader(tt.in))
			checkRead(t, got, err, tt.want, tt.wantErr)
		})
	}
}

func TestReadMooncake(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []Request
		wantErr []string
	}{
		{
			name: "rows, blank trailing line",
			in: `{"timestamp": 3000, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 2]}
{"timestamp": 3000, "input_length": 512, "output_length": 0, "hash_ids": [0]}
{"timestamp": 6500, "input_length": 0, "output_length": 3, "hash_ids": [], "extra": "ignored"}

`,
			want: []Request{
				{Line: 1, At: 0, InputTokens: 1500, OutputTokens: 7, HashIDs: []int64{0, 1, 2}},
				{Line: 2, At: 0, InputTokens: 512, OutputTokens: 0, HashIDs: []int64{0}},
				{Line: 3, At: 3500 * time.Millisecond, InputTokens: 0, OutputTokens: 3, HashIDs: []int64{}},
			},
		},
		{
			name: "CRLF",
			in:   "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [5, 6]}\r\n",
			want: []Request{{Line: 1, InputTokens: 513, OutputTokens: 1, HashIDs: []int64{5, 6}}},
		},
		{name: "empty", in: "", wantErr: []string{"empty input"}},
		{name: "blank lines only", in: "\n  \n", wantErr: []string{"empty input"}},
		{name: "too few ids", in: `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}
{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1]}`,
			wantErr: []string{"line 3:", "hash_ids has 2 ids, want ceil(1500/512) = 3"}},
		{name: "too many ids", in: `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}`,
			wantErr: []string{"line 1:", "hash_ids has 2 ids, want ceil(512/512) = 1"}},
		{name: "missing ids", in: `{"timestamp": 0, "input_length": 512, "output_length": 1}`,
			wantErr: []string{"line 1:", "hash_ids: missing"}},
		{name: "missing timestamp", in: `{"input_length": 512, "output_length": 1, "hash_ids": [0]}`,
			wantErr: []string{"line 1:", "timestamp: missing"}},
		{name: "fractional timestamp", in: `{"timestamp": 1.5, "input_length": 512, "output_length": 1, "hash_ids": [0]}`,
			wantErr: []string{"line 1:", `timestamp "1.5": not an integer`}},
		{name: "negative input", in: `{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}`,
			wantErr: []string{"line 1:", `input_length "-3": negative`}},
		{name: "negative output", in: `{"timestamp": 0, "input_length": 3, "output_length": -1, "hash_ids": [0]}`,
			wantErr: []string{"line 1:", `output_length "-1": negative`}},
		{name: "negative timestamp", in: `{"timestamp": -1, "input_length": 3, "output_length": 1, "hash_ids": [0]}`,
			wantErr: []string{"line 1:", `timestamp "-1": negative`}},
		{name: "huge timestamp", in: `{"timestamp": 9223372036854775807, "input_length": 3, "output_length": 1, "hash_ids": [0]}`,
			wantErr: []string{"line 1:", `timestamp 9223372036854775807: above`}},
		{name: "timestamps backwards", in: `{"timestamp": 3000, "input_length": 3, "output_length": 1, "hash_ids": [0]}

{"timestamp": 2999, "input_length": 3, "output_length": 1, "hash_ids": [0]}`,
			wantErr: []string{"line 3:", "timestamp 2999: before the previous row's 3000"}},
		{name: "not JSON", in: `{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}
timestamp,input_length`, wantErr: []string{"line 2:", "invalid character"}},
		{name: "ids not numbers", in: `{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": ["a"]}`,
			wantErr: []string{"line 1:", "hash_ids"}},
		{name: "two objects on a line", in: `{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]} {}`,
			wantErr: []string{"line 1:", "after top-level value"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ReadMooncake(strings.NewReader(tt.in))
			checkRead(t, got, err, tt.want, tt.wantErr)
		})
	}
}

func TestReadMooncakeLongLine(t *testing.T) {
	// A line longer than bufio.Scanner's default limit of 64 KiB: 300 ids padded with spaces.
	ids := make([]string, 300)
	want := make([]int64, 300)
	for i := range ids {
		want[i] = 1e15 + int64(i)
		ids[i] = strconv.FormatInt(want[i], 10) + strings.Repeat(" ", 300)
	}
	in := `{"timestamp": 0, "input_length": 153600, "output_length": 1, "hash_ids": [` + strings.Join(ids, ",") + "]}\n"
	if len(in) < 64<<10 {
		t.Fatalf("test line is %d bytes, want more than 64 KiB", len(in))
	}
	got, err := ReadMooncake(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got[0].HashIDs, want) {
		t.Errorf("ids = %v, want %v", got[0].HashIDs, want)
	}
	tooLong := `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}` + "\n" +
		`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0` + strings.Repeat(" ", maxMooncakeLine) + "]}\n"
	_, err = ReadMooncake(strings.NewReader(tooLong))
	if err == nil || !strings.Contains(err.Error(), "line 2: longer than") {
		t.Errorf("a line over the limit: err = %v, want line 2: longer than ...", err)
	}
}

func TestRead(t *testing.T) {
	azure := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
	mooncake := `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}`
	if reqs, err := Read(strings.NewReader(azure), FormatAzure); err != nil || len(reqs) != 1 {
		t.Errorf("Read azure = %v, %v", reqs, err)
	}
	if reqs, err := Read(strings.NewReader(mooncake), FormatMooncake); err != nil || len(reqs) != 1 {
		t.Errorf("Read mooncake = %v, %v", reqs, err)
	}
	if _, err := Read(strings.NewReader(mooncake), FormatAzure); err == nil || !strings.Contains(err.Error(), "line 1: header") {
		t.Errorf("Read mooncake as azure: err = %v, want a header error", err)
	}
	if _, err := Read(strings.NewReader(mooncake), Format(9)); err == nil || !strings.Contains(err.Error(), "Format(9)") {
		t.Errorf("Read in Format(9): err = %v", err)
	}
}

func TestOpen(t *testing.T) {
	dir := t.TempDir()
	azure := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
	mooncake := "\n" + `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}`
	tests := []struct {
		file, content string
		want          Format
		wantErr       string
	}{
		{"a.csv", azure, FormatAzure, ""},
		{"a.jsonl", mooncake, FormatMooncake, ""},
		{"a.JSON", mooncake, FormatMooncake, ""},
		{"a.txt", mooncake, FormatMooncake, ""},
		{"a", azure, FormatAzure, ""},
		{"bad.csv", mooncake, FormatAzure, "bad.csv: azure trace: line 2: header"},
		{"bad.jsonl", azure, FormatMooncake, "bad.jsonl: mooncake trace: line 1:"},
		{"missing.csv", "", 0, "missing.csv"},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			path := filepath.Join(dir, tt.file)
			if tt.file != "missing.csv" {
				if err := os.WriteFile(path, []byte(tt.content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			reqs, f, err := Open(path)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || f != tt.want || len(reqs) != 1 {
				t.Fatalf("Open = %d requests, %v, %v; want 1, %v", len(reqs), f, err, tt.want)
			}
		})
	}
}

func TestFormat(t *testing.T) {
	for _, f := range []Format{FormatAzure, FormatMooncake} {
		got, err := ParseFormat(strings.ToUpper(f.String()))
		if err != nil || got != f {
			t.Errorf("ParseFormat(%q) = %v, %v", f.String(), got, err)
		}
	}
	if _, err := ParseFormat("splitwise"); err == nil || !strings.Contains(err.Error(), `"splitwise"`) {
		t.Errorf("ParseFormat(splitwise): err = %v", err)
	}
	for f, want := range map[Format][]string{
		FormatAzure:    {"Splitwise", "ISCA 2024", "CC BY 4.0", "AzurePublicDataset"},
		FormatMooncake: {"Mooncake: Trading More Storage for Less Computation", "FAST 2025", "Apache-2.0"},
	} {
		for _, w := range want {
			if !strings.Contains(f.Source(), w) {
				t.Errorf("%v.Source() = %q, want it to contain %q", f, f.Source(), w)
			}
		}
	}
}

// checkRead compares a reader's result with the wanted requests, or its error with wanted substrings.
func checkRead(t *testing.T, got []Request, err error, want []Request, wantErr []string) {
	t.Helper()
	if wantErr != nil {
		if err == nil {
			t.Fatalf("got %d requests, want an error containing %q", len(got), wantErr)
		}
		for _, w := range wantErr {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("err = %q, want it to contain %q", err, w)
			}
		}
		if got != nil {
			t.Errorf("got %d requests with the error, want none", len(got))
		}
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got  %+v\nwant %+v", got, want)
	}
}
