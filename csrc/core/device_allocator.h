// One device's allocator: routes, budget, ledger, record_stream events and graph
// pools behind one mutex.
//
// Lock rule: mu_ guards every member except the ledger's counters (relaxed atomics,
// readable without it) and the immutable fields set by init(). Backings and routes
// are only called with mu_ held. No driver call that can block on the device is made
// on the cache-hit path.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_cache.h"
#include "graph_pools.h"
#include "ledger.h"
#include "ptr_map.h"
#include "route_pool.h"
#include "route_sync.h"
#include "route_vmm.h"

namespace tb {

struct Capabilities {
  bool vmm = false;
  bool pools = false;
  size_t granularity = 0;  // VMM minimum granularity
  size_t total_bytes = 0;
};

// Reads a device's capabilities without creating a context.
bool probe_device(int device, Capabilities* caps);

struct Settings {
  int64_t budget_bytes = -1;     // < 0: none (the whole card)
  double budget_fraction = -1;   // used when budget_bytes < 0 and fraction > 0
  bool reuse_before_grow = true; // see Note [Granule reuse before growth]
};

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
  };
  std::vector<BlockView> blocks;
};

class DeviceAllocator {
 public:
  explicit DeviceAllocator(int device) : device_(device) {}
  ~DeviceAllocator();

  bool init(const Settings& settings);
  int device() const { return device_; }
  const Capabilities& caps() const { return caps_; }
  Ledger& ledger() { return ledger_; }

  // nullptr + error (kOutOfMemory carries the quantified message).
  Block* malloc(size_t size, CUstream stream, int route, int tag);
  bool free(Block* block);
  // Frees the live block at `ptr`; *found tells whether there was one.
  bool free_ptr(uintptr_t ptr, bool* found);
  bool owns(uintptr_t ptr, Block** block);
  bool record_stream(Block* block, CUstream stream);

  // Returns cached memory of the default pools to the driver (synchronises the device).
  bool empty_cache();
  bool set_budget(int64_t bytes);
  int64_t budget() const { return budget_.load(std::memory_order_relaxed); }
  size_t reserved_total();
  size_t largest_free();
  size_t pool_route_reserved();

  // Graph capture (see Note [Interaction with CUDA graph capture]).
  bool begin_allocate_to_pool(const PoolId& id, StreamFilter filter);
  bool end_allocate_to_pool(const PoolId& id);
  bool release_pool(const PoolId& id);
  // torch.cuda.MemPool: a pool that exists (and holds a use) outside any capture.
  void create_or_incref_pool(const PoolId& id);
  int pool_use_count(const PoolId& id);

  std::vector<SegmentView> segments();
  void inactive_split(int64_t* count, int64_t* bytes);

  // --- called by routes and backings, mu_ held ---
  // Charges `bytes` of new driver memory against the budget; false + kOutOfMemory.
  bool charge(size_t bytes, int route, bool graph_pool, bool small);
  void uncharge(size_t bytes, int route, bool graph_pool, bool small);
  // Whether `bytes` more would stay within the budget (sets kOutOfMemory if not).
  bool fits(size_t bytes);
  // Puts the pool route's reserved figure (a pool attribute) into the ledger.
  void refresh_pool_reserved();
  bool make_current();
  BlockPool* default_pool(int route) { return route == kRouteVmm ? vmm_pool_.get() : sync_pool_.get(); }
  bool capturing() const { return graphs_.capturing(); }
  CUevent get_event();
  void put_event(CUevent e);
  std::string budget_text();

 private:
  int resolve_route(int route) const;
  Block* try_malloc(size_t size, CUstream stream, int route, BlockPool* graph_pool);
  void account_alloc(Block* b, int tag);
  void account_release(Block* b);   // allocated -> not allocated
  void account_inactive(Block* b);  // active -> free
  void return_block(Block* b);      // to its pool, or to the driver for the pool route
  void process_events();
  bool free_locked(Block* b);
  void synchronize_and_release_cached();
  void maybe_destroy_graph_pool(BlockPool* pool);
  void acquire_pool(const PoolId& id);
  std::string oom_message(size_t size, int route, int tag, bool budget_refused, const std::string& cause);

  const int device_;
  CUcontext ctx_ = nullptr;
  Capabilities caps_;
  std::atomic<int64_t> budget_{INT64_MAX};
  Ledger ledger_;

  std::mutex mu_;
  std::unique_ptr<VmmRoute> vmm_;
  std::unique_ptr<SyncRoute> sync_;
  std::unique_ptr<PoolRoute> pool_;
  std::unique_ptr<BlockPool> vmm_pool_;
  std::unique_ptr<BlockPool> sync_pool_;
  GraphPools graphs_;
  PtrMap live_;                                     // every allocated block, by address
  struct Pending {
    Block* block;
    CUevent event;
  };
  std::deque<Pending> pending_;           // record_stream events outstanding
  std::vector<Block*> deferred_frees_;    // frees needing events while a capture is open
  std::vector<CUevent> events_;           // reusable events
  size_t pool_reserved_seen_ = 0;         // last pool-route reserved figure put in the ledger
  bool budget_refused_ = false;           // why the last charge failed: budget (true) or driver
};

}  // namespace tb
