// The only file that includes torch headers: a subclass of torch's
// CUDAPluggableAllocator that serves torch from the core and answers torch's
// statistics, snapshot, cache and graph-pool calls from the core's ledger.
//
// Overriding allocate() and raw_deleter() skips the base class's mutex and pointer
// map on every allocation; the DataPtr context is the core's Block, so a free needs
// no lookup. Allocation failures become c10 errors here (this is C++ called by
// torch, not the C ABI): kOutOfMemory -> torch.cuda.OutOfMemoryError.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/allocator.h"
#include "core/error.h"
#include "tb_capi.h"

namespace tb {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;

[[noreturn]] void raise_last_error(const char* what) {
  const std::string msg = *last_error_message() ? std::string(last_error_message()) : std::string(what);
  if (last_error_code() == kOutOfMemory) TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  TORCH_CHECK(false, "torch_budget: ", what, ": ", msg);
}

void block_deleter(void* ctx) {
  if (ctx == nullptr) return;
  if (!tb::Allocator::get().free(static_cast<Block*>(ctx)))
    TORCH_WARN("torch_budget: free failed: ", last_error_message());
}

void raw_delete_fn(void* ptr) {
  if (ptr != nullptr && !tb::Allocator::get().free_ptr(ptr)) TORCH_WARN("torch_budget: ", last_error_message());
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
    Block* b = tb::Allocator::get().malloc(size, device, static_cast<CUstream>(stream));
    if (b == nullptr) raise_last_error("allocation failed");
    return {reinterpret_cast<void*>(b->ptr), b, &block_deleter, dev};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }

