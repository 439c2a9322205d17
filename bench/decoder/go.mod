module github.com/caddy-sglang/caddy-sglang/bench/decoder

go 1.26.0

require github.com/caddy-sglang/caddy-sglang v0.0.0

require github.com/valyala/fastjson v1.6.10

replace github.com/caddy-sglang/caddy-sglang => ../..
