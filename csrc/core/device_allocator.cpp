#include "device_allocator.h"

#include <algorithm>
#include <cstdio>

#include "driver.h"
#include "error.h"
#include "scope.h"

namespace tb {
namespace {

std::string human(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  else if (bytes >= (int64_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1 << 20));
  else std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  return buf;
}

bool is_small(const Block* b) { return b->segment ? b->segment->small : b->size <= kSmallSize; }

}  // namespace

// The driver may already be gone at process exit: driver resources are left to it;
// block objects are freed by their pools.
DeviceAllocator::~DeviceAllocator() {
  live_.for_each([](uintptr_t, Block* b) {
    if (b->segment == nullptr) delete b;  // pool-route blocks belong to no BlockPool
  });
}

bool probe_device(int device, Capabilities* caps) {
  const DriverApi* d = driver();
  TB_REQUIRE(d != nullptr, kNotAvailable, "no CUDA driver loaded", false);
  CUdevice dev = 0;
  TB_DRIVER_CHECK(d->deviceGet(&dev, device), false);
  TB_DRIVER_CHECK(d->deviceTotalMem(&caps->total_bytes, dev), false);
  int v = 0;
  TB_DRIVER_CHECK(d->deviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), false);
  caps->vmm = v != 0;
  TB_DRIVER_CHECK(d->deviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev), false);
  caps->pools = v != 0;
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
  if (!probe_device(device_, &caps_)) return false;
  CUdevice dev = 0;
  TB_DRIVER_CHECK(d->deviceGet(&dev, device_), false);
  TB_DRIVER_CHECK(d->primaryCtxRetain(&ctx_, dev), false);
  if (!make_current()) return false;

  size_t granule = 2 << 20;
  if (caps_.vmm) {
    granule = std::max(granule, caps_.granularity) / caps_.granularity * caps_.granularity;
    const size_t arena = (caps_.total_bytes + granule - 1) / granule * granule;
    vmm_ = std::make_unique<VmmRoute>(*this, granule, arena, settings.reuse_before_grow);
    vmm_pool_ = std::make_unique<BlockPool>(vmm_.get(), kRouteVmm, false);
  }
  sync_ = std::make_unique<SyncRoute>(*this);
  sync_pool_ = std::make_unique<BlockPool>(sync_.get(), kRouteSync, false);
  pool_ = std::make_unique<PoolRoute>(*this);
  if (caps_.pools && !pool_->init()) {
    caps_.pools = false;  // e.g. UVM disabled: the route is simply unavailable
    clear_error();
  }
  int64_t budget = INT64_MAX;
  if (settings.budget_bytes >= 0) budget = settings.budget_bytes;
  else if (settings.budget_fraction > 0) budget = static_cast<int64_t>(settings.budget_fraction * caps_.total_bytes);
  budget_.store(budget);
  return true;
}

bool DeviceAllocator::make_current() {
  const DriverApi* d = driver();
  CUcontext cur = nullptr;
  TB_DRIVER_CHECK(d->ctxGetCurrent(&cur), false);
  if (cur != ctx_) TB_DRIVER_CHECK(d->ctxSetCurrent(ctx_), false);
  return true;
}

int DeviceAllocator::resolve_route(int route) const {
  if (route == kRouteVmm && !caps_.vmm) route = caps_.pools ? kRoutePool : kRouteSync;
  if (route == kRoutePool && !caps_.pools) route = kRouteSync;
  return route;
}

// ---------------------------------------------------------------- budget

bool DeviceAllocator::fits(size_t bytes) {
  const int64_t reserved = ledger_.reserved_bytes.s[kAggregate].get();
  if (reserved + static_cast<int64_t>(bytes) > budget()) {
    budget_refused_ = true;
    set_error(kOutOfMemory, "budget");
    return false;
  }
  return true;
}

