package sglangsim

import (
	"context"
	"crypto/subtle"
	"math"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// RegisterGRPC registers the worker's SglangScheduler service (GetLoads only) on s.
func (w *Worker) RegisterGRPC(s grpc.ServiceRegistrar) {
	schedulerpb.RegisterSglangSchedulerServer(s, &grpcServer{w: w})
}

// GRPCServer returns a new gRPC server with the worker's SglangScheduler service registered.
func (w *Worker) GRPCServer(opts ...grpc.ServerOption) *grpc.Server {
	s := grpc.NewServer(opts...)
	w.RegisterGRPC(s)
	return s
}

type grpcServer struct {
	schedulerpb.UnimplementedSglangSchedulerServer
	w *Worker
}

// GetLoads answers with the same numbers as GET /v1/loads. Faults map to the status codes a real
// server or the network would produce.
func (g *grpcServer) GetLoads(ctx context.Context, req *schedulerpb.GetLoadsRequest) (*schedulerpb.GetLoadsResponse, error) {
	w := g.w
	if err := w.grpcAuth(ctx); err != nil {
		return nil, err
	}
	if w.faults.IsDown() {
		return nil, status.Error(codes.Unavailable, "worker is down")
	}
	if w.faults.NotFoundLoads() {
		return nil, status.Error(codes.Unimplemented, "unknown method GetLoads for service sglang.grpc.scheduler.SglangScheduler")
	}
	if !w.waitHang(ctx) {
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if w.faults.GarbageLoads() {
		return nil, status.Error(codes.Internal, "scheduler returned a malformed load report")
	}
	sec, err := parseInclude(req.GetInclude())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	dpRank := -1
	if req.DpRank != nil {
		if dpRank = int(req.GetDpRank()); dpRank < 0 {
			return nil, status.Errorf(codes.InvalidArgument, "invalid dp_rank %d", req.GetDpRank())
		}
	}
	now := time.Now()
	loads, err := selectRanks(w.Loads(), dpRank)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	resp := &schedulerpb.GetLoadsResponse{
		Timestamp: isoTime(now),
		Version:   w.cfg.Version,
		Loads:     make([]*schedulerpb.SchedulerLoad, len(loads)),
	}
	for i, l := range loads {
		pl := &schedulerpb.SchedulerLoad{
			DpRank:             int32(l.DPRank),
			NumRunningReqs:     clamp32(int64(l.Running)),
			NumWaitingReqs:     clamp32(int64(l.Waiting)),
			NumUsedTokens:      clamp32(l.UsedTokens),
			MaxTotalNumTokens:  clamp32(l.MaxTotalTokens),
			TokenUsage:         l.TokenUsage,
			GenThroughput:      l.GenThroughput,
			CacheHitRate:       l.CacheHitRate,
			Utilization:        l.Utilization,
			MaxRunningRequests: clamp32(int64(l.MaxRunning)),
		}
		if w.cfg.LegacyShape {
			pl.NumTotalReqs = clamp32(int64(l.Running + l.Waiting))
		} else {
			pl.NumWaitingUncachedTokens = clamp32(l.WaitingUncachedTokens)
		}
		if sec.memory {
			pl.Memory = &schedulerpb.MemoryMetrics{
				WeightGb:      weightGB,
				KvCacheGb:     round(float64(l.MaxTotalTokens)*kvBytesPerToken/(1<<30), 2),
				GraphGb:       graphGB,
				TokenCapacity: clamp32(l.MaxTotalTokens),
			}
		}
		if sec.queues {
			pl.Queues = &schedulerpb.QueueMetrics{Waiting: clamp32(int64(l.Waiting)), Retracted: clamp32(l.Retracted)}
		}
		resp.Loads[i] = pl
	}
	if w.cfg.LegacyShape {
		a := aggregate(loads)
		resp.DpRankCount = int32(w.cfg.DPRanks)
		resp.Aggregate = &schedulerpb.AggregateMetrics{
			TotalRunningReqs: clamp32(int64(a.TotalRunningReqs)),
			TotalWaitingReqs: clamp32(int64(a.TotalWaitingReqs)),
			TotalReqs:        clamp32(int64(a.TotalReqs)),
			AvgTokenUsage:    a.AvgTokenUsage,
			AvgThroughput:    a.AvgThroughput,
			AvgUtilization:   a.AvgUtilization,
		}
	}
	return resp, nil
}

// grpcAuth checks "authorization: Bearer <key>" metadata when the worker has an API key.
func (w *Worker) grpcAuth(ctx context.Context) error {
	if w.cfg.APIKey == "" {
		return nil
	}
	want := []byte("Bearer " + w.cfg.APIKey)
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		if subtle.ConstantTimeCompare([]byte(v), want) == 1 {
			return nil
		}
	}
	return status.Error(codes.Unauthenticated, "invalid or missing api key")
}

// clamp32 saturates: the proto's token counts are int32, and a huge pool must not wrap negative.
func clamp32(v int64) int32 {
	return int32(max(math.MinInt32, min(v, math.MaxInt32)))
}
