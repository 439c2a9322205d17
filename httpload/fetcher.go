// Package httpload fetches an SGLang worker's load over HTTP: GET /v1/loads?include=core, falling back to
// the deprecated GET /get_load on workers that predate it, decoded into a loadpolicy.Report.
package httpload

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/caddy-sglang/caddy-sglang/loadpolicy"
)

// DefaultMaxBody is the default cap on a load response body, in bytes.
const DefaultMaxBody = 1 << 20

// legacyProbeEvery is how often, in polls, a worker known to lack /v1/loads is asked for it again, so
// that an upgraded worker is noticed.
const legacyProbeEvery = 10

// drainLimit is how much of an error response is read so that its connection can be reused.
const drainLimit = 4 << 10

// Config configures a Fetcher.
type Config struct {
	// URL is the worker's base URL, e.g. http://127.0.0.1:30000; a path prefix is kept.
	URL string
	// APIKey, when set, is sent as "Authorization: Bearer <key>". It never appears in errors.
	APIKey string
	// Client sends the requests. Default: a lean HTTP/1.1 client of this Fetcher's own over one
	// kept-alive connection, which never uses a proxy and never follows a redirect.
	Client *http.Client
	// TLS configures the default client's TLS for an https URL; nil means Go's defaults (verify against
	// the system roots). It cannot be combined with Client, whose transport has its own.
	TLS *tls.Config
	// MaxBody caps the response body, in bytes. Default 1 MiB.
	MaxBody int64
}

// Fetcher polls one worker's load. It is safe for concurrent use.
type Fetcher struct {
	loads   endpoint     // /v1/loads?include=core
	getLoad endpoint     // /get_load
	client  *http.Client // from Config; nil when poller polls
	poller  *poller
	maxBody int64

	mu         sync.Mutex
	legacy     bool // the worker answered 404 on /v1/loads and serves /get_load
	sinceProbe int  // polls since /v1/loads was last asked, while legacy
}

// New returns a Fetcher for the worker at cfg.URL.
func New(cfg Config) (*Fetcher, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil {
		var urlErr *url.Error
		if errors.As(err, &urlErr) {
			err = urlErr.Err // url.Error repeats the value, credentials included
		}
		return nil, fmt.Errorf("load endpoint URL %q: %w", redactUserinfo(cfg.URL), err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("load endpoint URL %q: scheme must be http or https", u.Redacted())
	case u.Hostname() == "":
		return nil, fmt.Errorf("load endpoint URL %q: no host", u.Redacted())
	case u.User != nil:
		return nil, fmt.Errorf("load endpoint URL %q: credentials belong in the API key, not the URL", u.Redacted())
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return nil, fmt.Errorf("load endpoint URL %q: must have no query or fragment", u.Redacted())
	}
	if !validHeaderValue(cfg.APIKey) {
		return nil, errors.New("api key: contains a character not allowed in an HTTP header")
	}
	if cfg.MaxBody < 0 {
		return nil, fmt.Errorf("max body %d: must not be negative", cfg.MaxBody)
	}
	if cfg.TLS != nil && cfg.Client != nil {
		return nil, errors.New("tls config: cannot be combined with a client: set it on the client's transport")
	}
	f := &Fetcher{
		client:  cfg.Client,
		maxBody: cfg.MaxBody,
	}
	loads := u.JoinPath("v1", "loads")
	loads.RawQuery = "include=core"
	if f.loads, err = newEndpoint(loads, cfg.APIKey); err != nil {
		return nil, err
	}
	if f.getLoad, err = newEndpoint(u.JoinPath("get_load"), cfg.APIKey); err != nil {
		return nil, err
	}
	if f.maxBody == 0 {
		f.maxBody = DefaultMaxBody
	}
	if f.client == nil {
		f.poller = newPoller(u, cfg.TLS)
	}
	return f, nil
}

// endpoint is one URL a Fetcher asks. Its request is built once, so a poll parses no URL and builds
// no header; requests are only read, so concurrent polls share them.
type endpoint struct {
	url string
	req *http.Request // for a Config.Client
	raw []byte        // for the Fetcher's own poller
}

func newEndpoint(u *url.URL, apiKey string) (endpoint, error) {
	req, err := http.NewRequest(http.MethodGet, u.String(), nil)
	if err != nil {
		return endpoint{}, fmt.Errorf("request %s: %w", u, err)
	}
	req.Header.Set("Accept", "application/json")
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	return endpoint{url: u.String(), req: req, raw: request(u, apiKey)}, nil
}

// URL returns the load URL asked, e.g. http://127.0.0.1:30000/v1/loads?include=core.
func (f *Fetcher) URL() string { return f.loads.url }

// Legacy reports whether the worker was last seen serving only the deprecated /get_load.
func (f *Fetcher) Legacy() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.legacy
}

// Close closes the idle connection of the Fetcher's own client; a client from Config is left alone.
func (f *Fetcher) Close() error {
	if f.poller != nil {
		f.poller.closeIdle()
	}
	return nil
}

