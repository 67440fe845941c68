// The process-wide allocator: one DeviceAllocator per device, created on first use,
// and the entry points the C ABI and the torch bridge call.
#pragma once

#include <cuda.h>

#include <atomic>
#include <mutex>

#include "device_allocator.h"

namespace tb {

constexpr int kMaxDevices = 64;

class Allocator {
 public:
  // Never destroyed: torch may free tensors during interpreter shutdown.
  static Allocator& get();

  // Settings for devices initialised from now on. Fails after the first allocation.
  bool configure(const Settings& settings, int default_route);
  // Loads the CUDA driver unless a stand-in table is already installed.
  bool load_driver();
  int device_count();

  // nullptr + error. `device` < 0 is an error.
  DeviceAllocator* device(int index);
  DeviceAllocator* device_if_ready(int index);

  Block* malloc(size_t size, int device, CUstream stream);
  bool free(Block* block);
  // Finds the live block at `ptr` on any initialised device (kInvalidArgument if none).
  Block* find(void* ptr);
  bool free_ptr(void* ptr);
  bool started() const { return started_.load(std::memory_order_relaxed); }

 private:
  Allocator() = default;
  std::mutex mu_;  // guards creation of device allocators and settings
  Settings settings_;
  std::atomic<DeviceAllocator*> devices_[kMaxDevices] = {};
  std::atomic<bool> started_{false};
  int device_count_ = -1;
};

}  // namespace tb
