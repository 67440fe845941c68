// Pool checkpoints for CUDA graph trees: Note [Pool checkpoints] (pool_checkpoint.h).
#include "pool_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "error.h"
#include "graph_pools.h"
#include "scope.h"

namespace tb {
namespace {

std::string hex(uintptr_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

void record_checkpoint(const PoolId& id, const PrivatePool& pool, PoolCheckpoint* out) {
  out->pool = id;
  out->segments.clear();
  for (const auto& seg : pool.blocks->segments()) {
    CheckpointSegment cs{seg->base, {}};
    for (const Block* b = seg->head; b != nullptr; b = b->next)
      cs.blocks.push_back(CheckpointBlock{b->ptr, b->size, b->allocated ? b->requested : 0, b->stream, b->allocated});
    out->segments.push_back(std::move(cs));
  }
}

bool restore_checkpoint(PoolOwner& owner, const PoolCheckpoint& cp, const std::string& where,
                        std::vector<uintptr_t>* freed, std::vector<Block*>* created) {
  auto find_segments = [&](std::map<uintptr_t, Segment*>* out) -> PrivatePool* {
    PrivatePool* p = owner.find_pool(cp.pool);
    if (p == nullptr) return nullptr;
    out->clear();
    for (const auto& seg : p->blocks->segments()) (*out)[seg->base] = seg.get();
    return p;
  };
  // Carving maps memory: never behind a released tag (checked again after each wait).
  auto tag_live = [&](const PrivatePool& pool) {
    TB_REQUIRE(owner.tag_live(pool.tag), kState,
               "restoring a checkpoint of " + where + ": the pool belongs to tag '" + tag_name(pool.tag) +
                   "', which is released; restore the tag (torch_budget.restore) first",
               false);
    return true;
  };
  std::map<uintptr_t, Segment*> segs;
  PrivatePool* p = find_segments(&segs);
  TB_REQUIRE(p != nullptr, kInvalidArgument, "no " + where + " to restore a checkpoint into", false);
  if (!tag_live(*p)) return false;
  for (const CheckpointSegment& cs : cp.segments)
    TB_REQUIRE(segs.count(cs.base) != 0, kInvalidArgument,
               "the checkpoint of " + where + " has a segment at " + hex(cs.base) + " that no longer exists", false);
  // Waits for the device, the lock released meanwhile, then finds the pool again.
  auto wait = [&]() {
    TB_REQUIRE(owner.wait_for_device(), kState,
               "restoring a checkpoint of " + where + " needs a device synchronisation, impossible during capture",
               false);
    owner.settle();
    p = find_segments(&segs);
    TB_REQUIRE(p != nullptr, kState, where + " was destroyed while its checkpoint was being restored", false);
    if (!tag_live(*p)) return false;
    for (const CheckpointSegment& cs : cp.segments)
      TB_REQUIRE(segs.count(cs.base) != 0, kState, "segment " + hex(cs.base) + " of " + where + " went away", false);
    return true;
  };
  auto still_in_use = [&]() {
    set_error(kState, "a block of " + where + " is still in use after a device synchronisation: its checkpoint "
                      "cannot be restored");
    return false;
  };

  // 0. What could refuse the restore is passed before anything is freed: a refused restore
  // changes nothing torch can see. Each checkpointed segment must come down to one free block,
  // so a block there that waits on recorded streams now, or will once freed, needs the device
  // waited for -- refused while a capture is open anywhere, and no help for a stream of another
  // device (one used there is refused at once; one already waiting must be done after the wait).
  bool must_wait = false;
  for (const CheckpointSegment& cs : cp.segments)
    for (const Block* b = segs[cs.base]->head; b != nullptr; b = b->next) {
      for (const StreamRef& r : b->recorded)
        TB_REQUIRE(r.device == owner.device(), kState,
                   "restoring a checkpoint of " + where + ": block " + hex(b->ptr) + " was used on a stream of device " +
                       std::to_string(r.device) + ", which the restore cannot wait for",
                   false);
      must_wait = must_wait || !b->recorded.empty() || (!b->allocated && b->pending > 0);
    }
  if (must_wait) {
    if (!wait()) return false;
    for (const CheckpointSegment& cs : cp.segments)
      for (const Block* b = segs[cs.base]->head; b != nullptr; b = b->next)
        if (!b->allocated && b->pending > 0) return still_in_use();
  }

  // 1. Free every block allocated in the pool (torch took their tensors' deleters).
  std::vector<Block*> live;
  for (const auto& seg : p->blocks->segments())
    for (Block* b = seg->head; b != nullptr; b = b->next)
      if (b->allocated) live.push_back(b);
  for (Block* b : live) {
    freed->push_back(b->ptr);
    owner.free_live(b);
  }
  owner.settle();

  // 2. Frees waiting on recorded streams (of this device: step 0) must complete before the
  // layout can change.
  auto settled = [&]() {
    for (const CheckpointSegment& cs : cp.segments) {
      const Segment* seg = segs[cs.base];
      if (!seg->head->is_free() || seg->head->next != nullptr) return false;
    }
    return true;
  };
  if (!settled()) {
    if (!wait()) return false;
    if (!settled()) return still_in_use();
  }

  // 3. Carve each checkpointed segment back into its blocks.
  BlockPool* pool = p->blocks.get();
  // A failure part-way frees what was re-created, keeping the error.
  auto undo = [&]() {
    const KeepError kept;
    for (Block* b : *created) owner.free_live(b);
    created->clear();
    return false;
  };
  // Free ranges of the checkpoint (blocks then free, or waiting on a recorded stream) stay
  // free, merged as the pool merges them; each allocated block is carved at its address.
  for (const CheckpointSegment& cs : cp.segments) {
    Block* cur = segs[cs.base]->head;
    for (const CheckpointBlock& cb : cs.blocks) {
      if (!cb.allocated) continue;
      while (cur != nullptr && cur->ptr + cur->size <= cb.ptr) cur = cur->next;
      if (cur == nullptr || !cur->is_free() || cur->ptr > cb.ptr || cb.ptr + cb.size > cur->ptr + cur->size) {
        set_error(kState, "the checkpoint of " + where + " does not fit segment " + hex(cs.base) +
                              " at block " + hex(cb.ptr));
        return undo();
      }
      Block* b = pool->carve(cur, cb.ptr, cb.size, cb.requested);
      if (b == nullptr) {
        if (last_error_code() == kNeedSync) set_error(kOutOfMemory, "no memory for the checkpoint's blocks");
        return undo();
      }
      b->tag = p->tag;
      owner.adopt(b);
      created->push_back(b);
      cur = b->next;
    }
  }
  return true;
}

bool live_allocations_match(const PrivatePool& pool, const std::vector<uintptr_t>& expected) {
  std::vector<uintptr_t> sorted(expected);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  size_t count = 0;
  bool match = true;
  for (const auto& seg : pool.blocks->segments())
    for (const Block* b = seg->head; b != nullptr && match; b = b->next) {
      if (!b->allocated) continue;
      ++count;
      match = std::binary_search(sorted.begin(), sorted.end(), b->ptr);
    }
  return match && count == sorted.size();
}

}  // namespace tb
