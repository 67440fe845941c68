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

namespace {
constexpr Stat BlockStats::*kBlockStats[] = {&BlockStats::allocation, &BlockStats::active, &BlockStats::allocated_bytes,
                                             &BlockStats::active_bytes, &BlockStats::requested_bytes};
}  // namespace

void Ledger::reset_peaks() {
  for (BlockStats& k : blocks)
    for (Stat BlockStats::*s : kBlockStats) (k.*s).reset_peak();
  segment.reset_peak();
  reserved_bytes.reset_peak();
  for (RouteStats& r : route) {
    r.allocated.reset_peak();
    r.reserved.reset_peak();
  }
  for (TagStats& t : tag) {
    t.allocated.reset_peak();
    t.requested.reset_peak();
    t.allocations.reset_peak();
  }
  graph_pool_reserved.reset_peak();
}

void Ledger::reset_accumulated() {
  for (BlockStats& k : blocks)
    for (Stat BlockStats::*s : kBlockStats) (k.*s).reset_accumulated();
  segment.reset_accumulated();
  reserved_bytes.reset_accumulated();
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
