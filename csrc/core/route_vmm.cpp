#include "route_vmm.h"

#include <unistd.h>

#include <algorithm>
#include <iterator>

#include "error.h"

namespace tb {

VmmRoute::VmmRoute(const DeviceContext& ctx, Budget& budget, Ledger& ledger, StreamClock& clock, size_t granule,
                   size_t arena_bytes, bool reuse_before_grow)
    : ctx_(ctx), budget_(budget), ledger_(ledger), clock_(clock), granule_(granule), arena_bytes_(arena_bytes),
      reuse_(reuse_before_grow) {
  set_max_run(kDefaultRunBytes);
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

void VmmRoute::note_map(Segment& seg, size_t head, size_t count, CUmemGenericAllocationHandle h) {
  for (size_t i = head; i < head + count; ++i) seg.granules[i] = h;
  seg.span[head] = static_cast<uint32_t>(count);
  seg.maps[head] = count;
  seg.mapped += count;
}

void VmmRoute::note_unmap(Segment& seg, size_t head) {
  const size_t count = seg.span[head];
  for (size_t i = head; i < head + count; ++i) seg.granules[i] = 0;
  seg.span[head] = 0;
  seg.maps.erase(head);
  seg.mapped -= count;
  seg.unmaps++;
  if (!unreachable_.empty())  // Note [Unreachable mappings]
    unreachable_.erase(std::remove(unreachable_.begin(), unreachable_.end(), std::pair<const Segment*, size_t>(&seg, head)),
                       unreachable_.end());
}

size_t VmmRoute::unbacked(const Segment& seg, uintptr_t ptr, size_t size) const {
  const size_t first = (ptr - seg.base) / granule_, last = (ptr + size - 1 - seg.base) / granule_;
  // A range of a few granules (nearly every request) reads their handles: cheaper than a
  // walk of the mappings' tree. Long ranges (an arena's unmapped tail) walk the tree, so
  // neither grows with the card.
  size_t missing = 0;
  if (last - first < kScanGranules) {
    for (size_t i = first; i <= last; ++i) missing += seg.granules[i] == 0;
  } else {
    size_t covered = 0;
    for (auto it = seg.first_mapping(first); it != seg.maps.end() && it->first <= last; ++it)
      covered += std::min(it->first + it->second - 1, last) - std::max(it->first, first) + 1;
    missing = last - first + 1 - covered;
  }
  // Note [Unreachable mappings]: mapped, but not to be handed out before ensure_backed reaches them.
  if (__builtin_expect(!unreachable_.empty(), 0)) missing += unreachable_in(seg, first, last);
  return missing;
}

size_t VmmRoute::usable(const Block& b) const {
  const Segment& seg = *b.segment;
  const uintptr_t lo = b.ptr, hi = b.ptr + b.size;
  size_t best = 0;
  uintptr_t run_lo = 0, run_hi = 0;
  auto close_run = [&] {
    if (run_hi > run_lo) best = std::max<size_t>(best, std::min(run_hi, hi) - std::max(run_lo, lo));
  };
  for (auto it = seg.first_mapping((lo - seg.base) / granule_); it != seg.maps.end(); ++it) {
    const uintptr_t m_lo = seg.base + it->first * granule_, m_hi = m_lo + it->second * granule_;
    if (m_lo >= hi) break;
    if (m_lo != run_hi) {
      close_run();
      run_lo = m_lo;
    }
    run_hi = m_hi;
  }
  close_run();
  return best;
}

bool VmmRoute::ensure_backed(Segment& seg, uintptr_t ptr, size_t size) {
  const size_t first = (ptr - seg.base) / granule_;
  const size_t last = (ptr + size - 1 - seg.base) / granule_;
  std::vector<std::pair<size_t, size_t>> gaps;  // runs of missing granules: (first, count)
  size_t at = first, missing = 0;
  for (auto it = seg.first_mapping(first); it != seg.maps.end() && it->first <= last; ++it) {
    if (it->first > at) gaps.emplace_back(at, it->first - at);
    at = std::max(at, it->first + it->second);
  }
  if (at <= last) gaps.emplace_back(at, last + 1 - at);
  if (!unreachable_.empty() && !reach(seg, first, last)) return false;  // Note [Unreachable mappings]
  if (gaps.empty()) return true;
  for (const auto& g : gaps) missing += g.second;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  // Note [Packing: reclaim before growth]
  const size_t live = static_cast<size_t>(std::max<int64_t>(ledger_.blocks[kAggregate].allocated_bytes.get(), 0)) + size;
  high_water_ = std::max(high_water_, live);
  const int64_t over = budget_.reserved() + static_cast<int64_t>(missing * granule_) - allowance();
  // A move costs what it gives back and the part of the new mapping past the line (the
  // rest is growth, mapped either way): Note [Packing time].
  const bool move = reuse_ && over > 0 && packing_.may_move();
  const PackingTime::Clock::time_point start = PackingTime::Clock::now();
  size_t gave_back = 0;
  if (move) {
    keep_moving_ = true;  // Note [Moving handles]
    gave_back = reclaim(static_cast<size_t>(over));
    keep_moving_ = false;
  }
  const PackingTime::Clock::time_point mapping = move ? PackingTime::Clock::now() : start;
  bool ok = true;
  std::vector<std::pair<size_t, size_t>> runs;  // the mappings to make: (first granule, count)
  for (const auto& [begin, count] : gaps)
    for (size_t at = begin; at < begin + count; at += max_run_) runs.emplace_back(at, std::min(max_run_, begin + count - at));
  ok = map_missing(seg, runs);
  release_moving();
  const PackingTime::Clock::time_point end = PackingTime::Clock::now();
  const auto ns = [](PackingTime::Clock::duration d) {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  };
  bump(ledger_.mapping_ns, ns(end - start));
  if (gave_back > 0) {  // nothing clean to give back: pure growth, no move to charge
    const double past_line = std::min(1.0, static_cast<double>(over) / static_cast<double>(missing * granule_));
    packing_.spent(mapping - start, end - mapping, past_line);
    bump(ledger_.packing_ns, ns(end - start));
  }
  return ok;
}

bool VmmRoute::map_missing(Segment& seg, const std::vector<std::pair<size_t, size_t>>& runs) {
  for (size_t k = 0; k < runs.size(); ++k) {
    const auto [at, n] = runs[k];
    // What a packing reclaim just unmapped maps here first (Note [Moving handles]).
    if (!moving_.empty()) {
      size_t moved = 0;
      if (!map_moved(seg, at, n, &moved)) return false;
      if (moved > 0) continue;  // a kept handle of exactly this run's length
    }
    // A single granule takes a cached handle when there is one; longer runs get one new handle.
    if (n == 1 && !free_handles_.empty()) {
      if (!map_granules(seg, {at})) return false;
      continue;
    }
    // New memory: kept handles no later run can take go back first, so the device never holds
    // both (Note [Moving handles]).
    if (!moving_.empty()) release_unmatched(runs, k + 1);
    budget_.clear_refusal();
    bool ok = map_run(seg, at, n);
    // Kept handles no run fits are memory too, the budget's and the card's: they go back first.
    if (!ok && !moving_.empty()) {
      release_moving();
      budget_.clear_refusal();
      clear_error();
      ok = map_run(seg, at, n);
    }
    if (!ok && budget_.refused() && reclaim(n * granule_) > 0) {
      budget_.clear_refusal();
      ok = map_run(seg, at, n);
    }
    if (!ok) {
      if (budget_.refused() && reuse_ && clock_.requests_allowed()) {
        for (BlockPool* source : reuse_sources_) {
          if (!request_sync(*source, seg.stream)) continue;
          set_error(kNeedSync, "streams to synchronise before their free memory can be given back");
          break;
        }
      }
      return false;
    }
  }
  return true;
}

bool VmmRoute::map_granules(Segment& seg, const std::vector<size_t>& need) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  // A fresh attempt (a restore falls back here after a run the budget refused): its own
  // failure is the one an out-of-memory message names, the driver's or the budget's.
  budget_.clear_refusal();
  std::vector<CUmemGenericAllocationHandle> handles;
  if (!take_handles(need.size(), &handles)) return false;

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
  for (size_t k = 0; k < mapped; ++k) note_map(seg, need[k], 1, handles[k]);
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
  const KeepError kept;
  for (size_t k = 0; k < mapped; ++k) undo_mapping(seg, need[k]);
  free_handles_.insert(free_handles_.end(), handles.begin() + static_cast<long>(mapped), handles.end());
  return false;
}

size_t VmmRoute::mapping_head(const Segment& seg, size_t index) {
  auto it = seg.first_mapping(index);
  return it != seg.maps.end() && it->first <= index ? it->first : index;
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
    note_map(seg, first, count, h);
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
    undo_mapping(seg, first);  // a refused unmap leaves it mapped and counted in the segment
  } else {
    give_back_handle(h, bytes, placement(seg));
  }
  set_error(kDriverError, msg);
  return false;
}

