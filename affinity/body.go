package affinity

import (
	"bytes"
	"io"
	"math/bits"
	"net/http"
	"sync"
	"sync/atomic"
)

// ReadHead reads at most limit bytes of r's body into buf (grown only if its capacity is below what
// the body can need) and puts them back: afterwards r.Body yields the head followed by the rest of the
// original body, so the upstream receives exactly the bytes the client sent. complete reports that
// the head is the whole body. A read error is never lost: the head read so far is delivered first, then
// the error, to whoever reads r.Body next. A body with a Content-Encoding other than identity is not
// read (head is nil, complete false): its bytes are not the JSON. When r.GetBody is set, the head is
// read from a copy it returns and r.Body is left as it is.
//
// The head aliases buf, and r.Body refers to it until the request is over: buf must not be reused
// before then. ReadRequest takes care of that.
func ReadHead(r *http.Request, limit int, buf []byte) (head []byte, complete bool) {
	want, complete, ok := headSize(r, limit)
	if !ok {
		return nil, complete
	}
	if cap(buf) < want {
		buf = make([]byte, want)
	}
	head, complete, _ = readHead(r, buf[:want], nil)
	return head, complete
}

// ReadRequest reads the head of r's body as ReadHead does and parses it into dst as Parse does, into a
// buffer that is reused once nothing can read it any more: at once when r.Body was left as it was,
// else when r.Body has yielded the whole head. A head that is not read to its end (an abandoned
// attempt) is left to the garbage collector.
//
// A body of a known length up to maxWholeBody bytes is read whole instead, and r.Body becomes an
// in-memory reader of it, held in dst: Go's transport then writes the request's headers and body in
// one write, and no longer reads the client's body through the server's wrappers. With a body read
// where it is proxied, Caddy's CPU per request was 5-6% above least_conn's; read whole, what it is unread
// (results/2026-12-06/overhead.md). dst must outlive the request.
func ReadRequest(r *http.Request, limit int, dst *Request) {
	want, complete, ok := headSize(r, limit)
	if !ok {
		Parse(r.URL.Path, nil, complete, r.ContentLength, dst)
		return
	}
	if r.GetBody == nil && r.ContentLength > 0 && r.ContentLength <= maxWholeBody && int64(want) == r.ContentLength {
		head, complete := readWhole(r, &dst.whole)
		Parse(r.URL.Path, head, complete, r.ContentLength, dst)
		return
	}
	buf := getHead(want)
	head, complete, kept := readHead(r, (*buf)[:want], buf)
	Parse(r.URL.Path, head, complete, r.ContentLength, dst)
	if !kept {
		putHead(buf)
	}
}

// readWhole reads r's body, of a known length, into a buffer of its own and, when it ends there, makes
// r.Body an in-memory reader of it, whole; else it puts back what it read, as readHead does.
func readWhole(r *http.Request, whole *bytes.Reader) (head []byte, complete bool) {
	body := make([]byte, r.ContentLength+1) // a byte more than its length: the read sees the end
	n, err := io.ReadFull(r.Body, body)
	if int64(n) == r.ContentLength && err == io.ErrUnexpectedEOF {
		whole.Reset(body[:n])
		r.Body = io.NopCloser(whole)
		return body[:n], true
	}
	putBack(r, body[:n], err, nil)
	n = min(n, int(r.ContentLength)) // the head is the body as long as its length says
	return body[:n], isEnd(err, n, r.ContentLength)
}

// headSize is how many bytes of r's body to read with limit; not ok when none are (complete for an
// empty body).
func headSize(r *http.Request, limit int) (want int, complete, ok bool) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return 0, true, false
	}
	if enc := r.Header.Get("Content-Encoding"); enc != "" && enc != "identity" {
		return 0, false, false
	}
	if limit <= 0 {
		return 0, false, false
	}
	want = limit
	if r.ContentLength > 0 && r.ContentLength < int64(want) {
		want = int(r.ContentLength)
	}
	return want, false, true
}

