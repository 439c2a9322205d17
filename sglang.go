// Package sglang registers the caddy-sglang modules with Caddy: import it for its side effects, as
// `xcaddy build --with github.com/caddy-sglang/caddy-sglang` does.
package sglang

import (
	_ "github.com/caddy-sglang/caddy-sglang/caddymodule"
)