  void* raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    Block* b = tb::Allocator::get().malloc(nbytes, c10::cuda::current_device(), static_cast<CUstream>(stream));
    if (b == nullptr) raise_last_error("allocation failed");
    return reinterpret_cast<void*>(b->ptr);
  }

  void raw_delete(void* ptr) override {
    if (ptr != nullptr && !tb::Allocator::get().free_ptr(ptr)) raise_last_error("free failed");
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
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr) raise_last_error("setMemoryFraction");
    if (!(fraction > 0 ? d->set_budget(-1, fraction) : d->set_budget(0))) raise_last_error("setMemoryFraction");
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }

  void emptyCache(c10::cuda::MempoolId_t /*mempool_id*/) override {
    for (int i = 0; i < kMaxDevices; ++i) {
      tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(i);
      if (d != nullptr && !d->empty_cache()) raise_last_error("empty_cache");
    }
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr) raise_last_error("cacheInfo");
    *largest = d->largest_free();
    if (*largest == 0) {
      // Nothing cached yet: what could still be had, within the budget.
      size_t free_b = 0, total_b = 0;
      if (!d->mem_info(&free_b, &total_b)) raise_last_error("cacheInfo");
      const int64_t room = d->budget() - d->ledger().reserved_bytes.s[kAggregate].get();
      *largest = room < static_cast<int64_t>(free_b) ? static_cast<size_t>(std::max<int64_t>(room, 0)) : free_b;
    }
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
    tb::DeviceAllocator* d = tb::Allocator::get().device(dev_to_access);
    if (d == nullptr || !d->grant_peer(dev)) raise_last_error("enablePeerAccess");
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceStats stats;
    tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device);
    if (d == nullptr) return stats;
    d->read_locked([&](const Ledger& l) {
      copy_array(stats.allocation, l.allocation);
      copy_array(stats.segment, l.segment);
      copy_array(stats.active, l.active);
      copy_array(stats.allocated_bytes, l.allocated_bytes);
      copy_array(stats.reserved_bytes, l.reserved_bytes);
      copy_array(stats.active_bytes, l.active_bytes);
      copy_array(stats.requested_bytes, l.requested_bytes);
      stats.num_alloc_retries = l.num_alloc_retries.load();
      stats.num_ooms = l.num_ooms.load();
      stats.num_sync_all_streams = l.num_sync_all_streams.load();
      stats.num_device_alloc = l.num_device_alloc.load();
      stats.num_device_free = l.num_device_free.load();
    });
    int64_t split_count = 0, split_bytes = 0;
    d->inactive_split(&split_count, &split_bytes);
    stats.inactive_split[0].current = split_count;
    stats.inactive_split_bytes[0].current = split_bytes;
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    if (tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device)) d->reset_accumulated();
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    if (tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device)) d->reset_peaks();
  }

  cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool_id, bool /*include_traces*/) override {
    cca::SnapshotInfo info;
    const bool all = mempool_id.first == 0 && mempool_id.second == 0;
    for (int i = 0; i < kMaxDevices; ++i) {
      tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(i);
      if (d == nullptr) continue;
      for (const SegmentView& v : d->segments()) {
        if (!all && (v.pool.first != mempool_id.first || v.pool.second != mempool_id.second)) continue;
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(i);
        seg.address = v.base;
        seg.total_size = v.mapped;  // bytes that hold memory (a VMM arena's range is mostly unmapped)
        seg.requested_size = v.requested;
        seg.allocated_size = v.allocated;
        seg.active_size = v.active;
        seg.stream = v.stream;
        seg.is_large = !v.small;
        seg.is_expandable = v.route == kRouteVmm;
        seg.owner_private_pool_id = {v.pool.first, v.pool.second};
        for (const auto& bv : v.blocks) {
          if (bv.state == 0 && v.route == kRouteVmm) continue;  // unmapped range, not memory
          c10::CachingDeviceAllocator::BlockInfo bi;
          bi.size = bv.size;
          bi.requested_size = bv.requested;
          bi.allocated = bv.state == 1;
          bi.active = bv.state != 0;
          seg.blocks.push_back(bi);
        }
        info.segments.push_back(std::move(seg));
      }
      info.device_traces.emplace_back();
    }
    return info;
  }

  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr) raise_last_error("beginAllocateToPool");
    auto f = [filter = std::move(filter)](CUstream s) { return filter(static_cast<cudaStream_t>(s)); };
    if (!d->begin_allocate_to_pool({id.first, id.second}, std::move(f))) raise_last_error("beginAllocateToPool");
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    if (!tb::Allocator::get().end_pool(device, {id.first, id.second})) raise_last_error("endAllocateToPool");
  }

  void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr || !d->release_pool({id.first, id.second})) raise_last_error("releasePool");
  }

  // torch.cuda.MemPool and use_mem_pool reach the same private pools as capture.
  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> /*allocator*/) override {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr) raise_last_error("createOrIncrefPool");
    d->create_or_incref_pool({id.first, id.second});
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    tb::DeviceAllocator* d = tb::Allocator::get().device(device);
    if (d == nullptr) raise_last_error("getPoolUseCount");
    return d->pool_use_count({id.first, id.second});
  }

  // A private pool never lends memory to other allocations here: turning that off is
  // what we already do (torch's MemPool destructor does so), turning it on is refused.
  void setUseOnOOM(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*id*/, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "torch_budget: MemPool(use_on_oom=True) is not supported: out of memory is decided "
                             "by the budget, not by borrowing a private pool's memory");
  }

  std::string name() override { return "torch_budget"; }
};

// Never destroyed: torch may free tensors during interpreter shutdown, after static
// objects are gone.
std::shared_ptr<BudgetAllocator>& installed() {
  static auto* p = new std::shared_ptr<BudgetAllocator>();
  return *p;
}

}  // namespace
}  // namespace tb

extern "C" {

int tb_torch_install(void) {
  using namespace tb;
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
    if (!tb::Allocator::get().load_driver()) return last_error_code();
    auto a = std::make_shared<BudgetAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    installed() = a;
    return 0;
  } catch (const std::exception& e) {
    set_error(kState, std::string("installing the allocator failed: ") + e.what());
    return kState;
  }
}

int tb_torch_installed(void) {
  return tb::installed() && c10::cuda::CUDACachingAllocator::get() == tb::installed().get() ? 1 : 0;
}

}  // extern "C"
