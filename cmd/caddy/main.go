// Command caddy is Caddy with its standard modules and the caddy-sglang plugin: the binary that
// `xcaddy build --with github.com/caddy-sglang/caddy-sglang` produces.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-sglang/caddy-sglang"
)

func main() {
	caddycmd.Main()
}
