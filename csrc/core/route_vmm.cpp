#include "route_vmm.h"

#include <algorithm>

#include "device_allocator.h"
#include "driver.h"
#include "error.h"

namespace tb {

VmmRoute::VmmRoute(DeviceAllocator& dev, size_t granule, size_t arena_bytes, bool reuse_before_grow)
    : dev_(dev), granule_(granule), arena_bytes_(arena_bytes), reuse_before_grow_(reuse_before_grow) {
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = dev.device();
  access_.location = prop_.location;
  access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

// The driver may already be gone at process exit: nothing is released here.
VmmRoute::~VmmRoute() = default;

bool VmmRoute::grow(BlockPool& pool, size_t size, bool small, CUstream stream) {
  if (!dev_.make_current()) return false;
  // Small requests get a smaller arena: they never need more than a few GiB of range.
  size_t va = small ? std::max(granule_, arena_bytes_ / 16 / granule_ * granule_) : arena_bytes_;
  va = std::max(va, (size + granule_ - 1) / granule_ * granule_);
  CUdeviceptr base = 0;
  TB_DRIVER_CHECK(driver()->memAddressReserve(&base, va, granule_, 0, 0), false);
  auto seg = std::make_unique<Segment>();
  seg->base = base;
  seg->size = va;
  seg->small = small;
  seg->stream = stream;
  seg->route = kRouteVmm;
  seg->granules.assign(va / granule_, 0);
  pool.add_segment(std::move(seg));
  dev_.ledger().segment.add(small, 1);
  return true;
}

bool VmmRoute::ensure_backed(Segment& seg, uintptr_t ptr, size_t size) {
  const size_t first = (ptr - seg.base) / granule_;
  const size_t last = (ptr + size - 1 - seg.base) / granule_;
  std::vector<size_t> need;
  for (size_t i = first; i <= last; ++i)
    if (seg.granules[i] == 0) need.push_back(i);
  if (need.empty()) return true;
  if (!dev_.make_current()) return false;

  std::vector<CUmemGenericAllocationHandle> handles;
  if (!take_handles(need.size(), &handles)) return false;

  const DriverApi* d = driver();
  size_t mapped = 0;
  CUresult r = CUDA_SUCCESS;
  for (; mapped < need.size(); ++mapped) {
    r = d->memMap(seg.base + need[mapped] * granule_, granule_, 0, handles[mapped], 0);
    if (r != CUDA_SUCCESS) break;
  }
  if (r == CUDA_SUCCESS) {
    // One access call per contiguous run of newly mapped granules.
    size_t run = 0;
    for (size_t k = 1; k <= need.size() && r == CUDA_SUCCESS; ++k) {
      if (k == need.size() || need[k] != need[k - 1] + 1) {
        r = d->memSetAccess(seg.base + need[run] * granule_, (k - run) * granule_, &access_, 1);
        run = k;
      }
    }
  }
  if (r != CUDA_SUCCESS) {
    fail_driver(r, "cuMemMap/cuMemSetAccess", __FILE__, __LINE__);
    for (size_t k = 0; k < mapped; ++k) d->memUnmap(seg.base + need[k] * granule_, granule_);
    free_handles_.insert(free_handles_.end(), handles.begin(), handles.end());
    return false;
  }
  for (size_t k = 0; k < need.size(); ++k) seg.granules[need[k]] = handles[k];
  seg.mapped += need.size();
  if (seg.pool->graph_pool()) dev_.ledger().graph_pool_reserved.add(static_cast<int64_t>(need.size() * granule_));
  return true;
}

bool VmmRoute::take_handles(size_t n, std::vector<CUmemGenericAllocationHandle>* out) {
  auto drain = [&] {
    while (out->size() < n && !free_handles_.empty()) {
      out->push_back(free_handles_.back());
      free_handles_.pop_back();
    }
  };
  drain();
  bool stolen = false;
  if (out->size() < n && reuse_before_grow_) {
    steal(n - out->size());
    stolen = true;
    drain();
  }
  while (out->size() < n) {
    CUmemGenericAllocationHandle h = 0;
    bool charged = dev_.charge(granule_, kRouteVmm, false, false);
    CUresult r = CUDA_SUCCESS;
    if (charged) {
      r = driver()->memCreate(&h, granule_, &prop_, 0);
      if (r == CUDA_SUCCESS) {
        bump(dev_.ledger().num_device_alloc);
        out->push_back(h);
        continue;
      }
      dev_.uncharge(granule_, kRouteVmm, false, false);
    }
    if (!stolen) {  // budget or driver said no: move cached granules before giving up
      stolen = true;
      steal(n - out->size());
      drain();
      continue;
    }
    if (charged) fail_driver(r, "cuMemCreate", __FILE__, __LINE__);
    free_handles_.insert(free_handles_.end(), out->begin(), out->end());
    out->clear();
    return false;
  }
  return true;
}

size_t VmmRoute::steal(size_t n) {
  BlockPool* pool = dev_.default_pool(kRouteVmm);
  if (pool == nullptr || dev_.capturing()) return 0;  // no stream sync while capturing
  return unmap_free_granules(*pool, n, /*sync_streams=*/true);
}

size_t VmmRoute::unmap_free_granules(BlockPool& pool, size_t limit, bool sync_streams) {
  size_t got = 0;
  std::vector<CUstream> synced;
  for (bool small : {false, true}) {
    for (Block* b : pool.free_set(small)) {
      if (b->size < granule_) continue;
      Segment& s = *b->segment;
      const size_t lo = (b->ptr - s.base + granule_ - 1) / granule_;
      const size_t hi = (b->ptr + b->size - s.base) / granule_;
      for (size_t i = lo; i < hi; ++i) {
        if (s.granules[i] == 0) continue;
        if (sync_streams && std::find(synced.begin(), synced.end(), b->stream) == synced.end()) {
          // Work queued before the free may still touch these addresses.
          if (driver()->streamSynchronize(b->stream) != CUDA_SUCCESS) return got;
          synced.push_back(b->stream);
        }
        CUmemGenericAllocationHandle h = s.granules[i];
        if (!unmap_granule(s, i)) return got;
        free_handles_.push_back(h);
        if (++got >= limit) return got;
      }
    }
  }
  return got;
}

bool VmmRoute::unmap_granule(Segment& seg, size_t index) {
  CUresult r = driver()->memUnmap(seg.base + index * granule_, granule_);
  if (r != CUDA_SUCCESS) return fail_driver(r, "cuMemUnmap", __FILE__, __LINE__);
  seg.granules[index] = 0;
  seg.mapped--;
  if (seg.pool->graph_pool()) dev_.ledger().graph_pool_reserved.sub(static_cast<int64_t>(granule_));
  return true;
}

size_t VmmRoute::release_free_handles() {
  size_t released = 0;
  for (CUmemGenericAllocationHandle h : free_handles_) {
    driver()->memRelease(h);
    dev_.uncharge(granule_, kRouteVmm, false, false);
    bump(dev_.ledger().num_device_free);
    released += granule_;
  }
  free_handles_.clear();
  return released;
}

size_t VmmRoute::release_cached(BlockPool& pool) {
  if (!dev_.make_current()) return 0;
  unmap_free_granules(pool, SIZE_MAX, /*sync_streams=*/false);
  return release_free_handles();
}

void VmmRoute::destroy_segment(Segment& seg) {
  if (!dev_.make_current()) return;
  for (size_t i = 0; i < seg.granules.size(); ++i) {
    CUmemGenericAllocationHandle h = seg.granules[i];
    if (h == 0) continue;
    if (!unmap_granule(seg, i)) continue;
    driver()->memRelease(h);
    dev_.uncharge(granule_, kRouteVmm, false, false);
    bump(dev_.ledger().num_device_free);
  }
  driver()->memAddressFree(seg.base, seg.size);
  dev_.ledger().segment.sub(seg.small, 1);
}

}  // namespace tb
