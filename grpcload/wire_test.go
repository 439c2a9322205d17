package grpcload_test

import (
	"math"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/caddy-sglang/caddy-sglang/grpcload/schedulerpb"
)

// field is one expected field of the wire table: its number, wire type and encoded value. For a nested
// message, sub lists the nested message's fields.
type field struct {
	num  protowire.Number
	typ  protowire.Type
	val  any // int64 for varints, float64 for fixed64, string for strings
	sub  []field
	name string
}

func varint(num protowire.Number, name string, v int32) field {
	return field{num: num, typ: protowire.VarintType, val: int64(v), name: name}
}

func double(num protowire.Number, name string, v float64) field {
	return field{num: num, typ: protowire.Fixed64Type, val: v, name: name}
}

func str(num protowire.Number, name, v string) field {
	return field{num: num, typ: protowire.BytesType, val: v, name: name}
}

func msg(num protowire.Number, name string, sub ...field) field {
	return field{num: num, typ: protowire.BytesType, sub: sub, name: name}
}

// The generated messages encode every field with the number and wire type of the wire table. Every
// value is distinct, so that two swapped numbers would show.
func TestWireFormat(t *testing.T) {
	req := &schedulerpb.GetLoadsRequest{DpRank: proto.Int32(1), Include: []string{"core"}}
	checkWire(t, "GetLoadsRequest", req, []field{
		varint(1, "dp_rank", 1),
		str(2, "include", "core"),
	})

	memory := []field{double(1, "weight_gb", 1.5), double(2, "kv_cache_gb", 2.5), double(3, "graph_gb", 3.5), varint(4, "token_capacity", 404)}
	spec := []field{double(1, "accept_length", 11.5), double(2, "accept_rate", 12.5)}
	lora := []field{varint(1, "slots_used", 21), varint(2, "slots_total", 22), double(3, "utilization", 23.5)}
	disagg := []field{
		str(1, "mode", "prefill"), varint(2, "prefill_prealloc_queue_reqs", 32), varint(3, "prefill_inflight_queue_reqs", 33),
		varint(4, "decode_prealloc_queue_reqs", 34), varint(5, "decode_transfer_queue_reqs", 35),
		varint(6, "decode_retracted_queue_reqs", 36), double(7, "kv_transfer_speed_gb_s", 37.5), double(8, "kv_transfer_latency_ms", 38.5),
	}
	queues := []field{varint(1, "waiting", 41), varint(2, "grammar", 42), varint(3, "paused", 43), varint(4, "retracted", 44)}
	load := []field{
		varint(1, "dp_rank", 7), varint(2, "num_running_reqs", 102), varint(3, "num_waiting_reqs", 103),
		varint(4, "num_total_reqs", 104), varint(5, "num_used_tokens", math.MaxInt32), varint(6, "max_total_num_tokens", -106),
		double(7, "token_usage", 0.25), double(8, "gen_throughput", 1834.52), double(9, "cache_hit_rate", 0.4213),
		double(10, "utilization", 0.125), varint(11, "max_running_requests", 256),
		msg(12, "memory", memory...), msg(13, "speculative", spec...), msg(14, "lora", lora...),
		msg(15, "disaggregation", disagg...), msg(16, "queues", queues...),
		varint(17, "num_waiting_uncached_tokens", 5120),
	}
	aggregate := []field{
		varint(1, "total_running_reqs", 51), varint(2, "total_waiting_reqs", 52), varint(3, "total_reqs", 53),
		double(4, "avg_token_usage", 54.5), double(5, "avg_throughput", 55.5), double(6, "avg_utilization", 56.5),
	}
	resp := &schedulerpb.GetLoadsResponse{
		Timestamp: "2026-11-30T10:00:00.123456+00:00", Version: "0.5.6", DpRankCount: 3,
		Loads: []*schedulerpb.SchedulerLoad{{
			DpRank: 7, NumRunningReqs: 102, NumWaitingReqs: 103, NumTotalReqs: 104, NumUsedTokens: math.MaxInt32,
			MaxTotalNumTokens: -106, TokenUsage: 0.25, GenThroughput: 1834.52, CacheHitRate: 0.4213,
			Utilization: 0.125, MaxRunningRequests: 256, NumWaitingUncachedTokens: 5120,
			Memory:      &schedulerpb.MemoryMetrics{WeightGb: 1.5, KvCacheGb: 2.5, GraphGb: 3.5, TokenCapacity: 404},
			Speculative: &schedulerpb.SpeculativeMetrics{AcceptLength: 11.5, AcceptRate: 12.5},
			Lora:        &schedulerpb.LoRAMetrics{SlotsUsed: 21, SlotsTotal: 22, Utilization: 23.5},
			Disaggregation: &schedulerpb.DisaggregationMetrics{
				Mode: "prefill", PrefillPreallocQueueReqs: 32, PrefillInflightQueueReqs: 33, DecodePreallocQueueReqs: 34,
				DecodeTransferQueueReqs: 35, DecodeRetractedQueueReqs: 36, KvTransferSpeedGbS: 37.5, KvTransferLatencyMs: 38.5,
			},
			Queues: &schedulerpb.QueueMetrics{Waiting: 41, Grammar: 42, Paused: 43, Retracted: 44},
		}},
		Aggregate: &schedulerpb.AggregateMetrics{
			TotalRunningReqs: 51, TotalWaitingReqs: 52, TotalReqs: 53, AvgTokenUsage: 54.5, AvgThroughput: 55.5, AvgUtilization: 56.5,
		},
	}
	checkWire(t, "GetLoadsResponse", resp, []field{
		str(1, "timestamp", "2026-11-30T10:00:00.123456+00:00"), str(2, "version", "0.5.6"), varint(3, "dp_rank_count", 3),
		msg(4, "loads", load...), msg(5, "aggregate", aggregate...),
	})
}

