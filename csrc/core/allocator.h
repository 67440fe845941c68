// The process-wide allocator: one DeviceAllocator per device, created on first use,
// and the entry points the C ABI and the torch bridge call.
//
// Note [Fork]
// A child created by fork() inherits this process's allocator state, but not its
// CUDA contexts (the driver does not survive a fork). In such a child every
// allocation, share and opening of a share fails with a clear error and every free is
// ignored: the memory belongs
// to the parent, and the child's locks may have been copied while held by a thread
// that does not exist in the child. Start CUDA workers with the 'spawn' method.
#pragma once

#include <cuda.h>

#include <atomic>
#include <mutex>

#include "device_allocator.h"
#include "events.h"

namespace tb {

class Allocator {
 public:
  // Never destroyed: torch may free tensors during interpreter shutdown.
  static Allocator& get();

  // Settings for every device, those already created included. Fails once an
  // allocation was served.
  bool configure(const Settings& settings, int default_route);
  // A tag's budget for every device, those already created included (Note [Tag budgets]);
  // after configure(), before the first allocation.
  bool configure_tag_budget(int tag, int64_t bytes, double fraction);
  // Note [Packing time]: before the first allocation, after configure (which resets it).
  bool configure_packing_time(double share);
  // The device budget (tag < 0) or a tag's budget that devices created from now on start with,
  // at any time; devices already created keep theirs. `was_bytes` / `was_fraction` receive the
  // setting it replaces, for undoing it (set_budget(device="all") sets this and each served
  // device's, so that "every device" includes those that serve their first allocation later).
  bool set_later_budget(int tag, int64_t bytes, double fraction, int64_t* was_bytes, double* was_fraction);
  // Loads the CUDA driver unless a stand-in table is already installed.
  bool load_driver();
  int device_count();

  // nullptr + error. `device` < 0 is an error.
  DeviceAllocator* device(int index);
  DeviceAllocator* device_if_ready(int index);

  // noexcept: Note [An exception stops the process] (device_allocator.h).
  // `oom` (when given): an out-of-memory failure's figures (DeviceAllocator::malloc).
  Block* malloc(size_t size, int device, CUstream stream, OomFigures* oom = nullptr) noexcept;
  // Frees a block by its object (torch's deleter context).
  bool free(Block* block);
  // Frees the live block at `ptr` on whichever device holds it.
  bool free_ptr(void* ptr);
  // Frees the live block at `ptr` of `device`, whatever Block object holds it now.
  bool free_at(int device, uintptr_t ptr);
  bool lookup(void* ptr, int* device, BlockInfo* info);
  bool record_stream(void* ptr, CUstream stream, int stream_device);
  bool end_pool(int device, const PoolId& id);
  bool started() const { return started_.load(std::memory_order_relaxed); }
  bool forked() const { return forked_.load(std::memory_order_relaxed); }
  // true + kState in a process forked from one that used CUDA: what maps or shares device
  // memory (allocating, sharing, opening a share) cannot work there (Note [Fork]).
  bool refuse_in_fork_child();

 private:
  Allocator() = default;
  static void on_fork_child();
  bool not_ours(void* ptr);
  // device(index), with a std::bad_alloc out of the device's creation turned into an
  // out-of-memory error; cold: only the first allocation on a device reaches it.
  [[gnu::cold, gnu::noinline]] DeviceAllocator* create_device(int index) noexcept;

  std::mutex mu_;  // guards creation of device allocators and settings
  Settings settings_;
  std::atomic<DeviceAllocator*> devices_[kMaxDevices] = {};
  std::atomic<bool> started_{false};
  std::atomic<bool> forked_{false};
  int device_count_ = -1;
};

}  // namespace tb
