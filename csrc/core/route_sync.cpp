#include "route_sync.h"

#include "error.h"

namespace tb {

size_t SyncRoute::segment_size(size_t size, bool small) {
  if (small) return kSmallSegment;
  if (size < kMinLargeAlloc) return kMidSegment;
  return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

bool SyncRoute::grow(BlockPool& pool, size_t size, bool small, CUstream stream) {
  const size_t bytes = segment_size(size, small);
  Charge charge(budget_, bytes, Placement{kRouteSync, small, pool.graph_pool()});
  if (!charge.ok()) return false;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  CUdeviceptr ptr = 0;
  TB_DRIVER_CHECK(driver()->memAlloc(&ptr, bytes), false);
  charge.commit();
  bump(ledger_.num_device_alloc);
  pool.add_segment(ptr, bytes, small, stream);
  ledger_.segment.add(small, 1);
  return true;
}

bool SyncRoute::destroy_segment(Segment& seg) {
  detached_.push_back(Detached{seg.base, seg.size, Placement{kRouteSync, seg.small, seg.pool->graph_pool()}, false});
  ledger_.segment.sub(seg.small, 1);
  seg.pool->remove_segment(&seg);
  return true;
}

void SyncRoute::release_cached(BlockPool& pool) {
  for (Segment* seg : pool.idle_clean_segments()) destroy_segment(*seg);
}

size_t SyncRoute::detached_bytes() const {
  size_t n = 0;
  for (const Detached& d : detached_) n += d.size;
  return n;
}

std::vector<SyncRoute::Detached> SyncRoute::take_detached() {
  std::vector<Detached> out;
  out.swap(detached_);
  return out;
}

void SyncRoute::free_detached(std::vector<Detached>& list) const {
  if (list.empty()) return;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return;
  for (Detached& d : list) d.freed = driver()->memFree(d.base) == CUDA_SUCCESS;
}

void SyncRoute::settle(std::vector<Detached>& list) {
  for (Detached& d : list) {
    if (!d.freed) {
      detached_.push_back(d);
      continue;
    }
    budget_.uncharge(d.size, d.where);
    bump(ledger_.num_device_free);
  }
  list.clear();
}

}  // namespace tb
