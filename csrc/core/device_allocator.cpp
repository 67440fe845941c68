#include "device_allocator.h"

#include <algorithm>

#include "error.h"
#include "events.h"
#include "scope.h"

namespace tb {
namespace {

bool is_small(const Block* b) { return b->segment->small; }

// Syncs before an allocation gives up on remapping cached granules and grows.
constexpr int kSyncRounds = 3;

}  // namespace

std::atomic<int> DeviceAllocator::open_captures_{0};
std::atomic<bool> DeviceAllocator::capture_reuse_{false};

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

  if (caps_.vmm) {
    size_t granule = 2 << 20;
    granule = (std::max(granule, caps_.granularity) + caps_.granularity - 1) / caps_.granularity * caps_.granularity;
    const size_t arena = (caps_.total_bytes + granule - 1) / granule * granule;
    vmm_ = std::make_unique<VmmRoute>(ctx_, budget_, ledger_, clock_, granule, arena, settings.reuse_before_grow);
    vmm_pool_ = std::make_unique<BlockPool>(vmm_.get(), kRouteVmm, false, &store_, &clock_);
    vmm_->add_reuse_source(vmm_pool_.get());
    mover_ = std::make_unique<TagMover>(ctx_, *vmm_);
  }
  sync_ = std::make_unique<SyncRoute>(ctx_, budget_, ledger_);
  sync_pool_ = std::make_unique<BlockPool>(sync_.get(), kRouteSync, false, &store_, &clock_);
  if (caps_.pools) {
    pool_ = std::make_unique<PoolRoute>(ctx_, budget_, ledger_);
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
  std::lock_guard<std::mutex> lock(mu_);
  budget_.set_limit(Budget::resolve(settings.budget_bytes, settings.budget_fraction, caps_.total_bytes));
  if (vmm_) {
    vmm_->set_reuse_before_grow(settings.reuse_before_grow);
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

BlockPool* DeviceAllocator::tag_pool(int tag) {
  if (tag == 0) return vmm_pool_.get();
  std::unique_ptr<BlockPool>& p = tag_pools_[tag];
  if (!p) {
    p = std::make_unique<BlockPool>(vmm_.get(), kRouteVmm, false, &store_, &clock_);
    p->set_owner({0, 0}, tag);
    vmm_->add_reuse_source(p.get());
  }
  return p.get();
}

std::vector<BlockPool*> DeviceAllocator::pools_of(int tag) {
  std::vector<BlockPool*> out;
  if (tag_pools_[tag]) out.push_back(tag_pools_[tag].get());
  for (auto& [id, p] : graphs_.pools())
    if (p.tag == tag && p.blocks->route() == kRouteVmm) out.push_back(p.blocks.get());
  return out;
}

bool DeviceAllocator::mem_info(size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = 0;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  TB_DRIVER_CHECK(driver()->memGetInfo(free_bytes, total_bytes), false);
  return true;
}

// ---------------------------------------------------------------- waiting for the device

bool DeviceAllocator::sync_device(std::unique_lock<std::mutex>& lock) {
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
  if (ok) {
    clock_.device_synced(upto);
    bump(ledger_.num_sync_all_streams);
  }
  return ok;
}

void DeviceAllocator::sync_streams(std::unique_lock<std::mutex>& lock, const std::vector<CUstream>& streams) {
  const uint64_t upto = clock_.now();
  lock.unlock();
  std::vector<CUstream> done;
  if (open_captures() == 0) {
    ContextGuard guard(ctx_.ctx);
    for (CUstream s : streams)
      if (guard.ok() && driver()->streamSynchronize(s) == CUDA_SUCCESS) done.push_back(s);
  }
  lock.lock();
  for (CUstream s : done) clock_.stream_synced(s, upto);
  bump(ledger_.num_stream_syncs, static_cast<int64_t>(done.size()));
}

void DeviceAllocator::free_detached(std::unique_lock<std::mutex>& lock) {
  // cuMemFree waits for the device: never while a capture is open (kept for later).
  if (open_captures() > 0) return;
  std::vector<SyncRoute::Detached> list = sync_->take_detached();
  if (list.empty()) return;
  lock.unlock();
  sync_->free_detached(list);
  lock.lock();
  sync_->settle(list);
}

void DeviceAllocator::release_cached(std::unique_lock<std::mutex>& lock) {
  // Refused while a capture is open anywhere: then nothing is known of queued replays.
  bool synced = sync_device(lock);
  const size_t waiting = pending_.size() + deferred_.size();
  process_events();
  // Blocks whose recorded streams just completed were freed after that sync (their
  // free stamp is now): one more makes them clean, so this call gives them back too.
  if (synced && pending_.size() + deferred_.size() < waiting) synced = sync_device(lock);
  {
    // Unmapping and trimming are "unsafe" calls while another thread captures in global mode.
    RelaxedCaptureMode relaxed(open_captures() > 0);
    if (vmm_pool_) vmm_->release_cached(*vmm_pool_);
    for (int t = 1; t < kMaxTags; ++t)  // a released tag's segments are remembered by its pieces
      if (tag_pools_[t] && tag_live(t)) vmm_->release_cached(*tag_pools_[t]);
    sync_->release_cached(*sync_pool_);
    if (pool_pool_) pool_->release_cached(*pool_pool_);
    // A private pool no graph holds any more keeps only what its live blocks need
    // (its outputs may outlive the graph), as torch's allocator does. Its free blocks are
    // written by every replay of the graphs it served, so free stamps say nothing of
    // them: only after a synchronisation of the whole device.
    if (synced)
      for (auto& [id, p] : graphs_.pools())
        if (p.use_count == 0 && tag_live(p.tag)) p.blocks->backing()->release_cached(*p.blocks);
  }
  destroy_dead_pools(lock, /*all=*/true);
  free_detached(lock);
}

// ---------------------------------------------------------------- allocation

Block* DeviceAllocator::attempt(size_t size, CUstream stream, int route, int tag, bool allow_sync) {
  const bool capturing = graphs_.capturing();
  BlockPool* gp = capturing ? graphs_.route_for(stream) : nullptr;
  if (!capture_frees_.empty()) reuse_in_capture(stream);
  if (!capturing && (!pending_.empty() || !deferred_.empty())) process_events();
  clock_.allow_requests(allow_sync && open_captures() == 0);
  budget_.clear_refusal();
  // Any capture in global mode, on any thread, forbids this thread's cuMemCreate etc.
  RelaxedCaptureMode relaxed(open_captures() > 0);
  if (gp != nullptr) {
    PrivatePool* p = graphs_.find(gp, nullptr);
    TB_REQUIRE(p == nullptr || tag_live(p->tag), kState,
               "the graph pool being captured into belongs to tag '" + tag_name(p->tag) +
                   "', which is released: restore it before capturing",
               nullptr);
    return gp->malloc(size, stream);
  }
  const int used = resolve_route(caps_, route);
  if (used == kRouteVmm) return tag_pool(tag)->malloc(size, stream);
  return default_pool(used)->malloc(size, stream);
}

Block* DeviceAllocator::malloc(size_t size, CUstream stream, int route, int tag) {
  TB_REQUIRE(size > 0, kInvalidArgument, "allocation size must be positive", nullptr);
  std::unique_lock<std::mutex> lock(mu_);
  if (size > caps_.total_bytes) {
    // Can never fit (and keeps every size computation far from overflow).
    budget_.clear_refusal();
    fail_oom(size, stream, resolve_route(caps_, route), tag, "the request is larger than the device's total memory");
    if (size >= (size_t{1} << 60))  // torch's own sentence for such sizes, then ours
      set_error(kOutOfMemory, std::string("Tried to allocate more than 1EB memory. ") + last_error_message());
    return nullptr;
  }
  TB_REQUIRE(tag_live(tag), kState,
             "tag '" + tag_name(tag) + "' is released on device " + std::to_string(ctx_.device) +
                 ": restore it (torch_budget.restore) before allocating under it",
             nullptr);
  bool released = false;
  for (int round = 0;; ++round) {
    Block* b = attempt(size, stream, route, tag, round < kSyncRounds);
    if (b != nullptr) {
      b->tag = tag;
      account_alloc(b);
      live_.insert(b->ptr, b);
      trace_block(TraceAction::kAlloc, b);
      return b;
    }
    if (last_error_code() == kNeedSync) {
      sync_streams(lock, clock_.take_requests());
      continue;
    }
    if (last_error_code() == kInvalidArgument || last_error_code() == kState) return nullptr;
    if (!released && !graphs_.capturing()) {
      released = true;
      bump(ledger_.num_alloc_retries);
      release_cached(lock);
      continue;
    }
    const std::string cause = last_error_message();
    if (!graphs_.capturing()) {
      if (Block* lent = borrow(size, stream)) {
        account_alloc(lent);
        live_.insert(lent->ptr, lent);
        trace_block(TraceAction::kAlloc, lent);
        return lent;
      }
    }
    // A pool that grew past the budget before it could be trimmed back is trimmed
    // now, so the failure leaves the ledger within the budget.
    if (budget_.reserved() > budget_.limit()) release_cached(lock);
    const int used_route = graphs_.capturing() && graphs_.route_for(stream) ? graphs_.route_for(stream)->route()
                                                                            : resolve_route(caps_, route);
    fail_oom(size, stream, used_route, tag, cause);
    return nullptr;
  }
}

void DeviceAllocator::fail_oom(size_t size, CUstream stream, int route, int tag, const std::string& cause) {
  bump(ledger_.num_ooms);
  size_t free_b = 0;
  const std::string text = oom_text(size, route, tag, cause, &free_b);
  trace(TraceAction::kOom, ctx_.device, free_b, size, stream, {0, 0}, tag, route);
  set_error(kOutOfMemory, text);
}

std::string DeviceAllocator::oom_text(size_t size, int route, int tag, const std::string& cause, size_t* device_free) {
  size_t free_b = 0, total_b = 0;
  mem_info(&free_b, &total_b);
  if (total_b == 0) total_b = caps_.total_bytes;
  if (device_free != nullptr) *device_free = free_b;
  return budget_.oom_message(size, route, tag_name(tag), cause, free_b, total_b);
}

void DeviceAllocator::account_alloc(Block* b) {
  const bool small = is_small(b);
  const auto size = static_cast<int64_t>(b->size);
  const auto requested = static_cast<int64_t>(b->requested);
  ledger_.allocation.add(small, 1);
  ledger_.allocated_bytes.add(small, size);
  ledger_.active.add(small, 1);
  ledger_.active_bytes.add(small, size);
  ledger_.requested_bytes.add(small, requested);
  ledger_.route_allocated[b->route].add(size);
  bump(ledger_.route_count[b->route]);
  ledger_.tag_allocated[b->tag].add(size);
  ledger_.tag_requested[b->tag].add(requested);
  bump(ledger_.tag_count[b->tag]);
  if (b->route != kRouteVmm) off_route_[b->tag]++;
}

void DeviceAllocator::account_release(Block* b) {
  const bool small = is_small(b);
  const auto size = static_cast<int64_t>(b->size);
  const auto requested = static_cast<int64_t>(b->requested);
  ledger_.allocation.sub(small, 1);
  ledger_.allocated_bytes.sub(small, size);
  ledger_.requested_bytes.sub(small, requested);
  ledger_.route_allocated[b->route].sub(size);
  ledger_.tag_allocated[b->tag].sub(size);
  ledger_.tag_requested[b->tag].sub(requested);
  if (b->route != kRouteVmm) off_route_[b->tag]--;
}

void DeviceAllocator::account_inactive(Block* b) {
  const bool small = is_small(b);
  ledger_.active.sub(small, 1);
  ledger_.active_bytes.sub(small, static_cast<int64_t>(b->size));
}

// ---------------------------------------------------------------- free

bool DeviceAllocator::free(Block* b) {
  std::unique_lock<std::mutex> lock(mu_);
  // Safe to read under the lock even for a stale pointer: see BlockStore.
  TB_REQUIRE(b->allocated && live_.find(b->ptr) == b, kInvalidArgument,
             "free of a block that is not allocated (double free?)", false);
  free_locked(b);
  if (!dead_.empty()) destroy_dead_pools(lock, /*all=*/false, /*may_wait=*/false);
  return true;
}

bool DeviceAllocator::free_ptr(uintptr_t ptr, bool* found) {
  std::unique_lock<std::mutex> lock(mu_);
  Block* b = live_.find(ptr);
  *found = b != nullptr;
  if (b == nullptr) return false;
  free_locked(b);
  if (!dead_.empty()) destroy_dead_pools(lock, /*all=*/false, /*may_wait=*/false);
  return true;
}

void DeviceAllocator::free_locked(Block* b) {
  trace_block(TraceAction::kFreeRequested, b);
  live_.erase(b->ptr);
  account_release(b);
  b->allocated = false;  // `requested` stays: the trace reports it
  b->shared = false;     // torch keeps a shared tensor alive until every consumer dropped it
  // A stream-ordered free is a stream operation: none while a capture is open.
  const bool ordered_free = b->segment->pool->release_on_free();
  if (b->recorded.empty() && !(ordered_free && open_captures() > 0)) {
    retire(b);
    return;
  }
  b->pending = 1;  // held until events were recorded on every recorded stream
  deferred_.push_back(b);
  if (open_captures() > 0) {
    mark_capture_free(b);
    return;
  }
  process_events();
}

void DeviceAllocator::trace_block(TraceAction action, const Block* b) {
  if (!tracing()) return;
  const BlockPool* pool = b->segment->pool;
  // torch's trace reports the requested size of a block (the snapshot has both).
  trace(action, ctx_.device, b->ptr, b->requested, b->stream, pool->id(), b->tag, b->route);
}

void DeviceAllocator::retire(Block* b) {
  trace_block(TraceAction::kFreeCompleted, b);
  account_inactive(b);
  BlockPool* pool = b->segment->pool;
  const CUstream stream = b->stream;
  pool->free(b);
  clock_.note_free(stream);
  if (pool->graph_pool()) note_if_dead(pool);
}

bool DeviceAllocator::lookup(uintptr_t ptr, BlockInfo* out) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_.find(ptr);
  if (b == nullptr) return false;
  *out = BlockInfo{b->ptr, b->size, b->requested, b->route, b->tag};
  return true;
}

bool DeviceAllocator::record_stream(uintptr_t ptr, CUstream stream, int stream_device, bool* found) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_.find(ptr);
  *found = b != nullptr;
  if (b == nullptr) return false;
  if (stream == b->stream && stream_device == ctx_.device) return true;
  for (const StreamRef& r : b->recorded)
    if (r.stream == stream && r.device == stream_device) return true;
  b->recorded.push_back(StreamRef{stream, stream_device});
  return true;
}

// Records events for deferred frees, then retires every block whose recorded
// streams all passed their event. See Note [Stream-ordered reuse].
void DeviceAllocator::process_events() {
  if (open_captures() > 0) return;  // no event record or query while a capture is open
  EventCache& events = EventCache::get();
  for (size_t i = 0; i < deferred_.size();) {
    Block* b = deferred_[i];
    auto& rec = b->recorded;
    for (size_t k = 0; k < rec.size();) {
      CUevent e = events.record(rec[k].device, rec[k].stream);
      if (e == nullptr) {  // retried on the next pass
        ++k;
        continue;
      }
      pending_.push_back(Pending{b, e, rec[k].device, rec[k].stream});
      b->pending++;
      rec.erase(rec.begin() + static_cast<long>(k));
    }
    if (!rec.empty()) {
      ++i;
      continue;
    }
    deferred_[i] = deferred_.back();
    deferred_.pop_back();
    if (--b->pending == 0) retire(b);
  }
  // Events of one stream complete in the order they were recorded: once one is not
  // ready, the later ones of its stream are not queried.
  std::vector<std::pair<CUstream, int>> waiting;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const std::pair<CUstream, int> key{it->stream, it->device};
    if (std::find(waiting.begin(), waiting.end(), key) != waiting.end()) {
      ++it;
      continue;
    }
    if (events.query(it->event) != CUDA_SUCCESS) {  // not ready, or the query failed: later
      waiting.push_back(key);
      ++it;
      continue;
    }
    events.put(it->device, it->event);
    Block* b = it->block;
    it = pending_.erase(it);
    if (--b->pending == 0) retire(b);
  }
}

