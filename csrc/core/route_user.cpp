#include "route_user.h"

#include "error.h"
#include "route_sync.h"

namespace tb {

bool UserRoute::grow(BlockPool& pool, size_t size, bool small, CUstream stream) {
  // torch's segment sizes, so the user's allocator sees the calls it would see natively.
  const size_t bytes = SyncRoute::segment_size(size, small);
  Charge charge(budget_, bytes, Placement{kRouteSync, small, true});
  if (!charge.ok()) return false;
  const CUdeviceptr ptr = source_->alloc(bytes, stream);
  if (ptr == 0) {
    if (last_error_code() == kOk)
      set_error(kOutOfMemory, "the memory pool's own allocator returned no memory for " + format_size(bytes));
    return false;
  }
  charge.commit();
  bump(ledger_.num_device_alloc);
  pool.add_segment(ptr, bytes, small, stream);
  ledger_.segment.add(small, 1);
  return true;
}

bool UserRoute::destroy_segment(Segment& seg) {
  frees_.push_back(UserFree{source_, seg.base, seg.size, seg.small});  // freed with the lock released
  ledger_.segment.sub(seg.small, 1);
  seg.pool->remove_segment(&seg);
  return true;
}

void UserRoute::release_cached(BlockPool& pool) {
  for (Segment* seg : pool.idle_clean_segments()) destroy_segment(*seg);
}

}  // namespace tb
