// What the allocator shows of its segments: torch's snapshot, cacheInfo's neighbours and
// inactive_split. Read-only walks over block pools, run by the owner under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "block_cache.h"
#include "ledger.h"

namespace tb {

struct SegmentView {
  uintptr_t base;
  size_t size;
  size_t allocated;
  size_t requested;
  size_t active;
  size_t mapped;  // bytes actually backed (VMM); == size otherwise
  CUstream stream;
  bool small;
  int route;
  PoolId pool;  // {0,0} for the default pools
  struct BlockView {
    size_t size;
    size_t requested;
    int state;  // 0 free, 1 allocated, 2 waiting on recorded streams
    uintptr_t ptr;
    int tag;
  };
  std::vector<BlockView> blocks;
  std::vector<std::pair<uintptr_t, size_t>> runs;  // VMM, when asked for: mapped address ranges, in order
};

// One view per segment of `pools` (each with the pool id it belongs to); `granule` sizes
// VMM mappings, and `runs` asks for each VMM arena's mapped ranges too.
std::vector<SegmentView> describe_segments(const std::vector<std::pair<const BlockPool*, PoolId>>& pools,
                                           size_t granule, bool runs);
// The segments as torch's snapshot shows them: a VMM arena (described with runs) becomes
// one segment per run of mapped granules, holding the parts of blocks that lie in it (as
// torch shows its expandable segments), so blocks tile each segment exactly.
std::vector<SegmentView> split_at_mappings(std::vector<SegmentView> all);
// Free blocks carved from segments that still hold live blocks (torch's inactive_split), in all
// pools and in the small and the large ones (indexed by PoolKind); in a VMM arena only what
// mappings back counts, as torch's expandable segments count only mapped blocks.
void count_inactive_split(const std::vector<const BlockPool*>& pools, int64_t count[kPoolKinds],
                          int64_t bytes[kPoolKinds]);

}  // namespace tb