// ---------------------------------------------------------------- cache and budget

bool DeviceAllocator::empty_cache() {
  std::unique_lock<std::mutex> lock(mu_);
  TB_REQUIRE(!graphs_.capturing(), kState, "empty_cache() during CUDA graph capture", false);
  release_cached(lock);
  return true;
}

bool DeviceAllocator::set_budget(int64_t bytes, double fraction, bool strict) {
  TB_REQUIRE(bytes >= 0 || (fraction > 0 && fraction <= 1), kInvalidArgument,
             "a budget is bytes >= 0 or a fraction in (0, 1] of the card", false);
  bytes = Budget::resolve(bytes, fraction, caps_.total_bytes);
  std::unique_lock<std::mutex> lock(mu_);
  // Only resident memory counts: a released tag's blocks hold no device memory now.
  int64_t allocated = ledger_.allocated_bytes.s[kAggregate].get();
  for (int t = 1; t < kMaxTags; ++t)
    if (!tag_live(t)) allocated -= ledger_.tag_allocated[t].get();
  TB_REQUIRE(!strict || bytes >= allocated, kInvalidArgument,
             "budget of " + format_size(bytes) + " is below what device " + std::to_string(ctx_.device) +
                 " already has allocated (" + format_size(allocated) + "): free tensors first",
             false);
  if (bytes < budget_.reserved()) {
    TB_REQUIRE(!graphs_.capturing(), kState, "cannot lower the budget below reserved memory during graph capture",
               false);
    release_cached(lock);
    if (!strict) {
      budget_.set_limit(bytes);
      return true;
    }
    const int64_t reserved = budget_.reserved();
    TB_REQUIRE(bytes >= reserved, kInvalidArgument,
               "budget of " + format_size(bytes) + " is below the " + format_size(reserved) + " device " +
                   std::to_string(ctx_.device) + " still holds after releasing its cache (graph pools: " +
                   format_size(ledger_.graph_pool_reserved.get()) + ")",
               false);
  }
  budget_.set_limit(bytes);
  return true;
}

