// VMM route: exporting mappings to other processes (Note [Sharing memory between
// processes], ipc.h).
//
// Note [Sharing run mappings]
// torch's expandable-segment handle, the format a consumer on torch's native allocator
// opens, is a list of handles of one size mapped back to back. The mappings under a block
// are runs of different lengths (Note [Run mappings], route_vmm.h), so before the first
// export of a range its mappings are made uniform: the handle size is the greatest common
// divisor of their lengths, and each longer mapping is mapped again, at the same addresses
// and with the same contents, with handles of that size. A mapping that was already
// exported keeps its handle (a consumer may map it), so its length is the size, and a range
// whose exported mappings differ in length, or do not divide the others, is refused with an
// error naming the sync route. Mapping again: new handles are mapped at a scratch range,
// the device is synchronised (nothing may still write the old memory; refused while a
// capture is open, as a synchronisation would break it), the mapping is copied there, and
// the new handles take the old one's place. For that moment the range's memory exists
// twice, charged to the budget (a refusal is an out-of-memory error, nothing changed). Only
// the handles that hold the block's own granules go out (the offset counts from the first):
// one holding only a neighbour would go back to the driver with that neighbour's memory,
// its descriptor closed, while torch keeps just the shared block allocated for the consumers.
// So every exported handle lies under a block that was live when it was exported, and
// memory under a live block is never unmapped. An exported handle is never kept for a move
// (Note [Moving handles]) and lives until the last process unmaps it.
#include <unistd.h>

#include <algorithm>
#include <numeric>

#include "error.h"
#include "route_vmm.h"

namespace tb {

bool VmmRoute::export_block(Segment& seg, uintptr_t ptr, size_t size, bool may_sync, std::vector<int>* fds,
                            size_t* handle_bytes, uintptr_t* start) {
  TB_REQUIRE(prop_.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, kNotAvailable,
             "device " + std::to_string(ctx_.device) +
                 " cannot export VMM memory as file descriptors: share tensors allocated under "
                 "torch_budget.region(route='sync') instead",
             false);
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const size_t first = (ptr - seg.base) / granule_;
  const size_t last = (ptr + size - 1 - seg.base) / granule_;
  std::vector<std::pair<size_t, size_t>> maps;  // (head, granules) in address order
  size_t exported = 0, piece = 0;
  for (auto it = first_mapping(seg, first); it != seg.maps.end() && it->first <= last; ++it) {
    TB_REQUIRE(maps.empty() ? it->first <= first : maps.back().first + maps.back().second == it->first, kState,
               "internal: an allocated block lies on an unmapped granule", false);
    maps.emplace_back(it->first, it->second);
    if (fds_.count(seg.granules[it->first]) != 0) {
      TB_REQUIRE(exported == 0 || exported == it->second, kNotAvailable,
                 "this memory lies on handles already shared with another process in two different sizes, which "
                 "torch's format cannot describe: share tensors allocated under torch_budget.region(route='sync') "
                 "instead",
                 false);
      exported = it->second;
    }
    piece = std::gcd(piece, it->second);
  }
  TB_REQUIRE(!maps.empty() && maps.back().first + maps.back().second > last, kState,
             "internal: an allocated block lies on an unmapped granule", false);
  if (exported != 0) piece = exported;
  bool split = false;
  for (const auto& [head, count] : maps) {
    TB_REQUIRE(count % piece == 0, kNotAvailable,
               "this memory lies on a handle already shared with another process whose size does not divide the "
               "rest of the range, which torch's format cannot describe: share tensors allocated under "
               "torch_budget.region(route='sync') instead",
               false);
    split = split || count != piece;
  }
  if (split) {
    TB_REQUIRE(may_sync, kState,
               "sharing this tensor first maps its memory again, which needs a device synchronisation, impossible "
               "while a CUDA graph capture is open on device " + std::to_string(ctx_.device) +
                   ": share it before or after capturing",
               false);
    TB_REQUIRE(driver()->memcpyDtoDAsync != nullptr, kNotAvailable, "the driver has no cuMemcpyDtoDAsync", false);
    TB_DRIVER_CHECK(driver()->ctxSynchronize(), false);
    for (const auto& [head, count] : maps)
      if (count != piece && !split_mapping(seg, head, piece)) return false;
  }
  // Only the pieces that hold granules [first, last] go out: one holding only a neighbour would go
  // back to the driver, its descriptor closed, when that neighbour's memory is given back, while
  // this block is still shared. Every piece starts a whole number of pieces past the first mapping.
  const size_t head0 = maps.front().first;
  const size_t lo = head0 + (first - head0) / piece * piece;
  const size_t hi = head0 + ((last - head0) / piece + 1) * piece;
  std::vector<CUmemGenericAllocationHandle> fresh;  // exported by this call
  for (size_t head = lo; head < hi; head += piece) {
    const CUmemGenericAllocationHandle h = seg.granules[head];
    auto it = fds_.find(h);
    if (it == fds_.end()) {
      int fd = -1;
      const CUresult r = driver()->memExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) {
        // Nobody got what this call exported: those handles are not shared after all.
        for (CUmemGenericAllocationHandle f : fresh) {
          close(fds_[f]);
          fds_.erase(f);
        }
        fds->clear();
        return fail_driver(r, "cuMemExportToShareableHandle", __FILE__, __LINE__);
      }
      it = fds_.emplace(h, fd).first;
      fresh.push_back(h);
    }
    fds->push_back(it->second);
  }
  *handle_bytes = piece * granule_;
  *start = seg.base + lo * granule_;
  return true;
}

