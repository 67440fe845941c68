#include "driver.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "error.h"

namespace tb {
namespace {

std::atomic<const DriverApi*> g_driver{nullptr};
DriverApi g_cuda;

template <typename Fn>
bool resolve(void* lib, const char* symbol, Fn* out, std::string* why) {
  void* p = dlsym(lib, symbol);
  *out = reinterpret_cast<Fn>(p);
  if (p == nullptr && why != nullptr) {
    *why = std::string("libcuda.so.1 has no entry point ") + symbol;
    return false;
  }
  return true;
}

}  // namespace

bool DriverApi::has_vmm() const {
  return memAddressReserve && memAddressFree && memCreate && memRelease && memMap && memUnmap && memSetAccess &&
         memGetAllocationGranularity;
}

bool DriverApi::has_pools() const {
  return memPoolCreate && memPoolDestroy && memPoolSetAttribute && memPoolGetAttribute && memPoolTrimTo &&
         memPoolSetAccess && memAllocFromPoolAsync && memFreeAsync;
}

const DriverApi* driver() { return g_driver.load(std::memory_order_acquire); }

void set_driver(const DriverApi* api) { g_driver.store(api, std::memory_order_release); }

bool load_cuda_driver(std::string* why) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (driver() != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    *why = std::string("cannot load the CUDA driver (libcuda.so.1): ") + (err ? err : "unknown reason");
    return false;
  }
  DriverApi d{};
  // Versioned names are the ones cuda.h maps the plain names to.
  const bool base =
      resolve(lib, "cuInit", &d.init, why) && resolve(lib, "cuDeviceGet", &d.deviceGet, why) &&
      resolve(lib, "cuDeviceGetCount", &d.deviceGetCount, why) &&
      resolve(lib, "cuDeviceGetAttribute", &d.deviceGetAttribute, why) &&
      resolve(lib, "cuDeviceTotalMem_v2", &d.deviceTotalMem, why) &&
      resolve(lib, "cuDevicePrimaryCtxRetain", &d.primaryCtxRetain, why) &&
      resolve(lib, "cuCtxGetCurrent", &d.ctxGetCurrent, why) && resolve(lib, "cuCtxSetCurrent", &d.ctxSetCurrent, why) &&
      resolve(lib, "cuCtxSynchronize", &d.ctxSynchronize, why) && resolve(lib, "cuMemGetInfo_v2", &d.memGetInfo, why) &&
      resolve(lib, "cuMemAlloc_v2", &d.memAlloc, why) && resolve(lib, "cuMemFree_v2", &d.memFree, why) &&
      resolve(lib, "cuEventCreate", &d.eventCreate, why) && resolve(lib, "cuEventDestroy_v2", &d.eventDestroy, why) &&
      resolve(lib, "cuEventRecord", &d.eventRecord, why) && resolve(lib, "cuEventQuery", &d.eventQuery, why) &&
      resolve(lib, "cuStreamSynchronize", &d.streamSynchronize, why) &&
      resolve(lib, "cuThreadExchangeStreamCaptureMode", &d.threadExchangeStreamCaptureMode, why) &&
      resolve(lib, "cuGetErrorName", &d.getErrorName, why) &&
      resolve(lib, "cuEventSynchronize", &d.eventSynchronize, why) &&
      resolve(lib, "cuStreamCreate", &d.streamCreate, why) &&
      resolve(lib, "cuStreamDestroy_v2", &d.streamDestroy, why) &&
      resolve(lib, "cuMemcpyDtoHAsync_v2", &d.memcpyDtoHAsync, why) &&
      resolve(lib, "cuMemcpyHtoDAsync_v2", &d.memcpyHtoDAsync, why) &&
      resolve(lib, "cuMemsetD8Async", &d.memsetD8Async, why) &&
      resolve(lib, "cuMemHostAlloc", &d.memHostAlloc, why) && resolve(lib, "cuMemFreeHost", &d.memFreeHost, why);
  if (!base) return false;
  // Optional groups: a missing entry point leaves a null and turns the route off.
  resolve(lib, "cuMemHostRegister_v2", &d.memHostRegister, nullptr);
  resolve(lib, "cuMemHostUnregister", &d.memHostUnregister, nullptr);
  resolve(lib, "cuMemAddressReserve", &d.memAddressReserve, nullptr);
  resolve(lib, "cuMemAddressFree", &d.memAddressFree, nullptr);
  resolve(lib, "cuMemCreate", &d.memCreate, nullptr);
  resolve(lib, "cuMemRelease", &d.memRelease, nullptr);
  resolve(lib, "cuMemMap", &d.memMap, nullptr);
  resolve(lib, "cuMemUnmap", &d.memUnmap, nullptr);
  resolve(lib, "cuMemSetAccess", &d.memSetAccess, nullptr);
  resolve(lib, "cuMemGetAllocationGranularity", &d.memGetAllocationGranularity, nullptr);
  resolve(lib, "cuMemPoolCreate", &d.memPoolCreate, nullptr);
  resolve(lib, "cuMemPoolDestroy", &d.memPoolDestroy, nullptr);
  resolve(lib, "cuMemPoolSetAttribute", &d.memPoolSetAttribute, nullptr);
  resolve(lib, "cuMemPoolGetAttribute", &d.memPoolGetAttribute, nullptr);
  resolve(lib, "cuMemPoolTrimTo", &d.memPoolTrimTo, nullptr);
  resolve(lib, "cuMemPoolSetAccess", &d.memPoolSetAccess, nullptr);
  resolve(lib, "cuMemAllocFromPoolAsync", &d.memAllocFromPoolAsync, nullptr);
  resolve(lib, "cuMemFreeAsync", &d.memFreeAsync, nullptr);
  resolve(lib, "cuModuleLoadData", &d.moduleLoadData, nullptr);
  resolve(lib, "cuModuleUnload", &d.moduleUnload, nullptr);
  resolve(lib, "cuModuleGetFunction", &d.moduleGetFunction, nullptr);
  resolve(lib, "cuLaunchKernel", &d.launchKernel, nullptr);
  resolve(lib, "cuMemcpyDtoDAsync_v2", &d.memcpyDtoDAsync, nullptr);
  resolve(lib, "cuMemExportToShareableHandle", &d.memExportToShareableHandle, nullptr);
  resolve(lib, "cuMemImportFromShareableHandle", &d.memImportFromShareableHandle, nullptr);
  resolve(lib, "cuIpcGetMemHandle", &d.ipcGetMemHandle, nullptr);
  resolve(lib, "cuIpcOpenMemHandle_v2", &d.ipcOpenMemHandle, nullptr);
  resolve(lib, "cuIpcCloseMemHandle", &d.ipcCloseMemHandle, nullptr);
  resolve(lib, "cuStreamGetCaptureInfo_v3", &d.streamGetCaptureInfo, nullptr);
  resolve(lib, "cuGraphNodeGetDependencies_v2", &d.graphNodeGetDependencies, nullptr);
  CUresult r = d.init(0);
  if (r != CUDA_SUCCESS) {
    *why = "cuInit failed: " + std::to_string(static_cast<int>(r)) +
           " (no usable GPU, or the driver does not match the kernel module)";
    return false;
  }
  g_cuda = d;
  set_driver(&g_cuda);
  return true;
}

