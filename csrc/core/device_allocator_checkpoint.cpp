// DeviceAllocator: checkpoints of its private pools (Note [Pool checkpoints], pool_checkpoint.h).
#include "device_allocator.h"
#include "error.h"

namespace tb {

// The allocator's side of a checkpoint restore, its lock held throughout.
class DeviceAllocator::CheckpointHost final : public PoolOwner {
 public:
  CheckpointHost(DeviceAllocator& a, DeviceLock& lock) : a_(a), lock_(lock) {}
  PrivatePool* find_pool(const PoolId& id) override { return a_.graphs_.find(id); }
  void free_live(Block* b) override { a_.free_locked(b); }
  void settle() override { a_.uses_.settle(); }
  bool wait_for_device() override { return a_.sync_device(lock_); }
  void adopt(Block* b) override { a_.adopt(b); }
  bool tag_live(int tag) override { return a_.tags_.live(tag); }
  int device() const override { return a_.ctx_.device; }

 private:
  DeviceAllocator& a_;
  DeviceLock& lock_;
};

bool DeviceAllocator::checkpoint_pool(const PoolId& id, PoolCheckpoint* out) {
  auto lock = hold();
  PrivatePool* p = graphs_.find(id);
  TB_REQUIRE(p != nullptr, kInvalidArgument, "no private pool " + describe(id) + " on device " +
                                                 std::to_string(ctx_.device) + " to checkpoint", false);
  uses_.settle();
  record_checkpoint(id, *p, out);
  return true;
}

bool DeviceAllocator::restore_checkpoint(const PoolCheckpoint& cp, std::vector<uintptr_t>* freed,
                                         std::vector<Block*>* created) noexcept {
  auto lock = hold();
  // Re-created blocks take cached or clean memory only: a restore never asks for a stream
  // synchronisation half-way (the internal "needs sync" code must not escape).
  clock_.allow_requests(false);
  CheckpointHost host(*this, lock);
  return tb::restore_checkpoint(host, cp, "private pool " + describe(cp.pool) + " on device " +
                                              std::to_string(ctx_.device), freed, created);
}

bool DeviceAllocator::pool_live_matches(const PoolId& id, const std::vector<uintptr_t>& expected, bool* match) {
  auto lock = hold();
  PrivatePool* p = graphs_.find(id);
  TB_REQUIRE(p != nullptr, kInvalidArgument, "no private pool " + describe(id) + " on device " +
                                                 std::to_string(ctx_.device), false);
  *match = live_allocations_match(*p, expected);
  return true;
}

}  // namespace tb
