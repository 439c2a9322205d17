package caddymodule

import (
	"github.com/dustin/go-humanize"
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("sglang_load", parseGlobalOption)
}

// parseGlobalOption sets up the sglang_load app from the global option block. Syntax:
//
//	sglang_load {
//		interval             <duration>
//		timeout              <duration>
//		stale_after          <duration>
//		forget_after         <duration>
//		max_concurrent_polls <n>
//	}
func parseGlobalOption(d *caddyfile.Dispenser, _ any) (any, error) {
	app := new(App)
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "sglang_load", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from Caddyfile tokens; see parseGlobalOption for the syntax.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume option name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch name := d.Val(); name {
		case "interval", "timeout", "stale_after", "forget_after":
			dur, err := parsePositiveDuration(d)
			if err != nil {
				return err
			}
			switch name {
			case "interval":
				a.Interval = &dur
			case "timeout":
				a.Timeout = &dur
			case "forget_after":
				a.ForgetAfter = &dur
			default:
				a.StaleAfter = &dur
			}
		case "max_concurrent_polls":
			n, err := parseInt(d, 1, 1<<20)
			if err != nil {
				return err
			}
			a.MaxConcurrentPolls = &n
		default:
			return d.Errf("unrecognized subdirective %s", name)
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the policy from Caddyfile tokens. Syntax:
//
//	lb_policy sglang_load {
//		load_transport http|grpc
//		load_port      <port>
//		load_tls       [on|off] {
//			ca          <pem files...>
//			client_cert <cert file> <key file>
//			server_name <name>
//			insecure_skip_verify
//		}
//		load_tls_insecure_skip_verify
//		api_key        <token>
//		interval       <duration>
//		metric         cost|auto|queued_tokens|token_latency|token_usage|used_tokens|waiting|running
//		choose         auto|power_of_two|least|window
//		affinity               prefix|header <name>
//		affinity_balance       <factor>
//		affinity_index_size    <size>
//		read_body              <size>|off
//		default_max_tokens     <tokens>
//		prefill_tokens_per_sec <tokens/s>
//		decode_tokens_per_sec  <tokens/s>
//		decode_batch_halving   <requests>
//		delay_to_others        <0..1>
//		inflight_correction on|off
//		fallback       <policy> [<options...>]
//	}
func (p *Policy) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume policy name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch name := d.Val(); name {
		case "load_transport":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			if v != transportHTTP && v != transportGRPC {
				return d.Errf("load_transport: unknown transport %q: want http or grpc", v)
			}
			p.LoadTransport = v
		case "load_port":
			n, err := parseInt(d, 1, 65535)
			if err != nil {
				return err
			}
			p.LoadPort = n
		case "load_tls":
			on := true
			if d.NextArg() {
				switch d.Val() {
				case "on", "true":
				case "off", "false":
					on = false
				default:
					return d.Errf("load_tls: want on or off, got %q", d.Val())
				}
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			p.LoadTLS = &on
			if err := p.unmarshalLoadTLS(d); err != nil {
				return err
			}
		case "load_tls_insecure_skip_verify":
			if d.NextArg() {
				return d.ArgErr()
			}
			p.LoadTLSInsecureSkipVerify = true
		case "api_key":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			p.APIKey = v
		case "interval":
			dur, err := parsePositiveDuration(d)
			if err != nil {
				return err
			}
			p.Interval = dur
		case "metric":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			p.Metric = v
		case "choose":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			p.Choose = v
		case "affinity":
			if !d.NextArg() {
				return d.Err("affinity: missing mode: want prefix or header <name>")
			}
			p.Affinity = d.Val()
			if p.Affinity == affinityHeader {
				if !d.NextArg() {
					return d.Err("affinity: header needs a header name")
				}
				p.AffinityHeader = d.Val()
			}
			if d.NextArg() {
				return d.Errf("affinity: too many values")
			}
		case "affinity_balance":
			f, err := oneFloat(d, "a number >= 1", func(f float64) bool { return f >= 1 })
			if err != nil {
				return err
			}
			p.AffinityBalance = f
		case "affinity_index_size":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			size, err := humanize.ParseBytes(v)
			if err != nil || size == 0 || size > 1<<34 {
				return d.Errf("affinity_index_size: want a size from 1B to 16GiB, got %q", v)
			}
			p.AffinityIndexSize = int(size)
		case "read_body":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			if v == "off" {
				p.ReadBody = -1
				break
			}
			size, err := humanize.ParseBytes(v)
			if err != nil || size == 0 || size > 1<<30 {
				return d.Errf("read_body: want a size from 1B to 1GiB, or off, got %q", v)
			}
			p.ReadBody = int(size)
		case "default_max_tokens":
			n, err := parseInt(d, 1, math.MaxInt32)
			if err != nil {
				return err
			}
			p.DefaultMaxTokens = int64(n)
		case "prefill_tokens_per_sec", "decode_tokens_per_sec":
			name := d.Val()
			f, err := oneFloat(d, "a number > 0", func(f float64) bool { return f > 0 })
			if err != nil {
				return err
			}
			if name == "prefill_tokens_per_sec" {
				p.PrefillTokensPerSec = f
			} else {
				p.DecodeTokensPerSec = f
			}
		case "decode_batch_halving":
			f, err := oneFloat(d, "a number >= 1", func(f float64) bool { return f >= 1 })
			if err != nil {
				return err
			}
			p.DecodeBatchHalving = f
		case "delay_to_others":
			f, err := oneFloat(d, "a number from 0 to 1", func(f float64) bool { return f >= 0 && f <= 1 })
			if err != nil {
				return err
			}
			p.DelayToOthers = &f
		case "inflight_correction":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			var on bool
			switch v {
			case "on", "true":
				on = true
			case "off", "false":
			default:
				return d.Errf("inflight_correction: want on or off, got %q", v)
			}
			p.InflightCorrection = &on
		case "fallback":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if p.FallbackRaw != nil {
				return d.Err("fallback selection policy already specified")
			}
			name := d.Val()
			modID := "http.reverse_proxy.selection_policies." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			sel, ok := unm.(reverseproxy.Selector)
			if !ok {
				return d.Errf("fallback: module %s (%T) is not a selection policy", modID, unm)
			}
			p.FallbackRaw = caddyconfig.JSONModuleObject(sel, "policy", name, nil)
		default:
			return d.Errf("unrecognized subdirective %s", name)
		}
	}
	// Reject bad metric and choose values at adapt time too, with the directive's position.
	if err := p.parseOptions(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// unmarshalLoadTLS reads the optional block of load_tls into LoadTLSConfig.
func (p *Policy) unmarshalLoadTLS(d *caddyfile.Dispenser) error {
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if p.LoadTLSConfig == nil {
			p.LoadTLSConfig = new(reverseproxy.TLSConfig)
		}
		cfg := p.LoadTLSConfig
		switch name := d.Val(); name {
		case "ca":
			files := d.RemainingArgs()
			if len(files) == 0 {
				return d.Errf("load_tls ca: want one or more PEM files")
			}
			cfg.CARaw = caddyconfig.JSONModuleObject(caddytls.FileCAPool{TrustedCACertPEMFiles: files}, "provider", "file", nil)
		case "client_cert":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("load_tls client_cert: want <cert file> <key file>, got %q", args)
			}
			cfg.ClientCertificateFile, cfg.ClientCertificateKeyFile = args[0], args[1]
		case "server_name":
			v, err := oneArg(d)
			if err != nil {
				return d.Errf("load_tls %v", err)
			}
			cfg.ServerName = v
		case "insecure_skip_verify":
			if d.NextArg() {
				return d.ArgErr()
			}
			cfg.InsecureSkipVerify = true
		default:
			return d.Errf("load_tls: unrecognized option %s: want ca, client_cert, server_name or insecure_skip_verify", name)
		}
	}
	return nil
}

func oneArg(d *caddyfile.Dispenser) (string, error) {
	name := d.Val()
	if !d.NextArg() {
		return "", d.Errf("%s: missing value", name)
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.Errf("%s: too many values", name)
	}
	return v, nil
}

// oneFloat is the directive's one value, a finite number for which ok holds; else an error naming the
// directive, what it wants and the value.
func oneFloat(d *caddyfile.Dispenser, want string, ok func(float64) bool) (float64, error) {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return 0, err
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) || !ok(f) {
		return 0, d.Errf("%s: want %s, got %q", name, want, v)
	}
	return f, nil
}

func parsePositiveDuration(d *caddyfile.Dispenser) (caddy.Duration, error) {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return 0, err
	}
	dur, err := caddy.ParseDuration(v)
	if err != nil {
		return 0, d.Errf("%s: invalid duration %q: %v", name, v, err)
	}
	if dur <= 0 {
		return 0, d.Errf("%s: must be > 0, got %q", name, v)
	}
	return caddy.Duration(dur), nil
}

func parseInt(d *caddyfile.Dispenser, lo, hi int) (int, error) {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		return 0, d.Errf("%s: want an integer from %d to %d, got %q", name, lo, hi, v)
	}
	return n, nil
}

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*App)(nil)
	_ caddyfile.Unmarshaler = (*Policy)(nil)
)
