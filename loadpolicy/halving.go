package loadpolicy

// halvingFit measures a worker's batch halving H from its reports. At b running requests a request
// decodes at alone/(1 + (b-1)/H), so seconds per token and request, b/gen_throughput, is a line in
// b-1: 1/alone + (b-1)/(alone·H), and H is its intercept over its slope. The fit is least squares with
// older reports weighing less, so it follows a worker whose model changes; it measures nothing until the
// batch has varied enough to tell the slope from the noise of one window's throughput.
type halvingFit struct {
	w, x, y, xx, xy float64 // sums of weights, weighted x, y, x², xy
}

const (
	// halvingMemory is the weight a report keeps at the next one: the fit is over about the last 20.
	halvingMemory = 0.95
	// halvingMinReports is the least weight of reports a fit stands on.
	halvingMinReports = 4
	// halvingMinSpread is the least standard deviation of the batch, in requests, that measures a slope.
	halvingMinSpread = 2
	// A fitted halving is kept within these bounds: beyond them one noisy window could make a worker
	// look nearly free to join (or impossibly crowded).
	minHalving, maxHalving = 1, 256
)

// add folds in one report: x = running - 1, y = running / gen_throughput, in seconds per token.
func (f *halvingFit) add(x, y float64) {
	f.w = f.w*halvingMemory + 1
	f.x = f.x*halvingMemory + x
	f.y = f.y*halvingMemory + y
	f.xx = f.xx*halvingMemory + x*x
	f.xy = f.xy*halvingMemory + x*y
}

// halving is the fitted halving, and whether the reports measure one.
func (f *halvingFit) halving() (float64, bool) {
	if f.w < halvingMinReports {
		return 0, false
	}
	mx, my := f.x/f.w, f.y/f.w
	varX := f.xx/f.w - mx*mx
	if varX < halvingMinSpread*halvingMinSpread {
		return 0, false
	}
	slope := (f.xy/f.w - mx*my) / varX
	intercept := my - slope*mx
	if !(slope > 0 && intercept > 0) {
		return 0, false
	}
	return min(max(intercept/slope, minHalving), maxHalving), true
}
