package sglangsim

import (
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Handler returns the worker's HTTP routes:
//
//	GET  /v1/loads             load report (include=, dp_rank=, format=json|prometheus)
//	GET  /get_load             deprecated per-rank load array
//	GET  /metrics              Prometheus gauges
//	GET  /health               200 while up
//	POST /generate             SGLang native generation
//	POST /v1/chat/completions  OpenAI-compatible chat, with SSE streaming
//	POST /v1/completions       OpenAI-compatible completions, with SSE streaming
//	POST /sim/fault            flip faults: hang_loads=0|1, garbage=0|1, not_found=0|1, down=<duration>, reset=1
//	GET  /sim/stats            the worker's Stats as JSON
func (w *Worker) Handler() http.Handler { return w.handler }

func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/loads", w.auth(w.handleLoads))
	mux.HandleFunc("GET /get_load", w.auth(w.handleGetLoad))
	mux.HandleFunc("GET /metrics", w.handleMetrics)
	mux.HandleFunc("GET /health", w.handleHealth)
	mux.HandleFunc("POST /generate", w.auth(w.serve(generateAPI{})))
	mux.HandleFunc("POST /v1/chat/completions", w.auth(w.serve(openAIAPI{chat: true})))
	mux.HandleFunc("POST /v1/completions", w.auth(w.serve(openAIAPI{})))
	mux.HandleFunc("POST /sim/fault", w.handleFault)
	mux.HandleFunc("GET /sim/stats", w.handleStats)
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		// The control routes stay up so that a demo can bring a "down" worker back.
		if w.faults.IsDown() && !strings.HasPrefix(r.URL.Path, "/sim/") {
			writeDetail(rw, http.StatusServiceUnavailable, "worker is down")
			return
		}
		mux.ServeHTTP(rw, r)
	})
}

// auth enforces the API key the way SGLang's middleware does.
func (w *Worker) auth(h http.HandlerFunc) http.HandlerFunc {
	if w.cfg.APIKey == "" {
		return h
	}
	want := []byte("Bearer " + w.cfg.APIKey)
	return func(rw http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			writeJSON(rw, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"})
			return
		}
		h(rw, r)
	}
}

func (w *Worker) handleHealth(rw http.ResponseWriter, r *http.Request) {
	w.mu.Lock()
	closed := w.closed
	w.mu.Unlock()
	if closed {
		rw.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	rw.WriteHeader(http.StatusOK)
}

func (w *Worker) handleStats(rw http.ResponseWriter, r *http.Request) {
	writeJSON(rw, http.StatusOK, w.Stats())
}

// handleFault flips fault switches from the query: POST /sim/fault?hang_loads=1&garbage=0&down=5s.
func (w *Worker) handleFault(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var down *time.Duration
	setters := map[string]func(bool){
		"hang_loads": w.faults.SetHangLoads,
		"garbage":    w.faults.SetGarbageLoads,
		"not_found":  w.faults.SetNotFoundLoads,
		"reset": func(on bool) {
			if on {
				w.faults.Reset()
			}
		},
	}
	// Validate everything before changing anything.
	var apply []func()
	for key, vals := range q {
		v := vals[len(vals)-1]
		if key == "down" {
			d, err := time.ParseDuration(v)
			if err != nil {
				writeDetail(rw, http.StatusBadRequest, fmt.Sprintf("invalid down %q: want a duration such as 5s", v))
				return
			}
			down = &d
			continue
		}
		set, ok := setters[key]
		if !ok {
			writeDetail(rw, http.StatusBadRequest, fmt.Sprintf("unknown fault %q: want hang_loads, garbage, not_found, down or reset", key))
			return
		}
		on, err := strconv.ParseBool(v)
		if err != nil {
			writeDetail(rw, http.StatusBadRequest, fmt.Sprintf("invalid %s %q: want 0 or 1", key, v))
			return
		}
		if key == "reset" {
			apply = append([]func(){func() { set(on) }}, apply...) // reset first, then the rest
		} else {
			apply = append(apply, func() { set(on) })
		}
	}
	for _, f := range apply {
		f()
	}
	if down != nil {
		w.faults.Down(*down)
	}
	writeJSON(rw, http.StatusOK, w.faults.State())
}

func writeJSON(rw http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(rw, err.Error(), http.StatusInternalServerError)
		return
	}
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	_, _ = rw.Write(append(b, '\n'))
}

// writeDetail answers an error the way SGLang's FastAPI routes do.
func writeDetail(rw http.ResponseWriter, status int, msg string) {
	writeJSON(rw, status, map[string]string{"detail": msg})
}