std::string driver_error_name(CUresult r) {
  const DriverApi* d = driver();
  const char* name = nullptr;
  if (d != nullptr && d->getErrorName(r, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return "CUresult " + std::to_string(static_cast<int>(r));
}

ContextGuard::ContextGuard(CUcontext target) {
  // Retried as its restore is: a transient refusal would fail a free or a consumer's close.
  const DriverApi* d = driver();
  CUresult r = retry_driver([&] { return d->ctxGetCurrent(&previous_); });
  if (r != CUDA_SUCCESS) {
    fail_driver(r, "cuCtxGetCurrent", __FILE__, __LINE__);
    return;
  }
  if (previous_ != target) {
    r = retry_driver([&] { return d->ctxSetCurrent(target); });
    if (r != CUDA_SUCCESS) {
      fail_driver(r, "cuCtxSetCurrent", __FILE__, __LINE__);
      return;
    }
    switched_ = true;
  }
  ok_ = true;
}

ContextGuard::~ContextGuard() {
  if (!switched_) return;
  // A restore that fails would silently move the caller to our device: retry.
  retry_driver([&] { return driver()->ctxSetCurrent(previous_); }, 8);
}

RelaxedCaptureMode::RelaxedCaptureMode(bool active) : active_(active && driver() != nullptr) {
  if (!active_) return;
  previous_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  if (driver()->threadExchangeStreamCaptureMode(&previous_) != CUDA_SUCCESS) active_ = false;
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (!active_) return;
  retry_driver([&] { return driver()->threadExchangeStreamCaptureMode(&previous_); }, 8);
}

}  // namespace tb
