# Caddy with the caddy-sglang plugin, in the shape of Caddy's official images: a builder stage runs
# xcaddy with this checkout as the plugin, a slim runtime stage holds the binary and a default Caddyfile.
#
#   docker build -t caddy-sglang .
#   docker run --rm -p 8080:8080 -p 9180:9180 -e SGLANG_WORKERS="10.0.0.1:30000 10.0.0.2:30000" caddy-sglang
#
# Override the config by mounting a Caddyfile on /etc/caddy/Caddyfile.

ARG GO_VERSION=1.26
ARG ALPINE_VERSION=3.23

FROM golang:${GO_VERSION}-alpine${ALPINE_VERSION} AS builder

RUN apk add --no-cache ca-certificates git

ENV XCADDY_VERSION=v0.4.5
# The Caddy version xcaddy builds; the plugin is developed and tested against it.
ENV CADDY_VERSION=v2.11.9
# No clean-up of xcaddy's temporary module: the stage is thrown away anyway.
ENV XCADDY_SKIP_CLEANUP=1

RUN go install github.com/caddyserver/xcaddy/cmd/xcaddy@${XCADDY_VERSION}

# The module's dependencies first, so a code change does not download them again.
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .

# The module path is not published: @v0.0.0=/src replaces it with this checkout (see xcaddy.md).
WORKDIR /build
RUN xcaddy build ${CADDY_VERSION} \
		--output /usr/bin/caddy \
		--with github.com/caddy-sglang/caddy-sglang@v0.0.0=/src \
	&& /usr/bin/caddy list-modules | grep sglang_load

FROM alpine:${ALPINE_VERSION}

RUN apk add --no-cache ca-certificates mailcap

RUN set -eux; \
	mkdir -p /config/caddy /data/caddy /etc/caddy /usr/share/caddy; \
	chmod 1777 /config/caddy /data/caddy

COPY --from=builder /usr/bin/caddy /usr/bin/caddy
COPY examples/docker/Caddyfile /etc/caddy/Caddyfile

# See https://caddyserver.com/docs/conventions#file-locations
ENV XDG_CONFIG_HOME=/config
ENV XDG_DATA_HOME=/data

LABEL org.opencontainers.image.title="caddy-sglang"
LABEL org.opencontainers.image.description="Caddy with the caddy-sglang plugin: load-aware routing across SGLang workers"

VOLUME /config
VOLUME /data

# 8080: the proxy; 9180: /metrics and /healthz (see examples/docker/Caddyfile). The admin API
# (2019) listens on the container's loopback only. Unlike the official image, the binary gets no
# cap_net_bind_service: the default ports need none, and a file capability stops the binary from
# starting where capabilities are dropped (the Kubernetes example drops them all).
EXPOSE 8080
EXPOSE 9180

WORKDIR /srv

CMD ["caddy", "run", "--config", "/etc/caddy/Caddyfile", "--adapter", "caddyfile"]
