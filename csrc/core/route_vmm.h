// VMM route: per-stream arenas of reserved virtual addresses, backed granule by
// granule with physical handles (cuMemCreate / cuMemMap / cuMemSetAccess).
//
// Note [Packing: reclaim before growth]
// Physical memory is what the budget counts, virtual addresses are nearly free. So
// an arena is one large reserved range per (pool, stream, small/large); blocks are
// carved from it by best fit and only the granules a live block touches need to be
// mapped (Note [Placement by mapped memory], block_cache.h). Mapping costs per
// mapping, not per byte (Note [Run mappings]), so missing granules are mapped in runs
// of up to map_run bytes with one handle each. The price: a run goes back only whole,
// so one whose memory is partly live and partly free holds the free part until its
// live blocks go.
// Reserved memory is kept within 2 % of the highest live total the device has seen
// since torch's reset_peak_memory_stats (its high-water mark): an allocation whose new
// mappings would pass that line first gives back mappings lying wholly inside clean free
// blocks of the default and tag pools, the largest blocks first, each from its high end and
// only as much as the line needs (the block's front stays mapped for the next request that
// fits it; giving back whole blocks made the next large request map them again: on the
// serving-like mix over the host stand-in, 278 mappings per 100k operations instead of 29).
// Only clean blocks count (Note [Clean blocks]): the clock learns which are clean from
// events it records as frees happen, never by waiting, so when none is clean the
// allocation grows past the line instead; and moves spend a budget of time (Note [Packing
// time], packing_time.h), without which it grows too. It waits for a stream only when the
// budget itself refuses the new memory: then clean memory goes back first, and if that is
// not enough, the allocating stream is synchronised when its free blocks hold mappings,
// and the allocation retried. Graph pools are never a source: their free blocks may still
// be addressed by a captured graph.
// With reuse_before_grow off, nothing is given back before the budget refuses.
// The line sits a granule below 2 % (never below the mark itself in whole granules): a new
// mapping passes it by up to a granule, so it is where the peak stays within 2 %. Over the host
// stand-in (tools/sim_alloc.py) the serving-like mix peaked at 1.021 with the line at 2 % and
// 1.020 a granule below, with mappings per thousand operations 7.08 -> 7.12 (llama_generate
// 0.41 -> 0.48). Slack is what the recorded traces' steady state trades against moves: with the
// line a granule above 2 %, decode_graphs' last pass maps 0.44 per thousand operations instead of
// 0.89, at 1.021 of peak live instead of 1.013 (llama_generate 1.019 instead of 1.013); its steady
// state moves a 16 MiB run for two small-pool pages each pass while 62 MiB of the large pool is
// free but mapped, and needs 1.021 to move nothing.
//
// Note [Peer access to VMM memory]
// A mapping is accessible only to the devices named in cuMemSetAccess. Every
// mapping grants this device and every peer that torch enabled peer access for
// (enablePeerAccess); granting a new peer walks every arena of every pool this
// route backs and extends the mapped ranges, as torch's expandable segments do. The
// mappings of other processes' VMM memory that the device opened (a consumer's shared
// tensors, Note [Sharing memory between processes]) are extended too, as torch's
// enablePeerAccess extends the expandable segments it opened: those opened before the
// grant were reachable by their own device alone (DeviceAllocator::grant_peer).
//
// Note [Run mappings]
// The driver's VMM calls cost per mapping, not per byte (measured on an H200, µs per
// call with 2 MiB handles: create 8.6, map 2.1, cuMemSetAccess 22 -- 20 per mapping
// when one call covers many --, unmap 14, release 10; a whole mapping's life about
// 50 us plus 2 us per MiB; cuMemMap cannot map part of a handle). So the allocation path
// maps each run of missing granules with one handle of up to map_run bytes (16 MiB by
// default), and a restore (tag_sleep.h) maps each run it needs with one handle. With
// partial reclaims, runs of 64 MiB pack the serving-like mix and the recorded traces as
// tightly (peak reserved / peak live 1.018 against 1.020 over the host stand-in) with a third
// of the mappings, and large churn runs faster (lognormal mix 1.6x native against 2.2x on an
// H200 with packing unbounded in time); but what a shrinking workspace or an emptied
// untagged region leaves partly live in a run stays: on an H200 a workspace shrinking by
// 496 MiB gave back 448 MiB with 64 MiB runs, all of it with 16 MiB. So 16 MiB stays the
// default and packing time bounds the churn (Note [Packing time]). A run mapping is unmapped only as a whole:
// when packing or trimming finds it entirely inside clean free blocks, when its tag is
// released, or when its segment is destroyed; its handle then goes straight back to the
// driver (a run handle is not granule-sized, so it is never cached).
//
// Note [Moving handles]
// A packing move gives back mappings of clean free blocks and maps new memory elsewhere. The
// handles it unmaps are kept for that new mapping instead of being released and created again
// (on an H200 an unmap + map + access of a kept handle took 41 us; a mapping's whole life with
// a create and a release about 50 us plus 2 us per MiB): each run of the new mapping takes a
// kept handle of exactly its length (a shorter one would split the run into more mappings,
// which cost more than the create they save), new memory the rest. Kept handles no later run
// can take go back to the driver before new memory is made for a run, so the device never
// holds both: they did go back only once the allocation was backed, and that brief overlap set
// the peak a granule or more above what the moves kept it to (decode_graphs and llama_generate
// over the host stand-in: 1.021 and 1.024 of peak live, 1.013 and 1.013 with this order). What
// no run took goes back when the allocation is backed, or at once when new memory for a run is
// refused, by the budget or by the card, while they wait. Over the host stand-in with an H200's call
// costs, unbounded lognormal churn ran 12 % faster (about 900 moved mappings in 40k operations). A shared handle (exported to another process, which may still map it)
// is never kept. ledger's num_moves counts the mappings made this way.
//
// Note [Half-granule requests]
// torch serves requests up to 1 MiB from small segments. On this route a small arena is mapped
// granule by granule (2 MiB), so two 1 MiB requests fill a granule and a third needs a new one,
// while the large arena often holds mapped clean free memory that would serve them without a
// mapping. Over the host stand-in, decode_graphs' steady state (two short-lived 1 MiB requests
// per step at the packing line) moved a 16 MiB run each pass for them: 0.89 mappings per thousand
// operations in its last pass. So this route serves requests of exactly 1 MiB from the large
// arena (small_max() is 1 MiB less one block), where they fit into what larger blocks left,
// and a large free block splits off remainders from 1 MiB up. torch's stats still count them in
// small_pool (Block::small_request); only reserved memory counts where it lies.
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
#include "packing_time.h"

