#include "device_allocator.h"

#include <algorithm>

#include "error.h"
#include "events.h"
#include "host_pool.h"
#include "scope.h"

namespace tb {
namespace {

// torch's small_pool stats count requests of its small size class, wherever they lie.
bool is_small(const Block* b) { return b->small_request; }

// Syncs before an allocation gives up on remapping cached granules and grows.
constexpr int kSyncRounds = 3;

thread_local int t_quiet_attempts = 0;  // Note [A quiet first attempt]

std::nullptr_t refuse_quietly() {
  set_error(kOutOfMemory, "refused before reclaiming memory (a quiet first attempt)");
  return nullptr;
}

}  // namespace

DeviceAllocator::QuietAttempt::QuietAttempt() { ++t_quiet_attempts; }
DeviceAllocator::QuietAttempt::~QuietAttempt() { --t_quiet_attempts; }

std::atomic<int> DeviceAllocator::open_captures_{0};
std::atomic<bool> DeviceAllocator::capture_reuse_{false};
std::atomic<bool> DeviceAllocator::parking_{true};

DeviceAllocator::DeviceAllocator(int device)
    : ctx_{device, nullptr}, budget_(device, ledger_), clock_(device, open_captures_), store_(device) {}

bool probe_device(int device, Capabilities* caps) {
  const DriverApi* d = driver();
  TB_REQUIRE(d != nullptr, kNotAvailable, "no CUDA driver loaded", false);
  CUdevice dev = 0;
  TB_DRIVER_CHECK(d->deviceGet(&dev, device), false);
  TB_DRIVER_CHECK(d->deviceTotalMem(&caps->total_bytes, dev), false);
  int v = 0;
  TB_DRIVER_CHECK(d->deviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), false);
  caps->vmm = v != 0 && d->has_vmm();
  TB_DRIVER_CHECK(d->deviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev), false);
  caps->pools = v != 0 && d->has_pools();
  caps->granularity = 0;
  if (caps->vmm) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    TB_DRIVER_CHECK(d->memGetAllocationGranularity(&caps->granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                    false);
  }
  return true;
}

bool DeviceAllocator::init(const Settings& settings) {
  const DriverApi* d = driver();
  if (!probe_device(ctx_.device, &caps_)) return false;
  CUdevice dev = 0;
  TB_DRIVER_CHECK(d->deviceGet(&dev, ctx_.device), false);
  TB_DRIVER_CHECK(d->primaryCtxRetain(&ctx_.ctx, dev), false);
  HostPool::get().watch_captures(&open_captures_);  // Note [Unpinning during capture]

  if (caps_.vmm) {
    size_t granule = 2 << 20;
    granule = (std::max(granule, caps_.granularity) + caps_.granularity - 1) / caps_.granularity * caps_.granularity;
    const size_t arena = (caps_.total_bytes + granule - 1) / granule * granule;
    vmm_ = std::make_unique<VmmRoute>(ctx_, budget_, ledger_, clock_, granule, arena, settings.reuse_before_grow);
    vmm_pool_ = std::make_unique<BlockPool>(vmm_.get(), kRouteVmm, false, &store_, &clock_);
    vmm_->add_reuse_source(vmm_pool_.get());
    tags_.init(ctx_, vmm_.get(), vmm_pool_.get());
  }
  sync_ = std::make_unique<SyncRoute>(ctx_, budget_, ledger_);
  sync_pool_ = std::make_unique<BlockPool>(sync_.get(), kRouteSync, false, &store_, &clock_);
  if (caps_.pools) {
    pool_ = std::make_unique<PoolRoute>(ctx_, budget_, ledger_, open_captures_);
    if (pool_->init()) {
      pool_pool_ = std::make_unique<BlockPool>(pool_.get(), kRoutePool, false, &store_, &clock_);
    } else {
      caps_.pools = false;  // e.g. UVM disabled: the route is simply unavailable
      pool_.reset();
      clear_error();
    }
  }
  apply(settings);
  return true;
}

void DeviceAllocator::apply(const Settings& settings) {
  auto lock = hold();
  budget_.set_limit(Budget::resolve(settings.budget_bytes, settings.budget_fraction, caps_.total_bytes));
  for (int t = 0; t < kMaxTags; ++t)
    budget_.set_tag_limit(t, Budget::resolve(settings.tag_bytes[t], settings.tag_fraction[t], caps_.total_bytes));
  // Note [Adopting clean blocks] is reuse before growth too.
  sync_pool_->set_adopt_clean(settings.reuse_before_grow, &ledger_.num_adoptions);
  if (vmm_) {
    vmm_pool_->set_adopt_clean(settings.reuse_before_grow, &ledger_.num_adoptions);
    for (BlockPool* p : tags_.own_pools()) p->set_adopt_clean(settings.reuse_before_grow, &ledger_.num_adoptions);
    vmm_->set_reuse_before_grow(settings.reuse_before_grow);
    vmm_->set_packing_time(settings.packing_time);
    vmm_->set_max_run(settings.map_run_bytes > 0 ? static_cast<size_t>(settings.map_run_bytes)
                                                 : VmmRoute::kDefaultRunBytes);
  }
}

