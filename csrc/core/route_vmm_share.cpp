// VMM route: exporting mappings to other processes (Note [Sharing memory between
// processes], ipc.h).
//
// Note [Sharing run mappings]
// torch's expandable-segment handle, the format a consumer on torch's native allocator
// opens, is a list of handles of one size mapped back to back. The mappings under a block
// are runs of different lengths (Note [Run mappings], route_vmm.h), so before the first
// export of a range its mappings are made uniform: the handle size is the greatest common
// divisor of their lengths, and each longer mapping is mapped again, at the same addresses
// and with the same contents, with handles of that size (plan_share says which). A mapping
// that was already exported keeps its handle (a consumer may map it), so its length is the
// size, and a range whose exported mappings differ in length, or do not divide the others,
// is refused with an error naming the sync route.
// Mapping again, one mapping at a time (DeviceAllocator::cut_for_share): the device is
// synchronised (nothing may still write the old memory), new handles are mapped at a
// scratch range and the mapping is copied there (stage_cut), the device is synchronised
// again (the copy is done), and the new handles take the old one's place (commit_cut).
// Both waits run with the allocator's lock released, as every wait for the device does
// (Note [The allocator and its collaborators]), so after each the block is looked up again
// and everything re-checked: a block freed meanwhile fails the share; a mapping of its
// segment unmapped meanwhile (Segment::unmaps) drops what was staged and starts again, a
// few times before failing; a capture begun meanwhile fails it, as one open at the start
// does (a synchronisation would break it). A failure drops what was staged and leaves every
// mapping whole, its contents kept. While a mapping is staged its memory exists twice,
// charged to the budget (a refusal is an out-of-memory error, nothing changed).
// The rule this leaves to callers, as the allocator cannot hold back the kernels other
// threads launch: while a first share runs, work another thread launches on memory of a
// mapping being cut -- the shared tensor or any tensor lying on that mapping, one
// allocated there while the share waits included -- is kept only if it runs before that
// mapping's copy; run between the copy and the remap, its writes go to the old memory and
// are lost, and run while the range is unmapped, it faults (an illegal address). Work
// queued before the share began is waited for. So share a tensor before other threads
// launch work on the tensors around it (only the first share of a range cuts; later ones
// export the same handles and change nothing), or allocate what is shared under
// route('sync'), whose handles need no cut.
// Note [A cut that cannot be undone]
// A commit that fails after unmapping the old mapping maps it back. Where the driver refuses
// that too (after retries), or refuses to unmap the new handles already mapped in its place
// (which then stay, booked as mapped, with the contents copied into them), the rest of the range
// is unmapped: the books say so (those granules unmapped, the old handle given back), so that no
// cache release later tries to unmap it again and the memory is not held for good; the share
// fails naming the loss. A later allocation there maps
// new memory as anywhere else: the segment is marked (Segment::lost_mapping), so that the
// shared block, once freed, is not taken back as it is (Note [The parked block]) but goes
// through ensure_backed like any cached block. A mapping put back whose access is refused is
// listed as unreachable and marked the same way. The tensor being shared reads unmapped memory (a fault), which
// no allocator can prevent once the driver refuses every mapping.
// Only the handles that hold the block's own granules go out (the offset counts from the
// first): one holding only a neighbour would go back to the driver with that neighbour's
// memory, its descriptor closed, while torch keeps just the shared block allocated for the
// consumers. So every exported handle lies under a block that was live when it was
// exported, and memory under a live shared block is never unmapped (its tag is not
// released, Note [Tag arenas]). Once unmapped, an exported handle is never mapped again:
// never cached nor kept for a move (Note [Moving handles]); it goes to the driver, its
// descriptor closed, and lives until the last process unmaps it.
#include <unistd.h>

#include <algorithm>
#include <numeric>

#include "error.h"
#include "route_vmm.h"