namespace tb {

class VmmRoute final : public Backing {
 public:
  // Bytes a new mapping of the allocation path spans at most, by default (Note [Run mappings]).
  static constexpr size_t kDefaultRunBytes = 16 << 20;
  // Ranges up to this many granules are checked granule by granule (unbacked()).
  static constexpr size_t kScanGranules = 128;

  VmmRoute(const DeviceContext& ctx, Budget& budget, Ledger& ledger, StreamClock& clock, size_t granule,
           size_t arena_bytes, bool reuse_before_grow);

  // Pools whose clean free mappings may be given back for packing (the default VMM
  // pool and the tag pools; never a graph pool).
  void add_reuse_source(BlockPool* pool) { reuse_sources_.push_back(pool); }
  void set_reuse_before_grow(bool on) { reuse_ = on; }
  bool reuse_before_grow() const { return reuse_; }
  // Note [Packing time]: the share of wall-clock time moves may take.
  void set_packing_time(double share) { packing_.set_share(share); }
  void packing_idle() { packing_.idle(); }
  void packing_refill() { packing_.refill(); }
  // At least one granule.
  void set_max_run(size_t bytes) { max_run_ = std::max<size_t>(1, bytes / granule_); }

  bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) override;
  // Note [Half-granule requests].
  size_t small_max() const override { return kSmallSize - kMinBlockSize; }
  // A pool that never splits gets blocks of whole granules: no two of its blocks share one.
  size_t whole_block(size_t rounded) const override { return (rounded + granule_ - 1) / granule_ * granule_; }
  bool ensure_backed(Segment& seg, uintptr_t ptr, size_t size) override;
  void release_cached(BlockPool& pool) override;
  bool destroy_segment(Segment& seg) override;
  bool grant_peer(int peer) override;
  size_t unbacked(const Segment& seg, uintptr_t ptr, size_t size) const override;
  size_t usable(const Block& b) const override;

