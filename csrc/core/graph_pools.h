// Private pools for CUDA-graph capture.
//
// Note [Interaction with CUDA graph capture]
// torch brackets a capture with beginAllocateToPool(pool, filter) and
// endAllocateToPool(pool); while a capture is open, every allocation on a stream the
// filter accepts is served from that pool's own BlockPool, never from the default
// pools and never as a stream-ordered allocation (which would become a graph node).
// Replays reuse the captured addresses, so the pool's memory must stay put until no
// graph holds the pool: each begin takes a use, each releasePool (graph reset or
// destruction) drops one, and the memory is returned when the count is zero and no
// block of the pool is live (outputs still held by the user keep it). Frees during
// capture return blocks to the pool they came from. Event queries and records are
// illegal during capture, so event processing waits until no capture is open.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "block_cache.h"

namespace tb {

using PoolId = std::pair<uint64_t, uint64_t>;
using StreamFilter = std::function<bool(CUstream)>;

struct PrivatePool {
  std::unique_ptr<BlockPool> blocks;
  int use_count = 0;  // graphs (and open captures) holding the pool
};

class GraphPools {
 public:
  // Creates the pool on first use and takes one use.
  PrivatePool& acquire(const PoolId& id, Backing* backing, int route);
  // Drops one use; returns the pool when it is now unused (else nullptr). Unknown
  // ids or a count already at zero return nullptr and set kInvalidArgument.
  PrivatePool* release(const PoolId& id, bool* ok);
  void erase(const PoolId& id);
  PrivatePool* find(const PoolId& id);
  PrivatePool* find(const BlockPool* blocks, PoolId* id);

  void begin_capture(const PoolId& id, StreamFilter filter);
  void end_capture(const PoolId& id);
  bool capturing() const { return !captures_.empty(); }
  // Pool that an allocation on `stream` must come from, or nullptr.
  BlockPool* route_for(CUstream stream);

  std::map<PoolId, PrivatePool>& pools() { return pools_; }

 private:
  std::map<PoolId, PrivatePool> pools_;
  std::vector<std::pair<PoolId, StreamFilter>> captures_;
};

}  // namespace tb
