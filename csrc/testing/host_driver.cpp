// A host-memory stand-in for the driver entry points, so the core's block cache,
// ledger, routes and budget logic run in CPU tests.
//
// One device with a configurable capacity. Addresses are numbers, never
// dereferenced. Streams are opaque handles whose queued work completes only when a
// test says so (tb_host_complete), which lets tests observe stream-ordered reuse:
// an event recorded on a stream is "not ready" until that stream is completed.
#include <cuda.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "../core/driver.h"
#include "../tb_capi.h"  // declares the tb_host_ exports (visibility)

namespace {

constexpr uintptr_t kGranule = 2 << 20;

struct HostDevice {
  std::mutex mu;
  size_t capacity = 0;
  size_t used = 0;
  bool vmm = true;
  bool pools = true;
  uintptr_t next_va = uintptr_t(1) << 40;
  std::map<uintptr_t, size_t> allocs;       // cuMemAlloc / pool allocations
  std::map<uintptr_t, size_t> reservations; // VA ranges
  std::map<uint64_t, size_t> handles;       // physical handles
  std::map<uintptr_t, uint64_t> mappings;   // va -> handle (granule-sized maps)
  uint64_t next_handle = 1;
  std::map<void*, uint64_t> submitted;      // per stream: work items enqueued
  std::map<void*, uint64_t> completed;      // per stream: work items done
  size_t pool_used = 0, pool_reserved = 0;
  int64_t map_calls = 0, unmap_calls = 0, syncs = 0;
};

HostDevice* g = nullptr;
thread_local CUcontext t_ctx = nullptr;
CUcontext kCtx = reinterpret_cast<CUcontext>(0xC0);

struct HostEvent {
  void* stream = nullptr;
  uint64_t seq = 0;
};

uintptr_t carve(size_t size, size_t align) {
  uintptr_t p = (g->next_va + align - 1) / align * align;
  g->next_va = p + size + kGranule;  // gap so neighbours never touch
  return p;
}

CUresult h_init(unsigned) { return CUDA_SUCCESS; }
CUresult h_version(int* v) { *v = 13000; return CUDA_SUCCESS; }
CUresult h_device_get(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult h_device_count(int* n) { *n = 1; return CUDA_SUCCESS; }
CUresult h_attr(int* v, CUdevice_attribute a, CUdevice) {
  if (a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) *v = g->vmm;
  else if (a == CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) *v = g->pools;
  else *v = 0;
  return CUDA_SUCCESS;
}
CUresult h_total(size_t* b, CUdevice) { *b = g->capacity; return CUDA_SUCCESS; }
CUresult h_retain(CUcontext* c, CUdevice) { *c = kCtx; return CUDA_SUCCESS; }
CUresult h_get_current(CUcontext* c) { *c = t_ctx; return CUDA_SUCCESS; }
CUresult h_set_current(CUcontext c) { t_ctx = c; return CUDA_SUCCESS; }
CUresult h_ctx_sync() {
  std::lock_guard<std::mutex> l(g->mu);
  for (auto& [s, n] : g->submitted) g->completed[s] = n;
  g->syncs++;
  return CUDA_SUCCESS;
}
CUresult h_mem_info(size_t* f, size_t* t) {
  std::lock_guard<std::mutex> l(g->mu);
  *f = g->capacity - g->used;
  *t = g->capacity;
  return CUDA_SUCCESS;
}
CUresult h_alloc(CUdeviceptr* p, size_t bytes) {
  std::lock_guard<std::mutex> l(g->mu);
  if (g->used + bytes > g->capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  g->used += bytes;
  *p = carve(bytes, 512);
  g->allocs[*p] = bytes;
  return CUDA_SUCCESS;
}
CUresult h_free(CUdeviceptr p) {
  std::lock_guard<std::mutex> l(g->mu);
  auto it = g->allocs.find(p);
  if (it == g->allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  g->used -= it->second;
  g->allocs.erase(it);
  return CUDA_SUCCESS;
}
CUresult h_reserve(CUdeviceptr* p, size_t size, size_t align, CUdeviceptr, unsigned long long) {
  std::lock_guard<std::mutex> l(g->mu);
  if (size % kGranule) return CUDA_ERROR_INVALID_VALUE;
  *p = carve(size, align ? align : kGranule);
  g->reservations[*p] = size;
  return CUDA_SUCCESS;
}
CUresult h_addr_free(CUdeviceptr p, size_t size) {
  std::lock_guard<std::mutex> l(g->mu);
  auto it = g->reservations.find(p);
  if (it == g->reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  for (auto& [va, h] : g->mappings)
    if (va >= p && va < p + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  g->reservations.erase(it);
  return CUDA_SUCCESS;
}
CUresult h_create(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp*, unsigned long long) {
  std::lock_guard<std::mutex> l(g->mu);
  if (size % kGranule) return CUDA_ERROR_INVALID_VALUE;
  if (g->used + size > g->capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  g->used += size;
  *h = g->next_handle++;
  g->handles[*h] = size;
  return CUDA_SUCCESS;
}
CUresult h_release(CUmemGenericAllocationHandle h) {
  std::lock_guard<std::mutex> l(g->mu);
  auto it = g->handles.find(h);
  if (it == g->handles.end()) return CUDA_ERROR_INVALID_VALUE;
  for (auto& [va, mh] : g->mappings)
    if (mh == h) return CUDA_ERROR_INVALID_VALUE;  // released while mapped
  g->used -= it->second;
  g->handles.erase(it);
  return CUDA_SUCCESS;
}
bool inside_reservation(uintptr_t va, size_t size) {
  auto it = g->reservations.upper_bound(va);
  if (it == g->reservations.begin()) return false;
  --it;
  return va >= it->first && va + size <= it->first + it->second;
}
CUresult h_map(CUdeviceptr va, size_t size, size_t, CUmemGenericAllocationHandle h, unsigned long long) {
  std::lock_guard<std::mutex> l(g->mu);
  if (size != kGranule || va % kGranule || !g->handles.count(h) || !inside_reservation(va, size) ||
      g->mappings.count(va))
    return CUDA_ERROR_INVALID_VALUE;
  for (auto& [v, mh] : g->mappings)
    if (mh == h) return CUDA_ERROR_INVALID_VALUE;  // a handle maps once
  g->mappings[va] = h;
  g->map_calls++;
  return CUDA_SUCCESS;
}
CUresult h_unmap(CUdeviceptr va, size_t size) {
  std::lock_guard<std::mutex> l(g->mu);
  for (uintptr_t p = va; p < va + size; p += kGranule) {
    if (!g->mappings.erase(p)) return CUDA_ERROR_INVALID_VALUE;
    g->unmap_calls++;
  }
  return CUDA_SUCCESS;
}
CUresult h_access(CUdeviceptr va, size_t size, const CUmemAccessDesc*, size_t) {
  std::lock_guard<std::mutex> l(g->mu);
  for (uintptr_t p = va; p < va + size; p += kGranule)
    if (!g->mappings.count(p)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
CUresult h_granularity(size_t* gr, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) {
  *gr = kGranule;
  return CUDA_SUCCESS;
}
CUresult h_pool_create(CUmemoryPool* p, const CUmemPoolProps*) {
  *p = reinterpret_cast<CUmemoryPool>(0x9001);
  return CUDA_SUCCESS;
}
CUresult h_pool_destroy(CUmemoryPool) { return CUDA_SUCCESS; }
CUresult h_pool_set(CUmemoryPool, CUmemPool_attribute, void*) { return CUDA_SUCCESS; }
CUresult h_pool_get(CUmemoryPool, CUmemPool_attribute a, void* v) {
  std::lock_guard<std::mutex> l(g->mu);
  auto* out = static_cast<cuuint64_t*>(v);
  *out = a == CU_MEMPOOL_ATTR_USED_MEM_CURRENT ? g->pool_used : g->pool_reserved;
  return CUDA_SUCCESS;
}
CUresult h_pool_trim(CUmemoryPool, size_t keep) {
  std::lock_guard<std::mutex> l(g->mu);
  size_t target = std::max(keep, g->pool_used);
  if (g->pool_reserved > target) {
    g->used -= g->pool_reserved - target;
    g->pool_reserved = target;
  }
  return CUDA_SUCCESS;
}
CUresult h_pool_alloc(CUdeviceptr* p, size_t bytes, CUmemoryPool, CUstream) {
  std::lock_guard<std::mutex> l(g->mu);
  if (g->pool_used + bytes > g->pool_reserved) {
    size_t grow = g->pool_used + bytes - g->pool_reserved;
    if (g->used + grow > g->capacity) return CUDA_ERROR_OUT_OF_MEMORY;
    g->used += grow;
    g->pool_reserved += grow;
  }
  g->pool_used += bytes;
  *p = carve(bytes, 512);
  g->allocs[*p] = bytes;
  return CUDA_SUCCESS;
}
CUresult h_free_async(CUdeviceptr p, CUstream) {
  std::lock_guard<std::mutex> l(g->mu);
  auto it = g->allocs.find(p);
  if (it == g->allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  g->pool_used -= it->second;
  g->allocs.erase(it);
  return CUDA_SUCCESS;
}
CUresult h_event_create(CUevent* e, unsigned) {
  *e = reinterpret_cast<CUevent>(new HostEvent());
  return CUDA_SUCCESS;
}
CUresult h_event_destroy(CUevent e) {
  delete reinterpret_cast<HostEvent*>(e);
  return CUDA_SUCCESS;
}
CUresult h_event_record(CUevent e, CUstream s) {
  std::lock_guard<std::mutex> l(g->mu);
  auto* ev = reinterpret_cast<HostEvent*>(e);
  ev->stream = s;
  ev->seq = g->submitted[s];  // done once everything queued so far on s is done
  return CUDA_SUCCESS;
}
CUresult h_event_query(CUevent e) {
  std::lock_guard<std::mutex> l(g->mu);
  auto* ev = reinterpret_cast<HostEvent*>(e);
  return g->completed[ev->stream] >= ev->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult h_event_sync(CUevent e) {
  std::lock_guard<std::mutex> l(g->mu);
  auto* ev = reinterpret_cast<HostEvent*>(e);
  g->completed[ev->stream] = std::max(g->completed[ev->stream], ev->seq);
  return CUDA_SUCCESS;
}
CUresult h_wait(CUstream, CUevent, unsigned) { return CUDA_SUCCESS; }
CUresult h_stream_sync(CUstream s) {
  std::lock_guard<std::mutex> l(g->mu);
  g->completed[s] = g->submitted[s];
  g->syncs++;
  return CUDA_SUCCESS;
}
CUresult h_capture_mode(CUstreamCaptureMode*) { return CUDA_SUCCESS; }
CUresult h_dtoh(void*, CUdeviceptr, size_t) { return CUDA_SUCCESS; }
CUresult h_htod(CUdeviceptr, const void*, size_t) { return CUDA_SUCCESS; }
CUresult h_memset(CUdeviceptr, unsigned char, size_t) { return CUDA_SUCCESS; }
CUresult h_host_alloc(void** p, size_t bytes, unsigned) {
  *p = ::operator new(bytes);
  return CUDA_SUCCESS;
}
CUresult h_host_free(void* p) {
  ::operator delete(p);
  return CUDA_SUCCESS;
}
CUresult h_error_name(CUresult r, const char** name) {
  switch (r) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; break;
  }
  return CUDA_SUCCESS;
}

const tb::DriverApi kHostApi = {
    h_init, h_version, h_device_get, h_device_count, h_attr, h_total, h_retain, h_get_current, h_set_current,
    h_ctx_sync, h_mem_info, h_alloc, h_free, h_reserve, h_addr_free, h_create, h_release, h_map, h_unmap, h_access,
    h_granularity, h_pool_create, h_pool_destroy, h_pool_set, h_pool_get, h_pool_trim, h_pool_alloc, h_free_async,
    h_event_create, h_event_destroy, h_event_record, h_event_query, h_event_sync, h_wait, h_stream_sync,
    h_capture_mode, h_dtoh, h_htod, h_memset, h_host_alloc, h_host_free, h_error_name,
};

}  // namespace

extern "C" {

// Installs the stand-in with a device of `capacity` bytes. Call once per process,
// before any other tb_ function.
int tb_host_use(int64_t capacity, int vmm, int pools) {
  if (g != nullptr) return 1;
  g = new HostDevice();
  g->capacity = static_cast<size_t>(capacity);
  g->vmm = vmm != 0;
  g->pools = pools != 0;
  tb::set_driver(&kHostApi);
  return 0;
}

// Queues one unit of work on `stream` (what a kernel launch would do).
void tb_host_submit(void* stream) {
  std::lock_guard<std::mutex> l(g->mu);
  g->submitted[stream]++;
}

// Marks all work queued so far on `stream` as done.
void tb_host_complete(void* stream) {
  std::lock_guard<std::mutex> l(g->mu);
  g->completed[stream] = g->submitted[stream];
}

// Bytes of "device" memory the core holds from the stand-in.
int64_t tb_host_used(void) {
  std::lock_guard<std::mutex> l(g->mu);
  return static_cast<int64_t>(g->used);
}

// Counters: out[0] maps, out[1] unmaps, out[2] synchronisations, out[3] live handles,
// out[4] live mappings, out[5] live reservations.
void tb_host_counters(int64_t out[6]) {
  std::lock_guard<std::mutex> l(g->mu);
  out[0] = g->map_calls;
  out[1] = g->unmap_calls;
  out[2] = g->syncs;
  out[3] = static_cast<int64_t>(g->handles.size());
  out[4] = static_cast<int64_t>(g->mappings.size());
  out[5] = static_cast<int64_t>(g->reservations.size());
}

}  // extern "C"
