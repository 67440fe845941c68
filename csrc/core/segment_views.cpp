#include "segment_views.h"

#include <algorithm>

namespace tb {

std::vector<SegmentView> describe_segments(const std::vector<std::pair<const BlockPool*, PoolId>>& pools,
                                           size_t granule, bool runs) {
  std::vector<SegmentView> out;
  auto visit = [&](const BlockPool* pool, const PoolId& id) {
    if (pool == nullptr) return;
    for (const auto& seg : pool->segments()) {
      SegmentView v{};
      v.base = seg->base;
      v.size = seg->size;
      v.stream = seg->stream;
      v.small = seg->small;
      v.route = seg->route;
      v.pool = id;
      v.mapped = seg->route == kRouteVmm ? seg->mapped * granule : seg->size;
      if (runs && seg->route == kRouteVmm) {
        const size_t g = granule;
        for (const auto& [head, count] : seg->maps) {
          const uintptr_t at = seg->base + head * g;
          if (!v.runs.empty() && v.runs.back().first + v.runs.back().second == at) v.runs.back().second += count * g;
          else v.runs.emplace_back(at, count * g);
        }
      }
      for (const Block* b = seg->head; b; b = b->next) {
        const int state = b->allocated ? 1 : (b->pending > 0 ? 2 : 0);
        if (b->allocated) {
          v.allocated += b->size;
          v.requested += b->requested;
        }
        if (state != 0) v.active += b->size;
        v.blocks.push_back({b->size, b->requested, state, b->ptr, b->tag});
      }
      out.push_back(std::move(v));
    }
  };
  for (const auto& [pool, id] : pools) visit(pool, id);
  return out;
}

std::vector<SegmentView> split_at_mappings(std::vector<SegmentView> all) {
  std::vector<SegmentView> out;
  for (SegmentView& v : all) {
    if (v.route != kRouteVmm) {
      out.push_back(std::move(v));
      continue;
    }
    for (const auto& [start, bytes] : v.runs) {
      SegmentView r = v;
      r.base = start;
      r.size = r.mapped = bytes;
      r.allocated = r.requested = r.active = 0;
      r.blocks.clear();
      r.runs.clear();
      for (const SegmentView::BlockView& b : v.blocks) {
        const uintptr_t lo = std::max(b.ptr, start), hi = std::min(b.ptr + b.size, start + bytes);
        if (lo >= hi) continue;
        SegmentView::BlockView piece = b;
        piece.ptr = lo;
        piece.size = hi - lo;
        if (b.state == 1) {
          r.allocated += piece.size;
          r.requested += b.requested;
        }
        if (b.state != 0) r.active += piece.size;
        r.blocks.push_back(piece);
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

namespace {

// The bytes of free block `b` that memory backs: all of it, or in a VMM arena the part on
// mapped granules (an arena's unmapped tail is a free block too, and most of the card).
size_t backed_bytes(const Block* b) {
  const Segment& s = *b->segment;
  if (s.granules.empty()) return b->size;
  const size_t g = s.size / s.granules.size();
  const uintptr_t lo = b->ptr, hi = b->ptr + b->size;
  size_t out = 0;
  for (auto it = s.first_mapping((lo - s.base) / g); it != s.maps.end() && s.base + it->first * g < hi; ++it) {
    const uintptr_t from = std::max(lo, s.base + it->first * g);
    const uintptr_t to = std::min(hi, s.base + (it->first + it->second) * g);
    if (from < to) out += to - from;
  }
  return out;
}

}  // namespace

void count_inactive_split(const std::vector<const BlockPool*>& pools, int64_t count[kPoolKinds],
                          int64_t bytes[kPoolKinds]) {
  for (int k = 0; k < kPoolKinds; ++k) count[k] = bytes[k] = 0;
  auto visit = [&](const BlockPool* pool) {
    if (pool == nullptr) return;
    for (bool small : {true, false})
      for (const Block* b : pool->free_set(small))
        if (b->segment->live > 0)
          if (const size_t held = backed_bytes(b); held > 0)
            for (int k : {static_cast<int>(kAggregate), static_cast<int>(small ? kSmallPool : kLargePool)}) {
              ++count[k];
              bytes[k] += static_cast<int64_t>(held);
            }
  };
  for (const BlockPool* p : pools) visit(p);
}

}  // namespace tb
