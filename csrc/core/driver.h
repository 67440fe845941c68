// Driver entry points used by the core, resolved at run time.
//
// The core never links against libcuda: it reaches the driver through this table,
// filled either from libcuda.so.1 (load_cuda_driver) or by a host-memory stand-in
// used by the CPU tests (csrc/testing/host_driver.cpp). A machine without a driver
// builds and imports fine; asking for memory there is a clean error.
//
// Entry points come in groups. The base group is required. The others (VMM, memory
// pools, IPC, capture graphs) are optional: a driver lacking one of their entry points
// still loads, and the route that needs them is reported unavailable.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

namespace tb {

struct DriverApi {
  // --- base (required)
  CUresult (*init)(unsigned int flags);
  CUresult (*deviceGet)(CUdevice* dev, int ordinal);
  CUresult (*deviceGetCount)(int* count);
  CUresult (*deviceGetAttribute)(int* value, CUdevice_attribute attr, CUdevice dev);
  CUresult (*deviceTotalMem)(size_t* bytes, CUdevice dev);
  CUresult (*primaryCtxRetain)(CUcontext* ctx, CUdevice dev);
  CUresult (*ctxGetCurrent)(CUcontext* ctx);
  CUresult (*ctxSetCurrent)(CUcontext ctx);
  CUresult (*ctxSynchronize)();
  CUresult (*memGetInfo)(size_t* free_bytes, size_t* total_bytes);
  CUresult (*memAlloc)(CUdeviceptr* ptr, size_t bytes);
  CUresult (*memFree)(CUdeviceptr ptr);
  CUresult (*eventCreate)(CUevent* event, unsigned int flags);
  CUresult (*eventDestroy)(CUevent event);
  CUresult (*eventRecord)(CUevent event, CUstream stream);
  CUresult (*eventQuery)(CUevent event);
  CUresult (*streamSynchronize)(CUstream stream);
  CUresult (*threadExchangeStreamCaptureMode)(CUstreamCaptureMode* mode);
  CUresult (*getErrorName)(CUresult error, const char** name);
  // copies, streams and pinned host memory (release / restore of tags)
  CUresult (*eventSynchronize)(CUevent event);
  CUresult (*streamCreate)(CUstream* stream, unsigned int flags);
  CUresult (*streamDestroy)(CUstream stream);
  CUresult (*memcpyDtoHAsync)(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);
  CUresult (*memcpyHtoDAsync)(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
  CUresult (*memsetD8Async)(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream stream);
  CUresult (*memHostAlloc)(void** ptr, size_t bytes, unsigned int flags);
  CUresult (*memFreeHost)(void* ptr);
  // pinning memory the process mapped itself (optional as a pair; HostPool prefers it: host_pool.h)
  CUresult (*memHostRegister)(void* ptr, size_t bytes, unsigned int flags);
  CUresult (*memHostUnregister)(void* ptr);
  // --- VMM route (optional as a group)
  CUresult (*memAddressReserve)(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                unsigned long long flags);
  CUresult (*memAddressFree)(CUdeviceptr ptr, size_t size);
  CUresult (*memCreate)(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                        unsigned long long flags);
  CUresult (*memRelease)(CUmemGenericAllocationHandle handle);
  CUresult (*memMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                     unsigned long long flags);
  CUresult (*memUnmap)(CUdeviceptr ptr, size_t size);
  CUresult (*memSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count);
  CUresult (*memGetAllocationGranularity)(size_t* granularity, const CUmemAllocationProp* prop,
                                          CUmemAllocationGranularity_flags option);
  // --- stream-ordered pool route (optional as a group)
  CUresult (*memPoolCreate)(CUmemoryPool* pool, const CUmemPoolProps* props);
  CUresult (*memPoolDestroy)(CUmemoryPool pool);
  CUresult (*memPoolSetAttribute)(CUmemoryPool pool, CUmemPool_attribute attr, void* value);
  CUresult (*memPoolGetAttribute)(CUmemoryPool pool, CUmemPool_attribute attr, void* value);
  CUresult (*memPoolTrimTo)(CUmemoryPool pool, size_t keep);
  CUresult (*memPoolSetAccess)(CUmemoryPool pool, const CUmemAccessDesc* desc, size_t count);
  CUresult (*memAllocFromPoolAsync)(CUdeviceptr* ptr, size_t bytes, CUmemoryPool pool, CUstream stream);
  CUresult (*memFreeAsync)(CUdeviceptr ptr, CUstream stream);

  // --- the digest kernel of retained backups (optional as a group; digest.h)
  CUresult (*moduleLoadData)(CUmodule* module, const void* image);
  CUresult (*moduleUnload)(CUmodule module);
  CUresult (*moduleGetFunction)(CUfunction* f, CUmodule module, const char* name);
  CUresult (*launchKernel)(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, unsigned shared, CUstream stream, void** params, void** extra);

  // --- sharing memory with other processes (optional, each on its own)
  CUresult (*memcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);  // sharing runs
  CUresult (*memExportToShareableHandle)(void* shareable, CUmemGenericAllocationHandle handle,
                                         CUmemAllocationHandleType type, unsigned long long flags);
  CUresult (*memImportFromShareableHandle)(CUmemGenericAllocationHandle* handle, void* shareable,
                                           CUmemAllocationHandleType type);
  CUresult (*ipcGetMemHandle)(CUipcMemHandle* handle, CUdeviceptr ptr);
  CUresult (*ipcOpenMemHandle)(CUdeviceptr* ptr, CUipcMemHandle handle, unsigned int flags);
  CUresult (*ipcCloseMemHandle)(CUdeviceptr ptr);
  // --- the graph a stream is capturing (optional as a group: Note [Reuse during capture])
  CUresult (*streamGetCaptureInfo)(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                                   const CUgraphNode** tails, const CUgraphEdgeData** edges, size_t* count);
  CUresult (*graphNodeGetDependencies)(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* edges, size_t* count);
  bool has_vmm() const;
  bool has_pools() const;
  bool has_host_register() const { return memHostRegister && memHostUnregister; }
  bool has_capture_graph() const { return streamGetCaptureInfo && graphNodeGetDependencies; }
};

// The table in use; nullptr until a driver was loaded or installed.
const DriverApi* driver();

// Calls `call` (a driver call returning CUresult) until it succeeds, at most `attempts`
// times, for calls whose refusal would leave state the caller cannot account for (an unmap,
// restoring the caller's context); returns the last result.
template <typename F>
CUresult retry_driver(F call, int attempts = 4) {
  CUresult r = CUDA_SUCCESS;
  for (int attempt = 0; attempt < attempts; ++attempt)
    if ((r = call()) == CUDA_SUCCESS) break;
  return r;
}

// Fills the table from libcuda.so.1. Returns false with a reason when the library
// or a base entry point is missing.
bool load_cuda_driver(std::string* why);

// Replaces the table (the host stand-in of the tests). Not thread-safe: call
// before any allocation.
void set_driver(const DriverApi* api);

// Note [Injected driver failures] (driver_faults.cpp): the entry points that take memory
// fail at `rate` (seeded); false when no driver is loaded yet.
bool inject_driver_faults(double rate, uint64_t seed);
int64_t injected_driver_faults();

// "CUDA_ERROR_OUT_OF_MEMORY" style name of a driver result.
std::string driver_error_name(CUresult r);

// Read and write access for `device`, as cuMemSetAccess / cuMemPoolSetAccess take it.
inline CUmemAccessDesc read_write_access(int device) {
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return desc;
}

// A device and its primary context, as the routes see them.
struct DeviceContext {
  int device = -1;
  CUcontext ctx = nullptr;
};

// Makes `target` the calling thread's current context for the guard's lifetime and
// then restores whatever was current before (possibly no context at all). Every
// core path that calls the driver on a device's behalf holds one, so no entry point
// moves the caller's current device. ok() is false (error recorded) when the switch
// failed; the destructor retries a failed restore a few times.
class ContextGuard {
 public:
  explicit ContextGuard(CUcontext target);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
  bool ok() const { return ok_; }

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
  bool ok_ = false;
};

// Lets this thread make driver calls that stream capture in global mode forbids
// (cuMemCreate, cuMemAlloc, ...) while some stream is capturing, as torch's own
// allocator does. A no-op when `active` is false.
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(bool active);
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  bool active_;
  CUstreamCaptureMode previous_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

}  // namespace tb
