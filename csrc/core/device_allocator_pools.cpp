// Private pools: CUDA graph capture, torch.cuda.MemPool and their lifetimes
// (Note [Interaction with CUDA graph capture], graph_pools.h).
#include <algorithm>

#include "device_allocator.h"
#include "error.h"
#include "scope.h"

namespace tb {

// Note [Private pool routes]
// A private pool created under a tag lives on the VMM route when the device has it, so
// the tag can release it (Note [Tag arenas]). An untagged one lives on the synchronous
// route: segments of torch's sizes (2 MiB for small blocks, 20 MiB below 10 MiB,
// else the request rounded to 2 MiB), split by torch's rules, so its layout -- what
// graph trees checkpoint, what snapshots show, what NCCL registers -- is torch's own.
int DeviceAllocator::private_route(int tag) const { return tag != 0 && caps_.vmm ? kRouteVmm : kRouteSync; }

Backing* DeviceAllocator::private_backing(int tag) {
  return private_route(tag) == kRouteVmm ? static_cast<Backing*>(vmm_.get()) : static_cast<Backing*>(sync_.get());
}

bool DeviceAllocator::begin_allocate_to_pool(const PoolId& id, StreamFilter filter) noexcept {
  // No share's close is between its check of open_captures() and its driver calls (Note [Closing a
  // share during a capture]).
  std::unique_lock<std::shared_mutex> gate(close_gate());
  auto lock = hold();
  // Refused before the pool takes a use (Note [Interaction with CUDA graph capture]).
  TB_REQUIRE(!graphs_.capturing_into(id), kState,
             "beginAllocateToPool: graph pool " + describe(id) + " on device " + std::to_string(ctx_.device) +
                 " is already being captured into (torch's allocator: already recording to mempool_id); end "
                 "that capture first, or capture into another pool",
             false);
  const int tag = current_scope().tag;
  graphs_.acquire(id, private_backing(tag), private_route(tag), &store_, &clock_, tag);
  graphs_.begin_capture(id, std::move(filter));
  open_captures_.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

bool DeviceAllocator::end_allocate_to_pool(const PoolId& id) noexcept {
  {
    auto lock = hold();
    if (!graphs_.end_capture(id)) return false;
    open_captures_.fetch_sub(1, std::memory_order_acq_rel);
    if (!graphs_.capturing()) {  // markers and walks name nodes of graphs no longer captured
      uses_.captures_ended();
    }
    if (open_captures() == 0) {
      uses_.settle();
      destroy_dead_pools(lock);
    }
  }
  if (open_captures() == 0) captures_ended();  // shares closed during the capture (may synchronise)
  return true;
}

void DeviceAllocator::create_or_incref_pool(const PoolId& id, std::unique_ptr<SegmentSource> source) noexcept {
  auto lock = hold();
  std::unique_ptr<Backing> own;
  if (source != nullptr && graphs_.find(id) == nullptr)
    own = std::make_unique<UserRoute>(ctx_.device, budget_, ledger_, user_frees_, std::move(source));
  const int tag = current_scope().tag;
  graphs_.acquire(id, private_backing(tag), own ? kRouteSync : private_route(tag), &store_, &clock_, tag,
                  std::move(own));
}

bool DeviceAllocator::set_pool_options(const PoolId& id, int use_on_oom, bool no_split) noexcept {
  auto lock = hold();
  PrivatePool* p = graphs_.find(id);
  TB_REQUIRE(p != nullptr, kInvalidArgument,
             "no memory pool " + describe(id) + " on device " +
                 std::to_string(ctx_.device),
             false);
  if (use_on_oom >= 0) p->use_on_oom = use_on_oom != 0;
  if (no_split) p->blocks->set_no_split();
  return true;
}

bool DeviceAllocator::empty_pool_cache(const PoolId& id) noexcept {
  auto lock = hold();
  // As release_cached: a pool's free blocks are written by every replay of the graphs it served,
  // so only a pool no graph (and no MemPool) holds gives them back, and only after a
  // synchronisation of the whole device that started after its last use was dropped (a graph
  // replayed and reset while this waited is not covered); refused while a capture is open, the
  // pool keeps them. torch's release_cached_blocks(context, id) likewise touches only a
  // freeable pool.
  auto freeable = [&]() -> PrivatePool* {
    PrivatePool* p = graphs_.find(id);  // looked up again after the lock was released
    return p != nullptr && p->own_backing && p->use_count == 0 ? p : nullptr;
  };
  if (freeable() != nullptr && sync_device(lock))
    if (PrivatePool* p = freeable(); p != nullptr && clock_.device_clean(p->idle_since))
      p->own_backing->release_cached(*p->blocks);
  free_detached(lock);  // the segments go back to the pool's own allocator now, without the lock
  return true;
}

int DeviceAllocator::pool_use_count(const PoolId& id) {
  auto lock = hold();
  PrivatePool* p = graphs_.find(id);
  return p ? p->use_count : 0;
}

bool DeviceAllocator::release_pool(const PoolId& id) noexcept {
  auto lock = hold();
  if (!graphs_.release(id)) return false;
  PrivatePool* p = graphs_.find(id);
  if (p->use_count == 0) p->idle_since = clock_.stamp();
  note_if_dead(p->blocks.get());
  destroy_dead_pools(lock);
  return true;
}

void DeviceAllocator::settle_pools() noexcept {
  auto lock = hold();
  if (!dead_.empty() && open_captures() == 0) {
    uses_.settle();
    // A pool not clean yet goes at this device's next empty_cache or out-of-memory retry, which
    // wait for it: a capture that ended on another device must not wait for this one.
    destroy_dead_pools(lock, /*all=*/false, /*may_wait=*/false);
  }
}

void DeviceAllocator::note_if_dead(BlockPool* blocks) {
  PoolId id;
  PrivatePool* p = graphs_.find(blocks, &id);
  if (p == nullptr || !p->dead()) return;
  // A pool that came back and died again dies anew: replays of its new graphs count.
  for (DeadPool& d : dead_) {
    if (d.id != id) continue;
    d.died_at = clock_.stamp();
    d.during_capture = d.during_capture || open_captures() > 0;
    return;
  }
  dead_.push_back(DeadPool{id, clock_.stamp(), open_captures() > 0});
}

bool DeviceAllocator::dead_pool_of(const DeadPool& d, int tag) {
  if (tag < 0) return true;
  PrivatePool* p = graphs_.find(d.id);
  return p != nullptr && p->tag == tag;
}

bool DeviceAllocator::has_dead_pool_of(int tag) {
  for (const DeadPool& d : dead_)
    if (dead_pool_of(d, tag)) return true;
  return false;
}

void DeviceAllocator::destroy_dead_pools(DeviceLock& lock, bool all, bool may_wait, int tag, int64_t* freed) {
  if (dead_.empty() || open_captures() > 0) return;
  // A replay may still be running: wait for the device once for all of them.
  bool need_sync = false;
  for (const DeadPool& d : dead_)
    need_sync |= dead_pool_of(d, tag) && (all || !d.during_capture) && !clock_.device_clean(d.died_at);
  // Without waiting, only the pools already clean go.
  if (need_sync && may_wait && !sync_device(lock)) return;
  std::vector<DeadPool> dead;
  dead.swap(dead_);
  // A capture may begin on another device at any time (its lock is not this one), and
  // unmapping is an unsafe call while it captures in global mode.
  RelaxedCaptureMode relaxed(open_captures() > 0);
  const int64_t before = budget_.reserved();  // the lock is held from here to the end of the loop
  const int64_t queued_before = detached_bytes();
  for (const DeadPool& d : dead) {
    if ((d.during_capture && !all) || !dead_pool_of(d, tag)) {
      dead_.push_back(d);
      continue;
    }
    PrivatePool* p = graphs_.find(d.id);
    if (p == nullptr || !p->dead()) continue;  // revived while the lock was released
    if (!clock_.device_clean(d.died_at) || !tags_.live(p->tag)) {  // a released tag's pieces point into it
      dead_.push_back(d);
      continue;
    }
    std::vector<Segment*> segs;
    for (const auto& seg : p->blocks->segments()) segs.push_back(seg.get());
    bool gone = true;
    for (Segment* seg : segs) gone &= p->blocks->backing()->destroy_segment(*seg);
    if (!gone) {
      dead_.push_back(d);  // the driver refused part of it: retried later
      continue;
    }
    if (std::unique_ptr<Backing> own = graphs_.erase(d.id)) ended_routes_.push_back(std::move(own));
  }
  const int64_t destroyed = before - budget_.reserved();
  // The sync route's and MemPools' segments go back here, the lock released meanwhile, with
  // whatever else waited (an earlier failed cuMemFree): only these pools' count as freed here.
  const int64_t mine = detached_bytes() - queued_before;
  const int64_t detached = free_detached(lock);
  if (freed != nullptr) *freed += destroyed + std::min(mine, detached);
}

Block* DeviceAllocator::borrow(size_t size, CUstream stream) {
  for (auto& [id, p] : graphs_.pools()) {
    if (!p.use_on_oom || !tags_.live(p.tag)) continue;
    Block* b = p.blocks->malloc(size, stream, /*grow=*/false);
    if (b != nullptr) {
      b->tag = p.tag;
      return b;
    }
  }
  return nullptr;
}

}  // namespace tb
