#include "graph_pools.h"

#include <algorithm>
#include <string>

#include "error.h"

namespace tb {

PrivatePool& GraphPools::acquire(const PoolId& id, Backing* backing, int route) {
  PrivatePool& p = pools_[id];
  if (!p.blocks) p.blocks = std::make_unique<BlockPool>(backing, route, /*graph_pool=*/true);
  p.use_count++;
  return p;
}

PrivatePool* GraphPools::release(const PoolId& id, bool* ok) {
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second.use_count <= 0) {
    set_error(kInvalidArgument, "release of graph pool (" + std::to_string(id.first) + ", " +
                                    std::to_string(id.second) + ") that no graph holds");
    *ok = false;
    return nullptr;
  }
  *ok = true;
  return --it->second.use_count == 0 ? &it->second : nullptr;
}

void GraphPools::erase(const PoolId& id) { pools_.erase(id); }

PrivatePool* GraphPools::find(const PoolId& id) {
  auto it = pools_.find(id);
  return it == pools_.end() ? nullptr : &it->second;
}

PrivatePool* GraphPools::find(const BlockPool* blocks, PoolId* id) {
  for (auto& [key, pool] : pools_) {
    if (pool.blocks.get() == blocks) {
      *id = key;
      return &pool;
    }
  }
  return nullptr;
}

void GraphPools::begin_capture(const PoolId& id, StreamFilter filter) {
  captures_.emplace_back(id, std::move(filter));
}

void GraphPools::end_capture(const PoolId& id) {
  captures_.erase(std::remove_if(captures_.begin(), captures_.end(),
                                 [&](const std::pair<PoolId, StreamFilter>& c) { return c.first == id; }),
                  captures_.end());
}

BlockPool* GraphPools::route_for(CUstream stream) {
  for (auto& [id, filter] : captures_) {
    if (filter(stream)) {
      PrivatePool* p = find(id);
      return p ? p->blocks.get() : nullptr;
    }
  }
  return nullptr;
}

}  // namespace tb