func checkWire(t *testing.T, name string, m proto.Message, want []field) {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatalf("marshal %s: %v", name, err)
	}
	checkFields(t, name, b, want)
}

func checkFields(t *testing.T, name string, b []byte, want []field) {
	t.Helper()
	seen := map[protowire.Number]bool{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("%s: bad tag: %v", name, protowire.ParseError(n))
		}
		b = b[n:]
		var w *field
		for i := range want {
			if want[i].num == num {
				w = &want[i]
			}
		}
		if w == nil {
			t.Errorf("%s: unexpected field %d", name, num)
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				t.Fatalf("%s: bad field %d: %v", name, num, protowire.ParseError(n))
			}
			b = b[n:]
			continue
		}
		where := name + "." + w.name
		seen[num] = true
		if typ != w.typ {
			t.Errorf("%s = field %d: wire type %d, want %d", where, num, typ, w.typ)
		}
		switch typ {
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				t.Fatalf("%s: %v", where, protowire.ParseError(n))
			}
			// int32 encodes as a sign-extended 64-bit varint (neither zigzag nor unsigned).
			if got := int64(v); got != w.val {
				t.Errorf("%s = field %d: varint %d, want %v", where, num, got, w.val)
			}
			b = b[n:]
		case protowire.Fixed64Type:
			v, n := protowire.ConsumeFixed64(b)
			if n < 0 {
				t.Fatalf("%s: %v", where, protowire.ParseError(n))
			}
			if got := math.Float64frombits(v); got != w.val {
				t.Errorf("%s = field %d: double %v, want %v", where, num, got, w.val)
			}
			b = b[n:]
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				t.Fatalf("%s: %v", where, protowire.ParseError(n))
			}
			if w.sub != nil {
				checkFields(t, where, v, w.sub)
			} else if string(v) != w.val {
				t.Errorf("%s = field %d: string %q, want %q", where, num, v, w.val)
			}
			b = b[n:]
		default:
			t.Fatalf("%s = field %d: unexpected wire type %d", where, num, typ)
		}
	}
	for _, w := range want {
		if !seen[w.num] {
			t.Errorf("%s.%s: field %d not on the wire", name, w.name, w.num)
		}
	}
}

// The descriptors carry the table's names, numbers and `optional` markers, and the service its path.
func TestDescriptors(t *testing.T) {
	optional := map[protoreflect.FullName]bool{
		"sglang.grpc.scheduler.GetLoadsRequest.dp_rank":      true,
		"sglang.grpc.scheduler.SchedulerLoad.memory":         true,
		"sglang.grpc.scheduler.SchedulerLoad.speculative":    true,
		"sglang.grpc.scheduler.SchedulerLoad.lora":           true,
		"sglang.grpc.scheduler.SchedulerLoad.disaggregation": true,
		"sglang.grpc.scheduler.SchedulerLoad.queues":         true,
	}
	fd := schedulerpb.File_sglang_scheduler_proto
	if fd.Package() != "sglang.grpc.scheduler" || fd.Syntax() != protoreflect.Proto3 {
		t.Errorf("package %s, syntax %v; want sglang.grpc.scheduler, proto3", fd.Package(), fd.Syntax())
	}
	msgs := fd.Messages()
	var names []string
	for i := range msgs.Len() {
		m := msgs.Get(i)
		names = append(names, string(m.Name()))
		fields := m.Fields()
		for j := range fields.Len() {
			f := fields.Get(j)
			if got := f.HasOptionalKeyword(); got != optional[f.FullName()] {
				t.Errorf("%s: optional = %v, want %v", f.FullName(), got, optional[f.FullName()])
			}
		}
	}
	wantMsgs := []string{"GetLoadsRequest", "GetLoadsResponse", "SchedulerLoad", "AggregateMetrics", "MemoryMetrics",
		"SpeculativeMetrics", "LoRAMetrics", "DisaggregationMetrics", "QueueMetrics"}
	for _, w := range wantMsgs {
		if msgs.ByName(protoreflect.Name(w)) == nil {
			t.Errorf("message %s missing (have %v)", w, names)
		}
	}
	if len(names) != len(wantMsgs) {
		t.Errorf("messages %v, want exactly %v", names, wantMsgs)
	}
	if got := schedulerpb.SglangScheduler_GetLoads_FullMethodName; got != "/sglang.grpc.scheduler.SglangScheduler/GetLoads" {
		t.Errorf("method path %q", got)
	}
	if s := fd.Services(); s.Len() != 1 || s.Get(0).Methods().Len() != 1 {
		t.Errorf("want one service with one method: only GetLoads is declared")
	}
}