int resolve_route(const Capabilities& caps, int route) {
  if (route == kRouteVmm && !caps.vmm) route = caps.pools ? kRoutePool : kRouteSync;
  if (route == kRoutePool && !caps.pools) route = kRouteSync;
  return route;
}

BlockPool* DeviceAllocator::default_pool(int route) {
  if (route == kRouteVmm) return vmm_pool_.get();
  if (route == kRoutePool) return pool_pool_.get();
  return sync_pool_.get();
}

bool DeviceAllocator::mem_info(size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = 0;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  TB_DRIVER_CHECK(driver()->memGetInfo(free_bytes, total_bytes), false);
  return true;
}

// ---------------------------------------------------------------- waiting for the device

bool DeviceAllocator::sync_device(DeviceLock& lock) {
  if (open_captures() > 0) return false;  // would invalidate the capture
  const uint64_t upto = clock_.stamp();
  lock.unlock();
  bool ok = false;
  if (open_captures() == 0) {  // checked again: a capture may have begun meanwhile
    ContextGuard guard(ctx_.ctx);
    for (int attempt = 0; guard.ok() && attempt < 3 && !ok; ++attempt)
      ok = driver()->ctxSynchronize() == CUDA_SUCCESS;
  }
  lock.lock();
  unpark();  // Note [The parked block]: a free may have parked one meanwhile
  if (ok) {
    clock_.device_synced(upto);
    bump(ledger_.num_sync_all_streams);
  }
  // A capture that began while the lock was released may be allocating into the pools the
  // caller is about to clean up: then, as when one was open before, the caller keeps them.
  return ok && open_captures() == 0;
}

void DeviceAllocator::sync_streams(DeviceLock& lock, const std::vector<CUstream>& streams) {
  const uint64_t upto = clock_.now();
  lock.unlock();
  std::vector<CUstream> done;
  if (open_captures() == 0) {
    ContextGuard guard(ctx_.ctx);
    for (CUstream s : streams)
      if (guard.ok() && driver()->streamSynchronize(s) == CUDA_SUCCESS) done.push_back(s);
  }
  lock.lock();
  unpark();  // Note [The parked block]: a free may have parked one meanwhile
  for (CUstream s : done) clock_.stream_synced(s, upto);
  bump(ledger_.num_stream_syncs, static_cast<int64_t>(done.size()));
}

int64_t DeviceAllocator::detached_bytes() const {
  int64_t n = static_cast<int64_t>(sync_->detached_bytes());
  for (const UserFree& f : user_frees_) n += static_cast<int64_t>(f.size);
  return n;
}

int64_t DeviceAllocator::free_detached(DeviceLock& lock) {
  // cuMemFree waits for the device: never while a capture is open (kept for later).
  if (open_captures() > 0) return 0;
  std::vector<SyncRoute::Detached> list = sync_->take_detached();
  UserFrees user;
  user.swap(user_frees_);
  std::vector<std::unique_ptr<Backing>> ended;
  ended.swap(ended_routes_);
  if (list.empty() && user.empty() && ended.empty()) return 0;
  lock.unlock();
  sync_->free_detached(list);
  for (UserFree& f : user) {
    f.source->free(f.base);  // route_user.h: may wait, or take the GIL
    f.source.reset();        // and so may the allocator's end, where this was its last reference
  }
  ended.clear();  // a dead pool's route, with the allocator's last reference where no segment kept one
  lock.lock();
  unpark();  // Note [The parked block]: a free may have parked one meanwhile
  const int64_t before = budget_.reserved();  // the lock is held from here on
  sync_->settle(list);
  for (const UserFree& f : user) {  // sizes only: every source was let go before the lock
    budget_.uncharge(f.size, Placement{kRouteSync, f.small, true});
    bump(ledger_.num_device_free);
  }
  return before - budget_.reserved();
}