  size_t granule() const { return granule_; }
  // torch's reset_peak_memory_stats: the high-water mark starts again from what is live.
  void reset_high_water(size_t live) { high_water_ = live; }
  // Note [Sharing run mappings] (route_vmm_share.cpp): what exporting [ptr, ptr + size) of a
  // segment takes.
  struct ShareCut {
    size_t piece = 0;           // granules of each exported handle
    size_t lo = 0, hi = 0;      // the exported handles cover granules [lo, hi)
    std::vector<size_t> recut;  // heads of the mappings to map again with handles of `piece` first
    uint64_t unmaps = 0;        // the segment's Segment::unmaps then: its mappings are as planned while equal
  };
  // A mapping's new handles mapped at a scratch range, the copy of its contents queued; charged
  // to the budget until committed or dropped.
  struct StagedCut {
    size_t head = 0, count = 0, piece = 0;  // the mapping (granules) and its new handles' length
    CUmemGenericAllocationHandle old = 0;
    CUdeviceptr scratch = 0;
    size_t at_scratch = 0;  // bytes of new handles mapped at scratch
    std::vector<CUmemGenericAllocationHandle> handles;
    Placement placement{};  // kept: the segment may be gone when it is dropped
    bool charged = false;   // anything staged at all
  };
  // The handle size and the mappings to cut for sharing [ptr, ptr + size) of `seg`. false +
  // error where it cannot be shared in torch's format.
  bool plan_share(const Segment& seg, uintptr_t ptr, size_t size, ShareCut* out) const;
  // Stages mapping `head` of `seg` for a cut into handles of `piece` granules. false + error,
  // nothing staged. The device must be synchronised before (nothing still writes the old
  // memory) and after (the copy is done), with the segment's mappings unchanged, to commit.
  bool stage_cut(Segment& seg, size_t head, size_t piece, StagedCut* st);
  // The staged handles take the old mapping's place, which is released. false + error, the
  // mapping as it was and what was staged dropped.
  bool commit_cut(Segment& seg, StagedCut* st);
  // Gives back whatever `st` staged (nothing when it is empty); what the driver refuses to let
  // go stays charged as kCached and is retried by release_free_handles (stuck_scratch_).
  void drop_staged(StagedCut* st);
  // Whether the mapping a staged cut would replace was exported meanwhile (another thread
  // shared a block on it while this one waited): then it must stay as it is.
  bool staged_exported(const StagedCut& st) const { return st.charged && fds_.count(st.old) != 0; }
  // The mappings under [ptr, ptr + size) of `seg`, cut to one size first (plan_share), as file
  // descriptors of handles of that size, *handle_bytes, only those holding part of the range:
  // *start is where the first begins (Note [Sharing memory between processes], ipc.h). false +
  // error, nothing exported.
  bool export_block(Segment& seg, uintptr_t ptr, size_t size, std::vector<int>* fds, size_t* handle_bytes,
                    uintptr_t* start);

