package main

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/caddy-sglang/caddy-sglang/sglangsim"
)

// defaultTraceFleet is -fleet's default: two large fast workers and two at half their size and speed.
const defaultTraceFleet = "2x(pool=400000,prefill=12000,decode=150)+2x(pool=200000,prefill=6000,decode=75)"

// maxTraceWorkers bounds a -fleet: every arm runs its own copy of the fleet on a 2-core machine.
const maxTraceWorkers = 32

// fleetGroup is one group of a -fleet spec: count workers of one config.
type fleetGroup struct {
	spec  string // as written
	count int
	cfg   sglangsim.Config
}

// traceFleet is the workers of a -fleet spec, in order: group by group, named w0, w1, ...
type traceFleet struct {
	spec   string
	groups []fleetGroup
}

// fleetKey is a key of a -fleet group and the sglangsim.Config field it sets.
type fleetKey struct {
	name, field string
	set         func(c *sglangsim.Config, value string) error
}

// fleetKeys are the keys a -fleet group takes. Unset keys take the simulator's defaults.
var fleetKeys = []fleetKey{
	{"pool", "MaxTotalTokens", func(c *sglangsim.Config, v string) (err error) {
		c.MaxTotalTokens, err = positiveInt(v, "tokens")
		return err
	}},
	{"prefill", "PrefillTokensPerSec", func(c *sglangsim.Config, v string) (err error) {
		c.PrefillTokensPerSec, err = positiveFloat(v, "a number of tokens/s")
		return err
	}},
	{"decode", "DecodeTokensPerSec", func(c *sglangsim.Config, v string) (err error) {
		c.DecodeTokensPerSec, err = positiveFloat(v, "a number of tokens/s")
		return err
	}},
	{"batch", "MaxRunningRequests", func(c *sglangsim.Config, v string) error {
		n, err := positiveInt(v, "requests")
		c.MaxRunningRequests = int(n)
		return err
	}},
	{"chunk", "MaxPrefillTokens", func(c *sglangsim.Config, v string) (err error) {
		c.MaxPrefillTokens, err = positiveInt(v, "tokens")
		return err
	}},
	{"timing", "Timing", func(c *sglangsim.Config, v string) error {
		if err := c.Timing.UnmarshalText([]byte(v)); err != nil {
			return errors.New("want linear or step")
		}
		return nil
	}},
	{"speed", "Speed", func(c *sglangsim.Config, v string) (err error) {
		c.Speed, err = positiveFloat(v, "a factor of the step model's speed")
		return err
	}},
	{"host", "HostPoolTokens", func(c *sglangsim.Config, v string) (err error) {
		c.HostPoolTokens, err = positiveInt(v, "tokens")
		return err
	}},
	{"hostload", "HostLoadTokensPerSec", func(c *sglangsim.Config, v string) (err error) {
		c.HostLoadTokensPerSec, err = positiveFloat(v, "a number of tokens/s")
		return err
	}},
}

func positiveInt(v, unit string) (int64, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 || n > math.MaxInt32 {
		return 0, fmt.Errorf("want a whole number of %s from 1 to %d", unit, math.MaxInt32)
	}
	return n, nil
}

func positiveFloat(v, what string) (float64, error) {
	x, err := strconv.ParseFloat(v, 64)
	if err != nil || !(x > 0) || math.IsInf(x, 1) {
		return 0, fmt.Errorf("want %s above 0", what)
	}
	return x, nil
}

func fleetKeyNames() string {
	names := make([]string, len(fleetKeys))
	for i, k := range fleetKeys {
		names[i] = k.name
	}
	return strings.Join(names, ", ")
}

// parseFleet reads a -fleet spec: groups joined by +, each N x (key=value,...), e.g.
// 2x(pool=400000,prefill=12000,decode=150)+2x(pool=200000,prefill=6000,decode=75).
func parseFleet(spec string) (traceFleet, error) {
	f := traceFleet{spec: strings.TrimSpace(spec)}
	if f.spec == "" {
		return f, fmt.Errorf("-fleet: empty; want groups like %s joined by +", "2x(pool=400000,prefill=12000,decode=150)")
	}
	total := 0
	for i, g := range strings.Split(f.spec, "+") {
		group, err := parseFleetGroup(strings.TrimSpace(g))
		if err != nil {
			return f, fmt.Errorf("-fleet group %d %q: %w", i+1, strings.TrimSpace(g), err)
		}
		f.groups = append(f.groups, group)
		total += group.count
	}
	if total > maxTraceWorkers {
		return f, fmt.Errorf("-fleet: %d workers; at most %d (every arm runs its own fleet)", total, maxTraceWorkers)
	}
	return f, nil
}