bool DeviceAllocator::charge(size_t bytes, int route, bool graph_pool, bool small) {
  if (!fits(bytes)) return false;
  const auto n = static_cast<int64_t>(bytes);
  ledger_.reserved_bytes.add(small, n);
  ledger_.route_reserved[route].add(n);
  if (graph_pool && route != kRouteVmm) ledger_.graph_pool_reserved.add(n);  // VMM: counted at map time
  return true;
}

void DeviceAllocator::uncharge(size_t bytes, int route, bool graph_pool, bool small) {
  const auto n = static_cast<int64_t>(bytes);
  ledger_.reserved_bytes.sub(small, n);
  ledger_.route_reserved[route].sub(n);
  if (graph_pool && route != kRouteVmm) ledger_.graph_pool_reserved.sub(n);
}

void DeviceAllocator::refresh_pool_reserved() {
  if (!pool_ || !pool_->available()) return;
  const size_t now = pool_->reserved();
  const auto delta = static_cast<int64_t>(now) - static_cast<int64_t>(pool_reserved_seen_);
  if (delta > 0) {
    ledger_.reserved_bytes.add(false, delta);
    ledger_.route_reserved[kRoutePool].add(delta);
  } else if (delta < 0) {
    ledger_.reserved_bytes.sub(false, -delta);
    ledger_.route_reserved[kRoutePool].sub(-delta);
  }
  pool_reserved_seen_ = now;
}

size_t DeviceAllocator::reserved_total() { return static_cast<size_t>(ledger_.reserved_bytes.s[kAggregate].get()); }

size_t DeviceAllocator::pool_route_reserved() {
  std::lock_guard<std::mutex> lock(mu_);
  return pool_ && pool_->available() ? pool_->reserved() : 0;
}

bool DeviceAllocator::set_budget(int64_t bytes) {
  TB_REQUIRE(bytes >= 0, kInvalidArgument, "budget must be >= 0 bytes, got " + std::to_string(bytes), false);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t allocated = ledger_.allocated_bytes.s[kAggregate].get();
  TB_REQUIRE(bytes >= allocated, kInvalidArgument,
             "budget of " + human(bytes) + " is below what device " + std::to_string(device_) +
                 " already has allocated (" + human(allocated) + "): free tensors first",
             false);
  if (bytes < static_cast<int64_t>(reserved_total())) {
    TB_REQUIRE(!graphs_.capturing(), kState, "cannot lower the budget below reserved memory during graph capture",
               false);
    synchronize_and_release_cached();
    const int64_t reserved = static_cast<int64_t>(reserved_total());
    TB_REQUIRE(bytes >= reserved, kInvalidArgument,
               "budget of " + human(bytes) + " is below the " + human(reserved) + " device " +
                   std::to_string(device_) + " still holds after releasing its cache (graph pools: " +
                   human(ledger_.graph_pool_reserved.get()) + ")",
               false);
  }
  budget_.store(bytes);
  return true;
}

std::string DeviceAllocator::budget_text() {
  return budget() == INT64_MAX ? std::string("none (the whole card)") : human(budget());
}

std::string DeviceAllocator::oom_message(size_t size, int route, int tag, bool budget_refused,
                                         const std::string& cause) {
  size_t free_b = 0, total_b = 0;
  if (make_current()) driver()->memGetInfo(&free_b, &total_b);
  std::string msg = "torch_budget: CUDA out of memory on device " + std::to_string(device_) + ". Tried to allocate " +
                    human(static_cast<int64_t>(size)) + " (route " + route_name(route) + ", tag '" + tag_name(tag) +
                    "'). ";
  msg += budget_refused ? "It would exceed the budget of " + budget_text() + "."
                        : "The driver refused it (" + cause + ").";
  msg += " Allocated " + human(ledger_.allocated_bytes.s[kAggregate].get()) + ", reserved " +
         human(ledger_.reserved_bytes.s[kAggregate].get()) + " (cached memory was released and the allocation "
         "retried), budget " + budget_text() + ", device free " + human(static_cast<int64_t>(free_b)) + " of " +
         human(static_cast<int64_t>(total_b)) + ". ";
  msg += budget_refused
             ? "To allow more, raise the budget: torch_budget.install(budget=...), TORCH_BUDGET_CONF=budget:..., "
               "torch_budget.set_budget() or torch.cuda.set_per_process_memory_fraction(); or free tensors."
             : "Other processes or memory outside torch hold the rest: lower batch size or KV cache, or free tensors.";
  return msg;
}

