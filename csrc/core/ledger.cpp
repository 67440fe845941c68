#include "ledger.h"

#include <initializer_list>

namespace tb {

const char* route_name(int route) {
  switch (route) {
    case kRouteVmm: return "vmm";
    case kRoutePool: return "pool";
    case kRouteSync: return "sync";
    default: return "unknown";
  }
}

void Ledger::reset_peaks() {
  for (StatArray3* a : {&allocation, &segment, &active, &allocated_bytes, &reserved_bytes, &active_bytes,
                        &requested_bytes})
    a->reset_peak();
  for (int r = 0; r < kRouteCount; ++r) {
    route_allocated[r].reset_peak();
    route_reserved[r].reset_peak();
  }
  for (int t = 0; t < kMaxTags; ++t) {
    tag_allocated[t].reset_peak();
    tag_requested[t].reset_peak();
    tag_allocations[t].reset_peak();
  }
  graph_pool_reserved.reset_peak();
}

void Ledger::reset_accumulated() {
  for (StatArray3* a : {&allocation, &segment, &active, &allocated_bytes, &reserved_bytes, &active_bytes,
                        &requested_bytes})
    a->reset_accumulated();
  num_alloc_retries.store(0, std::memory_order_relaxed);
  num_ooms.store(0, std::memory_order_relaxed);
  num_device_alloc.store(0, std::memory_order_relaxed);
  num_device_free.store(0, std::memory_order_relaxed);
  num_sync_all_streams.store(0, std::memory_order_relaxed);
  num_stream_syncs.store(0, std::memory_order_relaxed);
  num_reclaims.store(0, std::memory_order_relaxed);
  num_moves.store(0, std::memory_order_relaxed);
  num_adoptions.store(0, std::memory_order_relaxed);
  num_take_backs.store(0, std::memory_order_relaxed);
  mapping_ns.store(0, std::memory_order_relaxed);
  packing_ns.store(0, std::memory_order_relaxed);
}

}  // namespace tb