func parseFleetGroup(g string) (fleetGroup, error) {
	count, keys, ok := strings.Cut(g, "x(")
	if !ok || !strings.HasSuffix(keys, ")") {
		return fleetGroup{}, fmt.Errorf("want Nx(key=value,...) with keys %s", fleetKeyNames())
	}
	n, err := strconv.Atoi(strings.TrimSpace(count))
	if err != nil || n < 1 || n > maxTraceWorkers {
		return fleetGroup{}, fmt.Errorf("count %q: want a whole number from 1 to %d", count, maxTraceWorkers)
	}
	group := fleetGroup{spec: g, count: n}
	seen := map[string]bool{}
	for kv := range strings.SplitSeq(strings.TrimSuffix(keys, ")"), ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		name, value, ok := strings.Cut(kv, "=")
		name, value = strings.TrimSpace(name), strings.TrimSpace(value)
		if !ok {
			return fleetGroup{}, fmt.Errorf("%q: want key=value", kv)
		}
		i := -1
		for j, k := range fleetKeys {
			if k.name == name {
				i = j
			}
		}
		if i < 0 {
			return fleetGroup{}, fmt.Errorf("unknown key %q: want %s", name, fleetKeyNames())
		}
		if seen[name] {
			return fleetGroup{}, fmt.Errorf("key %s given twice", name)
		}
		seen[name] = true
		if err := fleetKeys[i].set(&group.cfg, value); err != nil {
			return fleetGroup{}, fmt.Errorf("%s=%s: %w", name, value, err)
		}
	}
	return group, nil
}

// configs is a config per worker, named w0, w1, ... in group order, with the bench's simulator options.
func (f traceFleet) configs() []sglangsim.Config {
	var cfgs []sglangsim.Config
	for _, g := range f.groups {
		for range g.count {
			c := g.cfg
			c.Name = fmt.Sprintf("w%d", len(cfgs))
			benchSimOptions(&c)
			cfgs = append(cfgs, c)
		}
	}
	return cfgs
}

// labels are the workers' names, for the share columns.
func (f traceFleet) labels() []string {
	var l []string
	for _, c := range f.configs() {
		l = append(l, c.Name)
	}
	return l
}

// effective is a group's config with the simulator's defaults applied.
func (g fleetGroup) effective() sglangsim.Config { return sglangsim.New(g.cfg).Config() }

// cacheTokens is what the fleet's prefix caches hold at most, summed: every rank's KV pool and host tier.
func (f traceFleet) cacheTokens() int64 {
	var n int64
	for _, g := range f.groups {
		c := g.effective()
		n += int64(g.count*c.DPRanks) * (c.MaxTotalTokens + c.HostPoolTokens)
	}
	return n
}

// String describes the fleet for the report: each group's workers and their settings, defaults applied.
func (f traceFleet) String() string {
	var parts []string
	first := 0
	for _, g := range f.groups {
		names := fmt.Sprintf("w%d", first)
		if g.count > 1 {
			names += fmt.Sprintf("–w%d", first+g.count-1)
		}
		c := g.effective()
		timing := fmt.Sprintf("prefill %g tokens/s, decode %g tokens/s alone", c.PrefillTokensPerSec, c.DecodeTokensPerSec)
		if c.Timing == sglangsim.TimingStep {
			timing = fmt.Sprintf("step timing at speed %g", c.Speed)
		}
		host := ""
		if c.HostPoolTokens > 0 {
			host = fmt.Sprintf(", host tier %d tokens loading at %g tokens/s", c.HostPoolTokens, c.HostLoadTokensPerSec)
		}
		parts = append(parts, fmt.Sprintf("%s: pool %d tokens, %s, batch %d, chunk %d%s",
			names, c.MaxTotalTokens, timing, c.MaxRunningRequests, c.MaxPrefillTokens, host))
		first += g.count
	}
	return strings.Join(parts, "; ")
}

// index is the fleet's index of the worker of that name; -1 when none.
func (f *fleet) index(name string) int {
	for i, w := range f.workers {
		if w.Config().Name == name {
			return i
		}
	}
	return -1
}