// Fetch polls the worker once, under ctx's deadline. Errors are *StatusError, *DecodeError,
// *TooLargeError, or wrap the transport's error (e.g. context.DeadlineExceeded).
func (f *Fetcher) Fetch(ctx context.Context) (*loadpolicy.Report, error) {
	if f.skipProbe() {
		rep, err := f.get(ctx, f.getLoad, DecodeLegacyLoads)
		if !isNotFound(err) {
			return rep, err
		}
		// /get_load is gone too: the worker changed, so ask /v1/loads now.
	}
	return f.fetchLoads(ctx)
}

// skipProbe reports whether this poll should go straight to /get_load.
func (f *Fetcher) skipProbe() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.legacy {
		return false
	}
	f.sinceProbe++
	if f.sinceProbe >= legacyProbeEvery {
		f.sinceProbe = 0
		return false
	}
	return true
}

func (f *Fetcher) setLegacy(legacy bool) {
	f.mu.Lock()
	f.legacy, f.sinceProbe = legacy, 0
	f.mu.Unlock()
}

func (f *Fetcher) fetchLoads(ctx context.Context) (*loadpolicy.Report, error) {
	rep, err := f.get(ctx, f.loads, DecodeLoads)
	if !isNotFound(err) {
		if err == nil {
			f.setLegacy(false)
		}
		return rep, err
	}
	legacyRep, legacyErr := f.get(ctx, f.getLoad, DecodeLegacyLoads)
	switch {
	case legacyErr == nil:
		f.setLegacy(true)
		return legacyRep, nil
	case isNotFound(legacyErr):
		// Neither endpoint exists: the 404 of the current one is the error that helps.
		f.setLegacy(false)
		return nil, err
	default:
		return nil, legacyErr
	}
}

type decodeFunc func(body []byte, received time.Time) (*loadpolicy.Report, error)

// bodyBufs holds response buffers across polls; a poll's body is decoded before its buffer returns.
var bodyBufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// maxPooledBody is the largest buffer kept for reuse, so one oversized answer does not stay pinned.
const maxPooledBody = 64 << 10

func (f *Fetcher) get(ctx context.Context, e endpoint, decode decodeFunc) (*loadpolicy.Report, error) {
	if f.poller != nil {
		return f.poll(ctx, e, decode)
	}
	u := e.url
	resp, err := f.client.Do(e.req.WithContext(ctx))
	if err != nil {
		var urlErr *url.Error
		if errors.As(err, &urlErr) {
			err = urlErr.Err // it would name the URL a second time
		}
		return nil, fmt.Errorf("request %s: %w", u, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		_, _ = io.CopyN(io.Discard, resp.Body, drainLimit)
		return nil, &StatusError{Code: resp.StatusCode, URL: u}
	}
	// Refuse a declared oversized body before reading any of it; an undeclared one is cut at the cap.
	if resp.ContentLength > f.maxBody {
		return nil, &TooLargeError{Limit: f.maxBody, URL: u}
	}
	buf := bodyBufs.Get().(*bytes.Buffer)
	defer putBody(buf)
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, f.maxBody+1)); err != nil {
		return nil, fmt.Errorf("read load response from %s: %w", u, err)
	}
	if int64(buf.Len()) > f.maxBody {
		return nil, &TooLargeError{Limit: f.maxBody, URL: u}
	}
	return decodeFrom(buf.Bytes(), u, decode)
}

// poll is get over the Fetcher's own poller.
func (f *Fetcher) poll(ctx context.Context, e endpoint, decode decodeFunc) (*loadpolicy.Report, error) {
	resp, err := f.poller.do(ctx, e.raw, f.maxBody)
	switch {
	case errors.Is(err, errTooLarge):
		return nil, &TooLargeError{Limit: f.maxBody, URL: e.url}
	case err != nil:
		return nil, fmt.Errorf("request %s: %w", e.url, err)
	case resp.code < 200 || resp.code > 299:
		return nil, &StatusError{Code: resp.code, URL: e.url}
	}
	defer putBody(resp.body)
	return decodeFrom(resp.body.Bytes(), e.url, decode)
}

// decodeFrom decodes the body of a poll of u.
func decodeFrom(body []byte, u string, decode decodeFunc) (*loadpolicy.Report, error) {
	rep, err := decode(body, time.Now())
	if err != nil {
		if de, ok := err.(*DecodeError); ok {
			de.URL = u
		}
		return nil, err
	}
	return rep, nil
}

func isNotFound(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == http.StatusNotFound
}

// validHeaderValue reports whether s can be sent in a header without being rejected or splitting it.
func validHeaderValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// redactUserinfo hides the userinfo of a URL that did not parse, so that an error can still name it.
func redactUserinfo(raw string) string {
	start := 0
	if i := strings.Index(raw, "://"); i >= 0 {
		start = i + len("://")
	}
	end := len(raw)
	if i := strings.IndexAny(raw[start:], "/?#"); i >= 0 {
		end = start + i
	}
	at := strings.LastIndex(raw[start:end], "@")
	if at < 0 {
		return raw
	}
	return raw[:start] + "xxxxx" + raw[start+at:]
}
