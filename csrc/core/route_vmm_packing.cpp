// The VMM route's packing (Note [Packing: reclaim before growth], route_vmm.h): which free
// mappings are clean, giving them back, and asking for a stream when the budget refuses.
#include <algorithm>

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
  for (auto it = first_mapping(s, lo); it != s.maps.end() && it->first < hi; ++it)
    if (it->first >= lo && it->first + it->second <= hi) heads.push_back(it->first);
  return heads;
}

size_t VmmRoute::drop_inside(const Block& b, size_t want) {
  size_t bytes = 0;
  const std::vector<size_t> heads = inside(b);
  // From the high end down: what stays mapped is the block's front, in one piece, where
  // the next fitting request is placed.
  for (auto it = heads.rbegin(); it != heads.rend() && bytes < want; ++it) {
    const int64_t before = budget_.reserved();
    if (drop_granule(*b.segment, *it)) bytes += static_cast<size_t>(before - budget_.reserved());
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
  for (BlockPool* source : reuse_sources_) clean_free(*source, &blocks);
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

}  // namespace tb
