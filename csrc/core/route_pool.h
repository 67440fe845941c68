// Stream-ordered pool route: cuMemAllocFromPoolAsync / cuMemFreeAsync on a memory
// pool owned by torch_budget, behind the same Backing interface as the other
// routes: every allocation is a segment of its own, given back to the pool (a
// stream-ordered free on its stream) as soon as its block is freed.
//
// Note [Stream-ordered frees]
// A free here is a point on the block's stream: the pool may hand the memory out
// again to work ordered after that point. Streams recorded with record_stream are
// handled like on every route: the free waits for an event on each of them (Note
// [Stream-ordered reuse]). The pool caches freed memory itself (release threshold =
// max); its reserved figure, read from a pool attribute without synchronising, is
// what the ledger charges. Releasing the cache frees no idle segment while a capture is open
// on this device (torch begins allocating to the graph's pool before its stream captures, so
// no stream can be asked), and, while one is open on another device, none whose stream
// captures (or may: the driver cannot say): its free would become a node of that graph.
// Trimming the pool is not stream-ordered and runs.
//
// Note [Allocating beside a capture]
// A stream of this device may capture while this device has no capture of its own: it joined
// a capture begun on another device (an event fork). A stream-ordered allocation on it would
// become an allocation node of that graph, valid only while the graph runs, and be handed out
// as ordinary memory. So the allocation is ordered on a stream of the route's own, which never
// captures, and waited for: the memory is then usable on any stream, the caller's included,
// and its segment belongs to the caller's stream as any other. The wait is rare (a growth
// while such a capture is open) and runs in relaxed capture mode (DeviceAllocator::attempt).
// A later free of the block on the capturing stream waits for the captures to close (Note
// [Stream-ordered frees]).
//
// Note [Pool growth and the budget]
// The driver grows a pool in chunks, so one allocation can add more reserved
// memory than it asked for. The route checks the request, rounded up to the
// granularity the pool has grown by so far, before asking, reads the pool's reserved figure after, and when the
// growth does not fit the budget it frees the allocation and trims the pool back
// before failing; whatever the driver still holds is charged, never hidden.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>

#include "block_cache.h"
#include "budget.h"
#include "driver.h"

namespace tb {

class PoolRoute final : public Backing {
 public:
  // `open_captures`: how many captures are open in the process (Note [Stream-ordered frees]).
  PoolRoute(const DeviceContext& ctx, Budget& budget, Ledger& ledger, const std::atomic<int>& open_captures)
      : ctx_(ctx), budget_(budget), ledger_(ledger), open_captures_(open_captures) {}
  // Creates the pool; false + error when the driver cannot (the route is then unavailable).
  bool init();
  bool available() const { return pool_ != nullptr; }

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  bool ensure_backed(Segment&, uintptr_t, size_t) override { return true; }
  void release_cached(BlockPool& pool) override { release_cached(pool, false); }
  // `device_captures`: a capture is open on this device, its stream perhaps not capturing yet.
  void release_cached(BlockPool& pool, bool device_captures);
  bool destroy_segment(Segment& seg) override;
  bool release_on_free() const override { return true; }
  bool grant_peer(int peer) override;

 private:
  bool reserved(size_t* out) const;
  bool used(size_t* out) const;
  // Brings the ledger to the pool's reserved figure `now`.
  void settle(size_t now, bool small);

  const DeviceContext& ctx_;
  Budget& budget_;
  Ledger& ledger_;
  const std::atomic<int>& open_captures_;
  CUmemoryPool pool_ = nullptr;
  CUstream side_ = nullptr;  // Note [Allocating beside a capture]; kept for the process, as the pool
  size_t seen_small_ = 0;  // reserved bytes charged, by the kind of request that grew the pool
  size_t seen_large_ = 0;
  size_t chunk_ = 0;  // granularity of the pool's growth so far (gcd of the growths seen)
};

}  // namespace tb
