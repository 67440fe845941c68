// The only code that includes torch headers (with history.* and ipc.* beside it): a
// subclass of torch's CUDAPluggableAllocator that serves torch from the core and
// answers torch's statistics, snapshot, history, cache, graph-pool, checkpoint and
// IPC calls from the core's ledger, and tells torch's profiler of each allocation.
//
// Overriding allocate() and raw_deleter() skips the base class's mutex and pointer
// map on every allocation (Note [One deleter]). Allocation failures become c10
// errors here (this is C++ called by torch, not the C ABI): kOutOfMemory ->
// torch.cuda.OutOfMemoryError.
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "bridge/errors.h"
#include "bridge/history.h"
#include "bridge/ipc.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/scope.h"
#include "tb_capi.h"

namespace tb {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;

// torch's graph_capture_record_stream_reuse setting, on the torch versions that have it.
template <typename Config, typename = void>
struct HasCaptureReuse : std::false_type {};
template <typename Config>
struct HasCaptureReuse<Config, std::void_t<decltype(Config::graph_capture_record_stream_reuse())>> : std::true_type {};

template <typename Config = cca::CUDAAllocatorConfig>
bool capture_reuse_setting() {
  if constexpr (HasCaptureReuse<Config>::value)
    return Config::graph_capture_record_stream_reuse();
  else
    return false;
}

using bridge::History;

// torch.profiler(profile_memory=True) hears of each allocation and free from the
// allocator, as torch's own reports them: the block's size (negative for a free), then
// the device's allocated and reserved totals after the call. Nothing is read unless
// the profiler is recording memory; then under the lock, which accounts a parked block's
// free first (Note [The parked block]).
void report_to_profiler(int device, uintptr_t ptr, int64_t delta) {
  tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device);
  if (d == nullptr) return;
  size_t allocated = 0, reserved = 0;
  d->read_locked([&](const Ledger& l) {
    allocated = static_cast<size_t>(l.blocks[kAggregate].allocated_bytes.get());
    reserved = static_cast<size_t>(l.reserved_bytes.s[kAggregate].get());
  });
  c10::reportMemoryUsageToProfiler(reinterpret_cast<void*>(ptr), delta, allocated, reserved,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

// A free the profiler is told of: the block's device and size are read before it goes.
class ProfiledFree {
 public:
  explicit ProfiledFree(void* ptr) {
    if (c10::memoryProfilingEnabled() && !tb::Allocator::get().lookup(ptr, &device_, &info_)) device_ = -1;
  }
  void done() const {
    if (device_ >= 0) report_to_profiler(device_, info_.base, -static_cast<int64_t>(info_.size));
  }

 private:
  int device_ = -1;
  BlockInfo info_{};
};

}  // namespace

// Out of memory: torch's observers first (with the numbers torch gives them), then
// torch's OutOfMemoryError with the core's message.
void bridge::raise_last_error(const char* what, int device, size_t size, const tb::OomFigures* oom) {
  const std::string msg = *last_error_message() ? std::string(last_error_message()) : std::string(what);
  if (last_error_code() == kOutOfMemory) {
    if (tb::DeviceAllocator* d = device >= 0 ? tb::Allocator::get().device_if_ready(device) : nullptr) {
      size_t free_b = 0, total_b = 0;
      d->mem_info(&free_b, &total_b);
      const int64_t limit = d->budget() < static_cast<int64_t>(total_b) ? d->budget() : static_cast<int64_t>(total_b);
      // The allocation's own figures, from under the lock: the device's have moved on since
      // wherever another thread allocated meanwhile.
      const tb::OomFigures now{false, d->ledger().blocks[kAggregate].allocated_bytes.get(),
                               d->ledger().reserved_bytes.s[kAggregate].get()};
      const tb::OomFigures& f = oom != nullptr ? *oom : now;
      if (f.by_budget)
        History::get().notify_rejection(device, size, static_cast<size_t>(f.allocated), static_cast<size_t>(limit));
      History::get().notify_oom(device, size, static_cast<size_t>(limit), free_b);
      c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(size), static_cast<size_t>(f.allocated),
                                       static_cast<size_t>(f.reserved),
                                       c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  TORCH_CHECK(false, "torch_budget: ", what, ": ", msg);
}

namespace {

using bridge::raise_last_error;

// Note [One deleter]
// torch compares a storage's deleter with raw_deleter() (graph trees swap it, and
// _has_Standard_Deleter checks it), so every DataPtr we hand out uses this one
// function. A block is freed by its address, as torch's own allocator does: after a
// pool checkpoint is restored, a tensor that outlived it frees the block re-created
// at its address (Note [Pool checkpoints]). The context is that address with the
// device + 1 in its low bits (blocks are 512-byte aligned), so no device is searched;
// DataPtrs torch builds as {ptr, ptr, raw_deleter()} have 0 there.
constexpr uintptr_t kDeviceBits = 0xff;

void block_deleter(void* ctx) {
  if (ctx == nullptr) return;
  const auto v = reinterpret_cast<uintptr_t>(ctx);
  History::Scope stack(History::get(), c10::CachingDeviceAllocator::RecordContext::ALL);  // the free's stack
  const ProfiledFree profiled(reinterpret_cast<void*>(v & ~kDeviceBits));
  const bool ok = (v & kDeviceBits) != 0
                      ? tb::Allocator::get().free_at(static_cast<int>(v & kDeviceBits) - 1, v & ~kDeviceBits)
                      : tb::Allocator::get().free_ptr(ctx);
  if (!ok) {
    TORCH_WARN("torch_budget: free failed: ", last_error_message());
    return;
  }
  profiled.done();
}

void* block_context(const Block* b) {
  static_assert(kMaxDevices < kDeviceBits, "the device index must fit below the block alignment");
  return reinterpret_cast<void*>((b->ptr & kDeviceBits) == 0 ? b->ptr | static_cast<uintptr_t>(b->device + 1)
                                                              : b->ptr);
}

void copy_stat(c10::CachingAllocator::Stat& out, const Stat& in) {
  out.current = in.get();
  out.peak = in.peak.load(std::memory_order_relaxed);
  out.allocated = in.allocated.load(std::memory_order_relaxed);
  out.freed = in.freed.load(std::memory_order_relaxed);
}

void copy_array(c10::CachingAllocator::StatArray& out, const StatArray3& in) {
  for (int i = 0; i < kPoolKinds; ++i) copy_stat(out[i], in.s[i]);
}

void copy_array(c10::CachingAllocator::StatArray& out, const Ledger& l, Stat BlockStats::*s) {
  for (int i = 0; i < kPoolKinds; ++i) copy_stat(out[i], l.blocks[i].*s);
}

// A MemPool's own allocator, as the core's segment source.
class TorchSource final : public SegmentSource {
 public:
  explicit TorchSource(std::shared_ptr<cca::CUDAAllocator> a) : a_(std::move(a)) {}
  CUdeviceptr alloc(size_t bytes, CUstream stream) override {
    try {
      return reinterpret_cast<CUdeviceptr>(a_->raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream)));
    } catch (const std::exception& e) {
      set_error(kOutOfMemory, std::string("the memory pool's own allocator failed: ") + e.what());
      return 0;
    }
  }
  void free(CUdeviceptr ptr) override {
    try {
      a_->raw_delete(reinterpret_cast<void*>(ptr));
    } catch (const std::exception& e) {
      TORCH_WARN("torch_budget: the memory pool's own allocator failed to free: ", e.what());
    }
  }

 private:
  std::shared_ptr<cca::CUDAAllocator> a_;
};

// torch's trigger_free_memory_callbacks, which its allocator runs before it gives up on an
// allocation: what registered in c10's FreeCudaMemoryCallbacksRegistry frees memory it holds
// (torch's CUDA IPC limbo: blocks this process dropped while a consumer still held them, whose
// consumers are done). Run with no lock of the core held: the callbacks free through this
// allocator. Run after a quiet first attempt failed (Note [A quiet first attempt]), before the
// full one, which reclaims the cache only if what they freed was not enough.
void free_memory_callbacks() {
  for (const std::string& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys())
    c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
}

class BudgetAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  BudgetAllocator()
      : CUDAPluggableAllocator(
            [](size_t size, int device, cudaStream_t stream) {
              return tb_malloc(static_cast<ssize_t>(size), device, stream);
            },
            [](void* ptr, size_t size, int device, cudaStream_t stream) {
              tb_free(ptr, static_cast<ssize_t>(size), device, stream);
            }) {}

  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    const c10::Device dev(c10::DeviceType::CUDA, device);
    if (size == 0) return {nullptr, nullptr, &block_deleter, dev};
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    Block* b = serve(size, device, stream);
    return {reinterpret_cast<void*>(b->ptr), block_context(b), &block_deleter, dev};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &block_deleter; }

