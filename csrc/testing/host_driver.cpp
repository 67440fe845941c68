// A host-memory stand-in for the driver entry points, so the core's block cache,
// ledger, routes, budget and fault handling run in CPU tests.
//
// - Several devices, each with a capacity and its own context; calls that act on
//   "the current context" (cuMemAlloc, cuCtxSynchronize, cuMemGetInfo,
//   cuEventCreate) use the calling thread's, and an event can only be recorded on a
//   stream of its own device, as on a real driver. So current-device rules are
//   tested without a GPU.
// - Addresses are numbers, never dereferenced. Streams are opaque handles bound to a
//   device (tb_host_stream); unknown non-null handles belong to device 0. Queued
//   work completes only when a test says so (tb_host_complete) or a synchronisation
//   runs: an event recorded on a stream is "not ready" until then.
// - VMM mappings remember which devices were granted access (tb_host_can_access).
// - Memory pools grow in chunks (pool_chunk), as a real driver's do.
// - A fault injector fails any entry point on its Nth call from now, or at a rate,
//   with a chosen result (tb_host_fail).
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "../core/digest.h"
#include "../core/driver.h"
#include "../core/trace.h"
#include "../tb_capi.h"  // declares the tb_host_ exports (visibility)

namespace {

constexpr uintptr_t kGranule = 2 << 20;
constexpr uintptr_t kCtxBase = 0xC000;

struct HostDevice {
  size_t capacity = 0;
  size_t used = 0;
  bool vmm = true;
  bool pools = true;
  size_t pool_reserved = 0, pool_used = 0;
  std::set<int> pool_peers;
};

struct Alloc {
  int device;
  size_t size;
  bool from_pool;
  std::vector<uint8_t> data = {};  // filled on first access
};

struct Handle {
  int device;
  size_t size;
  std::vector<uint8_t> data;  // contents, materialised on the first copy into or out of it
  uint64_t root = 0;          // an imported handle: the handle it imports (its memory)
  int imports = 0;            // live imports of this handle
  bool dead = false;          // released while imports live: its memory stays until they go
};

// One entry per mapped granule; a mapping may span several granules of one handle
// and can only be unmapped as a whole, as on a real driver.
struct Mapping {
  uint64_t handle;
  std::set<int> access;
  uintptr_t head = 0;   // where the mapping starts
  size_t length = 0;    // its bytes
};

struct HostEvent {
  int device = 0;
  void* stream = nullptr;
  int stream_device = 0;
  uint64_t seq = 0;
};

struct Fault {
  int64_t countdown = 0;  // > 0: fail when it reaches zero
  bool sticky = false;    // and on every call after that
  double rate = 0;
  CUresult result = CUDA_SUCCESS;
};

struct State {
  std::mutex mu;
  std::vector<HostDevice> devices;
  size_t pool_chunk = 0;
  uintptr_t next_va = uintptr_t(1) << 40;
  std::map<uintptr_t, Alloc> allocs;         // cuMemAlloc / pool allocations
  std::map<uintptr_t, size_t> reservations;  // VA ranges
  std::map<uint64_t, Handle> handles;        // physical handles
  std::map<uintptr_t, Mapping> mappings;     // va -> handle (granule-sized maps)
  uint64_t next_handle = 1;
  int64_t imports_total = 0, ipc_open = 0;
  std::map<void*, int> streams;              // registered streams -> device
  uintptr_t next_stream = 0x7000000;
  std::map<std::pair<void*, int>, uint64_t> submitted, completed;  // per (stream, device)
  int64_t map_calls = 0, unmap_calls = 0, syncs = 0, injected = 0;
  int64_t event_records = 0, event_queries = 0;
  // Stream-ordered allocations and frees asked on a capturing stream: on a real driver, nodes of
  // its graph, not memory (Note [Allocating beside a capture]).
  int64_t captured_ordered_calls = 0;
  int64_t host_pinned = 0;                   // bytes of cuMemHostAlloc memory live
  std::set<void*> host_allocs;
  std::map<void*, size_t> host_sizes;
  std::map<void*, size_t> host_registered;   // cuMemHostRegister'ed ranges (counted in host_pinned)
  std::map<std::string, Fault> faults;
  Fault all;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  std::map<void*, std::pair<uint64_t, std::vector<CUgraphNode>>> captures;  // stream -> (sequence, tails)
  std::map<CUgraphNode, std::vector<CUgraphNode>> parents;                   // graph node -> dependencies
  bool hold_syncs = false;  // synchronisations wait until released (tb_host_hold_syncs)
  int pass_syncs = 0;       // held synchronisations that go through anyway (tb_host_pass_syncs)
  int waiting_syncs = 0;
  std::condition_variable sync_cv;
};

State* g = nullptr;
thread_local CUcontext t_ctx = nullptr;

const char* const kEntryPoints[] = {
    "cuInit", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetAttribute", "cuDeviceTotalMem",
    "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxSynchronize", "cuMemGetInfo",
    "cuMemAlloc", "cuMemFree", "cuEventCreate", "cuEventDestroy", "cuEventRecord", "cuEventQuery",
    "cuStreamSynchronize", "cuThreadExchangeStreamCaptureMode", "cuGetErrorName", "cuMemAddressReserve",
    "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
    "cuMemGetAllocationGranularity", "cuMemPoolCreate", "cuMemPoolDestroy", "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute", "cuMemPoolTrimTo", "cuMemPoolSetAccess", "cuMemAllocFromPoolAsync", "cuMemFreeAsync",
    "cuEventSynchronize", "cuStreamCreate", "cuStreamDestroy", "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync",
    "cuMemsetD8Async", "cuMemHostAlloc", "cuMemFreeHost", "cuStreamGetCaptureInfo", "cuGraphNodeGetDependencies",
    "cuMemExportToShareableHandle", "cuMemcpyDtoDAsync", "cuModuleLoadData", "cuModuleUnload", "cuModuleGetFunction",
    "cuLaunchKernel", "cuMemHostRegister", "cuMemHostUnregister", "cuMemImportFromShareableHandle",
    "cuIpcGetMemHandle", "cuIpcOpenMemHandle", "cuIpcCloseMemHandle",
};

bool known_entry(const std::string& name) {
  for (const char* e : kEntryPoints)
    if (name == e) return true;
  return false;
}

bool is_allocation(const char* name) {
  return !std::strcmp(name, "cuMemAlloc") || !std::strcmp(name, "cuMemCreate") || !std::strcmp(name, "cuMemHostAlloc") ||
         !std::strcmp(name, "cuMemAllocFromPoolAsync") || !std::strcmp(name, "cuMemAddressReserve");
}

double uniform() {
  g->rng ^= g->rng << 13;
  g->rng ^= g->rng >> 7;
  g->rng ^= g->rng << 17;
  return static_cast<double>(g->rng >> 11) / 9007199254740992.0;
}

bool fires(Fault& f) {
  if (f.countdown > 0 && --f.countdown == 0) {
    if (f.sticky) f.rate = 1.0;
    return true;
  }
  return f.rate > 0 && uniform() < f.rate;
}

// The result to fail `name` with now, or CUDA_SUCCESS. Caller holds g->mu.
CUresult inject(const char* name) {
  auto it = g->faults.find(name);
  bool fail = false;
  CUresult result = CUDA_SUCCESS;
  if (it != g->faults.end() && fires(it->second)) {
    fail = true;
    result = it->second.result;
  } else if (fires(g->all)) {
    fail = true;
    result = g->all.result;
  }
  if (!fail) return CUDA_SUCCESS;
  g->injected++;
  if (result == CUDA_SUCCESS) result = is_allocation(name) ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
  return result;
}

// With TB_HOST_DRIVER_COSTS=1 in the environment, the VMM entry points take about what they
// take on an H200 (Note [Run mappings]: create 9 us + 1.5 us per MiB, map 2, access 20 +
// 0.5 us per MiB, unmap 14, release 10), spent spinning, so that a replay over the stand-in
// (tools/sim_alloc.py --costs) shows what the driver's time does to a policy bounded in time.
void spend(double fixed_us, double us_per_mib = 0, size_t bytes = 0) {
  static const bool on = [] {
    const char* v = std::getenv("TB_HOST_DRIVER_COSTS");
    return v != nullptr && *v == '1';
  }();
  if (!on) return;
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::nanoseconds(static_cast<int64_t>((fixed_us + us_per_mib * bytes / 1048576.0) * 1e3));
  while (std::chrono::steady_clock::now() < until) {
  }
}

// The failing operator new that tests/test_core_exceptions.py preloads (tb_new_faults_pause,
// when present) fails no allocation of the stand-in's own: the real driver is C and throws
// nothing into the core.
class NewFaultsPaused {
 public:
  NewFaultsPaused() { step(1); }
  ~NewFaultsPaused() { step(-1); }

