package httpload

import "testing"

// BenchmarkDecodeLoads decodes a two-rank /v1/loads body: the monitor does this once per poll per worker.
func BenchmarkDecodeLoads(b *testing.B) {
	body := readFixture(b, "loads_current.json")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeLoads(body, received); err != nil {
			b.Fatal(err)
		}
	}
}