  void* raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return reinterpret_cast<void*>(serve(nbytes, c10::cuda::current_device(), stream)->ptr);
  }

  void raw_delete(void* ptr) override {
    if (ptr == nullptr) return;
    History::Scope stack(History::get(), c10::CachingDeviceAllocator::RecordContext::ALL);  // the free's stack
    const ProfiledFree profiled(ptr);
    if (!tb::Allocator::get().free_ptr(ptr)) raise_last_error("free failed");
    profiled.done();
  }

  void init(int /*device_count*/) override { initialized_ = true; }
  bool initialized() override { return initialized_; }

  double getMemoryFraction(c10::DeviceIndex device) override {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr || d->budget() == INT64_MAX) return 1.0;
    return static_cast<double>(d->budget()) / static_cast<double>(d->caps().total_bytes);
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "torch_budget: memory fraction must be within [0, 1], got ",
                fraction);
    tb::DeviceAllocator* d = ready(device, "setMemoryFraction");
    if (!(fraction > 0 ? d->set_budget(-1, fraction, false) : d->set_budget(0, -1, false)))
      raise_last_error("setMemoryFraction");
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }

  void emptyCache(c10::cuda::MempoolId_t mempool_id) override {
    const bool all = mempool_id.first == 0 && mempool_id.second == 0;
    // Segments given back now carry this stack when recording "all" (Note [History]).
    History::Scope stack(History::get(), c10::CachingDeviceAllocator::RecordContext::ALL);
    for (int i = 0; i < kMaxDevices; ++i) {
      tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(i);
      if (d == nullptr) continue;
      if (!(all ? d->empty_cache() : d->empty_pool_cache({mempool_id.first, mempool_id.second})))
        raise_last_error("empty_cache");
    }
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    tb::DeviceAllocator* d = ready(device, "cacheInfo");
    if (!d->cache_info(largest, tb::current_scope().tag)) raise_last_error("cacheInfo");
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    int device = 0;
    BlockInfo info{};
    if (!tb::Allocator::get().lookup(ptr, &device, &info)) raise_last_error("getBaseAllocation");
    *size = info.size;
    return reinterpret_cast<void*>(info.base);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr || ptr.get_deleter() != &block_deleter) return;
    // By address, under the owning device's lock: the block may be freed concurrently.
    if (!tb::Allocator::get().record_stream(ptr.get(), static_cast<CUstream>(stream.stream()), stream.device_index()))
      raise_last_error("recordStream");
  }

  // torch enables peer access before copies between devices; VMM mappings and the
  // memory pool need their own grant (Note [Peer access to VMM memory]).
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    if (!ready(dev_to_access, "enablePeerAccess")->grant_peer(dev)) raise_last_error("enablePeerAccess");
  }

  // torch's table (CUDACachingAllocator.h): without peer access, cudaMemcpyAsync between devices
  // fails on cuMemMap and cudaMallocAsync memory, which the VMM and pool routes hand out, where
  // the peer copy works on every kind; the pluggable base always made the plain copy.
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceStats stats;
    // As torch reports its default (no limit: SIZE_MAX), and as the snapshot's config says.
    stats.max_split_size = static_cast<int64_t>(std::numeric_limits<size_t>::max());
    tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device);
    if (d == nullptr) return stats;
    d->read_locked([&](const Ledger& l) {
      copy_array(stats.allocation, l, &BlockStats::allocation);
      copy_array(stats.segment, l.segment);
      copy_array(stats.active, l, &BlockStats::active);
      copy_array(stats.allocated_bytes, l, &BlockStats::allocated_bytes);
      copy_array(stats.reserved_bytes, l.reserved_bytes);
      copy_array(stats.active_bytes, l, &BlockStats::active_bytes);
      copy_array(stats.requested_bytes, l, &BlockStats::requested_bytes);
      stats.num_alloc_retries = l.num_alloc_retries.load();
      stats.num_ooms = l.num_ooms.load();
      stats.num_sync_all_streams = l.num_sync_all_streams.load();
      stats.num_device_alloc = l.num_device_alloc.load();
      stats.num_device_free = l.num_device_free.load();
    });
    int64_t split_count[kPoolKinds], split_bytes[kPoolKinds];
    d->inactive_split(split_count, split_bytes);
    for (int k = 0; k < kPoolKinds; ++k) {  // the current figure only: it is counted when asked
      stats.inactive_split[k].current = split_count[k];
      stats.inactive_split_bytes[k].current = split_bytes[k];
    }
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    if (tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device)) d->reset_accumulated();
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    if (tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device)) d->reset_peaks();
  }

  cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool_id, bool /*include_traces*/) override {
    cca::SnapshotInfo info{};  // value-initialised: torch's config struct has no defaults
    // The snapshot carries torch's allocator settings as torch reports them (the
    // visualiser shows them); torch_budget does not apply them.
    info.config_metadata.max_split_size = std::numeric_limits<size_t>::max();
    info.config_metadata.roundup_power2_divisions =
        c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions();
    info.config_metadata.last_allocator_settings =
        c10::CachingAllocator::AcceleratorAllocatorConfig::last_allocator_settings();
    const bool all = mempool_id.first == 0 && mempool_id.second == 0;
    int devices = 0;
    size_t total_active = 0;
    for (int i = 0; i < kMaxDevices; ++i) {
      tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(i);
      if (d == nullptr) continue;
      devices = i + 1;
      for (const SegmentView& v : d->mapped_segments()) {
        if (!all && (v.pool.first != mempool_id.first || v.pool.second != mempool_id.second)) continue;
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(i);
        seg.address = v.base;
        seg.total_size = v.size;
        seg.requested_size = v.requested;
        seg.allocated_size = v.allocated;
        seg.active_size = v.active;
        seg.stream = v.stream;
        seg.is_large = !v.small;
        seg.is_expandable = v.route == kRouteVmm;
        seg.owner_private_pool_id = {v.pool.first, v.pool.second};
        total_active += v.active;
        for (const auto& bv : v.blocks) {
          c10::CachingDeviceAllocator::BlockInfo bi;
          bi.size = bv.size;
          // An inactive block reports what its last allocation asked for, as torch's does.
          bi.requested_size = std::min(bv.requested, bv.size);
          bi.allocated = bv.state == 1;
          bi.active = bv.state != 0;
          if (bv.state != 0) bi.context_when_allocated = History::get().stack_of(i, bv.ptr);
          seg.blocks.push_back(std::move(bi));
        }
        info.segments.push_back(std::move(seg));
      }
    }
    std::sort(info.segments.begin(), info.segments.end(),
              [](const auto& a, const auto& b) { return a.address < b.address; });
    info.device_traces = History::get().traces(std::max<int>(devices, c10::cuda::device_count()), total_active);
    return info;
  }

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    History::get().record(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory, skip_actions);
  }

  bool isHistoryEnabled() override { return History::get().enabled(); }

  // torch.cuda.memory._set_memory_metadata: a string for this thread's trace entries.
  // (Declared without `override`: the hooks are virtual only in some torch versions.)
  bool supportsUserMetadata() { return true; }
  void setUserMetadata(const std::string& metadata) { History::set_user_metadata(metadata); }
  std::string getUserMetadata() { return History::user_metadata(); }

  // _record_memory_history(compile_context=True): torch.compile names the region it
  // runs, innermost last, for this thread's trace entries.
  void pushCompileContext(std::string& md) override { History::push_compile_context(md); }
  void popCompileContext() override { History::pop_compile_context(); }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    History::get().attach_oom_observer(std::move(observer));
  }

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
  // Called when the budget (torch's memory fraction included) refuses an allocation
  // before the driver is asked, then the out-of-memory observers are.
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    History::get().attach_rejection_observer(std::move(observer));
  }
