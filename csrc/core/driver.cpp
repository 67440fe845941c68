#include "driver.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

namespace tb {
namespace {

std::atomic<const DriverApi*> g_driver{nullptr};
DriverApi g_cuda;

template <typename Fn>
bool resolve(void* lib, const char* symbol, Fn* out, std::string* why) {
  void* p = dlsym(lib, symbol);
  if (p == nullptr) {
    *why = std::string("libcuda.so.1 has no entry point ") + symbol;
    return false;
  }
  *out = reinterpret_cast<Fn>(p);
  return true;
}

}  // namespace

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
  bool ok = resolve(lib, "cuInit", &d.init, why) && resolve(lib, "cuDriverGetVersion", &d.driverGetVersion, why) &&
            resolve(lib, "cuDeviceGet", &d.deviceGet, why) && resolve(lib, "cuDeviceGetCount", &d.deviceGetCount, why) &&
            resolve(lib, "cuDeviceGetAttribute", &d.deviceGetAttribute, why) &&
            resolve(lib, "cuDeviceTotalMem_v2", &d.deviceTotalMem, why) &&
            resolve(lib, "cuDevicePrimaryCtxRetain", &d.primaryCtxRetain, why) &&
            resolve(lib, "cuCtxGetCurrent", &d.ctxGetCurrent, why) &&
            resolve(lib, "cuCtxSetCurrent", &d.ctxSetCurrent, why) &&
            resolve(lib, "cuCtxSynchronize", &d.ctxSynchronize, why) &&
            resolve(lib, "cuMemGetInfo_v2", &d.memGetInfo, why) && resolve(lib, "cuMemAlloc_v2", &d.memAlloc, why) &&
            resolve(lib, "cuMemFree_v2", &d.memFree, why) &&
            resolve(lib, "cuMemAddressReserve", &d.memAddressReserve, why) &&
            resolve(lib, "cuMemAddressFree", &d.memAddressFree, why) && resolve(lib, "cuMemCreate", &d.memCreate, why) &&
            resolve(lib, "cuMemRelease", &d.memRelease, why) && resolve(lib, "cuMemMap", &d.memMap, why) &&
            resolve(lib, "cuMemUnmap", &d.memUnmap, why) && resolve(lib, "cuMemSetAccess", &d.memSetAccess, why) &&
            resolve(lib, "cuMemGetAllocationGranularity", &d.memGetAllocationGranularity, why) &&
            resolve(lib, "cuMemPoolCreate", &d.memPoolCreate, why) &&
            resolve(lib, "cuMemPoolDestroy", &d.memPoolDestroy, why) &&
            resolve(lib, "cuMemPoolSetAttribute", &d.memPoolSetAttribute, why) &&
            resolve(lib, "cuMemPoolGetAttribute", &d.memPoolGetAttribute, why) &&
            resolve(lib, "cuMemPoolTrimTo", &d.memPoolTrimTo, why) &&
            resolve(lib, "cuMemAllocFromPoolAsync", &d.memAllocFromPoolAsync, why) &&
            resolve(lib, "cuMemFreeAsync", &d.memFreeAsync, why) && resolve(lib, "cuEventCreate", &d.eventCreate, why) &&
            resolve(lib, "cuEventDestroy_v2", &d.eventDestroy, why) &&
            resolve(lib, "cuEventRecord", &d.eventRecord, why) && resolve(lib, "cuEventQuery", &d.eventQuery, why) &&
            resolve(lib, "cuEventSynchronize", &d.eventSynchronize, why) &&
            resolve(lib, "cuStreamWaitEvent", &d.streamWaitEvent, why) &&
            resolve(lib, "cuStreamSynchronize", &d.streamSynchronize, why) &&
            resolve(lib, "cuThreadExchangeStreamCaptureMode", &d.threadExchangeStreamCaptureMode, why) &&
            resolve(lib, "cuMemcpyDtoH_v2", &d.memcpyDtoH, why) && resolve(lib, "cuMemcpyHtoD_v2", &d.memcpyHtoD, why) &&
            resolve(lib, "cuMemsetD8_v2", &d.memsetD8, why) && resolve(lib, "cuMemHostAlloc", &d.memHostAlloc, why) &&
            resolve(lib, "cuMemFreeHost", &d.memFreeHost, why) && resolve(lib, "cuGetErrorName", &d.getErrorName, why);
  if (!ok) return false;
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

}  // namespace tb

namespace tb {

RelaxedCaptureMode::RelaxedCaptureMode(bool active) : active_(active && driver() != nullptr) {
  if (!active_) return;
  previous_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  if (driver()->threadExchangeStreamCaptureMode(&previous_) != CUDA_SUCCESS) active_ = false;
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (active_) driver()->threadExchangeStreamCaptureMode(&previous_);
}

}  // namespace tb