namespace tb {

bool VmmRoute::plan_share(const Segment& seg, uintptr_t ptr, size_t size, ShareCut* out) const {
  TB_REQUIRE(prop_.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, kNotAvailable,
             "device " + std::to_string(ctx_.device) +
                 " cannot export VMM memory as file descriptors: share tensors allocated under "
                 "torch_budget.region(route='sync') instead",
             false);
  const size_t first = (ptr - seg.base) / granule_;
  const size_t last = (ptr + size - 1 - seg.base) / granule_;
  std::vector<std::pair<size_t, size_t>> maps;  // (head, granules) in address order
  size_t exported = 0, piece = 0;
  for (auto it = seg.first_mapping(first); it != seg.maps.end() && it->first <= last; ++it) {
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
  *out = ShareCut{};
  for (const auto& [head, count] : maps) {
    TB_REQUIRE(count % piece == 0, kNotAvailable,
               "this memory lies on a handle already shared with another process whose size does not divide the "
               "rest of the range, which torch's format cannot describe: share tensors allocated under "
               "torch_budget.region(route='sync') instead",
               false);
    if (count != piece) out->recut.push_back(head);
  }
  // Only the pieces that hold granules [first, last] go out. Once cut, every piece starts a
  // whole number of pieces past the first mapping.
  const size_t head0 = maps.front().first;
  out->piece = piece;
  out->lo = head0 + (first - head0) / piece * piece;
  out->hi = head0 + ((last - head0) / piece + 1) * piece;
  out->unmaps = seg.unmaps;
  return true;
}

bool VmmRoute::export_block(Segment& seg, uintptr_t ptr, size_t size, std::vector<int>* fds, size_t* handle_bytes,
                            uintptr_t* start) {
  ShareCut cut;
  if (!plan_share(seg, ptr, size, &cut)) return false;
  TB_REQUIRE(cut.recut.empty(), kState, "internal: a shared range's mappings were not cut to one size first", false);
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  std::vector<CUmemGenericAllocationHandle> fresh;  // exported by this call
  for (size_t head = cut.lo; head < cut.hi; head += cut.piece) {
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
  *handle_bytes = cut.piece * granule_;
  *start = seg.base + cut.lo * granule_;
  return true;
}

bool VmmRoute::stage_cut(Segment& seg, size_t head, size_t piece, StagedCut* st) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  TB_REQUIRE(d->memcpyDtoDAsync != nullptr, kNotAvailable, "the driver has no cuMemcpyDtoDAsync", false);
  const size_t count = seg.span[head], bytes = count * granule_, piece_bytes = piece * granule_;
  const uintptr_t va = seg.base + head * granule_;
  // Both copies exist until the old handle goes.
  TB_REQUIRE(budget_.charge(bytes, placement(seg)), kOutOfMemory,
             "sharing this tensor maps " + format_size(bytes) + " of its memory again on device " +
                 std::to_string(ctx_.device) + ", which needs that much more for a moment, past the budget: "
                 "raise the budget, or share tensors allocated under torch_budget.region(route='sync')",
             false);
  *st = StagedCut{};
  st->head = head;
  st->count = count;
  st->piece = piece;
  st->old = seg.granules[head];
  st->placement = placement(seg);
  st->charged = true;
  CUresult r = CUDA_SUCCESS;
  const char* call = "cuMemAddressReserve";
  auto undo = [&] {
    fail_driver(r, call, __FILE__, __LINE__);
    const std::string msg = last_error_message();
    drop_staged(st);
    set_error(kDriverError, msg);
    return false;
  };
  if ((r = d->memAddressReserve(&st->scratch, bytes, granule_, 0, 0)) != CUDA_SUCCESS) return undo();
  for (size_t i = 0; i < count / piece; ++i) {
    CUmemGenericAllocationHandle h = 0;
    call = "cuMemCreate";
    if ((r = d->memCreate(&h, piece_bytes, &prop_, 0)) != CUDA_SUCCESS) return undo();
    st->handles.push_back(h);
    call = "cuMemMap";
    if ((r = d->memMap(st->scratch + st->at_scratch, piece_bytes, 0, h, 0)) != CUDA_SUCCESS) return undo();
    st->at_scratch += piece_bytes;
  }
  call = "cuMemSetAccess";
  if ((r = d->memSetAccess(st->scratch, bytes, access_.data(), 1)) != CUDA_SUCCESS) return undo();
  call = "cuMemcpyDtoDAsync";
  if ((r = d->memcpyDtoDAsync(st->scratch, va, bytes, nullptr)) != CUDA_SUCCESS) return undo();
  return true;
}

void VmmRoute::drop_staged(StagedCut* st) {
  if (!st->charged) return;
  ContextGuard guard(ctx_.ctx);
  const size_t bytes = st->count * granule_, piece_bytes = st->piece * granule_;
  const size_t held = st->handles.size() * piece_bytes;
  budget_.uncharge(bytes - held, st->placement);  // never created
  budget_.move(held, st->placement, kCached);
  Scratch scratch{st->scratch, bytes, st->at_scratch, piece_bytes, std::move(st->handles)};
  *st = StagedCut{};
  // A refusal here must not leave memory the ledger no longer counts: what stays is retried.
  if (!give_back_scratch(scratch)) stuck_scratch_.push_back(std::move(scratch));
}

bool VmmRoute::give_back_scratch(Scratch& s) {
  const DriverApi* d = driver();
  if (s.mapped > 0) {
    if (retry_driver([&] { return d->memUnmap(s.va, s.mapped); }) != CUDA_SUCCESS) return false;
    s.mapped = 0;
  }
  for (CUmemGenericAllocationHandle h : s.handles) {
    if (retry_driver([&] { return d->memRelease(h); }) == CUDA_SUCCESS)
      budget_.uncharge(s.piece_bytes, kCached);
    else
      stuck_runs_.emplace_back(h, s.piece_bytes);  // unmapped, still charged as kCached: retried later
  }
  s.handles.clear();
  if (s.va != 0) {
    if (retry_driver([&] { return d->memAddressFree(s.va, s.reserved); }) != CUDA_SUCCESS) return false;
    s.va = 0;
  }
  return true;
}

bool VmmRoute::commit_cut(Segment& seg, StagedCut* st) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) {
    const std::string msg = last_error_message();
    drop_staged(st);
    set_error(kDriverError, msg);
    return false;
  }
  const DriverApi* d = driver();
  const size_t head = st->head, bytes = st->count * granule_, piece_bytes = st->piece * granule_;
  const uintptr_t va = seg.base + head * granule_;
  const CUmemGenericAllocationHandle old = st->old;
  size_t at_va = 0;  // bytes of new handles mapped at va
  CUresult r = CUDA_SUCCESS;
  const char* call = "cuMemUnmap";
  auto undo = [&](bool old_unmapped) {
    fail_driver(r, call, __FILE__, __LINE__);
    std::string msg = last_error_message();
    // New handles mapped at va whose unmap is refused stay there (the old one cannot go back over them).
    const bool new_stay = at_va > 0 && retry_driver([&] { return d->memUnmap(va, at_va); }) != CUDA_SUCCESS;
    size_t kept = 0;  // of the staged handles, those that stay mapped at va
    if (old_unmapped) {
      if (!new_stay && retry_driver([&] { return d->memMap(va, bytes, 0, old, 0); }) == CUDA_SUCCESS) {
        // The books name `old` at head still; without access it is listed (Note [Unreachable mappings]).
        if (set_access(seg, head) != CUDA_SUCCESS) {
          unreachable_.emplace_back(&seg, head);
          seg.lost_mapping = true;
        }
      } else {
        // Note [A cut that cannot be undone]: the books say what the driver left.
        seg.lost_mapping = true;
        note_unmap(seg, head);
        give_back_handle(old, bytes, st->placement);
        if (new_stay) {  // mapped, holding the copied contents: booked, each reached or listed
          kept = at_va / piece_bytes;
          for (size_t i = 0; i < kept; ++i) {
            note_map(seg, head + i * st->piece, st->piece, st->handles[i]);
            if (set_access(seg, head + i * st->piece) != CUDA_SUCCESS)
              unreachable_.emplace_back(&seg, head + i * st->piece);
          }
          bump(ledger_.num_device_alloc, static_cast<int64_t>(kept));
          st->handles.erase(st->handles.begin(), st->handles.begin() + static_cast<std::ptrdiff_t>(kept));
        }
        const size_t lost = bytes - kept * piece_bytes;
        if (lost == 0)  // every new handle stays mapped, holding the copied contents
          msg += "; the new memory, already mapped in place of the old, could not be unmapped, so it stays there "
                 "with the contents copied into it, and the old memory went back to the driver";
        else
          msg += "; mapping the old memory back failed too, so " + std::to_string(lost) +
                 " bytes under the tensor being shared are unmapped and their contents lost";
      }
    }
    drop_staged(st);  // uncharges every staged byte: those kept mapped are charged again
    if (kept > 0) budget_.charge_unchecked(kept * piece_bytes, placement(seg));
    set_error(kDriverError, msg);
    return false;
  };
  if ((r = d->memUnmap(st->scratch, bytes)) != CUDA_SUCCESS) return undo(false);
  st->at_scratch = 0;
  if ((r = d->memUnmap(va, bytes)) != CUDA_SUCCESS) return undo(false);
  call = "cuMemMap";
  for (CUmemGenericAllocationHandle h : st->handles) {
    if ((r = d->memMap(va + at_va, piece_bytes, 0, h, 0)) != CUDA_SUCCESS) return undo(true);
    at_va += piece_bytes;
  }
  call = "cuMemSetAccess";
  if ((r = d->memSetAccess(va, bytes, access_.data(), access_.size())) != CUDA_SUCCESS) return undo(true);
  Scratch scratch{st->scratch, bytes, 0, piece_bytes, {}};  // only its addresses are left
  if (!give_back_scratch(scratch)) stuck_scratch_.push_back(std::move(scratch));
  bump(ledger_.num_device_alloc, static_cast<int64_t>(st->handles.size()));
  note_unmap(seg, head);
  for (size_t i = 0; i < st->handles.size(); ++i) note_map(seg, head + i * st->piece, st->piece, st->handles[i]);
  give_back_handle(old, bytes, st->placement);
  *st = StagedCut{};
  return true;
}

}  // namespace tb
