// Note [Injected driver failures]
// The GPU fuzzer (tools/fuzz_gpu.py) checks that a driver refusing memory at any moment
// costs an OutOfMemoryError or a retry that succeeds, never a wrong byte. This wraps the
// entry points that take memory from the driver -- cuMemCreate, cuMemMap, cuMemSetAccess,
// cuMemAddressReserve, cuMemAlloc, cuMemAllocFromPoolAsync -- in the table the core uses:
// each fails with CUDA_ERROR_OUT_OF_MEMORY at a seeded rate. Off (rate 0) it is the real
// table untouched. Install it before the first allocation; the rate may change later.
#include <atomic>
#include <cstdint>
#include <mutex>

#include "driver.h"

namespace tb {
namespace {

DriverApi g_real{};
DriverApi g_wrapped{};
std::atomic<double> g_rate{0};
std::atomic<uint64_t> g_state{1};
std::atomic<int64_t> g_injected{0};

bool fire() {
  const double rate = g_rate.load(std::memory_order_relaxed);
  if (rate <= 0) return false;
  uint64_t x = g_state.load(std::memory_order_relaxed), next;
  do {
    next = x;
    next ^= next << 13;
    next ^= next >> 7;
    next ^= next << 17;
  } while (!g_state.compare_exchange_weak(x, next, std::memory_order_relaxed));
  if (static_cast<double>(next >> 11) / 9007199254740992.0 >= rate) return false;
  g_injected.fetch_add(1, std::memory_order_relaxed);
  return true;
}

CUresult w_create(CUmemGenericAllocationHandle* h, size_t s, const CUmemAllocationProp* p, unsigned long long f) {
  return fire() ? CUDA_ERROR_OUT_OF_MEMORY : g_real.memCreate(h, s, p, f);
}
CUresult w_map(CUdeviceptr p, size_t s, size_t o, CUmemGenericAllocationHandle h, unsigned long long f) {
  return fire() ? CUDA_ERROR_OUT_OF_MEMORY : g_real.memMap(p, s, o, h, f);
}
CUresult w_access(CUdeviceptr p, size_t s, const CUmemAccessDesc* d, size_t n) {
  return fire() ? CUDA_ERROR_OUT_OF_MEMORY : g_real.memSetAccess(p, s, d, n);
}
CUresult w_reserve(CUdeviceptr* p, size_t s, size_t a, CUdeviceptr addr, unsigned long long f) {
  return fire() ? CUDA_ERROR_OUT_OF_MEMORY : g_real.memAddressReserve(p, s, a, addr, f);
}
CUresult w_alloc(CUdeviceptr* p, size_t s) { return fire() ? CUDA_ERROR_OUT_OF_MEMORY : g_real.memAlloc(p, s); }
CUresult w_pool_alloc(CUdeviceptr* p, size_t s, CUmemoryPool pool, CUstream st) {
  return fire() ? CUDA_ERROR_OUT_OF_MEMORY : g_real.memAllocFromPoolAsync(p, s, pool, st);
}

}  // namespace

bool inject_driver_faults(double rate, uint64_t seed) {
  static std::once_flag once;
  const DriverApi* current = driver();
  if (current == nullptr) return false;
  std::call_once(once, [current] {
    g_real = *current;
    g_wrapped = *current;
    if (g_real.memCreate) g_wrapped.memCreate = w_create;
    if (g_real.memMap) g_wrapped.memMap = w_map;
    if (g_real.memSetAccess) g_wrapped.memSetAccess = w_access;
    if (g_real.memAddressReserve) g_wrapped.memAddressReserve = w_reserve;
    if (g_real.memAlloc) g_wrapped.memAlloc = w_alloc;
    if (g_real.memAllocFromPoolAsync) g_wrapped.memAllocFromPoolAsync = w_pool_alloc;
    set_driver(&g_wrapped);
  });
  g_state.store(seed * 0x9E3779B97F4A7C15ull + 1, std::memory_order_relaxed);
  g_rate.store(rate, std::memory_order_relaxed);
  return true;
}

int64_t injected_driver_faults() { return g_injected.load(std::memory_order_relaxed); }

}  // namespace tb