void DeviceAllocator::release_cached(DeviceLock& lock) {
  // Refused while a capture is open anywhere: then nothing is known of queued replays.
  bool synced = sync_device(lock);
  const size_t waiting = uses_.waiting();
  uses_.settle();
  // Blocks whose recorded streams just completed were freed after that sync (their
  // free stamp is now): one more makes them clean, so this call gives them back too.
  if (synced && uses_.waiting() < waiting) sync_device(lock);
  {
    // Unmapping and trimming are "unsafe" calls while another thread captures in global mode.
    RelaxedCaptureMode relaxed(open_captures() > 0);
    if (vmm_pool_) vmm_->release_cached(*vmm_pool_);
    for (BlockPool* tp : tags_.own_pools())  // a released tag's segments are remembered by its pieces
      if (tags_.live(tp->tag())) vmm_->release_cached(*tp);
    sync_->release_cached(*sync_pool_);
    if (pool_pool_) pool_->release_cached(*pool_pool_, graphs_.capturing());  // Note [Stream-ordered frees]
    // A private pool no graph holds any more keeps only what its live blocks need
    // (its outputs may outlive the graph), as torch's allocator does. Its free blocks are
    // written by every replay of the graphs it served, so free stamps say nothing of
    // them: only after a synchronisation of the whole device that started after the pool's
    // last use was dropped (one dropped while this call waited is not covered by its sync).
    for (auto& [id, p] : graphs_.pools())
      if (p.use_count == 0 && clock_.device_clean(p.idle_since) && tags_.live(p.tag))
        p.blocks->backing()->release_cached(*p.blocks);
  }
  destroy_dead_pools(lock, /*all=*/true);
  free_detached(lock);
  tags_.drop_stale_backups();  // Note [Stale backups]
}

// ---------------------------------------------------------------- allocation

Block* DeviceAllocator::attempt(size_t size, CUstream stream, int route, int tag, bool allow_sync) {
  const bool capturing = graphs_.capturing();
  BlockPool* gp = capturing ? graphs_.route_for(stream) : nullptr;
  if (uses_.reusable_in_capture()) uses_.reuse_in_capture(stream);
  if (!capturing && !uses_.idle()) uses_.settle();
  clock_.allow_requests(allow_sync && open_captures() == 0);
  budget_.clear_refusal();
  // Any capture in global mode, on any thread, forbids this thread's cuMemCreate etc.
  RelaxedCaptureMode relaxed(open_captures() > 0);
  if (gp != nullptr) {
    PrivatePool* p = graphs_.find(gp, nullptr);
    TB_REQUIRE(p == nullptr || tags_.live(p->tag), kState,
               "the graph pool being captured into belongs to tag '" + tag_name(p->tag) +
                   "', which is released: restore it before capturing",
               nullptr);
    Block* b = gp->malloc(size, stream);
    // Note [Reuse during capture]: what the graph can order after its uses is known only of a
    // block allocated inside the capture (a MemPool's eager allocations come here too).
    if (b != nullptr && capture_reuse_.load(std::memory_order_relaxed)) b->capture = capture_id(stream);
    return b;
  }
  const int used = resolve_route(caps_, route);
  if (used == kRouteVmm) return tags_.pool(tag)->malloc(size, stream);
  return default_pool(used)->malloc(size, stream);
}

