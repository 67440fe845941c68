// VMM route: per-stream arenas of reserved virtual addresses, backed granule by
// granule with physical handles (cuMemCreate / cuMemMap / cuMemSetAccess).
//
// Note [Granule reuse before growth]
// Physical memory is what the budget counts, virtual addresses are nearly free. So
// an arena is one large reserved range per (pool, stream, small/large); blocks are
// carved from it by best fit and only the granules a live block touches need to be
// mapped. When a mapping needs physical handles and none are cached, granules lying
// wholly inside clean free blocks of the default pool (Note [Clean blocks]) are
// unmapped and their handles moved before any new physical memory is created. When
// free blocks of the allocating stream itself hold such granules but its queued work
// may still use them, the route asks for that stream to be synchronised (outside the
// lock; a cudaMalloc would wait for the device too) and the allocation is retried.
// It never waits for other streams: their cached granules come back under budget
// pressure, when the out-of-memory retry synchronises the device. Reserved memory
// then tracks live memory closely instead of the historical peak of each range.
// Graph pools are never a source: their free blocks may still be addressed by a
// captured graph.
//
// Note [Peer access to VMM memory]
// A mapping is accessible only to the devices named in cuMemSetAccess. Every
// mapping grants this device and every peer that torch enabled peer access for
// (enablePeerAccess); granting a new peer walks every arena of every pool this
// route backs and extends the mapped ranges, as torch's expandable segments do.
//
// Note [Run mappings]
// The driver's VMM calls cost per mapping, not per byte (measured on an H200, µs per
// 2 MiB): with 2 MiB handles, create 15 + map 4 + first cuMemSetAccess 41, unmap 26 +
// release 17; with one 64 MiB handle per mapping, about 3 µs per 2 MiB for all of it.
// Granule-sized handles are what lets any granule be reused on its own, so the
// allocation path keeps them; a restore (tag_sleep.h) maps each run of granules it
// needs with one handle, which makes it (and the next release) an order of magnitude
// cheaper. Such a run mapping is unmapped only as a whole: when reuse or trimming finds
// it entirely inside clean free blocks, when its tag is released, or when its segment
// is destroyed; its handle then goes straight back to the driver (a run handle is not
// granule-sized, so it is never cached).
//
// Accounting: a cached (unmapped) handle is charged to the large pool; mapping it
// into a small arena or a graph pool moves its bytes there (Budget::move).
#pragma once

#include <unordered_map>
#include <vector>

#include "block_cache.h"
#include "budget.h"
#include "driver.h"
#include "ipc.h"

namespace tb {

class VmmRoute final : public Backing {
 public:
  VmmRoute(const DeviceContext& ctx, Budget& budget, Ledger& ledger, size_t granule, size_t arena_bytes,
           bool reuse_before_grow);

  // Pools whose clean free granules may be remapped (the default VMM pool and the
  // tag pools; never a graph pool).
  void add_reuse_source(BlockPool* pool) { reuse_sources_.push_back(pool); }
  void set_reuse_before_grow(bool on) { reuse_ = on; }

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment& seg, uintptr_t ptr, size_t size) override;
  void release_cached(BlockPool& pool) override;
  bool destroy_segment(Segment& seg) override;
  bool grant_peer(int peer) override;

  size_t granule() const { return granule_; }
  // The mappings under [ptr, ptr + size) of `seg` as file descriptors, whole mappings:
  // *start is where the first begins (Note [Sharing memory between processes]).
  bool export_block(const Segment& seg, uintptr_t ptr, size_t size, std::vector<SharedPiece>* pieces,
                    uintptr_t* start);

  // For tag release / restore (tag_sleep.h). Maps granules `need` of `seg` (each
  // unmapped) with cached, reused or new memory; all or nothing.
  bool map_granules(Segment& seg, const std::vector<size_t>& need);
  // Maps granules [first, first + count) of `seg` (each unmapped) with one new handle
  // charged to the budget (Note [Run mappings]). false + error, nothing mapped.
  bool map_run(Segment& seg, size_t first, size_t count);
  // The first granule of the mapping that granule `index` (mapped) belongs to.
  static size_t mapping_head(const Segment& seg, size_t index);
  // Unmaps granule `index` and gives its memory back to the driver at once. false when
  // the unmap failed (still mapped); a refused release keeps the handle cached.
  bool drop_granule(Segment& seg, size_t index);
  // Unmaps up to `limit` granules lying wholly inside clean free blocks of `pool`
  // (kept as cached handles); returns how many.
  size_t unmap_clean_granules(BlockPool& pool, size_t limit);
  // Gives every cached handle back to the driver.
  void release_free_handles();

 private:
  static constexpr Placement kCached{kRouteVmm, false, false};
  Placement placement(const Segment& seg) const;
  // Handles for a mapping on `stream`: cached ones, then clean granules of free
  // blocks, then (once the allocating stream is synchronised) its own dirty ones,
  // then new memory within the budget.
  bool take_handles(size_t n, CUstream stream, std::vector<CUmemGenericAllocationHandle>* out);
  // Asks for `stream` to be synchronised when its free blocks hold mapped granules.
  bool request_sync(BlockPool& pool, CUstream stream);
  bool unmap_granule(Segment& seg, size_t index);
  // Unmaps the run mapping starting at `head` and releases its handle.
  bool release_run(Segment& seg, size_t head);
  bool unmap_range(uintptr_t va, size_t bytes);
  // cuMemRelease, closing the handle's exported descriptor once it is gone.
  CUresult release_handle(CUmemGenericAllocationHandle h);
  void traced(TraceAction action, const Segment& seg, uintptr_t va, size_t bytes) const;

  const DeviceContext& ctx_;
  Budget& budget_;
  Ledger& ledger_;
  const size_t granule_;
  const size_t arena_bytes_;
  bool reuse_;
  CUmemAllocationProp prop_{};
  std::vector<CUmemAccessDesc> access_;  // this device first, then peers
  std::vector<CUmemGenericAllocationHandle> free_handles_;  // created, unmapped, charged as kCached
  std::unordered_map<CUmemGenericAllocationHandle, int> fds_;  // exported descriptors, closed on release
  // Run handles the driver refused to release (unmapped, charged as kCached): retried.
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> stuck_runs_;
  std::vector<Segment*> arenas_;  // every arena of every pool this route backs
  std::vector<BlockPool*> reuse_sources_;
};

}  // namespace tb