#endif

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    History::get().attach_tracker(std::move(tracker));
  }

  // Note [Pool checkpoints] (core/pool_checkpoint.h).
  struct CheckpointState final : cca::AllocatorState {
    int device = 0;
    PoolCheckpoint checkpoint;
  };

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::cuda::MempoolId_t id) override {
    auto state = std::make_shared<CheckpointState>();
    state->device = device;
    if (!ready(device, "getCheckpointState")->checkpoint_pool({id.first, id.second}, &state->checkpoint))
      raise_last_error("getCheckpointState");
    return state;
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<CheckpointState>(as);
    TORCH_CHECK(state != nullptr, "torch_budget: setCheckpointPoolState needs a state from its getCheckpointState");
    TORCH_CHECK(state->device == device, "torch_budget: a checkpoint of device ", state->device,
                " cannot be restored on device ", static_cast<int>(device));
    std::vector<uintptr_t> freed;
    std::vector<Block*> created;
    if (!ready(device, "setCheckpointPoolState")->restore_checkpoint(state->checkpoint, &freed, &created))
      raise_last_error("setCheckpointPoolState");
    cca::CheckpointDelta delta;
    for (uintptr_t p : freed) delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
    const c10::Device dev(c10::DeviceType::CUDA, device);
    for (Block* b : created)
      delta.dataptrs_allocd.emplace_back(reinterpret_cast<void*>(b->ptr), block_context(b), &block_deleter, dev);
    return delta;
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<uintptr_t> ptrs;
    ptrs.reserve(expected.size());
    for (void* p : expected) ptrs.push_back(reinterpret_cast<uintptr_t>(p));
    bool match = false;
    if (!ready(device, "checkPoolLiveAllocations")->pool_live_matches({id.first, id.second}, ptrs, &match))
      raise_last_error("checkPoolLiveAllocations");
    return match;
  }

  cca::ShareableHandle shareIpcHandle(void* ptr) override { return bridge::share_ipc_handle(ptr); }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return bridge::open_ipc_handle(handle); }

  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    auto f = [filter = std::move(filter)](CUstream s) { return filter(static_cast<cudaStream_t>(s)); };
    tb::DeviceAllocator::set_capture_reuse(capture_reuse_setting());  // as set when this capture begins
    if (!ready(device, "beginAllocateToPool")->begin_allocate_to_pool({id.first, id.second}, std::move(f))) raise_last_error("beginAllocateToPool");
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    if (!tb::Allocator::get().end_pool(device, {id.first, id.second})) raise_last_error("endAllocateToPool");
  }

  void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    if (!ready(device, "releasePool")->release_pool({id.first, id.second})) raise_last_error("releasePool");
  }

  // torch.cuda.MemPool and use_mem_pool reach the same private pools as capture; a
  // MemPool built with its own allocator takes its segments from it (core/route_user.h).
  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    std::unique_ptr<SegmentSource> source;
    if (allocator != nullptr && allocator.get() != this) source = std::make_unique<TorchSource>(std::move(allocator));
    ready(device, "createOrIncrefPool")->create_or_incref_pool({id.first, id.second}, std::move(source));
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    return ready(device, "getPoolUseCount")->pool_use_count({id.first, id.second});
  }

  void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t id, bool use_on_oom) override {
    if (!ready(device, "setUseOnOOM")->set_pool_options({id.first, id.second}, use_on_oom ? 1 : 0, false))
      raise_last_error("setUseOnOOM");
  }

  void setNoSplit(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    if (!ready(device, "setNoSplit")->set_pool_options({id.first, id.second}, -1, true))
      raise_last_error("setNoSplit");
  }

  std::string name() override { return "torch_budget"; }

 private:
  static tb::DeviceAllocator* ready(c10::DeviceIndex device, const char* what) {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr) raise_last_error(what);
    return d;
  }

  static Block* serve(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    History& h = History::get();
    const bool recording = h.enabled();
    if (recording) h.before_alloc();
    Block* b = nullptr;
    tb::OomFigures oom;
    {
      const tb::DeviceAllocator::QuietAttempt quiet;  // Note [A quiet first attempt]
      b = tb::Allocator::get().malloc(size, device, static_cast<CUstream>(stream));
    }
    if (b == nullptr && last_error_code() == kOutOfMemory) {
      try {
        // The callbacks' frees record their own stacks, not this allocation's (Note [History]).
        const History::SetAside aside;
        free_memory_callbacks();
      } catch (...) {
        History::forget();  // put back as the exception left the scope: not for the next event
        throw;
      }
      b = tb::Allocator::get().malloc(size, device, static_cast<CUstream>(stream), &oom);
    }
    if (b == nullptr) {
      if (recording) History::forget();
      raise_last_error("allocation failed", device, size, &oom);
    }
    if (c10::memoryProfilingEnabled()) report_to_profiler(device, b->ptr, static_cast<int64_t>(b->size));
    return b;
  }
};

