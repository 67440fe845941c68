#include "allocator.h"

#include <pthread.h>

#include <cstdio>
#include <memory>
#include <new>
#include <string>

#include "driver.h"
#include "error.h"
#include "scope.h"

namespace tb {

Allocator& Allocator::get() {
  static Allocator* instance = [] {
    auto* a = new Allocator();
    pthread_atfork(nullptr, nullptr, &Allocator::on_fork_child);
    return a;
  }();
  return *instance;
}

// See Note [Fork].
void Allocator::on_fork_child() {
  Allocator& a = get();
  for (auto& d : a.devices_)
    if (d.load(std::memory_order_relaxed) != nullptr) a.forked_.store(true, std::memory_order_relaxed);
}

bool Allocator::refuse_in_fork_child() {
  TB_REQUIRE(!forked(), kState,
             "torch_budget cannot serve CUDA memory in a process forked from one that used CUDA: the device "
             "state does not carry over a fork. Start CUDA workers with the 'spawn' start method.",
             true);
  return false;
}

bool Allocator::configure(const Settings& settings, int default_route) {
  TB_REQUIRE(default_route >= 0 && default_route < kRouteCount, kInvalidArgument,
             "unknown route " + std::to_string(default_route), false);
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(!started(), kState, "torch_budget is already serving allocations: configure it before the first one",
             false);
  settings_ = settings;
  set_default_route(default_route);
  for (auto& slot : devices_)
    if (DeviceAllocator* d = slot.load(std::memory_order_acquire)) d->apply(settings);
  return true;
}

bool Allocator::configure_tag_budget(int tag, int64_t bytes, double fraction) {
  if (!Budget::check_tag_setting(tag, fraction)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(!started(), kState, "torch_budget is already serving allocations: set a tag's budget on a device with "
             "set_budget(..., tag=...)", false);
  settings_.tag_bytes[tag] = bytes;
  settings_.tag_fraction[tag] = fraction;
  for (auto& slot : devices_)
    if (DeviceAllocator* d = slot.load(std::memory_order_acquire)) d->apply(settings_);
  return true;
}

bool Allocator::configure_packing_time(double share) {
  TB_REQUIRE(share >= 0 && share <= 1, kInvalidArgument,
             "packing_time must be a share of time in [0, 1], got " + std::to_string(share), false);
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(!started(), kState, "torch_budget is already serving allocations: set packing_time before the first one",
             false);
  settings_.packing_time = share;
  for (auto& slot : devices_)
    if (DeviceAllocator* d = slot.load(std::memory_order_acquire)) d->apply(settings_);
  return true;
}

bool Allocator::set_later_budget(int tag, int64_t bytes, double fraction, int64_t* was_bytes, double* was_fraction) {
  if (tag >= 0 && !Budget::check_tag_setting(tag, fraction)) return false;
  TB_REQUIRE(fraction <= 1, kInvalidArgument, "a budget is bytes or a fraction in (0, 1]", false);
  std::lock_guard<std::mutex> lock(mu_);  // device() creates devices under it, from settings_
  int64_t& b = tag >= 0 ? settings_.tag_bytes[tag] : settings_.budget_bytes;
  double& f = tag >= 0 ? settings_.tag_fraction[tag] : settings_.budget_fraction;
  *was_bytes = b;
  *was_fraction = f;
  b = bytes;
  f = fraction;
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
  if (refuse_in_fork_child()) return nullptr;
  const int count = device_count();
  if (count < 0) return nullptr;
  TB_REQUIRE(index >= 0 && index < count && index < kMaxDevices, kInvalidArgument,
             "device " + std::to_string(index) + " does not exist (" + std::to_string(count) + " visible)", nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  d = devices_[index].load(std::memory_order_acquire);
  if (d != nullptr) return d;
  // Published only once whole: an exception out of its creation leaves no device behind.
  std::unique_ptr<DeviceAllocator> created(new DeviceAllocator(index));
  if (!created->init(settings_)) return nullptr;
  devices_[index].store(created.get(), std::memory_order_release);
  return created.release();
}

DeviceAllocator* Allocator::create_device(int index) noexcept {
  // device() publishes a device only once whole, so an exception out of its creation changed
  // nothing: unlike one out of a change (Note [An exception stops the process]), the caller
  // may go on, and a later allocation creates the device again.
  try {
    return device(index);
  } catch (const std::bad_alloc&) {
    set_error(kOutOfMemory, "host memory ran out while setting up the device");
    return nullptr;
  }
}

Block* Allocator::malloc(size_t size, int device_index, CUstream stream, OomFigures* oom) noexcept {
  if (refuse_in_fork_child()) return nullptr;
  DeviceAllocator* d = device_if_ready(device_index);
  if (__builtin_expect(d == nullptr, 0) && (d = create_device(device_index)) == nullptr) return nullptr;
  if (!started_.load(std::memory_order_relaxed)) started_.store(true, std::memory_order_relaxed);
  const Scope scope = current_scope();
  return d->malloc(size, stream, scope.route, scope.tag, oom);
}

bool Allocator::free(Block* block) {
  if (forked()) return true;  // the parent's memory: see Note [Fork]
  // block->device never changes for a Block object (BlockStore), so this read is
  // safe even for a stale pointer; the device checks the rest under its lock.
  DeviceAllocator* d = device_if_ready(block->device);
  TB_REQUIRE(d != nullptr, kInvalidArgument, "free of a block from an unknown device", false);
  return d->free(block);
}

bool Allocator::not_ours(void* ptr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", ptr);
  set_error(kInvalidArgument, std::string("pointer ") + buf +
                                  " was not allocated by torch_budget, or was already freed (double free)");
  return false;
}

bool Allocator::free_ptr(void* ptr) {
  if (forked()) return true;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceAllocator* d = device_if_ready(i);
    bool found = false;
    if (d == nullptr) continue;
    const bool ok = d->free_ptr(p, &found);
    if (found) return ok;
  }
  return not_ours(ptr);
}

bool Allocator::free_at(int device, uintptr_t ptr) {
  if (forked()) return true;
  DeviceAllocator* d = device_if_ready(device);
  bool found = false;
  if (d != nullptr && d->free_ptr(ptr, &found)) return true;
  return found ? false : not_ours(reinterpret_cast<void*>(ptr));
}

bool Allocator::lookup(void* ptr, int* device, BlockInfo* info) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceAllocator* d = device_if_ready(i);
    if (d != nullptr && d->lookup(p, info)) {
      *device = i;
      return true;
    }
  }
  return not_ours(ptr);
}

bool Allocator::record_stream(void* ptr, CUstream stream, int stream_device) {
  if (forked()) return true;
  TB_REQUIRE(stream_device >= 0 && stream_device < kMaxDevices, kInvalidArgument,
             "record_stream: stream of unknown device " + std::to_string(stream_device), false);
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceAllocator* d = device_if_ready(i);
    bool found = false;
    if (d == nullptr) continue;
    const bool ok = d->record_stream(p, stream, stream_device, &found);
    if (found) return ok;
  }
  return not_ours(ptr);
}

bool Allocator::end_pool(int device_index, const PoolId& id) {
  DeviceAllocator* d = device(device_index);
  if (d == nullptr || !d->end_allocate_to_pool(id)) return false;
  // The last capture anywhere ended: dead pools that are clean go now on every device, without
  // waiting for any (the ending device waited for its own in end_allocate_to_pool).
  if (DeviceAllocator::open_captures() == 0)
    for (int i = 0; i < kMaxDevices; ++i)
      if (DeviceAllocator* other = device_if_ready(i)) other->settle_pools();
  return true;
}

}  // namespace tb
