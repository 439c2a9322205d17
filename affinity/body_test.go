package affinity

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"
)

// received is what the upstream got.
type received struct {
	sum    [32]byte
	length int
	err    error
}

// relay starts an upstream on loopback that hashes what it receives and a front server that reads the
// head of each body with ReadHead and forwards the request to the upstream, as a proxy does.
func relay(t *testing.T, limit int) (front string, got <-chan received, heads <-chan []byte) {
	t.Helper()
	gotc := make(chan received, 1)
	headc := make(chan []byte, 1)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		var rec received
		copy(rec.sum[:], h.Sum(nil))
		rec.length, rec.err = int(n), err
		gotc <- rec
	}))
	t.Cleanup(upstream.Close)
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		head, complete := ReadHead(r, limit, make([]byte, 0, limit))
		headc <- append([]byte(nil), head...)
		out, err := http.NewRequestWithContext(r.Context(), r.Method, upstream.URL+r.URL.Path, r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		out.ContentLength = r.ContentLength
		resp, err := upstream.Client().Do(out)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		resp.Body.Close()
		w.Header().Set("X-Complete", fmt.Sprint(complete))
	}))
	t.Cleanup(proxy.Close)
	return proxy.URL, gotc, headc
}

func TestReadHeadBodyArrivesWhole(t *testing.T) {
	const limit = 16 << 10
	rng := rand.New(rand.NewPCG(1, 2))
	body := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	tests := []struct {
		name    string
		body    []byte
		chunked bool
	}{
		{"content-length, under the bound", body(1000), false},
		{"content-length, exactly the bound", body(limit), false},
		{"chunked, under the bound", body(1000), true},
		{"chunked, exactly the bound", body(limit), true},
		{"content-length, far over the bound", body(1 << 20), false},
		{"chunked, far over the bound", body(1 << 20), true},
		{"content-length, 10 MiB", body(10 << 20), false},
		{"chunked, 10 MiB", body(10 << 20), true},
	}
	front, got, heads := relay(t, limit)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r io.Reader = bytes.NewReader(tt.body)
			if tt.chunked {
				r = struct{ io.Reader }{r} // hides the length: the client sends it chunked
			}
			req, err := http.NewRequest(http.MethodPost, front+"/v1/chat/completions", r)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			rec, head := <-got, <-heads
			if rec.err != nil || rec.length != len(tt.body) || rec.sum != sha256.Sum256(tt.body) {
				t.Fatalf("upstream got %d bytes (error %v), want the %d sent, byte for byte", rec.length, rec.err, len(tt.body))
			}
			if want := tt.body[:min(limit, len(tt.body))]; !bytes.Equal(head, want) {
				t.Fatalf("head of %d bytes is not the body's first %d", len(head), len(want))
			}
			// A chunked body that fills the bound exactly may have more: only its end says.
			wantComplete := len(tt.body) < limit || len(tt.body) == limit && !tt.chunked
			if c := resp.Header.Get("X-Complete"); c != fmt.Sprint(wantComplete) {
				t.Fatalf("complete %s, want %t", c, wantComplete)
			}
		})
	}
}

// closeRecorder is a body that counts its Close calls.
type closeRecorder struct {
	io.Reader
	closed int
}

func (c *closeRecorder) Close() error { c.closed++; return nil }

func TestReadHeadReadErrorReachesUpstream(t *testing.T) {
	boom := errors.New("client went away")
	sent := []byte(strings.Repeat("x", 300))
	r := httptest.NewRequest(http.MethodPost, "/generate", io.MultiReader(bytes.NewReader(sent), iotest.ErrReader(boom)))
	r.ContentLength = -1
	head, complete := ReadHead(r, 1000, nil)
	if !bytes.Equal(head, sent) || complete {
		t.Fatalf("head %d bytes, complete %t; want the %d read, incomplete", len(head), complete, len(sent))
	}
	got, err := io.ReadAll(r.Body)
	if !bytes.Equal(got, sent) || !errors.Is(err, boom) {
		t.Fatalf("body gave %d bytes and %v; want the %d read, then the error", len(got), err, len(sent))
	}
}

