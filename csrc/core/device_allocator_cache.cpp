// DeviceAllocator: the cache, the budget, peer access and what stats and snapshots read.
#include <algorithm>

#include "device_allocator.h"
#include "error.h"

namespace tb {

// ---------------------------------------------------------------- cache and budget

bool DeviceAllocator::empty_cache() noexcept {
  auto lock = hold();
  TB_REQUIRE(!graphs_.capturing(), kState, "empty_cache() during CUDA graph capture", false);
  release_cached(lock);
  return true;
}

bool DeviceAllocator::set_budget(int64_t bytes, double fraction, bool strict) noexcept {
  TB_REQUIRE(bytes >= 0 || (fraction > 0 && fraction <= 1), kInvalidArgument,
             "a budget is bytes >= 0 or a fraction in (0, 1] of the card", false);
  bytes = Budget::resolve(bytes, fraction, caps_.total_bytes);
  auto lock = hold();
  // Only resident memory counts: a released tag's blocks hold no device memory now.
  int64_t allocated = ledger_.blocks[kAggregate].allocated_bytes.get();
  for (int t = 1; t < kMaxTags; ++t)
    if (!tags_.live(t)) allocated -= ledger_.tag[t].allocated.get();
  TB_REQUIRE(!strict || bytes >= allocated, kInvalidArgument,
             "budget of " + format_size(bytes) + " is below what device " + std::to_string(ctx_.device) +
                 " already has allocated (" + format_size(allocated) + "): free tensors first",
             false);
  if (bytes < budget_.reserved()) {
    TB_REQUIRE(!graphs_.capturing(), kState, "cannot lower the budget below reserved memory during graph capture",
               false);
    release_cached(lock);
    if (!strict) {
      budget_.set_limit(bytes);
      return true;
    }
    const int64_t reserved = budget_.reserved();
    TB_REQUIRE(bytes >= reserved, kInvalidArgument,
               "budget of " + format_size(bytes) + " is below the " + format_size(reserved) + " device " +
                   std::to_string(ctx_.device) + " still holds after releasing its cache (graph pools: " +
                   format_size(ledger_.graph_pool_reserved.get()) + ")",
               false);
  }
  budget_.set_limit(bytes);
  return true;
}

bool DeviceAllocator::set_tag_budget(int tag, int64_t bytes, double fraction) noexcept {
  if (!Budget::check_tag_setting(tag, fraction)) return false;
  const int64_t limit = Budget::resolve(bytes, fraction, caps_.total_bytes);
  auto lock = hold();
  const int64_t used = budget_.family_used(tag);
  // Note [Tag families]: its family's tags may hold all of it, so the refusal names each that does.
  const bool family = used != budget_.tag_used(tag);
  TB_REQUIRE(limit == Budget::kNone || limit >= used, kInvalidArgument,
             "budget of " + format_size(static_cast<uint64_t>(limit)) + " for tag '" + tag_name(tag) +
                 "' is below what " + (family ? "it and its family already have" : "it already has") +
                 " allocated on device " + std::to_string(ctx_.device) + " (" + budget_.family_use(tag) +
                 "): free " + (family ? "their" : "its") + " tensors first",
             false);
  budget_.set_tag_limit(tag, limit);
  return true;
}

bool DeviceAllocator::grant_peer(int peer) noexcept {
  TB_REQUIRE(peer >= 0 && peer != ctx_.device, kInvalidArgument,
             "device " + std::to_string(peer) + " cannot be a peer of device " + std::to_string(ctx_.device), false);
  auto lock = hold();
  if (std::find(peers_.begin(), peers_.end(), peer) != peers_.end()) return true;
  if (vmm_ && !vmm_->grant_peer(peer)) return false;
  if (pool_ && !pool_->grant_peer(peer)) return false;
  for (const auto& [ptr, bytes] : opened_)
    if (!grant_opened(ptr, bytes, peer)) return false;
  peers_.push_back(peer);
  return true;
}

size_t DeviceAllocator::largest_free() {
  auto lock = hold();
  size_t best = sync_pool_->largest_free();
  if (vmm_pool_) best = std::max(best, vmm_pool_->largest_free());
  for (const BlockPool* p : tags_.own_pools()) best = std::max(best, p->largest_free());
  return best;
}

bool DeviceAllocator::cache_info(size_t* largest, int tag) {
  // Note [What cacheInfo tells]
  // torch's own allocator answers with the device's free memory or its largest cached free
  // block, whichever is more (it starts from cudaMemGetInfo when asked with 0, as every caller
  // asks): an optimistic bound of what one allocation can get. cuDNN's benchmark keeps only the
  // plans whose workspace fits it and then allocates the largest of theirs, halving on each
  // failure. So the answer is what an allocation gets without any failure: the longest cached
  // stretch that is backed now (never the arena's unmapped address range), or the device's free
  // memory within the budget's room, whichever is more, and no more than the room of the
  // allocating scope's tag budget. Answering the cached stretch alone made the benchmark drop
  // every plan needing more workspace than happened to be cached whenever anything was, which
  // native torch would have timed; answering past the budget made each plan it tried a full
  // out-of-memory path.
  size_t free_b = 0, total_b = 0;
  if (!mem_info(&free_b, &total_b)) return false;
  const int64_t room = budget_.room();
  const size_t within = room < static_cast<int64_t>(free_b) ? static_cast<size_t>(std::max<int64_t>(room, 0)) : free_b;
  size_t best = std::max(largest_free(), within);
  const int64_t tag_room = budget_.tag_room(tag);
  if (tag_room != Budget::kNone) best = std::min(best, static_cast<size_t>(std::max<int64_t>(tag_room, 0)));
  *largest = best;
  return true;
}

void DeviceAllocator::reset_peaks() noexcept {
  auto lock = hold();
  ledger_.reset_peaks();
  // The packing line follows the peak the user measures from (Note [Packing: reclaim before growth]).
  if (vmm_) vmm_->reset_high_water(static_cast<size_t>(std::max<int64_t>(ledger_.blocks[kAggregate].allocated_bytes.get(), 0)));
}

void DeviceAllocator::packing_idle() noexcept {
  auto lock = hold();
  if (vmm_) vmm_->packing_idle();
}

void DeviceAllocator::packing_refill() noexcept {
  auto lock = hold();
  if (vmm_) vmm_->packing_refill();
}

void DeviceAllocator::reset_accumulated() noexcept {
  auto lock = hold();
  settle_tally();  // counted before the reset, then reset with the rest
  ledger_.reset_accumulated();
}

// ---------------------------------------------------------------- introspection

std::vector<SegmentView> DeviceAllocator::segments(bool runs) {
  auto lock = hold();
  std::vector<std::pair<const BlockPool*, PoolId>> pools{{vmm_pool_.get(), PoolId{0, 0}}};
  for (const BlockPool* p : tags_.own_pools()) pools.emplace_back(p, PoolId{0, 0});
  pools.emplace_back(sync_pool_.get(), PoolId{0, 0});
  pools.emplace_back(pool_pool_.get(), PoolId{0, 0});
  for (auto& [id, p] : graphs_.pools()) pools.emplace_back(p.blocks.get(), id);
  return describe_segments(pools, vmm_ ? vmm_->granule() : 0, runs);
}

std::vector<SegmentView> DeviceAllocator::mapped_segments() { return split_at_mappings(segments(/*runs=*/true)); }

void DeviceAllocator::inactive_split(int64_t count[kPoolKinds], int64_t bytes[kPoolKinds]) {
  auto lock = hold();
  // Every pool, as torch counts its private pools too.
  std::vector<const BlockPool*> pools{vmm_pool_.get(), sync_pool_.get(), pool_pool_.get()};
  for (const BlockPool* p : tags_.own_pools()) pools.push_back(p);
  for (const auto& [id, p] : graphs_.pools()) pools.push_back(p.blocks.get());
  count_inactive_split(pools, count, bytes);
}

}  // namespace tb
