// What the allocator did, for torch's memory history and trace trackers.
//
// Note [Allocator trace]
// torch's memory visualiser replays a trace of allocator actions: allocations, free
// requests, frees completing (later than the request when the block waits for a
// recorded stream), segments created and destroyed, ranges mapped and unmapped, and
// out-of-memory failures. Only the core sees all of them in the order they happen,
// so the core reports each to one process-wide sink, with the device's mutex held
// (the order on a device is the order of the events). The sink belongs to the torch
// bridge, which turns events into torch's TraceEntry; it must not call back into the
// allocator. With no sink set, an event costs one atomic load.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace tb {

using PoolId = std::pair<uint64_t, uint64_t>;

// In torch's order (c10::CachingDeviceAllocator::TraceEntry::Action).
enum class TraceAction : int {
  kAlloc = 0,
  kFreeRequested,
  kFreeCompleted,
  kSegmentAlloc,
  kSegmentFree,
  kSegmentMap,
  kSegmentUnmap,
  kSnapshot,
  kOom,  // addr: free bytes on the device
};

struct TraceEvent {
  TraceAction action;
  int device;
  uintptr_t addr;
  size_t size;
  CUstream stream;
  PoolId pool;
  int tag;    // the ledger tag of the block or segment
  int route;  // its route
};

using TraceSink = void (*)(const TraceEvent&);

// nullptr stops reporting.
void set_trace_sink(TraceSink sink);

namespace detail {
extern std::atomic<TraceSink> trace_sink;
}

inline bool tracing() { return detail::trace_sink.load(std::memory_order_acquire) != nullptr; }

inline void trace(TraceAction action, int device, uintptr_t addr, size_t size, CUstream stream, const PoolId& pool,
                  int tag, int route) {
  TraceSink sink = detail::trace_sink.load(std::memory_order_acquire);
  if (sink != nullptr) sink(TraceEvent{action, device, addr, size, stream, pool, tag, route});
}

}  // namespace tb
