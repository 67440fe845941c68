// Segments from an allocator the user gave a private pool (torch.cuda.MemPool(allocator=...),
// e.g. NCCL's ncclMemAlloc for buffers it registers): the pool's blocks are cut from
// them like any segment, and each is charged to the budget and the ledger (as the
// synchronous route: the memory is not ours to map or trim).
//
// The user's free may wait for the device (one built on cudaFree does) or for Python's GIL (a
// pluggable allocator written in Python), so it never runs under the device lock: a segment
// being given back is detached from its pool (still charged) into UserFrees, and the device
// allocator frees it with its lock released, then uncharges it (free_detached), as the sync
// route does with cuMemFree. The entry keeps the allocator alive: its pool may be gone by then.
#pragma once

#include <memory>
#include <vector>

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

// A segment waiting for its allocator's free (lock rule: the owning device's lock guards the list).
struct UserFree {
  std::shared_ptr<SegmentSource> source;
  CUdeviceptr base;
  size_t size;
  bool small;
};
using UserFrees = std::vector<UserFree>;

class UserRoute final : public Backing {
 public:
  UserRoute(int device, Budget& budget, Ledger& ledger, UserFrees& frees, std::unique_ptr<SegmentSource> source)
      : device_(device), budget_(budget), ledger_(ledger), frees_(frees), source_(std::move(source)) {}

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment&, uintptr_t, size_t) override { return true; }
  void release_cached(BlockPool& pool) override;
  bool destroy_segment(Segment& seg) override;

 private:
  int device_;
  Budget& budget_;
  Ledger& ledger_;
  UserFrees& frees_;
  std::shared_ptr<SegmentSource> source_;
};

}  // namespace tb
