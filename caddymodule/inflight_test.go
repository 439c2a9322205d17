package caddymodule_test

import (
	"encoding/json"
	"strings"
	"testing"

	cf "github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-sglang/caddy-sglang/caddymodule"
)

func TestInflightCorrectionOption(t *testing.T) {
	tests := []struct {
		input, want, err string
	}{
		{"sglang_load", `{}`, ""},
		{"sglang_load {\n inflight_correction off\n}", `{"inflight_correction":false}`, ""},
		{"sglang_load {\n inflight_correction on\n}", `{"inflight_correction":true}`, ""},
		{"sglang_load {\n inflight_correction maybe\n}", "", `"maybe"`},
		{"sglang_load {\n inflight_correction\n}", "", "missing value"},
	}
	for _, tt := range tests {
		var p caddymodule.Policy
		err := p.UnmarshalCaddyfile(cf.NewTestDispenser(tt.input))
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("%q: error = %v, want one containing %s", tt.input, err, tt.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", tt.input, err)
		}
		got, _ := json.Marshal(&p)
		if string(got) != tt.want {
			t.Errorf("%q: JSON = %s, want %s", tt.input, got, tt.want)
		}
	}
}
