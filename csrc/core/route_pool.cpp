#include "route_pool.h"

#include <cstdint>

#include "block_cache.h"
#include "device_allocator.h"
#include "driver.h"
#include "error.h"

namespace tb {

// The driver may already be gone at process exit: the pool is left to it.
PoolRoute::~PoolRoute() = default;

bool PoolRoute::init() {
  if (!dev_.make_current()) return false;
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = dev_.device();
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

size_t PoolRoute::reserved() const {
  cuuint64_t v = 0;
  if (pool_ == nullptr || driver()->memPoolGetAttribute(pool_, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
    return 0;
  return static_cast<size_t>(v);
}

size_t PoolRoute::used() const {
  cuuint64_t v = 0;
  if (pool_ == nullptr || driver()->memPoolGetAttribute(pool_, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &v) != CUDA_SUCCESS)
    return 0;
  return static_cast<size_t>(v);
}

Block* PoolRoute::malloc(size_t size, CUstream stream) {
  if (!dev_.make_current()) return nullptr;
  const size_t rounded = BlockPool::round_size(size);
  // Only memory the pool does not already cache counts against the budget.
  const size_t held = reserved(), in_use = used();
  const size_t grows_by = in_use + rounded > held ? in_use + rounded - held : 0;
  if (grows_by > 0 && !dev_.fits(grows_by)) return nullptr;
  CUdeviceptr ptr = 0;
  TB_DRIVER_CHECK(driver()->memAllocFromPoolAsync(&ptr, rounded, pool_, stream), nullptr);
  if (grows_by > 0) bump(dev_.ledger().num_device_alloc);
  auto* b = new Block();
  b->ptr = ptr;
  b->size = rounded;
  b->requested = size;
  b->stream = stream;
  b->route = kRoutePool;
  b->allocated = true;
  return b;
}

bool PoolRoute::free(Block* block) {
  if (!dev_.make_current()) return false;
  const DriverApi* d = driver();
  // See Note [Stream-ordered frees]: the free waits for every recorded stream.
  for (CUstream s : block->recorded) {
    CUevent e = dev_.get_event();
    if (e == nullptr) return false;
    TB_DRIVER_CHECK(d->eventRecord(e, s), false);
    TB_DRIVER_CHECK(d->streamWaitEvent(block->stream, e, 0), false);
    dev_.put_event(e);
  }
  TB_DRIVER_CHECK(d->memFreeAsync(block->ptr, block->stream), false);
  return true;
}

size_t PoolRoute::trim() {
  if (pool_ == nullptr || !dev_.make_current()) return 0;
  const size_t before = reserved();
  driver()->memPoolTrimTo(pool_, 0);
  const size_t after = reserved();
  return before > after ? before - after : 0;
}

}  // namespace tb