bool VmmRoute::split_mapping(Segment& seg, size_t head, size_t piece) {
  const DriverApi* d = driver();
  const size_t count = seg.span[head], bytes = count * granule_, piece_bytes = piece * granule_;
  const uintptr_t va = seg.base + head * granule_;
  const CUmemGenericAllocationHandle old = seg.granules[head];
  // Both copies exist until the old handle goes.
  TB_REQUIRE(budget_.charge(bytes, placement(seg)), kOutOfMemory,
             "sharing this tensor maps " + format_size(bytes) + " of its memory again on device " +
                 std::to_string(ctx_.device) + ", which needs that much more for a moment, past the budget: "
                 "raise the budget, or share tensors allocated under torch_budget.region(route='sync')",
             false);
  std::vector<CUmemGenericAllocationHandle> handles;
  CUdeviceptr scratch = 0;
  size_t at_scratch = 0, at_va = 0;  // bytes of new handles mapped at the scratch range, at va
  CUresult r = CUDA_SUCCESS;
  const char* call = "cuMemAddressReserve";
  // Cleanup calls are retried: a refusal there would leave memory the ledger no longer counts.
  auto undo = [&](bool old_unmapped) {
    fail_driver(r, call, __FILE__, __LINE__);
    const std::string msg = last_error_message();
    if (at_va > 0) retry_driver([&] { return d->memUnmap(va, at_va); });
    if (old_unmapped && retry_driver([&] { return d->memMap(va, bytes, 0, old, 0); }) == CUDA_SUCCESS)
      retry_driver([&] { return d->memSetAccess(va, bytes, access_.data(), access_.size()); });
    if (at_scratch > 0) retry_driver([&] { return d->memUnmap(scratch, at_scratch); });
    if (scratch != 0) retry_driver([&] { return d->memAddressFree(scratch, bytes); });
    for (CUmemGenericAllocationHandle h : handles) {
      if (retry_driver([&] { return d->memRelease(h); }) == CUDA_SUCCESS) {
        budget_.uncharge(piece_bytes, placement(seg));
      } else {
        stuck_runs_.emplace_back(h, piece_bytes);  // still charged: retried later
        budget_.move(piece_bytes, placement(seg), kCached);
      }
    }
    budget_.uncharge(bytes - handles.size() * piece_bytes, placement(seg));
    set_error(kDriverError, msg);
    return false;
  };
  if ((r = d->memAddressReserve(&scratch, bytes, granule_, 0, 0)) != CUDA_SUCCESS) return undo(false);
  for (size_t i = 0; i < count / piece; ++i) {
    CUmemGenericAllocationHandle h = 0;
    call = "cuMemCreate";
    if ((r = d->memCreate(&h, piece_bytes, &prop_, 0)) != CUDA_SUCCESS) return undo(false);
    handles.push_back(h);
    call = "cuMemMap";
    if ((r = d->memMap(scratch + at_scratch, piece_bytes, 0, h, 0)) != CUDA_SUCCESS) return undo(false);
    at_scratch += piece_bytes;
  }
  call = "cuMemSetAccess";
  if ((r = d->memSetAccess(scratch, bytes, access_.data(), 1)) != CUDA_SUCCESS) return undo(false);
  call = "cuMemcpyDtoDAsync";
  if ((r = d->memcpyDtoDAsync(scratch, va, bytes, nullptr)) != CUDA_SUCCESS) return undo(false);
  call = "cuCtxSynchronize";
  if ((r = d->ctxSynchronize()) != CUDA_SUCCESS) return undo(false);
  call = "cuMemUnmap";
  if ((r = d->memUnmap(scratch, bytes)) != CUDA_SUCCESS) return undo(false);
  at_scratch = 0;
  if ((r = d->memUnmap(va, bytes)) != CUDA_SUCCESS) return undo(false);
  call = "cuMemMap";
  for (CUmemGenericAllocationHandle h : handles) {
    if ((r = d->memMap(va + at_va, piece_bytes, 0, h, 0)) != CUDA_SUCCESS) return undo(true);
    at_va += piece_bytes;
  }
  call = "cuMemSetAccess";
  if ((r = d->memSetAccess(va, bytes, access_.data(), access_.size())) != CUDA_SUCCESS) return undo(true);
  retry_driver([&] { return d->memAddressFree(scratch, bytes); });
  bump(ledger_.num_device_alloc, static_cast<int64_t>(handles.size()));
  note_unmap(seg, head);
  for (size_t i = 0; i < handles.size(); ++i) note_map(seg, head + i * piece, piece, handles[i]);
  if (release_handle(old) == CUDA_SUCCESS) {
    budget_.uncharge(bytes, placement(seg));
    bump(ledger_.num_device_free);
  } else {
    stuck_runs_.emplace_back(old, bytes);  // still charged: retried later
    budget_.move(bytes, placement(seg), kCached);
  }
  return true;
}

}  // namespace tb