func TestReadHeadCloseLeavesAnUnreadBodyOpen(t *testing.T) {
	orig := &closeRecorder{Reader: strings.NewReader(strings.Repeat("y", 5000))}
	r := httptest.NewRequest(http.MethodPost, "/generate", nil)
	r.Body, r.ContentLength = orig, 5000
	ReadHead(r, 100, nil)
	// A transport that fails to dial closes the body unread; a retry must still find all of it.
	r.Body.Close()
	if orig.closed != 0 {
		t.Fatal("closing the unread body closed the client's body")
	}
	got, err := io.ReadAll(r.Body)
	if err != nil || len(got) != 5000 {
		t.Fatalf("after the unread close: %d bytes, %v; want 5000", len(got), err)
	}
	r.Body.Close()
	if orig.closed != 1 {
		t.Fatalf("closing the read body closed the client's body %d times, want 1", orig.closed)
	}
}

func TestReadHeadLeavesSomeBodiesAlone(t *testing.T) {
	t.Run("compressed", func(t *testing.T) {
		r := httptest.NewRequest(http.MethodPost, "/generate", strings.NewReader("\x1f\x8b..."))
		r.Header.Set("Content-Encoding", "gzip")
		body := r.Body
		if head, complete := ReadHead(r, 100, nil); head != nil || complete || r.Body != body {
			t.Fatalf("head %q, complete %t, body replaced %t", head, complete, r.Body != body)
		}
	})
	t.Run("no body", func(t *testing.T) {
		r := httptest.NewRequest(http.MethodGet, "/generate", nil)
		if head, complete := ReadHead(r, 100, nil); head != nil || !complete || r.Body != http.NoBody {
			t.Fatalf("head %q, complete %t", head, complete)
		}
	})
	t.Run("GetBody", func(t *testing.T) {
		r, err := http.NewRequest(http.MethodPost, "http://127.0.0.1/generate", strings.NewReader(`{"text":"hello"}`))
		if err != nil {
			t.Fatal(err)
		}
		body := r.Body
		head, complete := ReadHead(r, 100, nil)
		if string(head) != `{"text":"hello"}` || !complete || r.Body != body {
			t.Fatalf("head %q, complete %t, body replaced %t", head, complete, r.Body != body)
		}
		if got, _ := io.ReadAll(r.Body); string(got) != `{"text":"hello"}` {
			t.Fatalf("body %q", got)
		}
	})
}

