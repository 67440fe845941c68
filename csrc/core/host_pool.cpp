#include "host_pool.h"

#include <chrono>

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

bool HostPool::pin(size_t bytes, bool at_release) {
  bytes = (bytes + kUnit - 1) / kUnit * kUnit;
  const auto start = std::chrono::steady_clock::now();
  void* p = nullptr;
  // Portable: the backup of any device's tag may land in any chunk.
  CUresult r = driver()->memHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
  if (r != CUDA_SUCCESS) {
    fail_driver(r, "cuMemHostAlloc", __FILE__, __LINE__);
    return false;
  }
  stats_.pin_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  Chunk c{static_cast<uint8_t*>(p), bytes, {}};
  c.free[0] = bytes;
  chunks_.push_back(std::move(c));
  stats_.bytes += static_cast<int64_t>(bytes);
  stats_.chunks++;
  if (at_release) stats_.pinned_at_release += static_cast<int64_t>(bytes);
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
  for (const HostExtent& e : extents) {
    for (Chunk& c : chunks_) {
      if (e.ptr < c.base || e.ptr >= c.base + c.bytes) continue;
      size_t off = static_cast<size_t>(e.ptr - c.base), len = e.bytes;
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
      stats_.used -= static_cast<int64_t>(e.bytes);
      break;
    }
  }
}

bool HostPool::free_unused() {
  std::lock_guard<std::mutex> lock(mu_);
  bool ok = true;
  std::vector<Chunk> kept;
  for (Chunk& c : chunks_) {
    const bool unused = c.free.size() == 1 && c.free.begin()->first == 0 && c.free.begin()->second == c.bytes;
    if (!unused) {
      kept.push_back(std::move(c));
      continue;
    }
    CUresult r = driver()->memFreeHost(c.base);
    if (r != CUDA_SUCCESS) {
      ok = fail_driver(r, "cuMemFreeHost", __FILE__, __LINE__);
      kept.push_back(std::move(c));
      continue;
    }
    stats_.bytes -= static_cast<int64_t>(c.bytes);
    stats_.chunks--;
  }
  chunks_.swap(kept);
  return ok;
}

HostPoolStats HostPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace tb
