// VMM route: per-stream arenas of reserved virtual addresses, backed granule by
// granule with physical handles (cuMemCreate / cuMemMap / cuMemSetAccess).
//
// Note [Granule reuse before growth]
// Physical memory is what the budget counts, virtual addresses are nearly free. So
// an arena is one large reserved range per (pool, stream, small/large); blocks are
// carved from it by best fit and only the granules a live block touches need to be
// mapped. When a mapping needs physical handles and none are cached, granules lying
// wholly inside free blocks of the default pool are unmapped and their handles moved
// (after synchronising the stream that last used them) before any new physical
// memory is created. Reserved memory then tracks live memory closely instead of the
// historical peak of each address range. Graph pools are never a source: their free
// blocks may still be addressed by a captured graph.
#pragma once

#include <vector>

#include "block_cache.h"

namespace tb {

class DeviceAllocator;

class VmmRoute final : public Backing {
 public:
  VmmRoute(DeviceAllocator& dev, size_t granule, size_t arena_bytes, bool reuse_before_grow);
  ~VmmRoute() override;

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment& seg, uintptr_t ptr, size_t size) override;
  size_t release_cached(BlockPool& pool) override;
  void destroy_segment(Segment& seg) override;

  size_t granule() const { return granule_; }
  size_t cached_handles() const { return free_handles_.size(); }
  // Releases every cached (unmapped) handle; returns bytes released.
  size_t release_free_handles();

 private:
  bool take_handles(size_t n, std::vector<CUmemGenericAllocationHandle>* out);
  // Unmaps up to `n` granules lying wholly inside free blocks of the default pool.
  size_t steal(size_t n);
  size_t unmap_free_granules(BlockPool& pool, size_t limit, bool sync_streams);
  bool unmap_granule(Segment& seg, size_t index);

  DeviceAllocator& dev_;
  size_t granule_;
  size_t arena_bytes_;
  bool reuse_before_grow_;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::vector<CUmemGenericAllocationHandle> free_handles_;  // created, unmapped, counted as reserved
};

}  // namespace tb
