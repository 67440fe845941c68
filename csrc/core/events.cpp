#include "events.h"

#include <string>

#include "error.h"

namespace tb {

EventCache& EventCache::get() {
  static EventCache* instance = new EventCache();
  return *instance;
}

CUcontext EventCache::context(int device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx_[device] != nullptr) return ctx_[device];
  }
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  TB_DRIVER_CHECK(driver()->deviceGet(&dev, device), nullptr);
  TB_DRIVER_CHECK(driver()->primaryCtxRetain(&ctx, dev), nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  if (ctx_[device] == nullptr) ctx_[device] = ctx;
  return ctx_[device];
}

CUevent EventCache::record(int device, CUstream stream) {
  TB_REQUIRE(device >= 0 && device < kMaxDevices, kInvalidArgument,
             "stream of unknown device " + std::to_string(device), nullptr);
  CUcontext ctx = context(device);
  if (ctx == nullptr) return nullptr;
  CUevent e = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_[device].empty()) {
      e = free_[device].back();
      free_[device].pop_back();
    }
  }
  ContextGuard guard(ctx);
  if (!guard.ok()) {
    if (e != nullptr) put(device, e);
    return nullptr;
  }
  if (e == nullptr) TB_DRIVER_CHECK(driver()->eventCreate(&e, CU_EVENT_DISABLE_TIMING), nullptr);
  CUresult r = driver()->eventRecord(e, stream);
  if (r != CUDA_SUCCESS) {
    put(device, e);
    fail_driver(r, "cuEventRecord", __FILE__, __LINE__);
    return nullptr;
  }
  return e;
}

CUresult EventCache::query(CUevent event) { return driver()->eventQuery(event); }

void EventCache::put(int device, CUevent event) {
  std::lock_guard<std::mutex> lock(mu_);
  free_[device].push_back(event);
}

}  // namespace tb
