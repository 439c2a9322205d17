package trace

import (
	"bytes"
	"testing"
)

func FuzzReadAzure(f *testing.F) {
	f.Add([]byte("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"))
	f.Add([]byte("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.9799600,4808,10\r\n2023-11-16 18:17:03,1,\"2\""))
	f.Add([]byte("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,1,2\n2023-11-16 18:17:03,1,2\n"))
	f.Add([]byte("TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00,1,2\n9999-12-31 23:59:59.9999999,1,2\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		reqs, err := ReadAzure(bytes.NewReader(in))
		checkFuzzed(t, reqs, err, false)
	})
}

func FuzzReadMooncake(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 2290, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}

`))
	f.Add([]byte(`{"timestamp": 3000, "input_length": 0, "output_length": 0, "hash_ids": []}` + "\r\n" + `{"timestamp": "2999", "input_length": 1, "output_length": 1, "hash_ids": [9223372036854775807]}`))
	f.Add([]byte(`{"timestamp": 9223372036854, "input_length": 1e3, "output_length": -0, "hash_ids": null}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		reqs, err := ReadMooncake(bytes.NewReader(in))
		checkFuzzed(t, reqs, err, true)
	})
}

// checkFuzzed checks that a reader gave either an error and no requests, or valid requests.
func checkFuzzed(t *testing.T, reqs []Request, err error, withIDs bool) {
	t.Helper()
	if err != nil {
		if reqs != nil {
			t.Fatalf("%d requests with the error %v", len(reqs), err)
		}
		return
	}
	if len(reqs) == 0 {
		t.Fatal("no error and no requests")
	}
	if reqs[0].At != 0 {
		t.Fatalf("the first request at %v, want 0", reqs[0].At)
	}
	for i, r := range reqs {
		if i > 0 && (r.Line <= reqs[i-1].Line || r.At < reqs[i-1].At) {
			t.Fatalf("request %d (line %d at %v) after line %d at %v", i, r.Line, r.At, reqs[i-1].Line, reqs[i-1].At)
		}
		if r.Line < 1 || r.InputTokens < 0 || r.OutputTokens < 0 {
			t.Fatalf("request %d: %+v", i, r)
		}
		if withIDs != (r.HashIDs != nil) || withIDs && len(r.HashIDs) != blocks(r.InputTokens) {
			t.Fatalf("request %d: %d tokens with %d ids", i, r.InputTokens, len(r.HashIDs))
		}
	}
}