// TestReadRequestReusesTheHeadSafely checks the pooled head's hazards: a body read in part, closed
// twice and read again still yields its own bytes while other requests take buffers from the pool, and
// once its head is read out, the buffer another request reuses never shows through it.
func TestReadRequestReusesTheHeadSafely(t *testing.T) {
	const size, limit = 5000, 3000
	newRequest := func(fill byte) (*http.Request, []byte, *closeRecorder) {
		sent := bytes.Repeat([]byte{fill}, size)
		copy(sent, `{"prompt":"`) // a /v1/completions body cut inside its prompt
		orig := &closeRecorder{Reader: bytes.NewReader(sent)}
		r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
		r.Body, r.ContentLength = orig, size
		return r, sent, orig
	}
	read := func(r *http.Request, n int) []byte {
		t.Helper()
		got := make([]byte, n)
		if _, err := io.ReadFull(r.Body, got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	busy := func() { // other requests, each read out, so their buffers go back to the pool
		for range 10 {
			r, sent, _ := newRequest('b')
			var req Request
			ReadRequest(r, limit, &req)
			if got, err := io.ReadAll(r.Body); err != nil || !bytes.Equal(got, sent) {
				t.Fatalf("another request's body: %d bytes, %v", len(got), err)
			}
		}
	}

	t.Run("read in part", func(t *testing.T) {
		r, sent, orig := newRequest('a')
		req := Request{Blocks: make([]uint64, 0, MaxBlocks)}
		ReadRequest(r, limit, &req)
		if req.Shape != ShapeCompletion || req.PromptTokens != int64(size-len(`{"prompt":"`)+3)/4 {
			t.Fatalf("parsed %+v", req)
		}
		got := read(r, 1000)
		r.Body.Close()
		r.Body.Close()
		busy()
		rest, _ := io.ReadAll(r.Body) // read after close: the head's rest, then the closed original's
		if got = append(got, rest...); !bytes.Equal(got, sent) || orig.closed != 2 {
			t.Fatalf("body gave %d bytes (equal %t), original closed %d times", len(got), bytes.Equal(got, sent), orig.closed)
		}
	})

	t.Run("read out", func(t *testing.T) {
		reused := false
		for range 100 { // the pool may drop a buffer (always under -race now and then)
			r, sent, _ := newRequest('a')
			var req Request
			ReadRequest(r, limit, &req)
			buf := r.Body.(*headBody).pooled
			got := read(r, limit) // the head's last byte: its buffer goes back
			r.Body.Close()
			r.Body.Close()
			other, otherSent, _ := newRequest('b')
			ReadRequest(other, limit, &req)
			reused = reused || other.Body.(*headBody).pooled == buf
			rest, err := io.ReadAll(r.Body)
			if got = append(got, rest...); err != nil || !bytes.Equal(got, sent) {
				t.Fatalf("body gave %d bytes (equal %t), %v", len(got), bytes.Equal(got, sent), err)
			}
			if got, err := io.ReadAll(other.Body); err != nil || !bytes.Equal(got, otherSent) {
				t.Fatalf("the reusing request's body: %d bytes, %v", len(got), err)
			}
			if reused {
				return
			}
		}
		t.Fatal("no head buffer was reused")
	})

	t.Run("same as ReadHead and Parse", func(t *testing.T) {
		for _, body := range []string{chatBody(16<<10, true), chatBody(100, false), `{"text":"hi"}`} {
			r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
			want := Request{Blocks: make([]uint64, 0, MaxBlocks)}
			head, complete := ReadHead(r, 64<<10, nil)
			Parse(r.URL.Path, head, complete, r.ContentLength, &want)
			r = httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
			got := Request{Blocks: make([]uint64, 0, MaxBlocks)}
			ReadRequest(r, 64<<10, &got)
			parsed := got
			if parsed.whole = (bytes.Reader{}); fmt.Sprint(parsed) != fmt.Sprint(want) {
				t.Fatalf("ReadRequest %+v, ReadHead and Parse %+v", got, want)
			}
			if sent, err := io.ReadAll(r.Body); err != nil || string(sent) != body {
				t.Fatalf("body %d bytes, %v", len(sent), err)
			}
		}
	})
}

// A body of a known length up to maxWholeBody is read whole and handed on as an in-memory reader,
// which Go's transport writes with the headers; a body that does not end where its length says, or
// fails, is put back as it came, and a longer one keeps the pooled head.
func TestReadRequestHandsSmallBodiesOnWhole(t *testing.T) {
	inMemory := reflect.TypeOf(io.NopCloser(bytes.NewReader(nil))) // what the transport knows as in memory
	body := []byte(chatBody(1000, false))
	for _, c := range []struct {
		name   string
		sent   []byte
		fail   error // after sent, else the end
		length int64
		whole  bool
	}{
		{"whole", body, nil, int64(len(body)), true},
		{"longer than its length", append(bytes.Clone(body), "tail"...), nil, int64(len(body)), false},
		{"shorter than its length", body, nil, int64(len(body)) + 10, false},
		{"failing", body[:300], io.ErrClosedPipe, int64(len(body)), false},
		{"unknown length", body, nil, -1, false},
		{"over the bound", []byte(chatBody(maxWholeBody+1, false)), nil, maxWholeBody + 1, false},
	} {
		var sent io.Reader = bytes.NewReader(c.sent)
		if c.fail != nil {
			sent = io.MultiReader(sent, iotest.ErrReader(c.fail))
		}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		r.Body, r.ContentLength = io.NopCloser(sent), c.length
		var req Request
		ReadRequest(r, 64<<10, &req)
		if got := reflect.TypeOf(r.Body) == inMemory; got != c.whole {
			t.Errorf("%s: body handed on in memory %t, want %t", c.name, got, c.whole)
		}
		if c.fail == nil && req.MaxTokens != 256 {
			t.Errorf("%s: max_tokens %d, want 256", c.name, req.MaxTokens)
		}
		r.Body.Close() // unread, as a transport that fails to dial leaves it: a retry still reads it all
		got, err := io.ReadAll(r.Body)
		if !bytes.Equal(got, c.sent) || err != c.fail {
			t.Errorf("%s: body gave %d bytes (equal %t) and %v, want the %d sent and %v", c.name, len(got), bytes.Equal(got, c.sent), err, len(c.sent), c.fail)
		}
	}
}

func TestHeadClasses(t *testing.T) {
	for _, c := range []struct{ n, size int }{
		{1, 1024}, {1024, 1024}, {1025, 1536}, {1536, 1536}, {1537, 2048}, {16 << 10, 16 << 10},
		{16<<10 + 1, 24 << 10}, {64 << 10, 64 << 10}, {1 << 20, 1 << 20}, {1<<20 + 1, 1<<20 + 1},
	} {
		b := getHead(c.n)
		if len(*b) != c.size {
			t.Errorf("getHead(%d) has %d bytes, want %d", c.n, len(*b), c.size)
		}
		putHead(b)
	}
}

func BenchmarkReadHead(b *testing.B) {
	body := []byte(chatBody(16<<10, false))
	buf := make([]byte, 0, 64<<10)
	rd := bytes.NewReader(body)
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	b.ReportAllocs()
	cpu := startCPU()
	for b.Loop() {
		rd.Reset(body)
		r.Body, r.ContentLength = io.NopCloser(rd), int64(len(body))
		if head, complete := ReadHead(r, 64<<10, buf); len(head) != len(body) || !complete {
			b.Fatal("short head")
		}
	}
	cpu.report(b)
}

// Whatever the body, its declared length and how its reads come (a byte at a time, with the end on
// the last data, failing part way), ReadRequest never panics and the body then yields exactly what
// the client's would have: every byte sent and the same error at the end, read at once or in pieces,
// closed unread before (a retry after a dial error) or not.
func FuzzReadRequestPutsTheBodyBack(f *testing.F) {
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi"}],"max_tokens":8}`), int64(0), 64<<10, uint8(0))
	f.Add([]byte(chatBody(6000, true)), int64(-10), 3000, uint8(1|8))
	f.Add([]byte(`{"prompt":"abc"}`), int64(5), 1, uint8(2))
	f.Add([]byte(chatBody(5000, false)), int64(-1<<40), 4096, uint8(3|4))
	f.Fuzz(func(t *testing.T, sent []byte, lengthDelta int64, limit int, mode uint8) {
		// Small sizes keep a byte-at-a-time read quick; the head is cut or not either way.
		limit, sent = min(max(limit, -1), 8<<10), sent[:min(len(sent), 16<<10)]
		var reader io.Reader = bytes.NewReader(sent)
		var fail error
		switch mode % 4 {
		case 1:
			reader = iotest.OneByteReader(reader)
		case 2:
			reader = iotest.DataErrReader(reader)
		case 3:
			fail = io.ErrClosedPipe
			reader = io.MultiReader(io.LimitReader(reader, int64(len(sent)/2)), iotest.ErrReader(fail))
			sent = sent[:len(sent)/2]
		}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		r.Body = io.NopCloser(reader)
		switch {
		case lengthDelta < -1<<30: // unknown length
			r.ContentLength = -1
		default:
			r.ContentLength = max(int64(len(sent))+lengthDelta%64, 0)
		}
		req := Request{Blocks: make([]uint64, 0, MaxBlocks)}
		ReadRequest(r, limit, &req)
		if mode&4 != 0 {
			r.Body.Close() // unread: the next attempt reads it all
		}
		var got []byte
		var err error
		if mode&8 != 0 {
			got, err = io.ReadAll(iotest.OneByteReader(r.Body))
		} else {
			got, err = io.ReadAll(r.Body)
		}
		if !bytes.Equal(got, sent) || err != fail {
			t.Fatalf("body gave %d bytes (equal %t) and %v, want the %d sent and %v", len(got), bytes.Equal(got, sent), err, len(sent), fail)
		}
	})
}