// ---------------------------------------------------------------- allocation

Block* DeviceAllocator::try_malloc(size_t size, CUstream stream, int route, BlockPool* graph_pool) {
  budget_refused_ = false;
  RelaxedCaptureMode relaxed(graphs_.capturing());
  if (graph_pool != nullptr) return graph_pool->malloc(size, stream);
  if (route == kRoutePool) {
    Block* b = pool_->malloc(size, stream);
    if (b != nullptr) refresh_pool_reserved();
    return b;
  }
  return default_pool(route)->malloc(size, stream);
}

Block* DeviceAllocator::malloc(size_t size, CUstream stream, int route, int tag) {
  TB_REQUIRE(size > 0, kInvalidArgument, "allocation size must be positive", nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  BlockPool* graph_pool = nullptr;
  if (graphs_.capturing()) {
    graph_pool = graphs_.route_for(stream);
  } else if (!pending_.empty() || !deferred_frees_.empty()) {
    process_events();
  }
  route = graph_pool ? graph_pool->route() : resolve_route(route);
  Block* b = try_malloc(size, stream, route, graph_pool);
  if (b == nullptr) {
    if (last_error_code() != kOutOfMemory) return nullptr;
    bump(ledger_.num_alloc_retries);
    if (!graphs_.capturing()) synchronize_and_release_cached();
    b = try_malloc(size, stream, route, graph_pool);
    if (b == nullptr) {
      if (last_error_code() == kOutOfMemory) {
        bump(ledger_.num_ooms);
        set_error(kOutOfMemory, oom_message(size, route, tag, budget_refused_, last_error_message()));
      }
      return nullptr;
    }
  }
  b->device = device_;
  b->tag = tag;
  account_alloc(b, tag);
  live_.insert(b->ptr, b);
  return b;
}

void DeviceAllocator::account_alloc(Block* b, int tag) {
  const bool small = is_small(b);
  const auto size = static_cast<int64_t>(b->size);
  ledger_.allocation.add(small, 1);
  ledger_.allocated_bytes.add(small, size);
  ledger_.active.add(small, 1);
  ledger_.active_bytes.add(small, size);
  ledger_.requested_bytes.add(small, static_cast<int64_t>(b->requested));
  ledger_.route_allocated[b->route].add(size);
  bump(ledger_.route_count[b->route]);
  ledger_.tag_allocated[tag].add(size);
  ledger_.tag_requested[tag].add(static_cast<int64_t>(b->requested));
  bump(ledger_.tag_count[tag]);
}

void DeviceAllocator::account_release(Block* b) {
  const bool small = is_small(b);
  const auto size = static_cast<int64_t>(b->size);
  ledger_.allocation.sub(small, 1);
  ledger_.allocated_bytes.sub(small, size);
  ledger_.requested_bytes.sub(small, static_cast<int64_t>(b->requested));
  ledger_.route_allocated[b->route].sub(size);
  ledger_.tag_allocated[b->tag].sub(size);
  ledger_.tag_requested[b->tag].sub(static_cast<int64_t>(b->requested));
}

void DeviceAllocator::account_inactive(Block* b) {
  const bool small = is_small(b);
  ledger_.active.sub(small, 1);
  ledger_.active_bytes.sub(small, static_cast<int64_t>(b->size));
}

void DeviceAllocator::return_block(Block* b) {
  if (b->segment == nullptr) {  // pool route
    if (!pool_->free(b)) {
      // The memory stays with the pool; the block object goes either way.
    }
    delete b;
    return;
  }
  BlockPool* pool = b->segment->pool;
  pool->free(b);
  if (pool->graph_pool()) maybe_destroy_graph_pool(pool);
}

bool DeviceAllocator::owns(uintptr_t ptr, Block** block) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_.find(ptr);
  if (b == nullptr || !b->allocated) return false;
  *block = b;
  return true;
}

