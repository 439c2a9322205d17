package main

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestFleetPorts(t *testing.T) {
	if got := fleetPorts(0, 1, 0); got != nil {
		t.Errorf("base 0: ports %v, want nil (any free ports)", got)
	}
	seen := map[int]string{}
	for seed := int64(0); seed < maxPortSeeds; seed++ {
		for arm := range maxPortArms {
			ports := fleetPorts(20000, seed, arm)
			if len(ports) != len(workerScales) {
				t.Fatalf("seed %d arm %d: %d ports, want %d", seed, arm, len(ports), len(workerScales))
			}
			for _, p := range ports {
				if p < 20000 || p >= 32768 || p >= 20000+fleetPortSpan() {
					t.Fatalf("seed %d arm %d: port %d outside 20000..32767 or the plan's %d ports", seed, arm, p, fleetPortSpan())
				}
				if other, ok := seen[p]; ok {
					t.Fatalf("seed %d arm %d: port %d also given to %s", seed, arm, p, other)
				}
				seen[p] = fmt.Sprintf("seed %d arm %d", seed, arm)
			}
		}
	}
	if a, b := fleetPorts(20000, 5, 3), fleetPorts(20000, 5+maxPortSeeds, 3); !slices.Equal(a, b) {
		t.Errorf("seed 5 and %d: %v and %v, want one block (the plan is by seed modulo %d)", 5+maxPortSeeds, a, b, maxPortSeeds)
	}
	if a, b := fleetPorts(20000, -1, 0), fleetPorts(20000, maxPortSeeds-1, 0); !slices.Equal(a, b) {
		t.Errorf("seed -1: %v, want seed %d's block %v", a, maxPortSeeds-1, b)
	}
}

// A fleet on fixed ports listens where the plan says, and a port already taken fails the start with an
// error that names the flag.
func TestStartFleetOnFixedPorts(t *testing.T) {
	var ports []int
	for range workerScales {
		p, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		ports = append(ports, p)
	}
	f, err := startFleet(ports)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range ports {
		if want := fmt.Sprintf("127.0.0.1:%d", p); f.addrs[i] != want {
			t.Errorf("worker %d at %s, want %s", i, f.addrs[i], want)
		}
	}
	_, err = startFleet(ports) // every port is taken by the first fleet
	f.Close()
	if err == nil || !strings.Contains(err.Error(), "-fleet-ports") {
		t.Errorf("second fleet on the same ports: %v, want an error naming -fleet-ports", err)
	}
}
