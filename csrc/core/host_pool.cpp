#include "host_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <system_error>
#include <thread>

#include "driver.h"
#include "error.h"

namespace tb {

HostPool& HostPool::get() {
  static HostPool* pool = new HostPool();  // never destroyed: backups may outlive statics
  return *pool;
}

size_t HostPool::free_bytes() const {
  size_t n = 0;
  for (const Chunk& c : chunks_)
    for (const auto& [off, len] : c.free) n += len;
  return n;
}

namespace {

// Note [Pinning fast]
// cuMemHostAlloc pins at about 2 GB/s and unpins at about 8 (one H200 host, 8 GiB). The
// time is the kernel faulting in and zeroing pages one thread at a time, 4 KiB each. Mapping
// the memory ourselves with transparent huge pages asked for, faulting it in from several
// threads and then registering it (cuMemHostRegister) pinned at 21 GB/s and unpinned at
// 54 on the same host, and copies in and out ran at the link's 55 GB/s either way
// (tools/probe_pinning.py measures each way). So a pin maps and registers, and falls back
// to cuMemHostAlloc where mapping or registering fails. The mapping is not inherited by a
// forked child (MADV_DONTFORK): the kernel would otherwise copy every pinned page at the fork.
constexpr size_t kHuge = 2 << 20;
constexpr size_t kPage = 4096;
constexpr size_t kPerThread = 64 << 20;  // a thread per 64 MiB faulted in, up to kMaxThreads
constexpr unsigned kMaxThreads = 16;

void fault_in(uint8_t* base, size_t bytes) {
  unsigned threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), kMaxThreads);
  threads = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, bytes / kPerThread)));
  const size_t slice = (bytes / threads + kHuge - 1) / kHuge * kHuge;
  auto touch = [base, bytes](size_t from, size_t to) {
    volatile uint8_t* p = base;
    for (size_t off = from; off < std::min(to, bytes); off += kPage) p[off] = 0;
  };
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads; ++i) {
    try {
      pool.emplace_back(touch, i * slice, (i + 1) * slice);
    } catch (const std::system_error&) {
      touch(i * slice, (i + 1) * slice);  // no thread to spare: fault this slice in here
    }
  }
  touch(0, slice);
  for (std::thread& t : pool) t.join();
}

// Maps `bytes` (a multiple of kHuge) aligned to kHuge and registers them; nullptr where the
// system refuses either (the caller then asks cuMemHostAlloc).
uint8_t* map_and_register(size_t bytes) {
  const DriverApi* d = driver();
  if (!d->has_host_register()) return nullptr;
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto* start = static_cast<uint8_t*>(raw);
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(start) + kHuge - 1) & ~(kHuge - 1));
  if (base > start) munmap(start, static_cast<size_t>(base - start));
  if (const size_t tail = static_cast<size_t>(start + bytes + kHuge - (base + bytes))) munmap(base + bytes, tail);
#ifdef MADV_HUGEPAGE
  madvise(base, bytes, MADV_HUGEPAGE);  // a hint: without huge pages the pin is slower, not wrong
#endif
  madvise(base, bytes, MADV_DONTFORK);
  fault_in(base, bytes);
  if (d->memHostRegister(base, bytes, CU_MEMHOSTREGISTER_PORTABLE) != CUDA_SUCCESS) {
    munmap(base, bytes);
    return nullptr;
  }
  return base;
}

}  // namespace

bool HostPool::pin(size_t bytes, bool at_release) {
  bytes = (bytes + kUnit - 1) / kUnit * kUnit;
  const auto start = std::chrono::steady_clock::now();
  // Portable either way: the backup of any device's tag may land in any chunk.
  if (pinned_with_ == nullptr && driver()->ctxGetCurrent(&pinned_with_) != CUDA_SUCCESS) pinned_with_ = nullptr;
  Chunk c{map_and_register(bytes), bytes, {}, true, at_release};
  if (c.base == nullptr) {
    void* p = nullptr;
    CUresult r = driver()->memHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (r != CUDA_SUCCESS) {
      fail_driver(r, "cuMemHostAlloc", __FILE__, __LINE__);
      return false;
    }
    c.base = static_cast<uint8_t*>(p);
    c.registered = false;
  }
  stats_.pin_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  c.free[0] = bytes;
  if (c.registered) stats_.registered += static_cast<int64_t>(bytes);
  chunks_.push_back(std::move(c));
  stats_.bytes += static_cast<int64_t>(bytes);
  stats_.chunks++;
  if (at_release) stats_.pinned_at_release += static_cast<int64_t>(bytes);
  return true;
}

