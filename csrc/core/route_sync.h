// Synchronous route: segments from cuMemAlloc, cached by the block cache, returned
// with cuMemFree only when released (empty_cache, budget pressure, OOM retry).
//
// cuMemFree waits for the device, so it is never called under the device lock: a
// segment being given back is first detached from its pool (still charged), then
// freed with the lock released (free_detached), then uncharged (settle).
#pragma once

#include <vector>

#include "block_cache.h"
#include "budget.h"
#include "driver.h"

namespace tb {

class SyncRoute final : public Backing {
 public:
  SyncRoute(const DeviceContext& ctx, Budget& budget, Ledger& ledger) : ctx_(ctx), budget_(budget), ledger_(ledger) {}

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment&, uintptr_t, size_t) override { return true; }
  void release_cached(BlockPool& pool) override;
  bool destroy_segment(Segment& seg) override;

  static size_t segment_size(size_t size, bool small);

  struct Detached {
    CUdeviceptr base;
    size_t size;
    Placement where;
    bool freed;
  };
  // Under the lock: the segments waiting for cuMemFree.
  std::vector<Detached> take_detached();
  // Without the lock: frees them (marks each freed or not).
  void free_detached(std::vector<Detached>& list) const;
  // Under the lock: uncharges what was freed; keeps the rest for a later try.
  void settle(std::vector<Detached>& list);
  // Under the lock: the bytes waiting for cuMemFree.
  size_t detached_bytes() const;

 private:
  const DeviceContext& ctx_;
  Budget& budget_;
  Ledger& ledger_;
  std::vector<Detached> detached_;
};

}  // namespace tb