bool DeviceAllocator::grant_peer(int peer) {
  TB_REQUIRE(peer >= 0 && peer != ctx_.device, kInvalidArgument,
             "device " + std::to_string(peer) + " cannot be a peer of device " + std::to_string(ctx_.device), false);
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(peers_.begin(), peers_.end(), peer) != peers_.end()) return true;
  if (vmm_ && !vmm_->grant_peer(peer)) return false;
  if (pool_ && !pool_->grant_peer(peer)) return false;
  peers_.push_back(peer);
  return true;
}

size_t DeviceAllocator::largest_free() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t best = sync_pool_->largest_free();
  if (vmm_pool_) best = std::max(best, vmm_pool_->largest_free());
  for (const auto& p : tag_pools_)
    if (p) best = std::max(best, p->largest_free());
  return best;
}

bool DeviceAllocator::cache_info(size_t* largest) {
  *largest = largest_free();
  if (*largest > 0) return true;
  size_t free_b = 0, total_b = 0;
  if (!mem_info(&free_b, &total_b)) return false;
  const int64_t room = budget_.limit() - budget_.reserved();
  *largest = room < static_cast<int64_t>(free_b) ? static_cast<size_t>(std::max<int64_t>(room, 0)) : free_b;
  return true;
}

void DeviceAllocator::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  ledger_.reset_peaks();
}

