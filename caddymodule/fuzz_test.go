package caddymodule

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Fuzz targets of the Caddyfile unmarshalers. Seed corpora live in testdata/fuzz/<FuzzName>/. Each input
// must parse or fail with an error, never panic; what parses is validated as Caddy would at load time
// (caddy.Validate provisions and cleans up without starting anything), which must not panic either.

// dispenser tokenizes input as a Caddyfile. caddyfile.NewTestDispenser would exit the process on input
// the lexer rejects (an unterminated quote); that is the lexer's business, not the unmarshaler's.
func dispenser(input string) (*caddyfile.Dispenser, bool) {
	tokens, err := caddyfile.Tokenize([]byte(input), "Fuzzfile")
	if err != nil {
		return nil, false
	}
	return caddyfile.NewDispenser(tokens), true
}

// validateConfig validates a config of the app and a reverse proxy using the policy, either given as
// JSON or left to defaults when nil.
func validateConfig(t *testing.T, app, policy []byte) error {
	t.Helper()
	if app == nil {
		app = []byte(`{}`)
	}
	sel := map[string]any{}
	if policy != nil {
		if err := json.Unmarshal(policy, &sel); err != nil {
			t.Fatalf("policy JSON: %v: %s", err, policy)
		}
	}
	sel["policy"] = "sglang_load"
	selJSON, err := json.Marshal(sel)
	if err != nil {
		t.Fatal(err)
	}
	raw := `{"apps": {"sglang_load": ` + string(app) + `,` +
		`"http": {"servers": {"s": {"listen": [":0"], "routes": [{"handle": [{"handler": "reverse_proxy",` +
		`"load_balancing": {"selection_policy": ` + string(selJSON) + `}, "upstreams": [{"dial": "127.0.0.1:30000"}, {"dial": "127.0.0.1:30001"}]}]}]}}}}}`
	var cfg caddy.Config
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		t.Fatalf("config built from an accepted input is not JSON: %v\n%s", err, raw)
	}
	return caddy.Validate(&cfg)
}

func FuzzAppUnmarshalCaddyfile(f *testing.F) {
	f.Add("sglang_load {\n\tinterval 5s\n\ttimeout 1s\n\tstale_after 15s\n\tmax_concurrent_polls 8\n}")
	f.Fuzz(func(t *testing.T, input string) {
		d, ok := dispenser(input)
		if !ok {
			return
		}
		app := new(App)
		if err := app.UnmarshalCaddyfile(d); err != nil {
			return
		}
		raw, err := json.Marshal(app)
		if err != nil {
			t.Fatalf("marshal accepted app: %v", err)
		}
		// Every value the syntax accepts is one the app accepts: the parser checks what Provision checks.
		if err := validateConfig(t, raw, nil); err != nil {
			t.Fatalf("accepted input %q adapts to %s, which does not validate: %v", input, raw, err)
		}
	})
}

func FuzzPolicyUnmarshalCaddyfile(f *testing.F) {
	f.Add("sglang_load {\n\tload_transport grpc\n\tload_port 30010\n\tapi_key k\n\tinterval 2s\n\tmetric waiting\n\tchoose least\n\tfallback random\n}")
	f.Fuzz(func(t *testing.T, input string) {
		d, ok := dispenser(input)
		if !ok {
			return
		}
		p := new(Policy)
		if err := p.UnmarshalCaddyfile(d); err != nil {
			return
		}
		raw, err := json.Marshal(p)
		if err != nil {
			t.Fatalf("marshal accepted policy: %v", err)
		}
		// Only what the syntax cannot check is left to provisioning: the fallback policy's own options
		// and an API key that cannot go in a header. Any other error means parser and Provision disagree.
		if err := validateConfig(t, nil, raw); err != nil && !strings.Contains(err.Error(), "fallback") &&
			!strings.Contains(err.Error(), "api key") {
			t.Fatalf("accepted input %q adapts to %s, which fails to validate: %v", input, raw, err)
		}
	})
}
