#include "route_sync.h"

#include "device_allocator.h"
#include "driver.h"
#include "error.h"

namespace tb {

size_t SyncRoute::segment_size(size_t size, bool small) {
  if (small) return kSmallSegment;
  if (size < kMinLargeAlloc) return kMidSegment;
  return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

bool SyncRoute::grow(BlockPool& pool, size_t size, bool small, CUstream stream) {
  if (!dev_.make_current()) return false;
  const size_t bytes = segment_size(size, small);
  if (!dev_.charge(bytes, kRouteSync, pool.graph_pool(), small)) return false;
  CUdeviceptr ptr = 0;
  CUresult r = driver()->memAlloc(&ptr, bytes);
  if (r != CUDA_SUCCESS) {
    dev_.uncharge(bytes, kRouteSync, pool.graph_pool(), small);
    return fail_driver(r, "cuMemAlloc", __FILE__, __LINE__);
  }
  bump(dev_.ledger().num_device_alloc);
  auto seg = std::make_unique<Segment>();
  seg->base = ptr;
  seg->size = bytes;
  seg->small = small;
  seg->stream = stream;
  seg->route = kRouteSync;
  pool.add_segment(std::move(seg));
  dev_.ledger().segment.add(small, 1);
  return true;
}

void SyncRoute::destroy_segment(Segment& seg) {
  if (!dev_.make_current()) return;
  driver()->memFree(seg.base);
  dev_.uncharge(seg.size, kRouteSync, seg.pool->graph_pool(), seg.small);
  bump(dev_.ledger().num_device_free);
  dev_.ledger().segment.sub(seg.small, 1);
}

size_t SyncRoute::release_cached(BlockPool& pool) {
  std::vector<Segment*> idle;
  for (const auto& seg : pool.segments())
    if (seg->live == 0) idle.push_back(seg.get());
  size_t released = 0;
  for (Segment* seg : idle) {
    released += seg->size;
    destroy_segment(*seg);
    pool.remove_segment(seg);
  }
  return released;
}

}  // namespace tb