  // For tag release / restore (tag_sleep.h). Maps granules `need` of `seg` (each
  // unmapped) with cached, reused or new memory; all or nothing.
  bool map_granules(Segment& seg, const std::vector<size_t>& need);
  // Maps granules [first, first + count) of `seg` (each unmapped) with one new handle
  // charged to the budget (Note [Run mappings]). false + error, nothing mapped.
  bool map_run(Segment& seg, size_t first, size_t count);
  // Note [Unreachable mappings]: sets the access of every listed mapping over granules
  // [first, last] of `seg`, taking each off the list; false + error while one stays refused.
  bool reach(Segment& seg, size_t first, size_t last);
  // The first granule of the mapping that granule `index` (mapped) belongs to.
  static size_t mapping_head(const Segment& seg, size_t index);
  // Unmaps granule `index` and gives its memory back to the driver at once. false when
  // the unmap failed (still mapped); a refused release keeps the handle (park_handle).
  bool drop_granule(Segment& seg, size_t index);
  // Gives back every mapping lying wholly inside clean free blocks of `pool`; returns
  // the bytes that went back to the driver.
  size_t release_clean(BlockPool& pool);
  // Gives every cached handle back to the driver.
  void release_free_handles();

 private:
  static constexpr Placement kCached{kRouteVmm, false, false};
  Placement placement(const Segment& seg) const;
  // Gives an unmapped handle of `bytes`, charged at `where`, back to the driver; one the driver
  // refuses stays charged (as cached) and is retried later.
  void give_back_handle(CUmemGenericAllocationHandle h, size_t bytes, const Placement& where);
  // Handles for a mapping: cached ones, then new memory within the budget (after
  // giving clean free mappings back when the budget refuses).
  bool take_handles(size_t n, std::vector<CUmemGenericAllocationHandle>* out);
  // Note [Packing: reclaim before growth]: the reserved bytes the device may hold
  // before new mappings first give clean free ones back.
  // A granule below 2 % past the high-water mark, since a mapping passes the line by up to a
  // granule; never below the mark in whole granules.
  int64_t allowance() const {
    const size_t whole = (high_water_ + granule_ - 1) / granule_ * granule_;
    return static_cast<int64_t>(std::max(whole, high_water_ + high_water_ / 50 - std::min(granule_, high_water_ / 50)));
  }
  // Gives back clean free mappings of the reuse sources, the largest free blocks first,
  // from the high end of each, until at least `want` bytes went back or none is left;
  // returns the bytes.
  size_t reclaim(size_t want);
  // Maps each run (first granule, count) of `seg` (each unmapped) with one mapping; under
  // budget refusal gives clean memory back and retries, then asks for the allocating stream.
  bool map_missing(Segment& seg, const std::vector<std::pair<size_t, size_t>>& runs);
  // Asks for `stream` to be synchronised when its free blocks hold mappings.
  bool request_sync(BlockPool& pool, CUstream stream);
  // The first granules of the mappings lying wholly inside free block `b`.
  std::vector<size_t> inside(const Block& b) const;
  // Gives back mappings lying wholly inside free block `b`, its highest first, until at
  // least `want` bytes went back or none is left; returns the bytes.
  size_t drop_inside(const Block& b, size_t want);
  // Appends the clean free blocks of `pool` that can hold a whole granule.
  void clean_free(const BlockPool& pool, std::vector<const Block*>* out) const;
  // Note [Moving handles]: during a packing reclaim, keeps the handle of a mapping just unmapped
  // (`count` granules, from `seg`) for the mapping that follows, instead of releasing it;
  // false when it is not kept (not packing, or the handle was shared).
  bool keep_for_move(const Segment& seg, CUmemGenericAllocationHandle h, size_t count);
  // Maps a kept handle of exactly `room` granules at granule `first` of `seg`; *mapped: the
  // granules mapped (0: none has that length). false + error when the driver refused.
  bool map_moved(Segment& seg, size_t first, size_t room, size_t* mapped);
  // Gives the kept handles no mapping took back to the driver.
  void release_moving();
  // Gives back the kept handles whose length no run of runs[from...] has (one handle per run).
  void release_unmatched(const std::vector<std::pair<size_t, size_t>>& runs, size_t from);
  // Gives kept handle `h` (`count` granules) back to the driver; one it refuses stays charged.
  void release_kept(CUmemGenericAllocationHandle h, size_t count);
  // Bookkeeping of one mapping of handle `h`, `count` granules at `head`: the segment's
  // granules, span and maps change only here, together (Segment::granules).
  void note_map(Segment& seg, size_t head, size_t count, CUmemGenericAllocationHandle h);
  void note_unmap(Segment& seg, size_t head);
  bool unmap_granule(Segment& seg, size_t index);
  // Note [Unreachable mappings] (route_vmm_reach.cpp): undoes the mapping at `head` of an
  // allocation that failed; true when it is unmapped, false when it stays (reachable if its
  // access could be set, listed in unreachable_ if not).
  bool undo_mapping(Segment& seg, size_t head);
  // Granules in [first, last] of `seg` under a listed mapping; reach() sets their access,
  // taking each off the list; false + error while one in the range stays refused.
  size_t unreachable_in(const Segment& seg, size_t first, size_t last) const;
  // cuMemSetAccess over the mapping at `head` for every device, retried as retry_driver does.
  CUresult set_access(const Segment& seg, size_t head);
  // Keeps the unmapped one-granule handle `h`, charged as kCached: cached for a new mapping,
  // or, once exported, only until the driver releases it (stuck_runs_).
  void park_handle(CUmemGenericAllocationHandle h);
  // Unmaps the run mapping starting at `head` and releases its handle.
  bool release_run(Segment& seg, size_t head);
  bool unmap_range(uintptr_t va, size_t bytes);
  // cuMemRelease, closing the handle's exported descriptor once it is gone.
  CUresult release_handle(CUmemGenericAllocationHandle h);
  void traced(TraceAction action, const Segment& seg, uintptr_t va, size_t bytes) const;