// readHead fills buf from r's body (see ReadHead). pooled, if not nil, is buf's pool entry: kept
// reports that r.Body took it, to return it once its head is read.
func readHead(r *http.Request, buf []byte, pooled *[]byte) (head []byte, complete, kept bool) {
	if r.GetBody != nil {
		if body, err := r.GetBody(); err == nil {
			n, err := io.ReadFull(body, buf)
			body.Close()
			return buf[:n], isEnd(err, n, r.ContentLength), false
		}
	}
	n, err := io.ReadFull(r.Body, buf)
	return buf[:n], isEnd(err, n, r.ContentLength), putBack(r, buf[:n], err, pooled)
}

// putBack makes r.Body yield head, read from it with err, then the rest of the body. pooled, if not nil,
// is head's pool entry: kept reports that r.Body took it, to return it once head is read.
func putBack(r *http.Request, head []byte, err error, pooled *[]byte) (kept bool) {
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		err = nil // the original body reports its own end again when read
	}
	hb := &headBody{head: head, err: err, rest: r.Body}
	if len(head) > 0 {
		hb.pooled = pooled
	}
	r.Body = hb
	return hb.pooled != nil
}

// maxWholeBody is the longest body that ReadRequest reads whole into a buffer of its own: longer ones
// share pooled buffers. Caddy's CPU per request, read whole against pooled: even at 4 KiB, and at
// 16 KiB whole cost twice as much again over least_conn (8% against 4%): allocating and collecting
// the body outweighs the write it saves.
const maxWholeBody = 4 << 10

// isEnd reports whether a read of n bytes that ended with err saw the whole body.
func isEnd(err error, n int, contentLength int64) bool {
	return err == io.EOF || err == io.ErrUnexpectedEOF || int64(n) == contentLength
}

// headBody is a request body whose head was read ahead: the head, then the error that ended reading
// it (if any), then the rest of the original body.
type headBody struct {
	head []byte
	err  error
	rest io.ReadCloser
	// pooled is the head's buffer, returned to its pool by the Read that yields the head's last
	// byte: only Read looks at the head, and never again after that.
	pooled *[]byte
	// read is set once anything was asked of the body. Until then Close does not close the original,
	// as Caddy's reverse proxy does for an unread body, so a retry after a dial error still has all of it.
	// Atomic: a transport may Close from another goroutine than the one reading.
	read atomic.Bool
}

func (b *headBody) Read(p []byte) (int, error) {
	if !b.read.Load() {
		b.read.Store(true)
	}
	if len(b.head) > 0 {
		n := copy(p, b.head)
		b.head = b.head[n:]
		if len(b.head) == 0 {
			b.head = nil
			if b.pooled != nil {
				putHead(b.pooled)
				b.pooled = nil
			}
		}
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.rest.Read(p)
}

func (b *headBody) Close() error {
	if !b.read.Load() {
		return nil
	}
	return b.rest.Close()
}

// Head buffers are pooled by size class, 2^k and 1.5 × 2^k bytes from 1 KiB to 1 MiB, so a head
// takes at most half as much again as it needs; a larger one is not pooled.
const (
	minHeadShift = 10
	maxHeadShift = 20
)

var heads [2*(maxHeadShift-minHeadShift) + 1]sync.Pool

// headClass is the pool index and the size of the smallest class that holds n bytes, and whether it
// is pooled.
func headClass(n int) (index, size int, ok bool) {
	k := max(bits.Len(uint(n-1)), minHeadShift) // n <= 1<<k
	if k > maxHeadShift {
		return 0, n, false
	}
	if k > minHeadShift && n <= 3<<(k-2) {
		return 2*(k-minHeadShift) - 1, 3 << (k - 2), true
	}
	return 2 * (k - minHeadShift), 1 << k, true
}

// getHead returns a buffer of at least n bytes. A pool holds pointers: a slice would be boxed.
func getHead(n int) *[]byte {
	i, size, ok := headClass(n)
	if ok {
		if b, hit := heads[i].Get().(*[]byte); hit {
			return b
		}
	}
	b := make([]byte, size)
	return &b
}

// putHead returns a buffer from getHead to its pool. Nothing may refer to it any more.
func putHead(b *[]byte) {
	if i, size, ok := headClass(cap(*b)); ok && size == cap(*b) {
		heads[i].Put(b)
	}
}