 private:
  static void step(int by) {
    using Pause = void (*)(int);
    static const Pause pause = reinterpret_cast<Pause>(dlsym(RTLD_DEFAULT, "tb_new_faults_pause"));
    if (pause != nullptr) pause(by);
  }
};

#define HOST_ENTRY(name)                                   \
  NewFaultsPaused new_faults_paused_;                      \
  std::unique_lock<std::mutex> host_lock_(g->mu);          \
  if (CUresult injected_ = inject(name)) return injected_

// A synchronisation blocks while syncs are held, as one waiting for a busy device
// does; the state lock is released meanwhile.
void wait_if_held(std::unique_lock<std::mutex>& lock) {
  if (g->hold_syncs && g->pass_syncs > 0) {
    g->pass_syncs--;
    return;
  }
  g->waiting_syncs++;
  g->sync_cv.notify_all();
  g->sync_cv.wait(lock, [] { return !g->hold_syncs; });
  g->waiting_syncs--;
}

CUcontext ctx_of(int device) { return reinterpret_cast<CUcontext>(kCtxBase + 0x100 * static_cast<uintptr_t>(device)); }

int device_of_ctx(CUcontext c) {
  if (c == nullptr) return -1;
  const auto v = reinterpret_cast<uintptr_t>(c);
  if (v < kCtxBase || (v - kCtxBase) % 0x100) return -1;
  const auto d = static_cast<int>((v - kCtxBase) / 0x100);
  return d < static_cast<int>(g->devices.size()) ? d : -1;
}

int current_device() { return device_of_ctx(t_ctx); }

// The device a stream belongs to: registered streams know theirs, the null stream
// is the current context's, any other handle is device 0's.
int stream_device(void* s) {
  if (s == nullptr) return current_device();
  auto it = g->streams.find(s);
  return it == g->streams.end() ? 0 : it->second;
}

uintptr_t carve(size_t size, size_t align) {
  uintptr_t p = (g->next_va + align - 1) / align * align;
  g->next_va = p + size + kGranule;  // gap so neighbours never touch
  return p;
}

void complete_device(int device) {
  for (auto& [key, n] : g->submitted)
    if (key.second == device) g->completed[key] = n;
}

CUresult h_init(unsigned) { return CUDA_SUCCESS; }
CUresult h_device_get(CUdevice* d, int ordinal) {
  HOST_ENTRY("cuDeviceGet");
  if (ordinal < 0 || ordinal >= static_cast<int>(g->devices.size())) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult h_device_count(int* n) {
  HOST_ENTRY("cuDeviceGetCount");
  *n = static_cast<int>(g->devices.size());
  return CUDA_SUCCESS;
}
CUresult h_attr(int* v, CUdevice_attribute a, CUdevice d) {
  HOST_ENTRY("cuDeviceGetAttribute");
  if (a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) *v = g->devices[d].vmm;
  else if (a == CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) *v = g->devices[d].pools;
  else if (a == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) *v = g->devices[d].vmm;
  else *v = 0;
  return CUDA_SUCCESS;
}
CUresult h_total(size_t* b, CUdevice d) {
  HOST_ENTRY("cuDeviceTotalMem");
  *b = g->devices[d].capacity;
  return CUDA_SUCCESS;
}
CUresult h_retain(CUcontext* c, CUdevice d) {
  HOST_ENTRY("cuDevicePrimaryCtxRetain");
  *c = ctx_of(d);
  return CUDA_SUCCESS;
}
CUresult h_get_current(CUcontext* c) {
  HOST_ENTRY("cuCtxGetCurrent");
  *c = t_ctx;
  return CUDA_SUCCESS;
}
CUresult h_set_current(CUcontext c) {
  HOST_ENTRY("cuCtxSetCurrent");
  if (c != nullptr && device_of_ctx(c) < 0) return CUDA_ERROR_INVALID_CONTEXT;
  t_ctx = c;
  return CUDA_SUCCESS;
}
CUresult h_ctx_sync() {
  HOST_ENTRY("cuCtxSynchronize");
  const int d = current_device();
  if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
  wait_if_held(host_lock_);
  complete_device(d);
  g->syncs++;
  return CUDA_SUCCESS;
}
CUresult h_mem_info(size_t* f, size_t* t) {
  HOST_ENTRY("cuMemGetInfo");
  const int d = current_device();
  if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
  *f = g->devices[d].capacity - g->devices[d].used;
  *t = g->devices[d].capacity;
  return CUDA_SUCCESS;
}
CUresult h_alloc(CUdeviceptr* p, size_t bytes) {
  HOST_ENTRY("cuMemAlloc");
  const int d = current_device();
  if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
  HostDevice& dev = g->devices[d];
  if (bytes > dev.capacity - dev.used) return CUDA_ERROR_OUT_OF_MEMORY;
  dev.used += bytes;
  *p = carve(bytes, 512);
  g->allocs[*p] = Alloc{d, bytes, false};
  return CUDA_SUCCESS;
}
CUresult h_free(CUdeviceptr p) {
  HOST_ENTRY("cuMemFree");
  wait_if_held(host_lock_);  // cuMemFree waits for the device
  auto it = g->allocs.find(p);
  if (it == g->allocs.end() || it->second.from_pool) return CUDA_ERROR_INVALID_VALUE;
  g->devices[it->second.device].used -= it->second.size;
  g->allocs.erase(it);
  return CUDA_SUCCESS;
}
CUresult h_event_create(CUevent* e, unsigned) {
  HOST_ENTRY("cuEventCreate");
  const int d = current_device();
  if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
  auto* ev = new HostEvent();
  ev->device = d;
  *e = reinterpret_cast<CUevent>(ev);
  return CUDA_SUCCESS;
}
CUresult h_event_destroy(CUevent e) {
  HOST_ENTRY("cuEventDestroy");
  delete reinterpret_cast<HostEvent*>(e);
  return CUDA_SUCCESS;
}
CUresult h_event_record(CUevent e, CUstream s) {
  HOST_ENTRY("cuEventRecord");
  auto* ev = reinterpret_cast<HostEvent*>(e);
  const int sd = stream_device(s);
  if (sd != ev->device) return CUDA_ERROR_INVALID_HANDLE;  // a real driver refuses this too
  ev->stream = s;
  ev->stream_device = sd;
  ev->seq = g->submitted[{s, sd}];  // done once everything queued so far on s is done
  g->event_records++;
  return CUDA_SUCCESS;
}
CUresult h_event_query(CUevent e) {
  HOST_ENTRY("cuEventQuery");
  auto* ev = reinterpret_cast<HostEvent*>(e);
  g->event_queries++;
  return g->completed[{ev->stream, ev->stream_device}] >= ev->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult h_stream_sync(CUstream s) {
  HOST_ENTRY("cuStreamSynchronize");
  const int sd = stream_device(s);
  if (sd < 0) return CUDA_ERROR_INVALID_CONTEXT;
  wait_if_held(host_lock_);
  g->completed[{s, sd}] = g->submitted[{s, sd}];
  g->syncs++;
  return CUDA_SUCCESS;
}
CUresult h_capture_mode(CUstreamCaptureMode*) {
  HOST_ENTRY("cuThreadExchangeStreamCaptureMode");
  return CUDA_SUCCESS;
}
// Stand-in graph nodes are numbers.
std::vector<CUgraphNode> graph_nodes(const uint64_t* ids, int n) {
  std::vector<CUgraphNode> nodes;
  for (int i = 0; i < n; ++i) nodes.push_back(reinterpret_cast<CUgraphNode>(static_cast<uintptr_t>(ids[i])));
  return nodes;
}
CUresult h_capture_info(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                        const CUgraphNode** tails, const CUgraphEdgeData** edges, size_t* count) {
  HOST_ENTRY("cuStreamGetCaptureInfo");
  auto it = g->captures.find(s);
  const bool on = it != g->captures.end() && it->second.first != 0;
  *status = on ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  *id = on ? it->second.first : 0;
  *graph = on ? reinterpret_cast<CUgraph>(static_cast<uintptr_t>(it->second.first)) : nullptr;
  *tails = on ? it->second.second.data() : nullptr;
  *edges = nullptr;  // default edges only
  *count = on ? it->second.second.size() : 0;
  return CUDA_SUCCESS;
}
CUresult h_node_deps(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* edges, size_t* count) {
  HOST_ENTRY("cuGraphNodeGetDependencies");
  const std::vector<CUgraphNode>& p = g->parents[node];
  if (deps != nullptr) {
    if (*count < p.size()) return CUDA_ERROR_INVALID_VALUE;
    std::copy(p.begin(), p.end(), deps);
    if (edges != nullptr) std::fill(edges, edges + p.size(), CUgraphEdgeData{});
  }
  *count = p.size();
  return CUDA_SUCCESS;
}
CUresult h_error_name(CUresult r, const char** name) {
  switch (r) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; break;
  }
  return CUDA_SUCCESS;
}
CUresult h_reserve(CUdeviceptr* p, size_t size, size_t align, CUdeviceptr, unsigned long long) {
  HOST_ENTRY("cuMemAddressReserve");
  if (size == 0 || size % kGranule) return CUDA_ERROR_INVALID_VALUE;
  *p = carve(size, align ? align : kGranule);
  g->reservations[*p] = size;
  return CUDA_SUCCESS;
}
CUresult h_addr_free(CUdeviceptr p, size_t size) {
  HOST_ENTRY("cuMemAddressFree");
  auto it = g->reservations.find(p);
  if (it == g->reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = g->mappings.lower_bound(p);
  if (m != g->mappings.end() && m->first < p + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  g->reservations.erase(it);
  return CUDA_SUCCESS;
}
CUresult h_create(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop, unsigned long long) {
  HOST_ENTRY("cuMemCreate");
  const int d = prop->location.id;
  if (size % kGranule || d < 0 || d >= static_cast<int>(g->devices.size())) return CUDA_ERROR_INVALID_VALUE;
  HostDevice& dev = g->devices[d];
  if (size > dev.capacity - dev.used) return CUDA_ERROR_OUT_OF_MEMORY;
  dev.used += size;
  *h = g->next_handle++;
  g->handles[*h] = Handle{d, size};
  spend(9, 1.5, size);
  return CUDA_SUCCESS;
}
// A descriptor of the handle's memory, as the real driver gives one (here: /dev/null; the
// core only passes it on and closes it).
CUresult h_export(void* shareable, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                  unsigned long long) {
  HOST_ENTRY("cuMemExportToShareableHandle");
  if (g->handles.count(h) == 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  const int fd = static_cast<int>(syscall(SYS_memfd_create, ("tbh:" + std::to_string(h)).c_str(), 1u));
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}
CUresult h_import(CUmemGenericAllocationHandle* out, void* shareable, CUmemAllocationHandleType type) {
  HOST_ENTRY("cuMemImportFromShareableHandle");
  const int fd = static_cast<int>(reinterpret_cast<uintptr_t>(shareable));
  char link[64], name[256] = {0};
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, name, sizeof name - 1);
  if (n <= 0) return CUDA_ERROR_INVALID_VALUE;
  unsigned long long root = 0;
  if (sscanf(name, "/memfd:tbh:%llu", &root) != 1) return CUDA_ERROR_INVALID_VALUE;
  auto it = g->handles.find(root);
  if (it == g->handles.end() || it->second.dead) return CUDA_ERROR_INVALID_VALUE;
  it->second.imports++;
  *out = g->next_handle++;
  Handle a{it->second.device, it->second.size};
  a.root = root;
  g->handles[*out] = a;
  g->imports_total++;
  return CUDA_SUCCESS;
}
CUresult h_ipc_get(CUipcMemHandle* out, CUdeviceptr p) {
  HOST_ENTRY("cuIpcGetMemHandle");
  auto a = g->allocs.upper_bound(p);
  if (a == g->allocs.begin()) return CUDA_ERROR_INVALID_VALUE;
  --a;
  if (p >= a->first + a->second.size) return CUDA_ERROR_INVALID_VALUE;
  std::memset(out, 0, sizeof *out);
  const uintptr_t base = a->first;
  std::memcpy(out->reserved, &base, sizeof base);
  return CUDA_SUCCESS;
}
CUresult h_ipc_open(CUdeviceptr* p, CUipcMemHandle hh, unsigned int) {
  HOST_ENTRY("cuIpcOpenMemHandle");
  uintptr_t base = 0;
  std::memcpy(&base, hh.reserved, sizeof base);
  if (!g->allocs.count(base)) return CUDA_ERROR_INVALID_VALUE;
  *p = base;  // same process: the same address
  g->ipc_open++;
  return CUDA_SUCCESS;
}
CUresult h_ipc_close(CUdeviceptr) {
  HOST_ENTRY("cuIpcCloseMemHandle");
  g->ipc_open--;
  return CUDA_SUCCESS;
}
CUresult h_release(CUmemGenericAllocationHandle h) {
  HOST_ENTRY("cuMemRelease");
  auto it = g->handles.find(h);
  if (it == g->handles.end()) return CUDA_ERROR_INVALID_VALUE;
  for (auto& [va, m] : g->mappings)
    if (m.handle == h) return CUDA_ERROR_INVALID_VALUE;  // released while mapped
  if (it->second.dead) return CUDA_ERROR_INVALID_VALUE;
  if (it->second.root != 0) {
    auto r = g->handles.find(it->second.root);
    if (--r->second.imports == 0 && r->second.dead) {
      g->devices[r->second.device].used -= r->second.size;
      g->handles.erase(r);
    }
    g->handles.erase(it);
    return CUDA_SUCCESS;
  }
  if (it->second.imports > 0) { it->second.dead = true; return CUDA_SUCCESS; }
  g->devices[it->second.device].used -= it->second.size;
  g->handles.erase(it);
  spend(10);
  return CUDA_SUCCESS;
}
bool inside_reservation(uintptr_t va, size_t size) {
  auto it = g->reservations.upper_bound(va);
  if (it == g->reservations.begin()) return false;
  --it;
  return va >= it->first && va + size <= it->first + it->second;
}
CUresult h_map(CUdeviceptr va, size_t size, size_t, CUmemGenericAllocationHandle h, unsigned long long) {
  HOST_ENTRY("cuMemMap");
  if (size == 0 || size % kGranule || va % kGranule || !g->handles.count(h) || g->handles[h].size != size ||
      !inside_reservation(va, size))
    return CUDA_ERROR_INVALID_VALUE;
  for (uintptr_t p = va; p < va + size; p += kGranule)
    if (g->mappings.count(p)) return CUDA_ERROR_INVALID_VALUE;
  for (auto& [v, m] : g->mappings)
    if (m.handle == h) return CUDA_ERROR_INVALID_VALUE;  // a handle maps once
  for (uintptr_t p = va; p < va + size; p += kGranule) g->mappings[p] = Mapping{h, {}, va, size};
  g->map_calls++;
  spend(2);
  return CUDA_SUCCESS;
}
CUresult h_unmap(CUdeviceptr va, size_t size) {
  HOST_ENTRY("cuMemUnmap");
  for (uintptr_t p = va; p < va + size; p += kGranule) {
    auto m = g->mappings.find(p);
    if (m == g->mappings.end()) return CUDA_ERROR_INVALID_VALUE;
    // Only whole mappings can be unmapped.
    if (m->second.head < va || m->second.head + m->second.length > va + size) return CUDA_ERROR_INVALID_VALUE;
  }
  for (uintptr_t p = va; p < va + size; p += kGranule) {
    if (g->mappings[p].head == p) g->unmap_calls++;
    g->mappings.erase(p);
  }
  spend(14);
  return CUDA_SUCCESS;
}
CUresult h_access(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
  HOST_ENTRY("cuMemSetAccess");
  for (uintptr_t p = va; p < va + size; p += kGranule)
    if (!g->mappings.count(p)) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i)
    if (desc[i].location.id < 0 || desc[i].location.id >= static_cast<int>(g->devices.size()))
      return CUDA_ERROR_INVALID_DEVICE;
  for (uintptr_t p = va; p < va + size; p += kGranule)
    for (size_t i = 0; i < count; ++i) g->mappings[p].access.insert(desc[i].location.id);
  spend(20, 0.5, size);
  return CUDA_SUCCESS;
}
CUresult h_granularity(size_t* gr, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) {
  HOST_ENTRY("cuMemGetAllocationGranularity");
  *gr = kGranule;
  return CUDA_SUCCESS;
}

// Copies run at once on the host; VMM memory is addressed granule by granule through
// its mappings, so contents follow the physical handle (as on a real device).
CUresult visit_device(uintptr_t va, size_t bytes, const std::function<void(uint8_t*, size_t)>& fn) {
  for (uintptr_t p = va; p < va + bytes;) {
    const uintptr_t base = p / kGranule * kGranule;
    auto m = g->mappings.find(base);
    if (m == g->mappings.end()) {  // cuMemAlloc memory, addressed byte by byte
      auto a = g->allocs.upper_bound(p);
      if (a == g->allocs.begin()) return CUDA_ERROR_ILLEGAL_ADDRESS;
      --a;
      if (p + (va + bytes - p) > a->first + a->second.size) return CUDA_ERROR_ILLEGAL_ADDRESS;
      if (a->second.data.empty()) a->second.data.assign(a->second.size, 0xA5);
      fn(a->second.data.data() + (p - a->first), va + bytes - p);
      return CUDA_SUCCESS;
    }
    Handle* hp = &g->handles[m->second.handle];
    if (hp->root != 0) hp = &g->handles[hp->root];
    Handle& h = *hp;
    if (h.data.empty()) h.data.assign(h.size, 0xA5);  // fresh memory: garbage, not zeros
    const size_t n = std::min<size_t>(base + kGranule - p, va + bytes - p);
    fn(h.data.data() + (p - m->second.head), n);
    p += n;
  }
  return CUDA_SUCCESS;
}
CUresult h_event_sync(CUevent e) {
  HOST_ENTRY("cuEventSynchronize");
  auto* ev = reinterpret_cast<HostEvent*>(e);
  wait_if_held(host_lock_);
  auto& done = g->completed[{ev->stream, ev->stream_device}];
  done = std::max(done, ev->seq);
  return CUDA_SUCCESS;
}
CUresult h_stream_create(CUstream* s, unsigned) {
  HOST_ENTRY("cuStreamCreate");
  const int d = current_device();
  if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
  void* h = reinterpret_cast<void*>(g->next_stream);
  g->next_stream += 0x100;
  g->streams[h] = d;
  *s = static_cast<CUstream>(h);
  return CUDA_SUCCESS;
}
CUresult h_stream_destroy(CUstream s) {
  HOST_ENTRY("cuStreamDestroy");
  return g->streams.erase(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult h_dtoh(void* dst, CUdeviceptr src, size_t bytes, CUstream) {
  HOST_ENTRY("cuMemcpyDtoHAsync");
  auto* out = static_cast<uint8_t*>(dst);
  return visit_device(src, bytes, [&](uint8_t* p, size_t n) {
    std::memcpy(out, p, n);
    out += n;
  });
}
CUresult h_htod(CUdeviceptr dst, const void* src, size_t bytes, CUstream) {
  HOST_ENTRY("cuMemcpyHtoDAsync");
  const auto* in = static_cast<const uint8_t*>(src);
  return visit_device(dst, bytes, [&](uint8_t* p, size_t n) {
    std::memcpy(p, in, n);
    in += n;
  });
}
CUresult h_dtod(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream) {
  HOST_ENTRY("cuMemcpyDtoDAsync");
  std::vector<uint8_t> staged(bytes);
  uint8_t* at = staged.data();
  CUresult r = visit_device(src, bytes, [&](uint8_t* p, size_t n) {
    std::memcpy(at, p, n);
    at += n;
  });
  if (r != CUDA_SUCCESS) return r;
  at = staged.data();
  return visit_device(dst, bytes, [&](uint8_t* p, size_t n) {
    std::memcpy(p, at, n);
    at += n;
  });
}
// The digest kernel (csrc/kernels/digest.cu), run on the host as digest_host computes it.
const int kDigestModule = 0x5eed, kDigestFunction = 0xd16e;
CUresult h_module_load(CUmodule* m, const void* image) {
  HOST_ENTRY("cuModuleLoadData");
  if (std::strstr(static_cast<const char*>(image), ".entry tb_digest") == nullptr) return CUDA_ERROR_INVALID_PTX;
  *m = reinterpret_cast<CUmodule>(const_cast<int*>(&kDigestModule));
  return CUDA_SUCCESS;
}
CUresult h_module_unload(CUmodule m) {
  HOST_ENTRY("cuModuleUnload");
  return m == reinterpret_cast<CUmodule>(const_cast<int*>(&kDigestModule)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult h_get_function(CUfunction* f, CUmodule m, const char* name) {
  HOST_ENTRY("cuModuleGetFunction");
  if (m != reinterpret_cast<CUmodule>(const_cast<int*>(&kDigestModule)) || std::strcmp(name, "tb_digest") != 0)
    return CUDA_ERROR_NOT_FOUND;
  *f = reinterpret_cast<CUfunction>(const_cast<int*>(&kDigestFunction));
  return CUDA_SUCCESS;
}
CUresult h_launch(CUfunction f, unsigned gx, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                  void** params, void**) {
  HOST_ENTRY("cuLaunchKernel");
  if (f != reinterpret_cast<CUfunction>(const_cast<int*>(&kDigestFunction))) return CUDA_ERROR_INVALID_HANDLE;
  const uintptr_t table = *static_cast<CUdeviceptr*>(params[0]);
  const size_t words = *static_cast<unsigned long long*>(params[1]);
  const unsigned parts = *static_cast<unsigned*>(params[2]);
  const uintptr_t out = *static_cast<CUdeviceptr*>(params[3]);
  if (parts == 0 || gx % parts != 0) return CUDA_ERROR_INVALID_VALUE;
  std::vector<uint64_t> chunk(words);
  for (unsigned c = 0; c < gx / parts; ++c) {
    uint64_t base = 0;
    uint8_t* at = reinterpret_cast<uint8_t*>(&base);
    CUresult r = visit_device(table + c * sizeof(uint64_t), sizeof(uint64_t), [&](uint8_t* p, size_t n) {
      std::memcpy(at, p, n);
      at += n;
    });
    if (r != CUDA_SUCCESS) return r;
    at = reinterpret_cast<uint8_t*>(chunk.data());
    r = visit_device(base, words * 8, [&](uint8_t* p, size_t n) {
      std::memcpy(at, p, n);
      at += n;
    });
    if (r != CUDA_SUCCESS) return r;
    const tb::Digest d = tb::digest_host(chunk.data(), words);
    const uint8_t* in = reinterpret_cast<const uint8_t*>(d.data());
    r = visit_device(out + c * sizeof(tb::Digest), sizeof(tb::Digest), [&](uint8_t* p, size_t n) {
      std::memcpy(p, in, n);
      in += n;
    });
    if (r != CUDA_SUCCESS) return r;
  }
  spend(5);
  return CUDA_SUCCESS;
}
CUresult h_memset(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream) {
  HOST_ENTRY("cuMemsetD8Async");
  return visit_device(dst, bytes, [&](uint8_t* p, size_t n) { std::memset(p, value, n); });
}
CUresult h_host_alloc(void** p, size_t bytes, unsigned) {
  HOST_ENTRY("cuMemHostAlloc");
  if (current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
  *p = std::malloc(bytes);
  if (*p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  g->host_allocs.insert(*p);
  g->host_pinned += static_cast<int64_t>(bytes);
  g->host_sizes[*p] = bytes;
  return CUDA_SUCCESS;
}
CUresult h_free_host(void* p) {
  HOST_ENTRY("cuMemFreeHost");
  if (current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (!g->host_allocs.erase(p)) return CUDA_ERROR_INVALID_VALUE;
  g->host_pinned -= static_cast<int64_t>(g->host_sizes[p]);
  g->host_sizes.erase(p);
  std::free(p);
  return CUDA_SUCCESS;
}
CUresult h_host_register(void* p, size_t bytes, unsigned) {
  HOST_ENTRY("cuMemHostRegister");
  if (current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (p == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  for (const auto& [q, n] : g->host_registered) {
    const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
    if (a < b + n && b < a + bytes) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  g->host_registered[p] = bytes;
  g->host_pinned += static_cast<int64_t>(bytes);
  return CUDA_SUCCESS;
}
CUresult h_host_unregister(void* p) {
  HOST_ENTRY("cuMemHostUnregister");
  if (current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
  auto it = g->host_registered.find(p);
  if (it == g->host_registered.end()) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  g->host_pinned -= static_cast<int64_t>(it->second);
  g->host_registered.erase(it);
  return CUDA_SUCCESS;
}

CUmemoryPool pool_of(int device) { return reinterpret_cast<CUmemoryPool>(0x9000 + static_cast<uintptr_t>(device)); }
int device_of_pool(CUmemoryPool p) {
  const auto d = static_cast<int>(reinterpret_cast<uintptr_t>(p) - 0x9000);
  return d >= 0 && d < static_cast<int>(g->devices.size()) ? d : -1;
}

CUresult h_pool_create(CUmemoryPool* p, const CUmemPoolProps* props) {
  HOST_ENTRY("cuMemPoolCreate");
  if (props->location.id < 0 || props->location.id >= static_cast<int>(g->devices.size()))
    return CUDA_ERROR_INVALID_DEVICE;
  *p = pool_of(props->location.id);
  return CUDA_SUCCESS;
}
CUresult h_pool_destroy(CUmemoryPool) {
  HOST_ENTRY("cuMemPoolDestroy");
  return CUDA_SUCCESS;
}
CUresult h_pool_set(CUmemoryPool, CUmemPool_attribute, void*) {
  HOST_ENTRY("cuMemPoolSetAttribute");
  return CUDA_SUCCESS;
}
CUresult h_pool_get(CUmemoryPool p, CUmemPool_attribute a, void* v) {
  HOST_ENTRY("cuMemPoolGetAttribute");
  const int d = device_of_pool(p);
  if (d < 0) return CUDA_ERROR_INVALID_VALUE;
  auto* out = static_cast<cuuint64_t*>(v);
  *out = a == CU_MEMPOOL_ATTR_USED_MEM_CURRENT ? g->devices[d].pool_used : g->devices[d].pool_reserved;
  return CUDA_SUCCESS;
}
CUresult h_pool_trim(CUmemoryPool p, size_t keep) {
  HOST_ENTRY("cuMemPoolTrimTo");
  const int d = device_of_pool(p);
  if (d < 0) return CUDA_ERROR_INVALID_VALUE;
  HostDevice& dev = g->devices[d];
  const size_t target = std::max(keep, dev.pool_used);
  if (dev.pool_reserved > target) {
    dev.used -= dev.pool_reserved - target;
    dev.pool_reserved = target;
  }
  return CUDA_SUCCESS;
}
CUresult h_pool_access(CUmemoryPool p, const CUmemAccessDesc* desc, size_t count) {
  HOST_ENTRY("cuMemPoolSetAccess");
  const int d = device_of_pool(p);
  if (d < 0) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i) g->devices[d].pool_peers.insert(desc[i].location.id);
  return CUDA_SUCCESS;
}
bool stream_captures(CUstream s) {
  auto it = g->captures.find(s);
  return it != g->captures.end() && it->second.first != 0;
}
CUresult h_pool_alloc(CUdeviceptr* ptr, size_t bytes, CUmemoryPool p, CUstream s) {
  HOST_ENTRY("cuMemAllocFromPoolAsync");
  if (stream_captures(s)) g->captured_ordered_calls++;
  const int d = device_of_pool(p);
  if (d < 0 || stream_device(s) != d) return CUDA_ERROR_INVALID_VALUE;
  HostDevice& dev = g->devices[d];
  if (dev.pool_used + bytes > dev.pool_reserved) {
    size_t grow = dev.pool_used + bytes - dev.pool_reserved;
    if (g->pool_chunk > 0) grow = (grow + g->pool_chunk - 1) / g->pool_chunk * g->pool_chunk;
    if (grow > dev.capacity - dev.used) return CUDA_ERROR_OUT_OF_MEMORY;
    dev.used += grow;
    dev.pool_reserved += grow;
  }
  dev.pool_used += bytes;
  *ptr = carve(bytes, 512);
  g->allocs[*ptr] = Alloc{d, bytes, true};
  return CUDA_SUCCESS;
}
CUresult h_free_async(CUdeviceptr p, CUstream s) {
  HOST_ENTRY("cuMemFreeAsync");
  if (stream_captures(s)) g->captured_ordered_calls++;
  auto it = g->allocs.find(p);
  if (it == g->allocs.end() || !it->second.from_pool) return CUDA_ERROR_INVALID_VALUE;
  g->devices[it->second.device].pool_used -= it->second.size;
  g->allocs.erase(it);
  return CUDA_SUCCESS;
}

tb::DriverApi make_api() {
  tb::DriverApi a{};
  a.init = h_init;
  a.deviceGet = h_device_get;
  a.deviceGetCount = h_device_count;
  a.deviceGetAttribute = h_attr;
  a.deviceTotalMem = h_total;
  a.primaryCtxRetain = h_retain;
  a.ctxGetCurrent = h_get_current;
  a.ctxSetCurrent = h_set_current;
  a.ctxSynchronize = h_ctx_sync;
  a.memGetInfo = h_mem_info;
  a.memAlloc = h_alloc;
  a.memFree = h_free;
  a.eventCreate = h_event_create;
  a.eventDestroy = h_event_destroy;
  a.eventRecord = h_event_record;
  a.eventQuery = h_event_query;
  a.streamSynchronize = h_stream_sync;
  a.threadExchangeStreamCaptureMode = h_capture_mode;
  a.getErrorName = h_error_name;
  a.memAddressReserve = h_reserve;
  a.memAddressFree = h_addr_free;
  a.memCreate = h_create;
  a.memRelease = h_release;
  a.memExportToShareableHandle = h_export;
  a.memImportFromShareableHandle = h_import;
  a.ipcGetMemHandle = h_ipc_get;
  a.ipcOpenMemHandle = h_ipc_open;
  a.ipcCloseMemHandle = h_ipc_close;
  a.memMap = h_map;
  a.memUnmap = h_unmap;
  a.memSetAccess = h_access;
  a.memGetAllocationGranularity = h_granularity;
  a.memPoolCreate = h_pool_create;
  a.memPoolDestroy = h_pool_destroy;
  a.memPoolSetAttribute = h_pool_set;
  a.memPoolGetAttribute = h_pool_get;
  a.memPoolTrimTo = h_pool_trim;
  a.memPoolSetAccess = h_pool_access;
  a.memAllocFromPoolAsync = h_pool_alloc;
  a.memFreeAsync = h_free_async;
  a.eventSynchronize = h_event_sync;
  a.streamCreate = h_stream_create;
  a.streamDestroy = h_stream_destroy;
  a.memcpyDtoHAsync = h_dtoh;
  a.memcpyHtoDAsync = h_htod;
  a.memsetD8Async = h_memset;
  a.memcpyDtoDAsync = h_dtod;
  a.moduleLoadData = h_module_load;
  a.moduleUnload = h_module_unload;
  a.moduleGetFunction = h_get_function;
  a.launchKernel = h_launch;
  a.memHostAlloc = h_host_alloc;
  a.memFreeHost = h_free_host;
  a.memHostRegister = h_host_register;
  a.memHostUnregister = h_host_unregister;
  a.streamGetCaptureInfo = h_capture_info;
  a.graphNodeGetDependencies = h_node_deps;
  return a;
}

tb::DriverApi g_api;

struct FreeAtExit {
  void* ptr;
};
std::vector<FreeAtExit>* g_exit_frees = nullptr;

void free_at_exit() {
  for (const FreeAtExit& f : *g_exit_frees) tb_free(f.ptr, 0, 0, nullptr);
}

}  // namespace

extern "C" {

// Installs the stand-in with `devices` devices of `capacity` bytes each; pools grow
// in multiples of `pool_chunk` bytes (0: exactly as asked). Call once per process,
// before any other tb_ function.
int tb_host_use(int devices, int64_t capacity, int vmm, int pools, int64_t pool_chunk) {
  if (g != nullptr || devices < 1) return 1;
  g = new State();
  g->devices.resize(static_cast<size_t>(devices));
  for (HostDevice& d : g->devices) {
    d.capacity = static_cast<size_t>(capacity);
    d.vmm = vmm != 0;
    d.pools = pools != 0;
  }
  g->pool_chunk = static_cast<size_t>(pool_chunk);
  g_api = make_api();
  tb::set_driver(&g_api);
  return 0;
}

// From now on pools grow in multiples of `pool_chunk` bytes (0: exactly as asked).
void tb_host_pool_chunk(int64_t pool_chunk) { g->pool_chunk = static_cast<size_t>(pool_chunk); }

// A new stream handle on `device`.
void* tb_host_stream(int device) {
  std::lock_guard<std::mutex> l(g->mu);
  void* s = reinterpret_cast<void*>(g->next_stream);
  g->next_stream += 0x100;
  g->streams[s] = device;
  return s;
}

// Queues one unit of work on `stream` (what a kernel launch would do).
void tb_host_submit(void* stream) {
  std::lock_guard<std::mutex> l(g->mu);
  g->submitted[{stream, stream_device(stream)}]++;
}

// Marks all work queued so far on `stream` as done.
void tb_host_complete(void* stream) {
  std::lock_guard<std::mutex> l(g->mu);
  const int d = stream_device(stream);
  g->completed[{stream, d}] = g->submitted[{stream, d}];
}

// Bytes of "device" memory the core holds from the stand-in on `device`.
int64_t tb_host_used(int device) {
  std::lock_guard<std::mutex> l(g->mu);
  return static_cast<int64_t>(g->devices[device].used);
}

// out: maps, unmaps, synchronisations, live handles, live mappings, live
// reservations, injected failures, live cuMemAlloc/pool allocations.
void tb_host_counters(int64_t out[8]) {
  std::lock_guard<std::mutex> l(g->mu);
  out[0] = g->map_calls;
  out[1] = g->unmap_calls;
  out[2] = g->syncs;
  out[3] = static_cast<int64_t>(g->handles.size());
  out[4] = static_cast<int64_t>(g->mappings.size());
  out[5] = static_cast<int64_t>(g->reservations.size());
  out[6] = g->injected;
  out[7] = static_cast<int64_t>(g->allocs.size());
}

// out: cuEventRecord and cuEventQuery calls so far.
void tb_host_event_calls(int64_t out[2]) {
  std::lock_guard<std::mutex> l(g->mu);
  out[0] = g->event_records;
  out[1] = g->event_queries;
}

// cuMemAllocFromPoolAsync and cuMemFreeAsync calls so far on a stream that was capturing.
int64_t tb_host_captured_ordered_calls(void) {
  std::lock_guard<std::mutex> l(g->mu);
  return g->captured_ordered_calls;
}

// Fails `entry_point` ("cuMemMap", ...; "*" for every one) on its `nth` call from
// now (0: not by count; negative: on its -nth call and every call after) and/or at
// `rate` per call, returning `result` (0: out of
// memory for allocating calls, CUDA_ERROR_UNKNOWN otherwise). A null or empty name
// clears every fault. Returns 1 for an unknown name.
int tb_host_fail(const char* entry_point, int64_t nth, double rate, int result, uint64_t seed) {
  std::lock_guard<std::mutex> l(g->mu);
  if (seed != 0) g->rng = seed;
  if (entry_point == nullptr || !*entry_point) {
    g->faults.clear();
    g->all = Fault{};
    return 0;
  }
  Fault f{nth < 0 ? -nth : nth, nth < 0, rate, static_cast<CUresult>(result)};
  if (!std::strcmp(entry_point, "*")) {
    g->all = f;
    return 0;
  }
  if (!known_entry(entry_point)) return 1;
  g->faults[entry_point] = f;
  return 0;
}

// Makes `device`'s context current on this thread (-1: none).
int tb_host_set_current(int device) {
  std::lock_guard<std::mutex> l(g->mu);
  if (device >= static_cast<int>(g->devices.size())) return 1;
  t_ctx = device < 0 ? nullptr : ctx_of(device);
  return 0;
}

// The device of this thread's current context, or -1.
int tb_host_current(void) {
  std::lock_guard<std::mutex> l(g->mu);
  return current_device();
}

// While `hold` is set, synchronisations (and cuMemFree) block. Returns how many
// calls are blocked now; with hold and `wait_for` > 0, first waits until that many are.
int tb_host_hold_syncs(int hold, int wait_for) {
  std::unique_lock<std::mutex> l(g->mu);
  g->hold_syncs = hold != 0;
  if (hold && wait_for > 0) g->sync_cv.wait(l, [&] { return g->waiting_syncs >= wait_for; });
  g->sync_cv.notify_all();
  return g->waiting_syncs;
}

// While syncs are held, the next `n` synchronisations go through anyway (a test stops
// a caller at its (n + 1)th).
void tb_host_pass_syncs(int n) {
  std::lock_guard<std::mutex> l(g->mu);
  g->pass_syncs = n;
}

// Removes one entry point from the table, as a driver that lacks it would. Call
// right after tb_host_use, before any other tb_ function. Returns 1 for an unknown
// or required entry point.
int tb_host_remove_entry(const char* name) {
  std::lock_guard<std::mutex> l(g->mu);
  if (!std::strcmp(name, "cuMemSetAccess")) g_api.memSetAccess = nullptr;
  else if (!std::strcmp(name, "cuMemPoolSetAccess")) g_api.memPoolSetAccess = nullptr;
  else if (!std::strcmp(name, "cuMemCreate")) g_api.memCreate = nullptr;
  else if (!std::strcmp(name, "cuMemAllocFromPoolAsync")) g_api.memAllocFromPoolAsync = nullptr;
  else return 1;
  return 0;
}

void tb_host_capture(void* stream, uint64_t capture, const uint64_t* tails, int n) {
  std::lock_guard<std::mutex> l(g->mu);
  g->captures[stream] = {capture, graph_nodes(tails, n)};
}

void tb_host_node(uint64_t node, const uint64_t* parents, int n) {
  std::lock_guard<std::mutex> l(g->mu);
  g->parents[graph_nodes(&node, 1)[0]] = graph_nodes(parents, n);
}

// Frees `ptr` through tb_free after this thread's thread-local objects and earlier
// static objects are destroyed, as torch does for tensors alive at interpreter exit.
void tb_host_free_at_exit(void* ptr) {
  if (g_exit_frees == nullptr) {
    g_exit_frees = new std::vector<FreeAtExit>();
    std::atexit(free_at_exit);
  }
  g_exit_frees->push_back(FreeAtExit{ptr});
}

// Whether `device` may read and write the memory at `ptr`.
int tb_host_can_access(int device, void* ptr) {
  std::lock_guard<std::mutex> l(g->mu);
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  auto m = g->mappings.find(p / kGranule * kGranule);
  if (m != g->mappings.end()) return m->second.access.count(device) ? 1 : 0;
  auto a = g->allocs.upper_bound(p);
  if (a == g->allocs.begin()) return 0;
  --a;
  if (p >= a->first + a->second.size) return 0;
  if (a->second.device == device) return 1;
  return a->second.from_pool && g->devices[a->second.device].pool_peers.count(device) ? 1 : 0;
}

}  // extern "C"

extern "C" {

// Writes `bytes` from `src` to device memory at `va` (mapped VMM memory or cuMemAlloc memory); 1 if
// it is neither.
int tb_host_poke(void* va, const void* src, int64_t bytes) {
  std::lock_guard<std::mutex> l(g->mu);
  const auto* in = static_cast<const uint8_t*>(src);
  return visit_device(reinterpret_cast<uintptr_t>(va), static_cast<size_t>(bytes), [&](uint8_t* p, size_t n) {
    std::memcpy(p, in, n);
    in += n;
  }) == CUDA_SUCCESS ? 0 : 1;
}

// Reads `bytes` of device memory at `va` into `dst`; 1 if unmapped.
int tb_host_peek(void* va, void* dst, int64_t bytes) {
  std::lock_guard<std::mutex> l(g->mu);
  auto* out = static_cast<uint8_t*>(dst);
  return visit_device(reinterpret_cast<uintptr_t>(va), static_cast<size_t>(bytes), [&](uint8_t* p, size_t n) {
    std::memcpy(out, p, n);
    out += n;
  }) == CUDA_SUCCESS ? 0 : 1;
}

// Bytes of pinned host memory live.
int64_t tb_host_pinned(void) {
  std::lock_guard<std::mutex> l(g->mu);
  return g->host_pinned;
}

}  // extern "C"

namespace {

std::atomic<int64_t> g_trace_counts[9];

void count_trace(const tb::TraceEvent& e) {
  const int a = static_cast<int>(e.action);
  if (a >= 0 && a < 9) g_trace_counts[a].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

extern "C" {

// on = 1: counts from zero from now on; on = 0: stops counting. counts gets the counts.
void tb_host_trace(int on, int64_t counts[9]) {
  for (int a = 0; a < 9; ++a) counts[a] = g_trace_counts[a].load();
  if (on) {
    for (auto& c : g_trace_counts) c.store(0);
    tb::set_trace_sink(&count_trace);
  } else {
    tb::set_trace_sink(nullptr);
  }
}

}  // extern "C"

// ------------------------------------------------------------ a MemPool's own allocator
#include <thread>

#include "../core/allocator.h"
#include "../core/error.h"
#include "../core/route_user.h"
#include "../core/stream_order.h"

namespace {

// An allocator a user gave a MemPool, over the stand-in's cuMemAlloc. Its free checks what a
// free built on cudaFree (which waits for the device) or on Python (which takes the GIL)
// needs: that another thread can allocate on the device meanwhile. Frees that found the
// device allocator's lock held are counted.
std::atomic<int64_t> g_user_allocs{0}, g_user_frees{0}, g_user_frees_blocked{0}, g_user_ends{0},
    g_user_ends_blocked{0};

// Whether another thread can allocate on `device` within 300 ms (the device lock is not held).
bool device_lock_free(int device) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([done, device] {
    tb_free(tb_malloc(512, device, nullptr), 512, device, nullptr);
    done->store(true);
  }).detach();
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (!done->load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  return done->load();
}

class ProbingSource final : public tb::SegmentSource {
 public:
  explicit ProbingSource(int device) : device_(device) {}
  // The allocator's end (a Python object's, taking the GIL) must not run under the lock either.
  ~ProbingSource() override {
    if (!device_lock_free(device_)) g_user_ends_blocked.fetch_add(1);
    g_user_ends.fetch_add(1);
  }
  CUdeviceptr alloc(size_t bytes, CUstream) override {
    CUdeviceptr p = 0;
    tb_host_set_current(device_);  // a user's allocator allocates on the current device, as torch's do
    if (tb::driver()->memAlloc(&p, bytes) != CUDA_SUCCESS) {
      tb::set_error(tb::kOutOfMemory, "the stand-in's cuMemAlloc refused a MemPool segment");
      return 0;
    }
    g_user_allocs.fetch_add(1);
    return p;
  }
  void free(CUdeviceptr ptr) override {
    if (!device_lock_free(device_)) g_user_frees_blocked.fetch_add(1);
    tb_host_set_current(device_);
    tb::driver()->memFree(ptr);
    g_user_frees.fetch_add(1);
  }

 private:
  int device_;
};

// Shares opened and kept, as a consumer holds them (tb_host_open_kept).
std::mutex g_opened_mu;
std::map<int64_t, std::unique_ptr<tb::OpenedShare>> g_opened;
int64_t g_next_opened = 1;

}  // namespace

extern "C" {

// Creates private pool (id0, id1) on `device` with ProbingSource as its own allocator.
int tb_host_user_pool(int device, uint64_t id0, uint64_t id1) {
  tb::DeviceAllocator* d = tb::Allocator::get().device(device);
  if (d == nullptr) return 1;
  d->create_or_incref_pool({id0, id1}, std::make_unique<ProbingSource>(device));
  return 0;
}

// Opens `n` bytes of a share handle on `device` (Note [Sharing memory between processes])
// and closes what was opened: 0, or the core's error code.
int tb_host_open_share(int device, const char* bytes, int64_t n) {
  tb::DeviceAllocator* d = tb::Allocator::get().device(device);
  if (d == nullptr) return tb::last_error_code();
  tb::OpenedShare s;
  if (!d->open_shared(std::string(bytes, static_cast<size_t>(n)), &s)) return tb::last_error_code();
  d->close_shared(s);
  return 0;
}

// Opens a share on `device` and keeps it open, as a consumer holds what it opened: an id for
// tb_host_close_opened (> 0), or minus the core's error code; *ptr and *size: the mapping.
int64_t tb_host_open_kept(int device, const char* bytes, int64_t n, uint64_t* ptr, uint64_t* size) {
  tb::DeviceAllocator* d = tb::Allocator::get().device(device);
  if (d == nullptr) return -tb::last_error_code();
  auto s = std::make_unique<tb::OpenedShare>();
  if (!d->open_shared(std::string(bytes, static_cast<size_t>(n)), s.get())) return -tb::last_error_code();
  *ptr = s->ptr;
  *size = s->bytes;
  std::lock_guard<std::mutex> l(g_opened_mu);
  g_opened[g_next_opened] = std::move(s);
  return g_next_opened++;
}

// Closes what tb_host_open_kept opened (the consumer's close).
void tb_host_close_opened(int device, int64_t id) {
  std::unique_ptr<tb::OpenedShare> s;
  {
    std::lock_guard<std::mutex> l(g_opened_mu);
    auto it = g_opened.find(id);
    if (it == g_opened.end()) return;
    s = std::move(it->second);
    g_opened.erase(it);
  }
  if (tb::DeviceAllocator* d = tb::Allocator::get().device_if_ready(device)) d->close_shared(*s);
}

// What consumers hold: [imports made, cuIpcOpenMemHandle mappings open, physical handles, reservations].
void tb_host_import_counts(int64_t* out) {
  std::lock_guard<std::mutex> l(g->mu);
  out[0] = g->imports_total;
  out[1] = g->ipc_open;
  out[2] = static_cast<int64_t>(g->handles.size());
  out[3] = static_cast<int64_t>(g->reservations.size());
}

// Note [The parked block] on or off, for every device.
void tb_host_parking(int on) { tb::DeviceAllocator::set_parking(on != 0); }

// The stream clock's mark interval, for every device.
void tb_host_mark_interval(int64_t microseconds) {
  tb::StreamClock::set_mark_interval(std::chrono::microseconds(microseconds));
}

// tb_malloc under a quiet first attempt (Note [A quiet first attempt]), as the bridge asks first.
void* tb_host_malloc_quiet(int64_t size, int device, void* stream) {
  const tb::DeviceAllocator::QuietAttempt quiet;
  return tb_malloc(static_cast<ssize_t>(size), device, stream);
}

// The ProbingSource's allocations, frees, and frees that ran under the device lock.
void tb_host_user_counts(int64_t out[5]) {
  out[0] = g_user_allocs.load();
  out[1] = g_user_frees.load();
  out[2] = g_user_frees_blocked.load();
  out[3] = g_user_ends.load();
  out[4] = g_user_ends_blocked.load();
}

}  // extern "C"

extern "C" {

// Replays a trace (torch_budget.replay.trace) over the core on device 0, in C so that the
// time measured is the core's own: sizes[i] > 0 allocates tensor ids[i] on
// streams[stream_of[i]], 0 frees it. slots holds each live tensor's pointer (num_slots:
// one per id, null when not live), so successive calls continue one program. Returns the
// nanoseconds the operations took; -1 when an allocation failed or an id or stream is out
// of range (the core's error, or none, is set; earlier operations stand).
int64_t tb_host_replay(const int64_t* ids, const int64_t* sizes, const int8_t* stream_of, int64_t n,
                       void* const* streams, int num_streams, void** slots, int64_t num_slots) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= num_slots || stream_of[i] < 0 || stream_of[i] >= num_streams) return -1;
    if (sizes[i] > 0) {
      if (slots[id] != nullptr) return -1;  // allocated twice without a free
      slots[id] = tb_malloc(static_cast<ssize_t>(sizes[i]), 0, streams[stream_of[i]]);
      if (slots[id] == nullptr) return -1;
    } else {
      tb_free(slots[id], 0, 0, nullptr);
      slots[id] = nullptr;
    }
  }
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

}  // extern "C"
