package httpload

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/caddy-sglang/caddy-sglang/internal/tcpdial"
)

// maxHeaderBytes caps a response's status line and headers, as the net/http transport's
// MaxResponseHeaderBytes did.
const maxHeaderBytes = 64 << 10

// poller sends a fixed GET over one kept-alive HTTP/1.1 connection, on the calling goroutine. The
// net/http transport spends two goroutines per connection and hands every request between them: at
// a thousand polls a second that hand-off, not the request, was most of a poll's CPU. A poll is a GET
// with no body whose answer is read whole, so keep-alive, Content-Length or chunked bodies and a
// deadline per poll are all it needs.
// A redirect is an error status: only the configured address is polled, and the API key is never
// sent to an address a worker names.
type poller struct {
	addr   string      // host:port dialled
	tls    *tls.Config // nil for http
	dialer net.Dialer
	mu     sync.Mutex
	idle   *pollConn // one kept-alive connection; concurrent polls dial their own
}

type pollConn struct {
	net.Conn
	r *bufio.Reader
}

func newPoller(u *url.URL, tlsConfig *tls.Config) *poller {
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	p := &poller{addr: net.JoinHostPort(host, port), dialer: net.Dialer{KeepAlive: 30 * time.Second}}
	if u.Scheme == "https" {
		p.tls = &tls.Config{}
		if tlsConfig != nil {
			p.tls = tlsConfig.Clone()
		}
		if p.tls.ServerName == "" {
			p.tls.ServerName = host
		}
		p.tls.NextProtos = []string{"http/1.1"}
	}
	return p
}

// request is the bytes of a GET of u, with the headers the net/http client would send for it.
func request(u *url.URL, apiKey string) []byte {
	var b bytes.Buffer
	b.WriteString("GET ")
	uri := u.RequestURI()
	if uri[0] != '/' {
		b.WriteByte('/') // JoinPath on a URL without a path leaves it relative
	}
	b.WriteString(uri)
	b.WriteString(" HTTP/1.1\r\nHost: ")
	b.WriteString(u.Host)
	b.WriteString("\r\nUser-Agent: caddy-sglang\r\nAccept: application/json\r\n")
	if apiKey != "" {
		b.WriteString("Authorization: Bearer ")
		b.WriteString(apiKey)
		b.WriteString("\r\n")
	}
	b.WriteString("\r\n")
	return b.Bytes()
}

// response is what a poll read: the status code and, for a 2xx, the body.
type response struct {
	code int
	body *bytes.Buffer // from bodyBufs; the caller returns it
}

// errTooLarge is a body over the cap, declared or read.
var errTooLarge = errors.New("body too large")

// do sends req and reads the answer, under ctx. A body over maxBody fails with errTooLarge.
func (p *poller) do(ctx context.Context, req []byte, maxBody int64) (response, error) {
	c, reused, err := p.get(ctx)
	if err != nil {
		return response{}, err
	}
	resp, err := p.send(ctx, c, req, maxBody)
	if errors.Is(err, errNoAnswer) && reused && ctx.Err() == nil {
		// The worker closed the kept-alive connection while it was idle (uvicorn does after 5s),
		// before this request reached it: the request is a GET, so send it again on a new one.
		if c, _, err = p.get(ctx); err != nil {
			return response{}, err
		}
		resp, err = p.send(ctx, c, req, maxBody)
	}
	return resp, err
}

// errNoAnswer marks a connection that failed before any byte of an answer came back.
var errNoAnswer = errors.New("connection closed before an answer")

// send runs one round trip on c, which it keeps for the next poll or closes.
func (p *poller) send(ctx context.Context, c *pollConn, req []byte, maxBody int64) (response, error) {
	// A deadline on the socket bounds the poll; a cancel without one (Stop, Refresh) cuts it too.
	if d, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(d)
	} else {
		_ = c.SetDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	resp, keep, err := c.roundTrip(req, maxBody)
	if !stop() {
		keep = false // the cancel hook has cut, or is cutting, the socket
	}
	if err != nil {
		// The socket's deadline error hides which deadline it was; it can fire an instant before ctx's.
		if _, hasDeadline := ctx.Deadline(); ctx.Err() != nil {
			err = ctx.Err()
		} else if hasDeadline && errors.Is(err, os.ErrDeadlineExceeded) {
			err = context.DeadlineExceeded
		}
		_ = c.Close()
		if resp.body != nil {
			putBody(resp.body)
		}
		return response{}, err
	}
	if keep {
		p.put(c)
	} else {
		_ = c.Close()
	}
	return resp, nil
}

// get returns the kept-alive connection (reused) or dials a new one.
func (p *poller) get(ctx context.Context) (c *pollConn, reused bool, err error) {
	p.mu.Lock()
	c = p.idle
	p.idle = nil
	p.mu.Unlock()
	if c != nil {
		return c, true, nil
	}
	conn, err := tcpdial.Dial(ctx, &p.dialer, p.addr)
	if err != nil {
		return nil, false, err
	}
	if p.tls != nil {
		tc := tls.Client(conn, p.tls)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = conn.Close()
			return nil, false, err
		}
		conn = tc
	}
	return &pollConn{Conn: conn, r: bufio.NewReaderSize(conn, 4<<10)}, false, nil
}

func (p *poller) put(c *pollConn) {
	p.mu.Lock()
	if p.idle == nil {
		p.idle, c = c, nil
	}
	p.mu.Unlock()
	if c != nil {
		_ = c.Close()
	}
}

