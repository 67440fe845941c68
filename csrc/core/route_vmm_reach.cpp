// The VMM route's mappings that an allocation's failure left without access.
//
// Note [Unreachable mappings]
// A mapping is usable only once cuMemSetAccess named its devices. When an allocation's mapping
// fails part way (its access refused, or a later cuMemMap of the same allocation), what got
// mapped is unmapped again; but a refused unmap leaves the mapping where it is, counted in its
// segment, and from then on unbacked() counted its granules as backed: a later allocation placed
// on them got memory its own device could not touch (over the host stand-in: the access call
// refused once, every unmap refused after it, a live 96 MiB block with 16 MiB unreachable).
// So undo_mapping() sets the access of a mapping it could not unmap, as often as retry_driver
// allows, and only where that is refused too lists the mapping in unreachable_. A listed
// mapping's granules count as missing (unbacked()), so an allocation placed on them goes through
// ensure_backed(), which sets their access first (reach()) and fails with the driver's error
// while it cannot: nothing is handed out unreachable. A tag's restore likewise reaches every
// mapping it restores into before it copies (TagMover::map_piece): with the access refused and
// the unmap refused, a restore had reported success over memory the device could not touch.
// note_unmap() takes a mapping off the list,
// so the list never outlives its segment (destroy_segment unmaps every mapping first).
// The list is empty but after two refusals in a row, so the allocation path pays one test.
//
// Lock rule: used only under the owning DeviceAllocator's mutex, as the rest of the route.
#include <algorithm>

#include "error.h"
#include "route_vmm.h"

namespace tb {

namespace {

// Granules of the mapping at `head` of `seg` within [first, last].
size_t overlap(const Segment& seg, size_t head, size_t first, size_t last) {
  const size_t end = head + seg.span[head];  // one past its last granule
  return head <= last && end > first ? std::min(end - 1, last) - std::max(head, first) + 1 : 0;
}

}  // namespace

CUresult VmmRoute::set_access(const Segment& seg, size_t head) {
  const uintptr_t va = seg.base + head * granule_;
  const size_t bytes = seg.span[head] * granule_;
  return retry_driver([&] { return driver()->memSetAccess(va, bytes, access_.data(), access_.size()); });
}

bool VmmRoute::undo_mapping(Segment& seg, size_t head) {
  if (unmap_granule(seg, head)) return true;  // a run of several granules goes back whole
  if (set_access(seg, head) != CUDA_SUCCESS) unreachable_.emplace_back(&seg, head);
  return false;
}

size_t VmmRoute::unreachable_in(const Segment& seg, size_t first, size_t last) const {
  size_t n = 0;
  for (const auto& [s, head] : unreachable_)
    if (s == &seg) n += overlap(seg, head, first, last);
  return n;
}

bool VmmRoute::reach(Segment& seg, size_t first, size_t last) {
  for (auto it = unreachable_.begin(); it != unreachable_.end();) {
    if (it->first != &seg || overlap(seg, it->second, first, last) == 0) {
      ++it;
      continue;
    }
    ContextGuard guard(ctx_.ctx);  // ensure_backed calls this before it makes the context current
    if (!guard.ok()) return false;
    const CUresult r = set_access(seg, it->second);
    if (r != CUDA_SUCCESS) return fail_driver(r, "cuMemSetAccess", __FILE__, __LINE__);
    it = unreachable_.erase(it);
  }
  return true;
}

}  // namespace tb
