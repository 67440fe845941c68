#include "allocator.h"

#include <cstdio>
#include <string>

#include "driver.h"
#include "error.h"
#include "scope.h"

namespace tb {

Allocator& Allocator::get() {
  static Allocator* instance = new Allocator();
  return *instance;
}

bool Allocator::configure(const Settings& settings, int default_route) {
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(!started(), kState, "torch_budget is already serving allocations: configure it before the first one",
             false);
  TB_REQUIRE(default_route >= 0 && default_route < kRouteCount, kInvalidArgument,
             "unknown route " + std::to_string(default_route), false);
  settings_ = settings;
  set_default_route(default_route);
  return true;
}

bool Allocator::load_driver() {
  if (driver() != nullptr) return true;
  std::string why;
  TB_REQUIRE(load_cuda_driver(&why), kNotAvailable, why, false);
  return true;
}

int Allocator::device_count() {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_count_ >= 0) return device_count_;
  if (!load_driver()) return -1;
  int n = 0;
  TB_DRIVER_CHECK(driver()->deviceGetCount(&n), -1);
  device_count_ = n;
  return n;
}

DeviceAllocator* Allocator::device_if_ready(int index) {
  if (index < 0 || index >= kMaxDevices) return nullptr;
  return devices_[index].load(std::memory_order_acquire);
}

DeviceAllocator* Allocator::device(int index) {
  DeviceAllocator* d = device_if_ready(index);
  if (d != nullptr) return d;
  const int count = device_count();
  if (count < 0) return nullptr;
  TB_REQUIRE(index >= 0 && index < count, kInvalidArgument,
             "device " + std::to_string(index) + " does not exist (" + std::to_string(count) + " visible)", nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  d = devices_[index].load(std::memory_order_acquire);
  if (d != nullptr) return d;
  auto* created = new DeviceAllocator(index);
  if (!created->init(settings_)) {
    delete created;
    return nullptr;
  }
  devices_[index].store(created, std::memory_order_release);
  return created;
}

Block* Allocator::malloc(size_t size, int device_index, CUstream stream) {
  DeviceAllocator* d = device(device_index);
  if (d == nullptr) return nullptr;
  if (!started_.load(std::memory_order_relaxed)) started_.store(true, std::memory_order_relaxed);
  const Scope scope = current_scope();
  return d->malloc(size, stream, scope.route, scope.tag);
}

bool Allocator::free(Block* block) {
  DeviceAllocator* d = device_if_ready(block->device);
  TB_REQUIRE(d != nullptr, kInvalidArgument, "free of a block from an unknown device", false);
  return d->free(block);
}

Block* Allocator::find(void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceAllocator* d = device_if_ready(i);
    Block* b = nullptr;
    if (d != nullptr && d->owns(p, &b)) return b;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", ptr);
  set_error(kInvalidArgument, std::string("pointer ") + buf +
                                  " was not allocated by torch_budget, or was already freed (double free)");
  return nullptr;
}

bool Allocator::free_ptr(void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceAllocator* d = device_if_ready(i);
    bool found = false;
    if (d == nullptr) continue;
    const bool ok = d->free_ptr(p, &found);
    if (found) return ok;
  }
  return find(ptr) != nullptr;  // records the "not ours / double free" error
}

}  // namespace tb