bool HostPool::unpin(const Chunk& c) {
  const DriverApi* d = driver();
  if (!c.registered) {
    CUresult r = d->memFreeHost(c.base);
    return r == CUDA_SUCCESS || fail_driver(r, "cuMemFreeHost", __FILE__, __LINE__);
  }
  CUresult r = d->memHostUnregister(c.base);
  if (r != CUDA_SUCCESS) return fail_driver(r, "cuMemHostUnregister", __FILE__, __LINE__);
  munmap(c.base, c.bytes);
  stats_.registered -= static_cast<int64_t>(c.bytes);
  return true;
}

bool HostPool::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto held = static_cast<size_t>(stats_.bytes);
  return bytes <= held || pin(bytes - held, false);
}

bool HostPool::take(size_t bytes, std::vector<HostExtent>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t have = free_bytes();
  if (have < bytes && !pin(bytes - have, true)) {
    set_error(kOutOfMemory, "cannot pin " + std::to_string(bytes - have) +
                                " more bytes of host memory for a backup: " + last_error_message());
    return false;
  }
  size_t left = bytes;
  for (Chunk& c : chunks_) {
    for (auto it = c.free.begin(); it != c.free.end() && left > 0;) {
      const size_t off = it->first, len = it->second, n = std::min(len, left);
      out->push_back(HostExtent{c.base + off, n});
      it = c.free.erase(it);
      if (n < len) it = c.free.emplace(off + n, len - n).first;
      left -= n;
    }
    if (left == 0) break;
  }
  stats_.used += static_cast<int64_t>(bytes);
  return true;
}

void HostPool::give_back(const std::vector<HostExtent>& extents) {
  std::lock_guard<std::mutex> lock(mu_);
  // An extent may run on into the chunk the allocator placed next to it (a caller joins
  // extents adjacent in address): each chunk takes back its own part.
  for (HostExtent e : extents) {
    while (e.bytes > 0) {
      Chunk* in = nullptr;
      for (Chunk& c : chunks_)
        if (e.ptr >= c.base && e.ptr < c.base + c.bytes) in = &c;
      if (in == nullptr) break;
      Chunk& c = *in;
      size_t off = static_cast<size_t>(e.ptr - c.base);
      const size_t part = std::min(e.bytes, c.bytes - off);  // this chunk's part of the extent
      size_t len = part;  // grows as the part joins its free neighbours
      e.ptr += part;
      e.bytes -= part;
      auto next = c.free.lower_bound(off);
      if (next != c.free.end() && next->first == off + len) {
        len += next->second;
        next = c.free.erase(next);
      }
      if (next != c.free.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == off) {
          off = prev->first;
          len += prev->second;
          c.free.erase(prev);
        }
      }
      c.free[off] = len;
      stats_.used -= static_cast<int64_t>(part);
    }
  }
  if (keep_ || capturing()) return;  // Note [Unpinning during capture]: the next one unpins them
  // Called from destructors and failure paths: the caller's error stays what it was, and a
  // chunk the driver refuses to unpin stays pinned (free_unused() tries it again).
  const KeepError kept;
  unpin_unused([](const Chunk& c) { return c.at_release; });
}

template <class Which>
bool HostPool::unpin_unused(Which which) {
  // Unpinning needs a current context, and the thread that drops the last backup of a chunk
  // may have none (a destructor, a Python finalizer): it borrows the one the pool pinned with.
  // The memory is portable, so any context of the process unpins it.
  CUcontext current = nullptr;
  if (driver()->ctxGetCurrent(&current) != CUDA_SUCCESS) current = nullptr;
  ContextGuard guard(current == nullptr && pinned_with_ != nullptr ? pinned_with_ : current);
  if (!guard.ok()) return false;  // every chunk stays pinned; the error says why
  bool ok = true;
  std::vector<Chunk> kept;
  for (Chunk& c : chunks_) {
    const bool unused = c.free.size() == 1 && c.free.begin()->first == 0 && c.free.begin()->second == c.bytes;
    if (!unused || !which(c)) {
      kept.push_back(std::move(c));
      continue;
    }
    if (!unpin(c)) {
      ok = false;
      kept.push_back(std::move(c));
      continue;
    }
    stats_.bytes -= static_cast<int64_t>(c.bytes);
    stats_.chunks--;
  }
  chunks_.swap(kept);
  return ok;
}

bool HostPool::free_unused() {
  std::lock_guard<std::mutex> lock(mu_);
  TB_REQUIRE(!capturing(), kState,
             "a CUDA graph capture may be open (a capture into a private pool or a torch.cuda.use_mem_pool block, "
             "which torch opens alike, has not ended), and unpinning host memory would invalidate a capture: free "
             "the host pool once it ends",
             false);
  return unpin_unused([](const Chunk&) { return true; });
}

bool HostPool::set_keep(bool keep) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool was = keep_;
  keep_ = keep;
  return was;
}

bool HostPool::keeps() {
  std::lock_guard<std::mutex> lock(mu_);
  return keep_;
}

HostPoolStats HostPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace tb