bool DeviceAllocator::free(Block* b) {
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(b->allocated && live_.find(b->ptr) == b, kInvalidArgument,
             "free of a block that is not allocated (double free?)", false);
  return free_locked(b);
}

bool DeviceAllocator::free_ptr(uintptr_t ptr, bool* found) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_.find(ptr);
  *found = b != nullptr && b->allocated;
  return *found && free_locked(b);
}

bool DeviceAllocator::free_locked(Block* b) {
  live_.erase(b->ptr);
  account_release(b);
  b->allocated = false;
  const bool pool_route = b->segment == nullptr;
  if (graphs_.capturing() && (pool_route || !b->recorded.empty())) {
    // No event records and no stream-ordered frees while a capture is open: the
    // block is held until the capture ends.
    b->pending = 1;
    deferred_frees_.push_back(b);
    return true;
  }
  if (pool_route || b->recorded.empty()) {
    // No other stream used it, or the pool route orders the free on its own stream.
    account_inactive(b);
    return_block(b);
    return true;
  }
  b->pending = 1;  // held until every recorded stream passed this point
  deferred_frees_.push_back(b);
  process_events();
  return true;
}

bool DeviceAllocator::record_stream(Block* b, CUstream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stream == b->stream) return true;
  if (std::find(b->recorded.begin(), b->recorded.end(), stream) == b->recorded.end()) b->recorded.push_back(stream);
  return true;
}

CUevent DeviceAllocator::get_event() {
  if (!events_.empty()) {
    CUevent e = events_.back();
    events_.pop_back();
    return e;
  }
  CUevent e = nullptr;
  TB_DRIVER_CHECK(driver()->eventCreate(&e, CU_EVENT_DISABLE_TIMING), nullptr);
  return e;
}

void DeviceAllocator::put_event(CUevent e) { events_.push_back(e); }

// Starts events for blocks whose free was deferred, then frees every block whose
// recorded streams all passed their event. See Note [Stream-ordered reuse].
void DeviceAllocator::process_events() {
  if (graphs_.capturing()) return;
  const DriverApi* d = driver();
  if (!deferred_frees_.empty()) {
    make_current();
    std::vector<Block*> deferred;
    deferred.swap(deferred_frees_);
    for (Block* b : deferred) {
      if (b->segment == nullptr) {  // pool route: the free itself waits on the streams
        b->pending = 0;
        account_inactive(b);
        return_block(b);
        continue;
      }
      b->pending = 0;
      for (CUstream s : b->recorded) {
        CUevent e = get_event();
        if (e == nullptr || d->eventRecord(e, s) != CUDA_SUCCESS) {
          // Cannot order against that stream: wait for it instead.
          d->streamSynchronize(s);
          if (e) put_event(e);
          continue;
        }
        b->pending++;
        pending_.push_back(Pending{b, e});
      }
      if (b->pending == 0) {
        account_inactive(b);
        return_block(b);
      }
    }
  }
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (d->eventQuery(it->event) == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    put_event(it->event);
    Block* b = it->block;
    it = pending_.erase(it);
    if (--b->pending == 0) {
      account_inactive(b);
      return_block(b);
    }
  }
}

void DeviceAllocator::synchronize_and_release_cached() {
  if (!make_current()) return;
  driver()->ctxSynchronize();
  bump(ledger_.num_sync_all_streams);
  process_events();
  if (vmm_pool_) vmm_->release_cached(*vmm_pool_);
  sync_->release_cached(*sync_pool_);
  if (pool_->available()) {
    pool_->trim();
    refresh_pool_reserved();
  }
}

bool DeviceAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(!graphs_.capturing(), kState, "empty_cache() during CUDA graph capture", false);
  synchronize_and_release_cached();
  return true;
}

size_t DeviceAllocator::largest_free() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t best = sync_pool_->largest_free();
  if (vmm_pool_) best = std::max(best, vmm_pool_->largest_free());
  return best;
}

