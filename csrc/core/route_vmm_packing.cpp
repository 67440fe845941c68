// The VMM route's packing (Note [Packing: reclaim before growth], route_vmm.h): which free
// mappings are clean, giving them back, moving their handles (Note [Moving handles]), and
// asking for a stream when the budget refuses.
#include <algorithm>

#include "error.h"
#include "route_vmm.h"

namespace tb {

namespace {

// Calls fn(block) for every free block of `pool` of at least `min` bytes, per stream
// from the largest down: the free sets order by (stream, size), so the many small free
// blocks are never visited.
template <typename Fn>
void for_each_large_free(const BlockPool& pool, size_t min, Fn fn) {
  for (bool small : {false, true}) {
    const FreeSet& fs = pool.free_set(small);
    Block key;
    for (auto it = fs.begin(); it != fs.end();) {
      key.stream = (*it)->stream;
      key.size = SIZE_MAX;
      key.ptr = UINTPTR_MAX;
      const auto stream_end = fs.upper_bound(&key);
      key.size = min;
      key.ptr = 0;
      const auto from = fs.lower_bound(&key);
      for (auto b = stream_end; b != from;) fn(*--b);
      it = stream_end;
    }
  }
}

}  // namespace

std::vector<size_t> VmmRoute::inside(const Block& b) const {
  const Segment& s = *b.segment;
  const size_t lo = (b.ptr - s.base + granule_ - 1) / granule_;
  const size_t hi = (b.ptr + b.size - s.base) / granule_;
  std::vector<size_t> heads;
  for (auto it = s.first_mapping(lo); it != s.maps.end() && it->first < hi; ++it)
    if (it->first >= lo && it->first + it->second <= hi) heads.push_back(it->first);
  return heads;
}

size_t VmmRoute::drop_inside(const Block& b, size_t want) {
  size_t bytes = 0;
  const std::vector<size_t> heads = inside(b);
  // From the high end down: what stays mapped is the block's front, in one piece, where
  // the next fitting request is placed.
  for (auto it = heads.rbegin(); it != heads.rend() && bytes < want; ++it) {
    // What went back to the driver, or is kept to move (Note [Moving handles]).
    const int64_t before = budget_.reserved() - static_cast<int64_t>(moving_bytes_);
    if (drop_granule(*b.segment, *it))
      bytes += static_cast<size_t>(before - (budget_.reserved() - static_cast<int64_t>(moving_bytes_)));
  }
  return bytes;
}

void VmmRoute::clean_free(const BlockPool& pool, std::vector<const Block*>* out) const {
  for_each_large_free(pool, granule_, [&](const Block* b) {
    if (clock_.clean(b->stream, b->freed_at)) out->push_back(b);
  });
}

size_t VmmRoute::reclaim(size_t want) {
  if (reuse_sources_.empty()) return 0;
  clock_.refresh();
  std::vector<const Block*> blocks;
  for (BlockPool* source : reuse_sources_) {
    source->merge_clean();
    clean_free(*source, &blocks);
  }
  std::sort(blocks.begin(), blocks.end(), [](const Block* a, const Block* b) { return a->size > b->size; });
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return 0;
  size_t got = 0;
  for (const Block* b : blocks) {
    if (got >= want) break;
    got += drop_inside(*b, want - got);
  }
  if (got > 0) bump(ledger_.num_reclaims);
  return got;
}

size_t VmmRoute::release_clean(BlockPool& pool) {
  clock_.refresh();
  pool.merge_clean();
  std::vector<const Block*> blocks;
  clean_free(pool, &blocks);
  size_t got = 0;
  for (const Block* b : blocks) got += drop_inside(*b, SIZE_MAX);
  return got;
}

bool VmmRoute::request_sync(BlockPool& pool, CUstream stream) {
  bool asked = false;
  for_each_large_free(pool, granule_, [&](const Block* b) {
    if (asked || b->stream != stream || clock_.clean(b->stream, b->freed_at) || inside(*b).empty()) return;
    clock_.request(stream);
    asked = true;
  });
  return asked;
}

bool VmmRoute::keep_for_move(const Segment& seg, CUmemGenericAllocationHandle h, size_t count) {
  if (!keep_moving_ || fds_.count(h) != 0) return false;  // a shared handle may still be mapped elsewhere
  budget_.move(count * granule_, placement(seg), kCached);
  moving_.emplace_back(h, count);
  moving_bytes_ += count * granule_;
  return true;
}

bool VmmRoute::map_moved(Segment& seg, size_t first, size_t room, size_t* mapped) {
  *mapped = 0;
  size_t pick = moving_.size();
  for (size_t i = 0; i < moving_.size() && pick == moving_.size(); ++i)
    if (moving_[i].second == room) pick = i;
  if (pick == moving_.size()) return true;
  const auto [h, count] = moving_[pick];
  const uintptr_t va = seg.base + first * granule_;
  const size_t bytes = count * granule_;
  const CUresult r = driver()->memMap(va, bytes, 0, h, 0);
  if (r != CUDA_SUCCESS) return fail_driver(r, "cuMemMap", __FILE__, __LINE__);  // still kept: released later
  moving_.erase(moving_.begin() + static_cast<long>(pick));
  moving_bytes_ -= bytes;
  note_map(seg, first, count, h);
  budget_.move(bytes, kCached, placement(seg));
  const CUresult a = driver()->memSetAccess(va, bytes, access_.data(), access_.size());
  if (a != CUDA_SUCCESS) {
    fail_driver(a, "cuMemSetAccess", __FILE__, __LINE__);
    const std::string msg = last_error_message();
    undo_mapping(seg, first);  // a refused unmap leaves it mapped and counted in the segment
    set_error(kDriverError, msg);
    return false;
  }
  bump(ledger_.num_moves);
  traced(TraceAction::kSegmentMap, seg, va, bytes);
  *mapped = count;
  return true;
}

void VmmRoute::release_kept(CUmemGenericAllocationHandle h, size_t count) {
  moving_bytes_ -= count * granule_;
  if (release_handle(h) != CUDA_SUCCESS) {
    stuck_runs_.emplace_back(h, count * granule_);  // still charged as cached: retried later
    return;
  }
  budget_.uncharge(count * granule_, kCached);
  bump(ledger_.num_device_free);
}

void VmmRoute::release_unmatched(const std::vector<std::pair<size_t, size_t>>& runs, size_t from) {
  std::vector<size_t> lengths;  // of the runs still to map, each taken by at most one kept handle
  for (size_t k = from; k < runs.size(); ++k) lengths.push_back(runs[k].second);
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> kept;
  for (const auto& [h, count] : moving_) {
    auto it = std::find(lengths.begin(), lengths.end(), count);
    if (it != lengths.end()) {
      lengths.erase(it);
      kept.emplace_back(h, count);
    } else {
      release_kept(h, count);
    }
  }
  moving_.swap(kept);
}

void VmmRoute::release_moving() {
  for (const auto& [h, count] : moving_) release_kept(h, count);
  moving_.clear();
  moving_bytes_ = 0;
}

}  // namespace tb
