// The pinned host pool: page-locked host memory that tag backups are copied into.
//
// Pinning is slower than a pinned copy (21 GB/s against the link's 55 on the host measured,
// and 2 GB/s through cuMemHostAlloc: Note [Pinning fast]), so the pool pins once -- ahead of time with reserve(), or at the
// first release that finds it too small -- and keeps the memory across release / restore
// cycles until free_unused() is called. Backups take granule-aligned extents first-fit
// from its chunks and give them back on restore.
//
// Note [Keeping pinned memory]: keeping is the default. With set_keep(false) a chunk pinned at
// a release is unpinned as soon as the last backup in it goes back (what torch_memory_saver
// does with each backup); chunks reserve() pinned stay either way: they were asked for.
//
// Note [Unpinning during capture]: unpinning (cuMemHostUnregister, cuMemFreeHost) is a call
// that a CUDA graph capture in global mode forbids to every thread, and the thread unpinning
// may be any (a finalizer ending the last view of a backup). While the process has a capture
// open, chunks stay pinned: give_back leaves them to the next give_back or free_unused, and
// free_unused refuses, saying so. What is counted is open pool contexts: torch opens a
// use_mem_pool block as it opens a capture (beginAllocateToPool, before any stream captures),
// so one counts as a capture too.
//
// Lock rule: one process-wide mutex; taken after a device's mutex, never before one.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace tb {

struct HostExtent {
  uint8_t* ptr;
  size_t bytes;
};

struct HostPoolStats {
  int64_t bytes = 0;              // pinned bytes held
  int64_t used = 0;               // bytes holding backups
  int64_t chunks = 0;             // pinned allocations
  int64_t pinned_at_release = 0;  // bytes pinned because a release found the pool too small
  int64_t pin_ns = 0;             // time spent pinning
  int64_t registered = 0;         // of bytes, mapped by the pool and registered (the fast way)
};

class HostPool {
 public:
  static HostPool& get();

  // Pins until the pool holds at least `bytes` (in the calling thread's current context,
  // which the caller sets). false + error when the driver refuses.
  bool reserve(size_t bytes);
  // `bytes` (a multiple of the unit) as extents, pinning the shortfall first; false +
  // kOutOfMemory (nothing taken) when that fails.
  bool take(size_t bytes, std::vector<HostExtent>* out);
  void give_back(const std::vector<HostExtent>& extents);
  // Unpins every chunk that holds no backup.
  bool free_unused();
  // Note [Keeping pinned memory]; returns the previous setting.
  bool set_keep(bool keep);
  bool keeps();
  HostPoolStats stats();
  // The process's count of open captures (Note [Unpinning during capture]).
  void watch_captures(const std::atomic<int>* open) { captures_.store(open, std::memory_order_release); }

  static constexpr size_t kUnit = 2 << 20;

 private:
  struct Chunk {
    uint8_t* base;
    size_t bytes;
    std::map<size_t, size_t> free;  // offset -> length, coalesced
    bool registered;                // mapped here and registered, else from cuMemHostAlloc
    bool at_release;                // pinned because a release found the pool too small
  };
  bool pin(size_t bytes, bool at_release);
  bool unpin(const Chunk& c);  // false + error where the driver refuses (the chunk stays)
  // Unpins the chunks that hold nothing and pass `which`; false where the driver refused one.
  template <class Which>
  bool unpin_unused(Which which);
  size_t free_bytes() const;

  std::mutex mu_;
  std::vector<Chunk> chunks_;
  HostPoolStats stats_;
  bool keep_ = true;
  CUcontext pinned_with_ = nullptr;  // current at the first pin; unpin_unused borrows it
  std::atomic<const std::atomic<int>*> captures_{nullptr};
  bool capturing() const {
    const std::atomic<int>* open = captures_.load(std::memory_order_acquire);
    return open != nullptr && open->load(std::memory_order_acquire) > 0;
  }
};

}  // namespace tb
