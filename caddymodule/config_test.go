package caddymodule_test

import (
	"encoding/json"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-sglang/caddy-sglang/caddymodule"
)

func TestCaddyfileAdaptsToGoldenJSON(t *testing.T) {
	for _, name := range []string{"full", "cost"} {
		t.Run(name, func(t *testing.T) {
			caddyfile, err := os.ReadFile("testdata/" + name + ".caddyfile")
			if err != nil {
				t.Fatal(err)
			}
			golden, err := os.ReadFile("testdata/" + name + ".golden.json")
			if err != nil {
				t.Fatal(err)
			}
			caddytest.AssertAdapt(t, string(caddyfile), "caddyfile", strings.TrimSuffix(string(golden), "\n"))
		})
	}
}

// The JSON a user writes by hand, with readable durations, configures exactly what the Caddyfile does.
func TestHandWrittenJSONEqualsCaddyfile(t *testing.T) {
	golden, err := os.ReadFile("testdata/full.golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var adapted struct {
		Apps struct {
			SGLang json.RawMessage `json:"sglang_load"`
			HTTP   struct {
				Servers map[string]struct {
					Routes []struct {
						Handle []struct {
							LoadBalancing struct {
								Policy json.RawMessage `json:"selection_policy"`
							} `json:"load_balancing"`
						} `json:"handle"`
					} `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(golden, &adapted); err != nil {
		t.Fatal(err)
	}
	decode := func(raw string, v any) {
		t.Helper()
		dec := json.NewDecoder(strings.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(v); err != nil {
			t.Fatalf("decode %s: %v", raw, err)
		}
	}
	var fromCaddyfile, fromJSON caddymodule.App
	decode(string(adapted.Apps.SGLang), &fromCaddyfile)
	decode(`{"interval": "5s", "timeout": "1s", "stale_after": "20s", "forget_after": "2m", "max_concurrent_polls": 16}`, &fromJSON)
	// Compare what the two configure, re-encoded: App holds unexported runtime state too.
	if c, j := mustJSON(t, &fromCaddyfile), mustJSON(t, &fromJSON); c != j {
		t.Errorf("app: Caddyfile gives %s, JSON %s", c, j)
	}

	policyRaw := adapted.Apps.HTTP.Servers["srv0"].Routes[0].Handle[0].LoadBalancing.Policy
	var pc, pj map[string]any
	decode(string(policyRaw), &pc)
	decode(`{"policy": "sglang_load", "load_transport": "grpc", "load_port": 30010, "load_tls": true,
		"load_tls_config": {"ca": {"provider": "file", "pem_files": ["/etc/caddy/workers-ca.pem"]},
			"client_certificate_file": "/etc/caddy/client.pem", "client_certificate_key_file": "/etc/caddy/client.key",
			"server_name": "worker.internal"},
		"load_tls_insecure_skip_verify": true, "api_key": "secret-token", "interval": 2000000000,
		"metric": "token_usage", "choose": "least", "fallback": {"policy": "random_choose", "choose": 3}}`, &pj)
	if !reflect.DeepEqual(pc, pj) {
		t.Errorf("policy: Caddyfile gives %v, JSON %v", pc, pj)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestInvalidCaddyfileValues(t *testing.T) {
	tests := []struct {
		global, policy string
		want           string
	}{
		{global: "interval 0s", want: `interval: must be > 0, got "0s"`},
		{global: "interval -5s", want: `interval: must be > 0, got "-5s"`},
		{global: "interval soon", want: `interval: invalid duration "soon"`},
		{global: "timeout 0", want: `timeout: must be > 0, got "0"`},
		{global: "stale_after -1m", want: `stale_after: must be > 0, got "-1m"`},
		{global: "stale_after", want: "stale_after: missing value"},
		{global: "forget_after 0s", want: `forget_after: must be > 0, got "0s"`},
		{global: "forget_after later", want: `forget_after: invalid duration "later"`},
		{global: "interval 1s 2s", want: "interval: too many values"},
		{global: "max_concurrent_polls 0", want: `max_concurrent_polls: want an integer from 1 to 1048576, got "0"`},
		{global: "jitter 1", want: "unrecognized subdirective jitter"},
		{policy: "load_transport udp", want: `load_transport: unknown transport "udp"`},
		{policy: "load_port 70000", want: `load_port: want an integer from 1 to 65535, got "70000"`},
		{policy: "load_port http", want: `load_port: want an integer from 1 to 65535, got "http"`},
		{policy: "interval 0s", want: `interval: must be > 0, got "0s"`},
		{policy: "metric tokens", want: `metric: unknown metric "tokens"`},
		{policy: "choose p2c", want: `choose: unknown choice "p2c"`},
		{policy: "load_tls maybe", want: `load_tls: want on or off, got "maybe"`},
		{policy: "load_tls {\n ca\n }", want: "load_tls ca: want one or more PEM files"},
		{policy: "load_tls {\n client_cert only.pem\n }", want: `load_tls client_cert: want <cert file> <key file>, got ["only.pem"]`},
		{policy: "load_tls {\n server_name\n }", want: "load_tls server_name: missing value"},
		{policy: "load_tls {\n ciphers all\n }", want: "load_tls: unrecognized option ciphers"},
		{policy: "load_tls off {\n server_name w\n }", want: "load_tls_config: set while load_tls is off"},
		{policy: "fallback nosuchpolicy", want: "nosuchpolicy"},
		{policy: "bogus 1", want: "unrecognized subdirective bogus"},
		{policy: "default_max_tokens 0", want: `default_max_tokens: want an integer from 1 to 2147483647, got "0"`},
		{policy: "prefill_tokens_per_sec -3", want: `prefill_tokens_per_sec: want a number > 0, got "-3"`},
		{policy: "decode_tokens_per_sec fast", want: `decode_tokens_per_sec: want a number > 0, got "fast"`},
		{policy: "decode_batch_halving 0.5", want: `decode_batch_halving: want a number >= 1, got "0.5"`},
		{policy: "delay_to_others 1.5", want: `delay_to_others: want a number from 0 to 1, got "1.5"`},
		{policy: "delay_to_others all", want: `delay_to_others: want a number from 0 to 1, got "all"`},
		{policy: "read_body lots", want: `read_body: want a size from 1B to 1GiB, or off, got "lots"`},
		{policy: "affinity", want: "affinity: missing mode"},
		{policy: "affinity suffix", want: `affinity: unknown mode "suffix": want prefix or header`},
		{policy: "affinity header", want: "affinity: header needs a header name"},
		{policy: "affinity prefix\n\t\t\tmetric token_usage", want: `metric: affinity prices requests with the cost metric, got "token_usage"`},
		{policy: "affinity_balance 0.9", want: `affinity_balance: want a number >= 1, got "0.9"`},
		{policy: "affinity_index_size 0", want: `affinity_index_size: want a size from 1B to 16GiB, got "0"`},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			cfg := ":8080 {\n\treverse_proxy 127.0.0.1:30000 {\n\t\tlb_policy sglang_load {\n\t\t\t" + tt.policy + "\n\t\t}\n\t}\n}\n"
			if tt.global != "" {
				cfg = "{\n\tsglang_load {\n\t\t" + tt.global + "\n\t}\n}\n" + cfg
			}
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cfg), nil)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("adapt error = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestInvalidJSONValues(t *testing.T) {
	tests := []struct {
		app, policy string
		want        string
	}{
		{app: `"interval": 0`, want: "interval: must be > 0, got 0s"},
		{app: `"timeout": "-1s"`, want: "timeout: must be > 0, got -1s"},
		{app: `"stale_after": 0`, want: "stale_after: must be > 0, got 0s"},
		{app: `"max_concurrent_polls": -1`, want: "max_concurrent_polls: must be >= 1, got -1"},
		{app: `"max_concurrent_polls": 0`, want: "max_concurrent_polls: must be >= 1, got 0"},
		{app: `"forget_after": "-1s"`, want: "forget_after: must be > 0, got -1s"},
		{policy: `"load_transport": "udp"`, want: `load_transport: unknown transport "udp"`},
		{policy: `"load_port": 70000`, want: "load_port: 70000 is not a port number"},
		{policy: `"interval": "-2s"`, want: "interval: must be > 0, got -2s"},
		{policy: `"metric": "tokens"`, want: `metric: unknown metric "tokens"`},
		{policy: `"choose": "p2c"`, want: `choose: unknown choice "p2c"`},
		{policy: `"default_max_tokens": -1`, want: "default_max_tokens: must be > 0, got -1"},
		{policy: `"read_body": -2`, want: "read_body: want a size in bytes, or -1 for never, got -2"},
		{policy: `"decode_batch_halving": 0.5`, want: "decode_batch_halving: must be a finite number >= 1, got 0.5"},
		{policy: `"delay_to_others": -0.5`, want: "delay_to_others: must be a number from 0 to 1, got -0.5"},
		{policy: `"affinity": "suffix"`, want: `affinity: unknown mode "suffix"`},
		{policy: `"affinity": "header"`, want: "affinity: header needs a header name"},
		{policy: `"affinity": "prefix", "affinity_balance": 0.5`, want: "affinity_balance: must be a finite number >= 1, got 0.5"},
		{policy: `"load_tls_config": {"client_certificate_file": "c.pem"}`, want: "load_tls_config: client_certificate_file specified without client_certificate_key_file"},
		{policy: `"load_tls_config": {"ca": {"provider": "file", "pem_files": ["/no/such/ca.pem"]}}`, want: "load_tls_config: "},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			policy := `"policy": "sglang_load"`
			if tt.policy != "" {
				policy += ", " + tt.policy
			}
			raw := `{"apps": {` +
				`"sglang_load": {` + tt.app + `},` +
				`"http": {"servers": {"s": {"listen": [":0"], "routes": [{"handle": [{"handler": "reverse_proxy",` +
				`"load_balancing": {"selection_policy": {` + policy + `}}, "upstreams": [{"dial": "127.0.0.1:30000"}]}]}]}}}}}`
			var cfg caddy.Config
			if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
				t.Fatal(err)
			}
			err := caddy.Validate(&cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("validate error = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestExampleCaddyfileValidates(t *testing.T) {
	raw, err := os.ReadFile("../Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(raw, nil)
	if err != nil {
		t.Fatalf("adapt Caddyfile.example: %v", err)
	}
	var cfg caddy.Config
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.Admin = &caddy.AdminConfig{Disabled: true}
	if err := caddy.Validate(&cfg); err != nil {
		t.Fatalf("validate Caddyfile.example: %v", err)
	}
}
