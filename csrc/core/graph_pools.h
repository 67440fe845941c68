// Private pools for CUDA-graph capture and torch.cuda.MemPool.
//
// Note [Interaction with CUDA graph capture]
// torch brackets a capture with beginAllocateToPool(pool, filter) and
// endAllocateToPool(pool); while a capture is open, every allocation on a stream the
// filter accepts is served from that pool's own BlockPool, never from the default
// pools and never as a stream-ordered allocation (which would become a graph node).
// Replays reuse the captured addresses, so the pool's memory must stay put until no
// graph holds the pool: each begin (and each MemPool) takes a use, each releasePool
// (graph reset or destruction, MemPool exit) drops one. A pool with no use and no
// live block (outputs still held by the user keep it) is dead: it is destroyed after
// a device synchronisation that started after it died (a replay may still run), and
// never while any capture is open anywhere in the process (a synchronisation would
// invalidate it) -- then the end of the last capture destroys it. Frees during
// capture return blocks to the pool they came from. Event records and queries wait
// until no capture is open.
//
// Several captures may be open at once (from several threads), each into a pool of its
// own: as torch's allocator ("already recording to mempool_id"), a capture into a pool
// that one is open into already is refused, so an end closes the one capture into its
// pool and never another thread's.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "block_cache.h"

namespace tb {

using StreamFilter = std::function<bool(CUstream)>;

// "(first, second)", for messages.
std::string describe(const PoolId& id);

struct PrivatePool {
  std::unique_ptr<Backing> own_backing;  // a MemPool's own allocator (route_user.h); outlives `blocks`
  std::unique_ptr<BlockPool> blocks;
  int use_count = 0;  // graphs, MemPools and open captures holding the pool
  // StreamClock stamp of the drop of its last use: its free blocks go back only after a
  // synchronisation of the whole device that started later (a replay queued before the drop
  // still writes them), however the synchronisation and the drop interleaved.
  uint64_t idle_since = 0;
  int tag = 0;        // the tag in force when the pool was created (Note [Tag arenas])
  bool use_on_oom = false;  // default allocations that find no memory may take its free blocks
  bool dead() const { return use_count == 0 && blocks->live_blocks() == 0; }
};

class GraphPools {
 public:
  // Creates the pool on first use (charged to `tag`) and takes one use.
  PrivatePool& acquire(const PoolId& id, Backing* backing, int route, BlockStore* store, StreamClock* clock, int tag,
                       std::unique_ptr<Backing> own = nullptr);
  // Drops one use. Unknown ids or a count already at zero: false + kInvalidArgument.
  bool release(const PoolId& id);
  // Destroys the pool; returns its own backing (a MemPool's allocator, route_user.h), which
  // outlived its blocks, for the caller to end where it may (never under the device lock).
  std::unique_ptr<Backing> erase(const PoolId& id);
  PrivatePool* find(const PoolId& id);
  PrivatePool* find(const BlockPool* blocks, PoolId* id);

  // Whether a capture into `id` is open (a second one is refused).
  bool capturing_into(const PoolId& id) const;
  void begin_capture(const PoolId& id, StreamFilter filter);
  // Closes the open capture into `id`; false + kInvalidArgument when none is open.
  bool end_capture(const PoolId& id);
  bool capturing() const { return !captures_.empty(); }
  // Pool that an allocation on `stream` must come from, or nullptr.
  BlockPool* route_for(CUstream stream);

  std::map<PoolId, PrivatePool>& pools() { return pools_; }

 private:
  std::map<PoolId, PrivatePool> pools_;
  std::vector<std::pair<PoolId, StreamFilter>> captures_;
};

}  // namespace tb