  const DeviceContext& ctx_;
  Budget& budget_;
  Ledger& ledger_;
  StreamClock& clock_;
  const size_t granule_;
  const size_t arena_bytes_;
  bool reuse_;
  CUmemAllocationProp prop_{};
  std::vector<CUmemAccessDesc> access_;  // this device first, then peers
  std::vector<CUmemGenericAllocationHandle> free_handles_;  // created, unmapped, charged as kCached; never exported
  // Exported descriptors, closed on release. An exported handle is never mapped again once
  // unmapped: never cached, never kept for a move (Note [Sharing run mappings]).
  std::unordered_map<CUmemGenericAllocationHandle, int> fds_;
  // Run handles the driver refused to release (unmapped, charged as kCached): retried.
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> stuck_runs_;
  // A staged cut's scratch range (Note [Sharing run mappings]) on its way back to the driver:
  // unmapped (`mapped` bytes from va), its handles released, its addresses freed, in that order.
  // Its handles stay charged as kCached until released: a range still mapped holds their memory.
  struct Scratch {
    CUdeviceptr va = 0;
    size_t reserved = 0, mapped = 0, piece_bytes = 0;
    std::vector<CUmemGenericAllocationHandle> handles;
  };
  // Takes `s` as far back to the driver as the driver lets it; true once nothing of it is left.
  bool give_back_scratch(Scratch& s);
  // Scratch ranges the driver refused to unmap or free: retried by release_free_handles.
  std::vector<Scratch> stuck_scratch_;
  // Note [Unreachable mappings]: (segment, head) of mappings left without access.
  std::vector<std::pair<const Segment*, size_t>> unreachable_;
  std::vector<Segment*> arenas_;  // every arena of every pool this route backs
  std::vector<BlockPool*> reuse_sources_;
  size_t max_run_ = 1;     // granules
  size_t high_water_ = 0;  // the most bytes allocated at once on the device (Note [Packing: ...])
  PackingTime packing_;
  // Note [Moving handles]: handles a packing reclaim unmapped, with their granules (unmapped,
  // charged as kCached), kept while keep_moving_ for the mapping that follows and released when
  // that allocation is backed; moving_bytes_ is their total.
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> moving_;
  size_t moving_bytes_ = 0;
  bool keep_moving_ = false;
};

}  // namespace tb