bool VmmRoute::release_run(Segment& seg, size_t head) {
  const size_t count = seg.span[head];
  if (!unmap_range(seg.base + head * granule_, count * granule_)) return false;
  traced(TraceAction::kSegmentUnmap, seg, seg.base + head * granule_, count * granule_);
  const CUmemGenericAllocationHandle h = seg.granules[head];
  note_unmap(seg, head);
  if (!keep_for_move(seg, h, count)) give_back_handle(h, count * granule_, placement(seg));
  return true;
}

void VmmRoute::give_back_handle(CUmemGenericAllocationHandle h, size_t bytes, const Placement& where) {
  if (release_handle(h) == CUDA_SUCCESS) {
    budget_.uncharge(bytes, where);
    bump(ledger_.num_device_free);
  } else {
    stuck_runs_.emplace_back(h, bytes);  // still charged: retried later
    budget_.move(bytes, where, kCached);
  }
}

bool VmmRoute::drop_granule(Segment& seg, size_t index) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const size_t head = mapping_head(seg, index);
  if (seg.span[head] > 1) return release_run(seg, head);
  if (!unmap_range(seg.base + index * granule_, granule_)) return false;
  traced(TraceAction::kSegmentUnmap, seg, seg.base + index * granule_, granule_);
  const CUmemGenericAllocationHandle h = seg.granules[index];
  note_unmap(seg, index);
  if (keep_for_move(seg, h, 1)) return true;
  if (release_handle(h) != CUDA_SUCCESS) {
    park_handle(h);  // still the driver's memory, still charged: retried later
    budget_.move(granule_, placement(seg), kCached);
    return true;
  }
  budget_.uncharge(granule_, placement(seg));
  bump(ledger_.num_device_free);
  return true;
}

