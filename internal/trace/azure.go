package trace

import (
	"encoding/csv"
	"errors"
	"io"
	"strconv"
	"strings"
	"time"
)

// azureHeader is the header of the Azure 2023 trace files.
var azureHeader = []string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"}

// AzureTimeLayout is the layout of the Azure trace's timestamps (UTC wall clock, 7 fractional digits).
// Parsing also takes fewer or no fractional digits.
const AzureTimeLayout = "2006-01-02 15:04:05.0000000"

// azureParseLayout accepts any number of fractional digits: Go parses a fraction after the seconds
// even when the layout has none.
const azureParseLayout = "2006-01-02 15:04:05"

// ReadAzure reads an Azure LLM inference trace (CSV, header TIMESTAMP,ContextTokens,GeneratedTokens,
// LF or CRLF line ends). At is the time since the first row.
func ReadAzure(r io.Reader) ([]Request, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1 // counted below, for an error in this package's words
	cr.ReuseRecord = true
	cr.LazyQuotes = true // a stray quote then shows in the value an error quotes
	header, err := cr.Read()
	if err == io.EOF {
		return nil, errEmpty
	}
	if err != nil {
		return nil, csvError(err)
	}
	if len(header) > 0 {
		header[0] = strings.TrimPrefix(header[0], "\ufeff")
	}
	if line, _ := cr.FieldPos(0); !equalFields(header, azureHeader) {
		return nil, lineError(line, "header %q: want %q", strings.Join(header, ","), strings.Join(azureHeader, ","))
	}
	var (
		reqs  []Request
		first time.Time
		prev  time.Time
	)
	for {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, csvError(err)
		}
		line, _ := cr.FieldPos(0)
		if len(rec) != len(azureHeader) {
			return nil, lineError(line, "%d fields %q: want %d", len(rec), strings.Join(rec, ","), len(azureHeader))
		}
		at, err := time.Parse(azureParseLayout, strings.TrimSpace(rec[0]))
		if err != nil {
			return nil, lineError(line, "%s %q: not a time like %q", azureHeader[0], rec[0], AzureTimeLayout)
		}
		if len(reqs) == 0 {
			first, prev = at, at
		}
		if at.Before(prev) {
			return nil, lineError(line, "%s %q: before the previous row's %s", azureHeader[0], rec[0],
				prev.Format(AzureTimeLayout))
		}
		prev = at
		in, err := count(line, azureHeader[1], rec[1])
		if err != nil {
			return nil, err
		}
		out, err := count(line, azureHeader[2], rec[2])
		if err != nil {
			return nil, err
		}
		reqs = append(reqs, Request{Line: line, At: at.Sub(first), InputTokens: in, OutputTokens: out})
	}
	if len(reqs) == 0 {
		return nil, errEmpty
	}
	return reqs, nil
}

// count parses a token count: a non-negative integer.
func count(line int, field, s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, lineError(line, "%s %q: not an integer", field, s)
	}
	if n < 0 {
		return 0, lineError(line, "%s %q: negative", field, s)
	}
	return n, nil
}

// csvError puts a CSV syntax error in this package's words.
func csvError(err error) error {
	var pe *csv.ParseError
	if errors.As(err, &pe) {
		return lineError(pe.Line, "column %d: %v", pe.Column, pe.Err)
	}
	return err
}

func equalFields(got, want []string) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if strings.TrimSpace(got[i]) != want[i] {
			return false
		}
	}
	return true
}