// Never destroyed: torch may free tensors during interpreter shutdown, after static
// objects are gone.
std::shared_ptr<BudgetAllocator>& installed() {
  static auto* p = new std::shared_ptr<BudgetAllocator>();
  return *p;
}

// Note [Installing without the driver]: torch's allocator can be replaced without the CUDA
// driver; `start_driver` loads it (dlopen + cuInit) now, so that a machine without a usable
// driver fails here rather than at the first allocation. Left to the first allocation, the
// process stays forkable: cuInit before a fork leaves the child unable to start CUDA (which
// torch and vLLM call poisoning the fork, and vLLM's parent processes fork their workers).
int install_allocator(bool start_driver) {
  clear_error();
  try {
    auto* current = c10::cuda::CUDACachingAllocator::get();
    if (installed() && current == installed().get()) return 0;
    if (current != nullptr && current->initialized()) {
      set_error(kState,
                "torch's CUDA allocator is already initialised: call torch_budget.install() at process start, "
                "before the first CUDA tensor is created (and before torch.cuda.init() or any CUDA call)");
      return kState;
    }
    if (start_driver && !Allocator::get().load_driver()) return last_error_code();
    auto a = std::make_shared<BudgetAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    // torch.accelerator's memory calls look the CUDA allocator up in c10's table.
    c10::SetAllocator(c10::DeviceType::CUDA, a.get(), std::numeric_limits<uint8_t>::max());
    installed() = a;
    return 0;
  } catch (const std::exception& e) {
    set_error(kState, std::string("installing the allocator failed: ") + e.what());
    return kState;
  }
}

}  // namespace
}  // namespace tb

extern "C" {

int tb_torch_install(void) { return tb::install_allocator(true); }

int tb_torch_install_deferred(void) { return tb::install_allocator(false); }

int tb_torch_installed(void) {
  return tb::installed() && c10::cuda::CUDACachingAllocator::get() == tb::installed().get() ? 1 : 0;
}

}  // extern "C"
