// Stream-ordered pool route: cuMemAllocFromPoolAsync / cuMemFreeAsync on a memory
// pool owned by torch_budget.
//
// Note [Stream-ordered frees]
// A free here is a point on the block's stream: the pool may hand the memory out
// again to work ordered after that point (the driver follows event dependencies for
// other streams). Streams recorded with record_stream are folded in by making the
// block's stream wait on an event recorded on each of them before the free is
// enqueued. The pool caches freed memory itself (release threshold = max), and its
// reserved / used figures are read from pool attributes without synchronising.
#pragma once

#include <cuda.h>

#include <cstddef>

namespace tb {

struct Block;
class DeviceAllocator;

class PoolRoute {
 public:
  explicit PoolRoute(DeviceAllocator& dev) : dev_(dev) {}
  ~PoolRoute();
  bool init();
  bool available() const { return pool_ != nullptr; }

  Block* malloc(size_t size, CUstream stream);
  bool free(Block* block);
  // Bytes the pool holds from the driver / hands out now (pool attributes).
  size_t reserved() const;
  size_t used() const;
  // Returns cached memory to the driver; the caller synchronised the device.
  size_t trim();

 private:
  DeviceAllocator& dev_;
  CUmemoryPool pool_ = nullptr;
};

}  // namespace tb
