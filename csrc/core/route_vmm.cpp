#include "route_vmm.h"

#include <unistd.h>

#include <algorithm>

#include "error.h"

namespace tb {

VmmRoute::VmmRoute(const DeviceContext& ctx, Budget& budget, Ledger& ledger, size_t granule, size_t arena_bytes,
                   bool reuse_before_grow)
    : ctx_(ctx), budget_(budget), ledger_(ledger), granule_(granule), arena_bytes_(arena_bytes),
      reuse_(reuse_before_grow) {
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = ctx.device;
  access_.push_back(read_write_access(ctx.device));
  // Exportable handles, so blocks can be shared with other processes (Note [Sharing
  // memory between processes]).
  CUdevice dev = 0;
  int fd_ok = 0;
  if (driver()->memExportToShareableHandle != nullptr && driver()->deviceGet(&dev, ctx.device) == CUDA_SUCCESS &&
      driver()->deviceGetAttribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) ==
          CUDA_SUCCESS &&
      fd_ok != 0)
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

CUresult VmmRoute::release_handle(CUmemGenericAllocationHandle h) {
  const CUresult r = driver()->memRelease(h);
  if (r == CUDA_SUCCESS && !fds_.empty()) {
    auto it = fds_.find(h);
    if (it != fds_.end()) {
      close(it->second);
      fds_.erase(it);
    }
  }
  return r;
}

bool VmmRoute::export_block(const Segment& seg, uintptr_t ptr, size_t size, std::vector<SharedPiece>* pieces,
                            uintptr_t* start) {
  TB_REQUIRE(prop_.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, kNotAvailable,
             "device " + std::to_string(ctx_.device) +
                 " cannot export VMM memory as file descriptors: share tensors allocated under "
                 "torch_budget.route('sync') instead",
             false);
  const size_t first = (ptr - seg.base) / granule_;
  const size_t last = (ptr + size - 1 - seg.base) / granule_;
  size_t i = mapping_head(seg, first);
  *start = seg.base + i * granule_;
  while (i <= last) {
    const CUmemGenericAllocationHandle h = seg.granules[i];
    TB_REQUIRE(h != 0, kState, "internal: an allocated block lies on an unmapped granule", false);
    const size_t span = std::max<size_t>(seg.span[i], 1);
    auto it = fds_.find(h);
    if (it == fds_.end()) {
      int fd = -1;
      TB_DRIVER_CHECK(driver()->memExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                      false);
      it = fds_.emplace(h, fd).first;
    }
    pieces->push_back(SharedPiece{it->second, span * granule_});
    i += span;
  }
  return true;
}

Placement VmmRoute::placement(const Segment& seg) const {
  return Placement{kRouteVmm, seg.small, seg.pool->graph_pool()};
}

bool VmmRoute::grow(BlockPool& pool, size_t size, bool small, CUstream stream) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  // Small requests get a smaller arena: they never need more than a few GiB of range.
  size_t va = small ? std::max(granule_, arena_bytes_ / 16 / granule_ * granule_) : arena_bytes_;
  va = std::max(va, (size + granule_ - 1) / granule_ * granule_);
  CUdeviceptr base = 0;
  TB_DRIVER_CHECK(driver()->memAddressReserve(&base, va, granule_, 0, 0), false);
  arenas_.push_back(pool.add_segment(base, va, small, stream, va / granule_));
  ledger_.segment.add(small, 1);
  return true;
}

bool VmmRoute::ensure_backed(Segment& seg, uintptr_t ptr, size_t size) {
  const size_t first = (ptr - seg.base) / granule_;
  const size_t last = (ptr + size - 1 - seg.base) / granule_;
  std::vector<size_t> need;
  for (size_t i = first; i <= last; ++i)
    if (seg.granules[i] == 0) need.push_back(i);
  return need.empty() || map_granules(seg, need);
}

