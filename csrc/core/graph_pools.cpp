#include "graph_pools.h"

#include <string>

#include "error.h"

namespace tb {

std::string describe(const PoolId& id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

PrivatePool& GraphPools::acquire(const PoolId& id, Backing* backing, int route, BlockStore* store,
                                 StreamClock* clock, int tag, std::unique_ptr<Backing> own) {
  PrivatePool& p = pools_[id];
  if (!p.blocks) {
    if (own) {
      p.own_backing = std::move(own);
      backing = p.own_backing.get();
    }
    p.blocks = std::make_unique<BlockPool>(backing, route, /*graph_pool=*/true, store, clock);
    p.blocks->set_owner(id, tag);
    p.tag = tag;
  }
  p.use_count++;
  return p;
}

bool GraphPools::release(const PoolId& id) {
  auto it = pools_.find(id);
  TB_REQUIRE(it != pools_.end() && it->second.use_count > 0, kInvalidArgument,
             "release of graph pool " + describe(id) + " that no graph holds", false);
  it->second.use_count--;
  return true;
}

std::unique_ptr<Backing> GraphPools::erase(const PoolId& id) {
  auto it = pools_.find(id);
  if (it == pools_.end()) return nullptr;
  std::unique_ptr<Backing> own = std::move(it->second.own_backing);
  pools_.erase(it);  // its blocks go now, their backing after them
  return own;
}

PrivatePool* GraphPools::find(const PoolId& id) {
  auto it = pools_.find(id);
  return it == pools_.end() ? nullptr : &it->second;
}

PrivatePool* GraphPools::find(const BlockPool* blocks, PoolId* id) {
  for (auto& [key, pool] : pools_) {
    if (pool.blocks.get() == blocks) {
      if (id != nullptr) *id = key;
      return &pool;
    }
  }
  return nullptr;
}

bool GraphPools::capturing_into(const PoolId& id) const {
  for (const auto& c : captures_)
    if (c.first == id) return true;
  return false;
}

void GraphPools::begin_capture(const PoolId& id, StreamFilter filter) {
  captures_.emplace_back(id, std::move(filter));
}

bool GraphPools::end_capture(const PoolId& id) {
  for (auto it = captures_.begin(); it != captures_.end(); ++it) {  // at most one per pool
    if (it->first == id) {
      captures_.erase(it);
      return true;
    }
  }
  set_error(kInvalidArgument, "end of a capture into graph pool " + describe(id) + " that was never begun");
  return false;
}

BlockPool* GraphPools::route_for(CUstream stream) {
  // Newest first: with nested torch.cuda.use_mem_pool scopes the innermost one serves.
  for (auto it = captures_.rbegin(); it != captures_.rend(); ++it) {
    if (it->second(stream)) {
      PrivatePool* p = find(it->first);
      return p ? p->blocks.get() : nullptr;
    }
  }
  return nullptr;
}

}  // namespace tb