Block* DeviceAllocator::malloc(size_t size, CUstream stream, int route, int tag, OomFigures* oom) {
  TB_REQUIRE(size > 0, kInvalidArgument, "allocation size must be positive", nullptr);
  DeviceLock lock(mu_);
  // The block freed last may be taken back as it is (Note [The parked block]), before anything
  // reads the ledger, which counts it until then: nothing changed since its free, and its bytes
  // were within the budgets; take_parked checks what malloc's checks below would refuse.
  if (parked_ != nullptr) {
    if (Block* b = take_parked(size, stream, route, tag)) return b;
  }
  // Note [Tag arenas]: a block captured into a graph pool is the pool's, whatever scope is open:
  // charged, budgeted and released with the tag the pool was created under.
  const BlockPool* into = graphs_.capturing() ? graphs_.route_for(stream) : nullptr;
  if (into != nullptr) tag = into->tag();
  const bool quiet = t_quiet_attempts > 0;
  if (size > caps_.total_bytes) {
    // Can never fit (and keeps every size computation far from overflow).
    if (quiet) return refuse_quietly();
    fail_oom(size, stream, resolve_route(caps_, route), tag, "the request is larger than the device's total memory",
             /*by_budget=*/false, oom);
    if (size >= (size_t{1} << 60))  // torch's own sentence for such sizes, then ours
      set_error(kOutOfMemory, std::string("Tried to allocate more than 1EB memory. ") + last_error_message());
    return nullptr;
  }
  // A graph pool of a released tag: attempt() refuses it, naming the pool. Checked again
  // whenever the lock was let go: another thread may have released the tag meanwhile.
  auto tag_live = [&] {
    TB_REQUIRE((graphs_.capturing() && graphs_.route_for(stream) != nullptr) || tags_.live(tag), kState,
               "tag '" + tag_name(tag) + "' is released on device " + std::to_string(ctx_.device) +
                   ": restore it (torch_budget.restore, or the resume / wake_up / materialize of the serving "
                   "stack whose adapter paused it) before allocating under it",
               false);
    return true;
  };
  if (!tag_live()) return nullptr;
  if (!budget_.tag_fits(tag, BlockPool::round_size(size))) {
    if (quiet) return refuse_quietly();
    fail_tag_oom(size, BlockPool::round_size(size), stream, resolve_route(caps_, route), tag, oom);
    return nullptr;
  }
  // A block may be larger than the rounded request (a remainder too small to split):
  // the budget of the tag it is charged to (b->tag) is checked on the block itself too.
  auto within_tag = [&](Block* b) {
    if (budget_.tag_fits(b->tag, b->size)) return true;
    const size_t charged = b->size;
    const int used_route = b->route;
    const int charged_tag = b->tag;
    b->segment->pool->free(b);
    if (quiet) {
      refuse_quietly();
      return false;
    }
    fail_tag_oom(size, charged, stream, used_route, charged_tag, oom);
    return false;
  };
  bool released = false;
  for (int round = 0;; ++round) {
    Block* b = attempt(size, stream, route, tag, round < kSyncRounds);
    if (b != nullptr) {
      // A graph pool's tag, also for a capture that began while the lock was released.
      b->tag = b->segment->pool->graph_pool() ? b->segment->pool->tag() : tag;
      if (!within_tag(b)) return nullptr;
      adopt(b);
      return b;
    }
    if (last_error_code() == kNeedSync) {
      sync_streams(lock, clock_.take_requests());
      if (!tag_live()) return nullptr;
      continue;
    }
    if (last_error_code() == kInvalidArgument || last_error_code() == kState) return nullptr;
    if (quiet) return refuse_quietly();
    if (!released && !graphs_.capturing()) {
      released = true;
      bump(ledger_.num_alloc_retries);
      release_cached(lock);
      if (!tag_live()) return nullptr;
      continue;
    }
    // Why the last attempt failed, kept before the lock may be let go below (release_cached): the
    // Budget's record is the last attempt's of any thread.
    const std::string cause = last_error_message();
    const bool by_budget = budget_.refused();
    if (!graphs_.capturing()) {
      if (Block* lent = borrow(size, stream)) {
        if (!within_tag(lent)) return nullptr;
        adopt(lent);
        return lent;
      }
    }
    // A pool that grew past the budget before it could be trimmed back is trimmed
    // now, so the failure leaves the ledger within the budget.
    if (budget_.reserved() > budget_.limit()) release_cached(lock);
    const int used_route = graphs_.capturing() && graphs_.route_for(stream) ? graphs_.route_for(stream)->route()
                                                                            : resolve_route(caps_, route);
    fail_oom(size, stream, used_route, tag, cause, by_budget, oom);
    return nullptr;
  }
}

void DeviceAllocator::adopt(Block* b) {
  account_alloc(b);
  live_.insert(b->ptr, b);
  trace_block(TraceAction::kAlloc, b);
}

// ---------------------------------------------------------------- free

bool DeviceAllocator::free(Block* b) noexcept {
  auto lock = hold();  // a block parked before must not be a neighbour left out of its pool
  // Safe to read under the lock even for a stale pointer: see BlockStore.
  TB_REQUIRE(b->allocated && live_.find(b->ptr) == b, kInvalidArgument,
             "free of a block that is not allocated (double free?)", false);
  free_locked(b, /*may_park=*/true);
  if (!dead_.empty()) destroy_dead_pools(lock, /*all=*/false, /*may_wait=*/false);
  return true;
}

bool DeviceAllocator::free_ptr(uintptr_t ptr, bool* found) noexcept {
  auto lock = hold();
  Block* b = live_.take(ptr);
  *found = b != nullptr;
  if (b == nullptr) return false;
  free_taken(b, /*may_park=*/true);
  if (!dead_.empty()) destroy_dead_pools(lock, /*all=*/false, /*may_wait=*/false);
  return true;
}

void DeviceAllocator::free_locked(Block* b, bool may_park) {
  live_.erase(b->ptr);
  free_taken(b, may_park);
}

