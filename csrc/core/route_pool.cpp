#include "route_pool.h"

#include <algorithm>
#include <numeric>
#include <cstdint>

#include "capture_graph.h"
#include "error.h"

namespace tb {

bool PoolRoute::init() {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = ctx_.device;
  TB_DRIVER_CHECK(driver()->memPoolCreate(&pool_, &props), false);
  cuuint64_t keep_all = UINT64_MAX;  // the pool is our cache: never trim at sync points
  CUresult r = driver()->memPoolSetAttribute(pool_, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all);
  if (r != CUDA_SUCCESS) {
    driver()->memPoolDestroy(pool_);
    pool_ = nullptr;
    return fail_driver(r, "cuMemPoolSetAttribute", __FILE__, __LINE__);
  }
  return true;
}

bool PoolRoute::reserved(size_t* out) const {
  // The ledger mirrors this figure: a failed read is retried rather than guessed.
  cuuint64_t v = 0;
  const CUresult r =
      retry_driver([&] { return driver()->memPoolGetAttribute(pool_, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v); });
  if (r != CUDA_SUCCESS) return fail_driver(r, "cuMemPoolGetAttribute", __FILE__, __LINE__);
  *out = static_cast<size_t>(v);
  return true;
}

bool PoolRoute::used(size_t* out) const {
  cuuint64_t v = 0;
  TB_DRIVER_CHECK(driver()->memPoolGetAttribute(pool_, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &v), false);
  *out = static_cast<size_t>(v);
  return true;
}

void PoolRoute::settle(size_t now, bool small) {
  const size_t seen = seen_small_ + seen_large_;
  if (now > seen) {
    budget_.charge_unchecked(now - seen, Placement{kRoutePool, small, false});
    (small ? seen_small_ : seen_large_) += now - seen;
    return;
  }
  size_t drop = seen - now;
  const size_t from_large = std::min(drop, seen_large_);
  if (from_large > 0) budget_.uncharge(from_large, Placement{kRoutePool, false, false});
  seen_large_ -= from_large;
  drop -= from_large;
  if (drop > 0) budget_.uncharge(drop, Placement{kRoutePool, true, false});
  seen_small_ -= drop;
}

bool PoolRoute::grow(BlockPool& pool, size_t size, bool small, CUstream stream) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  size_t held = 0, in_use = 0;
  if (!reserved(&held) || !used(&in_use)) return false;
  settle(held, small);
  // See Note [Pool growth and the budget].
  const size_t need = in_use + size > held ? in_use + size - held : 0;
  // Predicted growth: the request rounded up to the granularity the pool has grown by so far.
  const size_t predicted = chunk_ > 0 ? (need + chunk_ - 1) / chunk_ * chunk_ : need;
  if (need > 0 && !budget_.fits(predicted)) return false;
  // Note [Allocating beside a capture]
  CUstream order = stream;
  if (open_captures_.load(std::memory_order_acquire) > 0 && may_be_capturing(stream)) {
    if (side_ == nullptr) TB_DRIVER_CHECK(driver()->streamCreate(&side_, CU_STREAM_NON_BLOCKING), false);
    order = side_;
  }
  CUdeviceptr ptr = 0;
  TB_DRIVER_CHECK(driver()->memAllocFromPoolAsync(&ptr, size, pool_, order), false);
  if (order != stream) {
    const CUresult r = driver()->streamSynchronize(order);
    if (r != CUDA_SUCCESS) {
      driver()->memFreeAsync(ptr, order);
      return fail_driver(r, "cuStreamSynchronize", __FILE__, __LINE__);
    }
  }
  size_t after = held;
  const bool known = reserved(&after);
  const size_t grew = after > held ? after - held : 0;
  if (grew > 0) chunk_ = chunk_ > 0 ? std::gcd(chunk_, grew) : grew;
  if (!known || (grew > 0 && !budget_.fits(grew))) {
    const ErrorCode code = known ? kOutOfMemory : last_error_code();
    const std::string msg = last_error_message();
    if (driver()->memFreeAsync(ptr, order) == CUDA_SUCCESS) {
      driver()->memPoolTrimTo(pool_, held);
    } else {
      // Kept as a free segment of the pool, as one whose free was refused later is:
      // release_cached frees it again (else nothing would, and the driver kept it for good).
      pool.add_segment(ptr, size, small, stream);
      ledger_.segment.add(small, 1);
    }
    size_t now = 0;
    if (reserved(&now)) settle(now, small);
    set_error(code, msg);
    return false;
  }
  if (grew > 0) bump(ledger_.num_device_alloc);
  settle(after, small);
  pool.add_segment(ptr, size, small, stream);
  ledger_.segment.add(small, 1);
  return true;
}

bool PoolRoute::destroy_segment(Segment& seg) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  TB_DRIVER_CHECK(driver()->memFreeAsync(seg.base, seg.stream), false);
  ledger_.segment.sub(seg.small, 1);
  seg.pool->remove_segment(&seg);
  return true;
}

void PoolRoute::release_cached(BlockPool& pool, bool device_captures) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return;
  // Segments whose stream-ordered free was refused earlier (Note [Stream-ordered frees]).
  std::vector<Segment*> idle;
  const bool capturing = open_captures_.load(std::memory_order_acquire) > 0;
  if (!device_captures)
    for (const auto& seg : pool.segments())
      if (seg->live == 0 && !(capturing && may_be_capturing(seg->stream))) idle.push_back(seg.get());
  for (Segment* seg : idle) destroy_segment(*seg);
  size_t before = 0, now = 0;
  if (!reserved(&before)) return;
  settle(before, false);
  if (driver()->memPoolTrimTo(pool_, 0) != CUDA_SUCCESS || !reserved(&now)) return;
  if (now < before) bump(ledger_.num_device_free);
  settle(now, false);
}

bool PoolRoute::grant_peer(int peer) {
  const CUmemAccessDesc desc = read_write_access(peer);
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  TB_DRIVER_CHECK(driver()->memPoolSetAccess(pool_, &desc, 1), false);
  return true;
}

}  // namespace tb
