// Synchronous route: segments from cuMemAlloc, cached by the block cache, returned
// with cuMemFree only when released (empty_cache, budget pressure, OOM retry).
#pragma once

#include "block_cache.h"

namespace tb {

class DeviceAllocator;

class SyncRoute final : public Backing {
 public:
  explicit SyncRoute(DeviceAllocator& dev) : dev_(dev) {}
  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment&, uintptr_t, size_t) override { return true; }
  size_t release_cached(BlockPool& pool) override;
  void destroy_segment(Segment& seg) override;

  static size_t segment_size(size_t size, bool small);

 private:
  DeviceAllocator& dev_;
};

}  // namespace tb
