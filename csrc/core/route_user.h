// Segments from an allocator the user gave a private pool (torch.cuda.MemPool(allocator=...),
// e.g. NCCL's ncclMemAlloc for buffers it registers): the pool's blocks are cut from
// them like any segment, and each is charged to the budget and the ledger (as the
// synchronous route: the memory is not ours to map or trim).
#pragma once

#include <memory>

#include "block_cache.h"
#include "budget.h"
#include "driver.h"

namespace tb {

// The user's allocator. alloc returns 0 with the error set on failure.
class SegmentSource {
 public:
  virtual ~SegmentSource() = default;
  virtual CUdeviceptr alloc(size_t bytes, CUstream stream) = 0;
  virtual void free(CUdeviceptr ptr) = 0;
};

class UserRoute final : public Backing {
 public:
  UserRoute(int device, Budget& budget, Ledger& ledger, std::unique_ptr<SegmentSource> source)
      : device_(device), budget_(budget), ledger_(ledger), source_(std::move(source)) {}

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment&, uintptr_t, size_t) override { return true; }
  void release_cached(BlockPool& pool) override;
  bool destroy_segment(Segment& seg) override;

 private:
  int device_;
  Budget& budget_;
  Ledger& ledger_;
  std::unique_ptr<SegmentSource> source_;
};

}  // namespace tb
