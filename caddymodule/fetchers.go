package caddymodule

import (
	"crypto/tls"

	"github.com/caddy-sglang/caddy-sglang/grpcload"
	"github.com/caddy-sglang/caddy-sglang/httpload"
	"github.com/caddy-sglang/caddy-sglang/monitor"
)

// newFetcher builds the fetcher that polls the endpoint spec describes.
func newFetcher(spec endpointSpec) (monitor.Fetcher, error) {
	var tlsConfig *tls.Config
	if spec.tls {
		tlsConfig = new(tls.Config)
		if spec.tlsConfig != nil {
			tlsConfig = spec.tlsConfig.Clone()
		}
		// Verification stays on unless the config opts out explicitly.
		tlsConfig.InsecureSkipVerify = tlsConfig.InsecureSkipVerify || spec.insecureSkipVerify //nolint:gosec
	}
	switch spec.transport {
	case transportGRPC:
		return grpcload.New(grpcload.Config{Target: spec.address, TLS: tlsConfig, APIKey: spec.apiKey})
	default:
		scheme := "http://"
		if spec.tls {
			scheme = "https://"
		}
		return httpload.New(httpload.Config{URL: scheme + spec.address, APIKey: spec.apiKey, TLS: tlsConfig})
	}
}