bool VmmRoute::take_handles(size_t n, std::vector<CUmemGenericAllocationHandle>* out) {
  while (out->size() < n && !free_handles_.empty()) {
    out->push_back(free_handles_.back());
    free_handles_.pop_back();
  }
  bool reclaimed = false;
  while (out->size() < n) {
    Charge charge(budget_, granule_, kCached);
    if (!charge.ok()) {
      // Clean free memory elsewhere goes back first (Note [Packing: reclaim before growth]).
      if (reclaimed || reclaim((n - out->size()) * granule_) == 0) break;
      reclaimed = true;
      budget_.clear_refusal();
      continue;
    }
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
  free_handles_.insert(free_handles_.end(), out->begin(), out->end());
  out->clear();
  return false;
}

void VmmRoute::traced(TraceAction action, const Segment& seg, uintptr_t va, size_t bytes) const {
  trace(action, ctx_.device, va, bytes, seg.stream, seg.pool->id(), seg.pool->tag(), kRouteVmm);
}

bool VmmRoute::unmap_range(uintptr_t va, size_t bytes) {
  const CUresult r = retry_driver([&] { return driver()->memUnmap(va, bytes); });
  return r == CUDA_SUCCESS || fail_driver(r, "cuMemUnmap", __FILE__, __LINE__);
}

bool VmmRoute::unmap_granule(Segment& seg, size_t index) {
  const size_t head = mapping_head(seg, index);
  if (seg.span[head] > 1) return release_run(seg, head);
  if (!unmap_range(seg.base + index * granule_, granule_)) return false;
  traced(TraceAction::kSegmentUnmap, seg, seg.base + index * granule_, granule_);
  park_handle(seg.granules[index]);
  note_unmap(seg, index);
  budget_.move(granule_, placement(seg), kCached);
  return true;
}

void VmmRoute::park_handle(CUmemGenericAllocationHandle h) {
  // A consumer may still import an exported handle by its descriptor: mapped again here, it
  // would show them another block's memory.
  if (fds_.count(h) != 0) {
    stuck_runs_.emplace_back(h, granule_);
  } else {
    free_handles_.push_back(h);
  }
}

void VmmRoute::release_free_handles() {
  ContextGuard guard(ctx_.ctx);
  std::vector<Scratch> scratch;
  for (Scratch& s : stuck_scratch_)
    if (!give_back_scratch(s)) scratch.push_back(std::move(s));
  stuck_scratch_.swap(scratch);
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
  release_clean(pool);
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
  std::vector<size_t> heads;
  for (const auto& m : seg.maps) heads.push_back(m.first);
  for (size_t head : heads)
    if (!unmap_granule(seg, head)) all_unmapped = false;
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
    // One call per run of adjacent mappings.
    for (auto it = seg->maps.begin(); it != seg->maps.end();) {
      const size_t lo = it->first;
      size_t hi = it->first + it->second;
      for (++it; it != seg->maps.end() && it->first == hi; ++it) hi += it->second;
      TB_DRIVER_CHECK(driver()->memSetAccess(seg->base + lo * granule_, (hi - lo) * granule_, &desc, 1), false);
    }
  }
  access_.push_back(desc);
  return true;
}

}  // namespace tb