// closeIdle closes the kept-alive connection; a later poll dials a new one.
func (p *poller) closeIdle() {
	p.mu.Lock()
	c := p.idle
	p.idle = nil
	p.mu.Unlock()
	if c != nil {
		_ = c.Close()
	}
}

// roundTrip writes req and reads one response. keep reports whether the connection can carry another.
func (c *pollConn) roundTrip(req []byte, maxBody int64) (resp response, keep bool, err error) {
	if _, err := c.Write(req); err != nil {
		return resp, false, fmt.Errorf("%w: %w", errNoAnswer, err)
	}
	if _, err := c.r.Peek(1); err != nil {
		return resp, false, fmt.Errorf("%w: %w", errNoAnswer, err)
	}
	h, err := c.readHeader()
	if err != nil {
		return resp, false, err
	}
	resp.code = h.code
	if h.code < 200 || h.code > 299 {
		// Drain a short error body to keep the connection; a long or unframed one costs a reconnect.
		if !h.chunked && h.length >= 0 && h.length <= drainLimit {
			_, err := c.r.Discard(int(h.length))
			return resp, err == nil && h.keepAlive, nil
		}
		return resp, false, nil
	}
	if h.length > maxBody {
		return resp, false, errTooLarge
	}
	resp.body = bodyBufs.Get().(*bytes.Buffer)
	switch {
	case h.chunked:
		err = c.readChunked(resp.body, maxBody)
	case h.length >= 0:
		resp.body.Grow(int(h.length))
		_, err = io.CopyN(resp.body, c.r, h.length)
	default: // no framing: the body ends with the connection
		h.keepAlive = false
		err = readCapped(resp.body, c.r, maxBody)
	}
	return resp, h.keepAlive && err == nil, err
}

type header struct {
	code      int
	length    int64 // -1 when not declared
	chunked   bool
	keepAlive bool
}

// readHeader reads the status line and the headers that frame the body.
func (c *pollConn) readHeader() (header, error) {
	h := header{length: -1, keepAlive: true}
	read := 0
	for first := true; ; first = false {
		line, err := c.r.ReadSlice('\n')
		read += len(line)
		if err != nil {
			if errors.Is(err, bufio.ErrBufferFull) || read > maxHeaderBytes {
				return h, errors.New("response header too long")
			}
			return h, err
		}
		if read > maxHeaderBytes {
			return h, errors.New("response header too long")
		}
		line = bytes.TrimRight(line, "\r\n")
		if first {
			// HTTP/1.1 200 OK
			if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
				return h, fmt.Errorf("malformed HTTP status line %q", truncate(line))
			}
			if line[7] == '0' {
				h.keepAlive = false
			}
			code, err := strconv.Atoi(string(line[9:12]))
			if err != nil || code < 100 {
				return h, fmt.Errorf("malformed HTTP status line %q", truncate(line))
			}
			h.code = code
			continue
		}
		if len(line) == 0 {
			if h.code >= 100 && h.code < 200 {
				// An interim answer: the real one follows.
				h, read, first = header{length: -1, keepAlive: true}, 0, true
				continue
			}
			return h, nil
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			return h, fmt.Errorf("malformed HTTP header line %q", truncate(line))
		}
		value = bytes.TrimSpace(value)
		switch {
		case asciiEqualFold(name, "content-length"):
			n, err := strconv.ParseInt(string(value), 10, 64)
			if err != nil || n < 0 {
				return h, fmt.Errorf("malformed Content-Length %q", truncate(value))
			}
			h.length = n
		case asciiEqualFold(name, "transfer-encoding"):
			if !asciiEqualFold(value, "chunked") {
				return h, fmt.Errorf("unsupported Transfer-Encoding %q", truncate(value))
			}
			h.chunked = true
		case asciiEqualFold(name, "connection"):
			if asciiEqualFold(value, "close") {
				h.keepAlive = false
			}
		}
	}
}

// readChunked reads a chunked body into dst, at most maxBody bytes of it.
func (c *pollConn) readChunked(dst *bytes.Buffer, maxBody int64) error {
	for {
		line, err := c.r.ReadSlice('\n')
		if err != nil {
			return err
		}
		line = bytes.TrimRight(line, "\r\n")
		if i := bytes.IndexByte(line, ';'); i >= 0 {
			line = line[:i] // chunk extensions
		}
		n, err := strconv.ParseInt(string(bytes.TrimSpace(line)), 16, 64)
		if err != nil || n < 0 {
			return fmt.Errorf("malformed chunk size %q", truncate(line))
		}
		if n == 0 {
			// Trailers, then the blank line.
			for {
				t, err := c.r.ReadSlice('\n')
				if err != nil {
					return err
				}
				if len(bytes.TrimRight(t, "\r\n")) == 0 {
					return nil
				}
			}
		}
		if int64(dst.Len())+n > maxBody {
			return errTooLarge
		}
		if _, err := io.CopyN(dst, c.r, n); err != nil {
			return err
		}
		if _, err := c.r.Discard(2); err != nil { // CRLF after the chunk
			return err
		}
	}
}

// readCapped reads r to its end into dst, failing with errTooLarge past maxBody bytes.
func readCapped(dst *bytes.Buffer, r io.Reader, maxBody int64) error {
	if _, err := dst.ReadFrom(io.LimitReader(r, maxBody+1)); err != nil {
		return err
	}
	if int64(dst.Len()) > maxBody {
		return errTooLarge
	}
	return nil
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range len(b) {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// truncate keeps an echoed protocol fragment short in an error.
func truncate(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}

func putBody(buf *bytes.Buffer) {
	if buf.Cap() <= maxPooledBody {
		buf.Reset()
		bodyBufs.Put(buf)
	}
}