bool VmmRoute::map_granules(Segment& seg, const std::vector<size_t>& need) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  std::vector<CUmemGenericAllocationHandle> handles;
  if (!take_handles(need.size(), seg.stream, &handles)) return false;

  const DriverApi* d = driver();
  size_t mapped = 0;
  CUresult r = CUDA_SUCCESS;
  const char* call = "cuMemMap";
  for (; mapped < need.size(); ++mapped) {
    r = d->memMap(seg.base + need[mapped] * granule_, granule_, 0, handles[mapped], 0);
    if (r != CUDA_SUCCESS) break;
  }
  if (r == CUDA_SUCCESS) {
    // One access call per contiguous run of newly mapped granules.
    call = "cuMemSetAccess";
    size_t run = 0;
    for (size_t k = 1; k <= need.size() && r == CUDA_SUCCESS; ++k) {
      if (k == need.size() || need[k] != need[k - 1] + 1) {
        r = d->memSetAccess(seg.base + need[run] * granule_, (k - run) * granule_, access_.data(), access_.size());
        run = k;
      }
    }
  }
  // Whatever got mapped belongs to the segment from here on (and is counted there);
  // on failure it is unmapped again, and what cannot be unmapped stays mapped.
  for (size_t k = 0; k < mapped; ++k) {
    seg.granules[need[k]] = handles[k];
    seg.span[need[k]] = 1;
  }
  seg.mapped += mapped;
  budget_.move(mapped * granule_, kCached, placement(seg));
  if (r == CUDA_SUCCESS) {
    size_t run = 0;
    for (size_t k = 1; k <= need.size(); ++k) {
      if (k == need.size() || need[k] != need[k - 1] + 1) {
        traced(TraceAction::kSegmentMap, seg, seg.base + need[run] * granule_, (k - run) * granule_);
        run = k;
      }
    }
    return true;
  }
  fail_driver(r, call, __FILE__, __LINE__);
  const ErrorCode code = last_error_code();
  const std::string msg = last_error_message();
  for (size_t k = 0; k < mapped; ++k) unmap_granule(seg, need[k]);
  free_handles_.insert(free_handles_.end(), handles.begin() + static_cast<long>(mapped), handles.end());
  set_error(code, msg);
  return false;
}

size_t VmmRoute::mapping_head(const Segment& seg, size_t index) {
  while (seg.span[index] == 0 && index > 0) --index;
  return index;
}

bool VmmRoute::map_run(Segment& seg, size_t first, size_t count) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const size_t bytes = count * granule_;
  Charge charge(budget_, bytes, placement(seg));
  if (!charge.ok()) return false;
  const DriverApi* d = driver();
  CUmemGenericAllocationHandle h = 0;
  TB_DRIVER_CHECK(d->memCreate(&h, bytes, &prop_, 0), false);
  charge.commit();  // the driver's memory now, whatever happens below
  bump(ledger_.num_device_alloc);
  const uintptr_t va = seg.base + first * granule_;
  CUresult r = d->memMap(va, bytes, 0, h, 0);
  const char* call = "cuMemMap";
  if (r == CUDA_SUCCESS) {
    for (size_t i = first; i < first + count; ++i) seg.granules[i] = h;
    seg.span[first] = static_cast<uint32_t>(count);
    seg.mapped += count;
    r = d->memSetAccess(va, bytes, access_.data(), access_.size());
    if (r == CUDA_SUCCESS) {
      traced(TraceAction::kSegmentMap, seg, va, bytes);
      return true;
    }
    call = "cuMemSetAccess";
  }
  fail_driver(r, call, __FILE__, __LINE__);
  const std::string msg = last_error_message();
  if (seg.span[first] == count) {
    release_run(seg, first);  // a refused unmap leaves it mapped and counted in the segment
  } else if (release_handle(h) == CUDA_SUCCESS) {
    budget_.uncharge(bytes, placement(seg));
    bump(ledger_.num_device_free);
  } else {
    stuck_runs_.emplace_back(h, bytes);
    budget_.move(bytes, placement(seg), kCached);
  }
  set_error(kDriverError, msg);
  return false;
}

bool VmmRoute::release_run(Segment& seg, size_t head) {
  const size_t count = seg.span[head];
  if (!unmap_range(seg.base + head * granule_, count * granule_)) return false;
  traced(TraceAction::kSegmentUnmap, seg, seg.base + head * granule_, count * granule_);
  const CUmemGenericAllocationHandle h = seg.granules[head];
  for (size_t i = head; i < head + count; ++i) seg.granules[i] = 0;
  seg.span[head] = 0;
  seg.mapped -= count;
  if (release_handle(h) != CUDA_SUCCESS) {
    stuck_runs_.emplace_back(h, count * granule_);  // still charged: retried later
    budget_.move(count * granule_, placement(seg), kCached);
    return true;
  }
  budget_.uncharge(count * granule_, placement(seg));
  bump(ledger_.num_device_free);
  return true;
}

