// Events for record_stream, on any device.
//
// An event must be recorded on a stream of its own device, and record_stream may
// name a stream of another device than the block's (a tensor of cuda:1 used by a
// kernel on cuda:0). The cache keeps reusable events per device and records each
// under its device's primary context, restoring the caller's afterwards.
//
// Lock rule: its own mutex, taken only for the free lists; never held across a
// driver call that can block. Never destroyed (frees can arrive during exit).
#pragma once

#include <cuda.h>

#include <mutex>
#include <vector>

#include "driver.h"

namespace tb {

constexpr int kMaxDevices = 64;

class EventCache {
 public:
  static EventCache& get();

  // An event recorded on `stream` of `device`; nullptr + error on failure.
  CUevent record(int device, CUstream stream);
  // CUDA_SUCCESS when the work before the event is done, CUDA_ERROR_NOT_READY when
  // not yet, another code when the query failed (treated as not yet by callers).
  CUresult query(CUevent event);
  void put(int device, CUevent event);

 private:
  EventCache() = default;
  CUcontext context(int device);

  std::mutex mu_;
  CUcontext ctx_[kMaxDevices] = {};
  std::vector<CUevent> free_[kMaxDevices];
};

}  // namespace tb