// ---------------------------------------------------------------- graph pools

bool DeviceAllocator::begin_allocate_to_pool(const PoolId& id, StreamFilter filter) {
  std::lock_guard<std::mutex> lock(mu_);
  acquire_pool(id);
  graphs_.begin_capture(id, std::move(filter));
  return true;
}

void DeviceAllocator::acquire_pool(const PoolId& id) {
  Backing* backing = caps_.vmm ? static_cast<Backing*>(vmm_.get()) : static_cast<Backing*>(sync_.get());
  graphs_.acquire(id, backing, caps_.vmm ? kRouteVmm : kRouteSync);
}

void DeviceAllocator::create_or_incref_pool(const PoolId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  acquire_pool(id);
}

int DeviceAllocator::pool_use_count(const PoolId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  PrivatePool* p = graphs_.find(id);
  return p ? p->use_count : 0;
}

bool DeviceAllocator::end_allocate_to_pool(const PoolId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  graphs_.end_capture(id);
  if (!graphs_.capturing()) process_events();
  return true;
}

bool DeviceAllocator::release_pool(const PoolId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  bool ok = false;
  PrivatePool* p = graphs_.release(id, &ok);
  if (!ok) return false;
  if (p != nullptr) maybe_destroy_graph_pool(p->blocks.get());
  return true;
}

void DeviceAllocator::maybe_destroy_graph_pool(BlockPool* blocks) {
  PoolId id;
  PrivatePool* p = graphs_.find(blocks, &id);
  if (p == nullptr || p->use_count > 0 || blocks->live_blocks() > 0 || graphs_.capturing()) return;
  // A replay may still be running on some stream.
  if (!make_current()) return;
  driver()->ctxSynchronize();
  for (const auto& seg : blocks->segments()) blocks->backing()->destroy_segment(*seg);
  graphs_.erase(id);
}

// ---------------------------------------------------------------- introspection

std::vector<SegmentView> DeviceAllocator::segments() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SegmentView> out;
  auto visit = [&](BlockPool& pool, const PoolId& id) {
    for (const auto& seg : pool.segments()) {
      SegmentView v{};
      v.base = seg->base;
      v.size = seg->size;
      v.stream = seg->stream;
      v.small = seg->small;
      v.route = seg->route;
      v.pool = id;
      v.mapped = seg->route == kRouteVmm ? seg->mapped * vmm_->granule() : seg->size;
      for (const Block* b = seg->head; b; b = b->next) {
        const int state = b->allocated ? 1 : (b->pending > 0 ? 2 : 0);
        if (b->allocated) {
          v.allocated += b->size;
          v.requested += b->requested;
        }
        if (state != 0) v.active += b->size;
        v.blocks.push_back({b->size, b->requested, state});
      }
      out.push_back(std::move(v));
    }
  };
  if (vmm_pool_) visit(*vmm_pool_, PoolId{0, 0});
  visit(*sync_pool_, PoolId{0, 0});
  for (auto& [id, p] : graphs_.pools()) visit(*p.blocks, id);
  live_.for_each([&](uintptr_t, Block* b) {
    if (b->segment != nullptr) return;
    SegmentView v{};
    v.base = b->ptr;
    v.size = v.allocated = v.active = v.mapped = b->size;
    v.requested = b->requested;
    v.stream = b->stream;
    v.small = b->size <= kSmallSize;
    v.route = kRoutePool;
    v.blocks.push_back({b->size, b->requested, 1});
    out.push_back(std::move(v));
  });
  return out;
}

void DeviceAllocator::inactive_split(int64_t* count, int64_t* bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  *count = 0;
  *bytes = 0;
  auto visit = [&](BlockPool& pool) {
    for (bool small : {true, false})
      for (const Block* b : pool.free_set(small))
        if (b->segment->live > 0) {
          ++*count;
          *bytes += static_cast<int64_t>(b->size);
        }
  };
  if (vmm_pool_) visit(*vmm_pool_);
  visit(*sync_pool_);
}

}  // namespace tb