bool VmmRoute::drop_granule(Segment& seg, size_t index) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const size_t head = mapping_head(seg, index);
  if (seg.span[head] > 1) return release_run(seg, head);
  if (!unmap_range(seg.base + index * granule_, granule_)) return false;
  traced(TraceAction::kSegmentUnmap, seg, seg.base + index * granule_, granule_);
  const CUmemGenericAllocationHandle h = seg.granules[index];
  seg.granules[index] = 0;
  seg.span[index] = 0;
  seg.mapped--;
  if (release_handle(h) != CUDA_SUCCESS) {
    free_handles_.push_back(h);  // still the driver's memory, still charged: retried later
    budget_.move(granule_, placement(seg), kCached);
    return true;
  }
  budget_.uncharge(granule_, placement(seg));
  bump(ledger_.num_device_free);
  return true;
}

bool VmmRoute::take_handles(size_t n, CUstream stream, std::vector<CUmemGenericAllocationHandle>* out) {
  auto drain = [&] {
    while (out->size() < n && !free_handles_.empty()) {
      out->push_back(free_handles_.back());
      free_handles_.pop_back();
    }
  };
  auto give_back = [&] {
    free_handles_.insert(free_handles_.end(), out->begin(), out->end());
    out->clear();
  };
  drain();
  if (out->size() < n && reuse_ && !reuse_sources_.empty()) {
    for (BlockPool* source : reuse_sources_) {
      if (out->size() >= n) break;
      unmap_clean_granules(*source, n - out->size());
      drain();
    }
    if (out->size() < n && reuse_sources_[0]->clock().requests_allowed()) {
      for (BlockPool* source : reuse_sources_) {
        if (!request_sync(*source, stream)) continue;
        give_back();
        set_error(kNeedSync, "streams to synchronise before granules can be reused");
        return false;
      }
    }
  }
  while (out->size() < n) {
    Charge charge(budget_, granule_, kCached);
    if (!charge.ok()) break;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = driver()->memCreate(&h, granule_, &prop_, 0);
    if (r != CUDA_SUCCESS) {
      fail_driver(r, "cuMemCreate", __FILE__, __LINE__);
      break;
    }
    charge.commit();
    bump(ledger_.num_device_alloc);
    out->push_back(h);
  }
  if (out->size() == n) return true;
  give_back();
  return false;
}

size_t VmmRoute::unmap_clean_granules(BlockPool& pool, size_t limit) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return 0;
  size_t got = 0;
  for (bool small : {false, true}) {
    const FreeSet& fs = pool.free_set(small);
    for (auto it = fs.begin(); it != fs.end() && got < limit; ++it) {
      const Block* b = *it;
      if (b->size < granule_ || !pool.clock().clean(b->stream, b->freed_at)) continue;
      Segment& s = *b->segment;
      const size_t lo = (b->ptr - s.base + granule_ - 1) / granule_;
      const size_t hi = (b->ptr + b->size - s.base) / granule_;
      for (size_t i = lo; i < hi && got < limit;) {
        if (s.granules[i] == 0) {
          ++i;
          continue;
        }
        const size_t head = mapping_head(s, i), end = head + s.span[head];
        // A run mapping goes only as a whole (Note [Run mappings]); it frees budget, not handles.
        if (s.span[head] > 1) {
          if (head >= lo && end <= hi) release_run(s, head);
          i = end;
          continue;
        }
        if (unmap_granule(s, i)) ++got;
        ++i;
      }
    }
  }
  return got;
}

