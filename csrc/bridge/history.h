// torch's memory history for the torch_budget allocator: what recordHistory turns on,
// what snapshot() reports as device traces and block stacks, and the observers torch
// attaches (trace trackers, out-of-memory observers).
//
// Note [History]
// The core reports every allocator action to one sink (Note [Allocator trace]) with
// the device's mutex held. The stack of an allocation (or a free, when recording
// "all") must be gathered before that mutex is taken -- gathering takes the GIL, and
// a thread holding the GIL may be waiting for the device's mutex -- so the bridge
// gathers it first and parks it in a thread-local slot that the sink picks up for the
// event this thread causes. Entries go to a ring buffer per device (torch's
// max_entries), oldest first in a snapshot; the stacks of live blocks are kept by
// address for the snapshot's blocks. Trace trackers see every entry, history on or
// off, skip list or not, as torch's own allocator calls them.
//
// A free gathers its stack (when recording "all") for its free_requested entry and, when
// the block is free at once, for its free_completed entry too; a free that waits for
// other streams completes later with the allocation's stack. torch's allocator does
// the same. The free's stack is dropped when the free call returns.
//
// A block keeps its stack until it is freed, also after recording stops (torch's
// blocks hold theirs): a snapshot taken later still names where live memory came
// from. So the sink stays on while any stack is kept, to drop each with its block.
//
// Lock rule: mu_ guards the rings, the block stacks and the observer lists; it is
// taken inside a device's mutex (from the sink) and never the other way round.
// Trackers run with mu_ released and the device's mutex held.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/trace.h"

namespace tb::bridge {

namespace cda = c10::CachingDeviceAllocator;
namespace cca = c10::cuda::CUDACachingAllocator;

class History {
 public:
  static History& get();

  // torch's recordHistory. A recorder is required unless `when` is NEVER.
  void record(bool enabled, cda::CreateContextFn recorder, size_t max_entries, cda::RecordContext when,
              bool clear, const std::vector<std::string>& skip_actions);
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }

  // Before an allocation on this thread: gathers the stack the event will carry.
  void before_alloc() {
    if (when_.load(std::memory_order_relaxed) >= static_cast<int>(cda::RecordContext::STATE)) gather();
  }
  // Drops the stacks this thread's call gathered and did not use, or used for a free.
  static void forget();
  // Keeps this thread's gathered allocation stack aside for its lifetime (frees that run meanwhile,
  // as torch's free-memory callbacks do, record their own) and puts it back at the end; an
  // exception leaving the scope should forget() it after.
  class SetAside {
   public:
    SetAside();
    ~SetAside();
    SetAside(const SetAside&) = delete;
    SetAside& operator=(const SetAside&) = delete;

   private:
    std::shared_ptr<c10::GatheredContext> kept_;
  };
  // Gathers this thread's stack for the events of a call when recording at least
  // `level`, and forgets it when the call is over.
  class Scope {
   public:
    Scope(History& h, cda::RecordContext level) : active_(h.enabled() && h.when_.load() >= static_cast<int>(level)) {
      if (active_) h.gather();
    }
    ~Scope() {
      if (active_) forget();
    }

   private:
    bool active_;
  };
  // torch's user metadata (thread-local), copied into each trace entry.
  static void set_user_metadata(const std::string& md);
  static std::string user_metadata();
  // torch.compile's region names (thread-local, innermost last): the innermost goes
  // into each trace entry, "N/A" outside any.
  static void push_compile_context(const std::string& region);
  static void pop_compile_context();

  void attach_tracker(cda::AllocatorTraceTracker tracker);
  void attach_oom_observer(cca::OutOfMemoryObserver observer);
  void notify_oom(int device, size_t size, size_t limit, size_t device_free);
  // Observers of allocations the budget refused before asking the driver (torch's
  // OomRejectionObserver, where torch has it): (device, size, allocated, limit).
  using RejectionObserver = std::function<void(int64_t, size_t, size_t, size_t)>;
  void attach_rejection_observer(RejectionObserver observer);
  void notify_rejection(int device, size_t size, size_t allocated, size_t limit);

  // For snapshot(): the traces per device, oldest first, times in µs since the epoch,
  // and a SNAPSHOT entry added for the next one; the stack of the live block at `ptr`.
  std::vector<std::vector<cda::TraceEntry>> traces(int devices, size_t total_active);
  std::shared_ptr<c10::GatheredContext> stack_of(int device, uintptr_t ptr);

 private:
  History() = default;
  static void sink(const TraceEvent& e);
  void on_event(const TraceEvent& e);
  void gather();
  void update_sink();
  struct Ring;
  void push(Ring& r, cda::TraceEntry&& entry);  // mu_ held

  struct Ring {
    std::vector<cda::TraceEntry> entries;
    size_t next = 0;  // once full: the slot the next entry overwrites (the oldest)
  };

  std::mutex mu_;
  std::atomic<bool> enabled_{false};
  std::atomic<int> when_{0};  // RecordContext
  std::atomic<cda::CreateContextFn> recorder_{nullptr};  // read without mu_ on every allocation
  size_t max_entries_ = 1;
  bool skip_[16] = {};
  std::vector<Ring> rings_;
  std::unordered_map<uintptr_t, std::shared_ptr<c10::GatheredContext>> stacks_[64];  // per device
  size_t stacked_ = 0;  // entries in stacks_
  // Replaced, never changed, when one is attached: an event takes a reference, not a copy.
  std::shared_ptr<const std::vector<cda::AllocatorTraceTracker>> trackers_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<RejectionObserver> rejection_observers_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

}  // namespace tb::bridge
