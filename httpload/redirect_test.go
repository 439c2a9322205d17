package httpload_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sglang/caddy-sglang/httpload"
)

// A worker's redirect is not followed: it reads as the status it is, and the address it names is never
// asked, with or without the API key.
func TestRedirectNotFollowed(t *testing.T) {
	var elsewhere atomic.Int64
	other := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		elsewhere.Add(1)
		rw.Write([]byte(`{"loads":[]}`))
	}))
	defer other.Close()
	for _, code := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		worker := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			http.Redirect(rw, r, other.URL+r.URL.Path, code)
		}))
		f, err := httpload.New(httpload.Config{URL: worker.URL, APIKey: "k"})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		rep, err := f.Fetch(ctx)
		cancel()
		var se *httpload.StatusError
		if rep != nil || !errors.As(err, &se) || se.Code != code {
			t.Errorf("redirect %d: report %v, error %v; want a StatusError %d", code, rep, err, code)
		}
		f.Close()
		worker.Close()
	}
	if n := elsewhere.Load(); n != 0 {
		t.Errorf("the redirect target was asked %d times", n)
	}
}