bool VmmRoute::request_sync(BlockPool& pool, CUstream stream) {
  for (bool small : {false, true}) {
    for (const Block* b : pool.free_set(small)) {
      if (b->stream != stream || b->size < granule_ || pool.clock().clean(b->stream, b->freed_at)) continue;
      const Segment& s = *b->segment;
      const size_t lo = (b->ptr - s.base + granule_ - 1) / granule_;
      const size_t hi = (b->ptr + b->size - s.base) / granule_;
      for (size_t i = lo; i < hi; ++i) {
        if (s.granules[i] != 0) {
          pool.clock().request(stream);
          return true;
        }
      }
    }
  }
  return false;
}

void VmmRoute::traced(TraceAction action, const Segment& seg, uintptr_t va, size_t bytes) const {
  trace(action, ctx_.device, va, bytes, seg.stream, seg.pool->id(), seg.pool->tag(), kRouteVmm);
}

bool VmmRoute::unmap_range(uintptr_t va, size_t bytes) {
  CUresult r = CUDA_SUCCESS;
  for (int attempt = 0; attempt < 4; ++attempt)
    if ((r = driver()->memUnmap(va, bytes)) == CUDA_SUCCESS) return true;
  return fail_driver(r, "cuMemUnmap", __FILE__, __LINE__);
}

bool VmmRoute::unmap_granule(Segment& seg, size_t index) {
  const size_t head = mapping_head(seg, index);
  if (seg.span[head] > 1) return release_run(seg, head);
  if (!unmap_range(seg.base + index * granule_, granule_)) return false;
  traced(TraceAction::kSegmentUnmap, seg, seg.base + index * granule_, granule_);
  free_handles_.push_back(seg.granules[index]);
  seg.granules[index] = 0;
  seg.span[index] = 0;
  seg.mapped--;
  budget_.move(granule_, placement(seg), kCached);
  return true;
}

void VmmRoute::release_free_handles() {
  ContextGuard guard(ctx_.ctx);
  std::vector<CUmemGenericAllocationHandle> kept;
  for (CUmemGenericAllocationHandle h : free_handles_) {
    if (release_handle(h) != CUDA_SUCCESS) {
      kept.push_back(h);  // still the driver's memory, still charged: retried next time
      continue;
    }
    budget_.uncharge(granule_, kCached);
    bump(ledger_.num_device_free);
  }
  free_handles_.swap(kept);
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> stuck;
  for (const auto& [h, bytes] : stuck_runs_) {
    if (release_handle(h) != CUDA_SUCCESS) {
      stuck.emplace_back(h, bytes);
      continue;
    }
    budget_.uncharge(bytes, kCached);
    bump(ledger_.num_device_free);
  }
  stuck_runs_.swap(stuck);
}

void VmmRoute::release_cached(BlockPool& pool) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return;
  unmap_clean_granules(pool, SIZE_MAX);
  release_free_handles();
  // Arenas left without live blocks and mappings give their address range back.
  std::vector<Segment*> empty;
  for (const auto& seg : pool.segments())
    if (seg->live == 0 && seg->mapped == 0) empty.push_back(seg.get());
  for (Segment* seg : empty) destroy_segment(*seg);
}

bool VmmRoute::destroy_segment(Segment& seg) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  bool all_unmapped = true;
  for (size_t i = 0; i < seg.granules.size(); ++i)
    if (seg.granules[i] != 0 && !unmap_granule(seg, i)) all_unmapped = false;
  release_free_handles();
  if (!all_unmapped) return false;
  TB_DRIVER_CHECK(driver()->memAddressFree(seg.base, seg.size), false);
  ledger_.segment.sub(seg.small, 1);
  arenas_.erase(std::remove(arenas_.begin(), arenas_.end(), &seg), arenas_.end());
  seg.pool->remove_segment(&seg);
  return true;
}

bool VmmRoute::grant_peer(int peer) {
  for (const CUmemAccessDesc& a : access_)
    if (a.location.id == peer) return true;
  const CUmemAccessDesc desc = read_write_access(peer);
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  for (Segment* seg : arenas_) {
    size_t i = 0;
    while (i < seg->granules.size()) {
      if (seg->granules[i] == 0) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < seg->granules.size() && seg->granules[j] != 0) ++j;
      TB_DRIVER_CHECK(driver()->memSetAccess(seg->base + i * granule_, (j - i) * granule_, &desc, 1), false);
      i = j;
    }
  }
  access_.push_back(desc);
  return true;
}

}  // namespace tb