void DeviceAllocator::reset_accumulated() {
  std::lock_guard<std::mutex> lock(mu_);
  ledger_.reset_accumulated();
}

// ---------------------------------------------------------------- introspection

std::vector<SegmentView> DeviceAllocator::segments(bool runs) {
  std::lock_guard<std::mutex> lock(mu_);
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
      v.mapped = seg->route == kRouteVmm ? seg->mapped * vmm_->granule() : seg->size;
      if (runs && seg->route == kRouteVmm) {
        const size_t g = vmm_->granule();
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
  visit(vmm_pool_.get(), PoolId{0, 0});
  for (const auto& p : tag_pools_) visit(p.get(), PoolId{0, 0});
  visit(sync_pool_.get(), PoolId{0, 0});
  visit(pool_pool_.get(), PoolId{0, 0});
  for (auto& [id, p] : graphs_.pools()) visit(p.blocks.get(), id);
  return out;
}

std::vector<SegmentView> DeviceAllocator::mapped_segments() {
  std::vector<SegmentView> all = segments(/*runs=*/true);
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

void DeviceAllocator::inactive_split(int64_t* count, int64_t* bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  inactive_split_locked(count, bytes);
}

void DeviceAllocator::inactive_split_locked(int64_t* count, int64_t* bytes) {
  *count = 0;
  *bytes = 0;
  auto visit = [&](const BlockPool* pool) {
    if (pool == nullptr) return;
    for (bool small : {true, false})
      for (const Block* b : pool->free_set(small))
        if (b->segment->live > 0) {
          ++*count;
          *bytes += static_cast<int64_t>(b->size);
        }
  };
  visit(vmm_pool_.get());
  visit(sync_pool_.get());
  for (const auto& p : tag_pools_) visit(p.get());
}

}  // namespace tb
