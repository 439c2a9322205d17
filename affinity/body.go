package affinity

import (
	"io"
	"net/http"
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
// before then.
func ReadHead(r *http.Request, limit int, buf []byte) (head []byte, complete bool) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return nil, true
	}
	if enc := r.Header.Get("Content-Encoding"); enc != "" && enc != "identity" {
		return nil, false
	}
	if limit <= 0 {
		return nil, false
	}
	want := limit
	if r.ContentLength > 0 && r.ContentLength < int64(want) {
		want = int(r.ContentLength)
	}
	if cap(buf) < want {
		buf = make([]byte, want)
	}
	buf = buf[:want]
	if r.GetBody != nil {
		if body, err := r.GetBody(); err == nil {
			n, err := io.ReadFull(body, buf)
			body.Close()
			return buf[:n], isEnd(err, n, r.ContentLength)
		}
	}
	n, err := io.ReadFull(r.Body, buf)
	complete = isEnd(err, n, r.ContentLength)
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		err = nil // the original body reports its own end again when read
	}
	r.Body = &headBody{head: buf[:n], err: err, rest: r.Body}
	return buf[:n], complete
}

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