void DeviceAllocator::free_taken(Block* b, bool may_park) {
  trace_block(TraceAction::kFreeRequested, b);
  b->allocated = false;  // `requested` stays: the trace reports it
  b->shared = false;     // torch keeps a shared tensor alive until every consumer dropped it
  const BlockPool* pool = b->segment->pool;
  if (!uses_.must_wait(b, pool->release_on_free())) {
    const bool park =
        may_park && !pool->graph_pool() && !pool->release_on_free() && parking_.load(std::memory_order_relaxed);
    if (!park) account_release(b);  // a parked block's free is accounted when it leaves parked_
    retire(b, park);
    return;
  }
  account_release(b);
  uses_.hold(b, capture_reuse_.load(std::memory_order_relaxed));
}

void DeviceAllocator::trace_block(TraceAction action, const Block* b) {
  if (!tracing()) return;
  const BlockPool* pool = b->segment->pool;
  // torch's trace reports the requested size of a block (the snapshot has both).
  trace(action, ctx_.device, b->ptr, b->requested, b->stream, pool->id(), b->tag, b->route);
}

void DeviceAllocator::retire(Block* b, bool park) {
  trace_block(TraceAction::kFreeCompleted, b);
  if (!park) account_inactive(b);
  BlockPool* pool = b->segment->pool;
  const CUstream stream = b->stream;
  if (park) {  // out of its pool, which still counts it handed out, stamped as its free would
    b->allocated = true;
    b->freed_at = clock_.stamp();
    parked_ = b;
  } else {
    pool->free(b);
  }
  clock_.note_free(stream);
  if (pool->graph_pool()) note_if_dead(pool);
}

DeviceLock DeviceAllocator::hold() {
  DeviceLock lock(mu_);
  unpark();
  return lock;
}

void DeviceAllocator::unpark() {
  Block* b = parked_;
  if (b == nullptr) return;
  parked_ = nullptr;
  account_release(b);  // the free, accounted now (Note [The parked block])
  account_inactive(b);
  b->segment->pool->free(b, b->freed_at);
}

Block* DeviceAllocator::take_parked(size_t size, CUstream stream, int route, int tag) {
  Block* b = parked_;
  // The pool attempt() would pick (looked up, never created: malloc may yet refuse the request
  // before choosing one), and nothing else to do first: no capture or pool allocation open
  // (their blocks come from elsewhere), no free waiting on recorded streams.
  const int used = resolve_route(caps_, route);
  BlockPool* pool = used == kRouteVmm ? tags_.existing_pool(tag) : default_pool(used);
  const size_t requested = b->requested;  // as freed: take_back sets the new request's
  const bool small = is_small(b);
  // Its tag may have been released since its allocation (its tensors stay live), or be over its
  // budget with the block still charged (a pool checkpoint's restore charges without asking it):
  // malloc refuses then.
  if (size > b->size || b->stream != stream || b->tag != tag || b->segment->pool != pool || graphs_.capturing() ||
      !uses_.idle() || !tags_.live(tag) || !budget_.tag_fits(tag, 0) || pool->take_back(b, size) == nullptr) {
    unpark();
    return nullptr;
  }
  // Nothing that changes the ledger or a pool ran since the free: the budgets took the block
  // before (its tag's too: the same bytes, the same tag), and its tag is live.
  parked_ = nullptr;
  bump(ledger_.num_take_backs);
  // Taken back for the request it was freed from, in the same stats pool: a pure cycle.
  const bool same_request = b->requested == requested && is_small(b) == small;
  TakeBackTally& t = tally_;
  if (same_request && static_cast<int64_t>(b->size) == t.size && static_cast<int64_t>(requested) == t.requested &&
      small == t.small && b->route == t.route && b->tag == t.tag) {
    ++t.pending;
  } else {
    settle_tally();
    account_take_back(b, requested, small);
    if (same_request)
      t = TakeBackTally{0, static_cast<int64_t>(b->size), static_cast<int64_t>(requested), small, b->route, b->tag};
  }
  live_.insert(b->ptr, b);
  trace_block(TraceAction::kAlloc, b);
  return b;
}

bool DeviceAllocator::lookup(uintptr_t ptr, BlockInfo* out) {
  auto lock = hold();
  Block* b = live_.find(ptr);
  if (b == nullptr) return false;
  *out = BlockInfo{b->ptr, b->size, b->requested, b->route, b->tag};
  return true;
}

bool DeviceAllocator::record_stream(uintptr_t ptr, CUstream stream, int stream_device, bool* found) noexcept {
  auto lock = hold();
  Block* b = live_.find(ptr);
  *found = b != nullptr;
  if (b == nullptr) return false;
  StreamUses::record(b, stream, stream_device, ctx_.device);
  return true;
}

}  // namespace tb
