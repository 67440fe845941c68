// DeviceAllocator: release and restore of tags (Note [Tag arenas] in tag_sleep.h).
#include <algorithm>

#include "device_allocator.h"
#include "disk_backup.h"
#include "error.h"
#include "scope.h"

namespace tb {

bool DeviceAllocator::check_tag(int tag, const char* what) {
  TB_REQUIRE(tag > 0 && tag < tag_count(), kInvalidArgument,
             std::string(what) + ": " + (tag == 0 ? "untagged memory cannot be released" : "unknown tag id " +
                                                                                             std::to_string(tag)),
             false);
  TB_REQUIRE(caps_.vmm && vmm_, kNotAvailable,
             std::string(what) + " of tag '" + tag_name(tag) + "': device " + std::to_string(ctx_.device) +
                 " has no VMM support, and only VMM memory can be released and restored",
             false);
  TB_REQUIRE(open_captures() == 0, kState,
             std::string(what) + " of tag '" + tag_name(tag) + "' while a CUDA graph capture is open", false);
  return true;
}

bool DeviceAllocator::release_tag(int tag, int backup, const std::vector<uintptr_t>& discardable) noexcept {
  const bool retain = (backup & kBackupRetain) != 0;
  backup &= ~kBackupRetain;
  TB_REQUIRE(backup >= 0 && backup < kBackupModes, kInvalidArgument,
             "unknown backup mode " + std::to_string(backup) + ": none, memset, cpu, pinned or disk", false);
  TB_REQUIRE(!retain || backup == kBackupCpu || backup == kBackupPinned, kInvalidArgument,
             std::string("only a cpu or pinned backup can be retained, not ") + backup_name(backup), false);
  TB_REQUIRE(backup != kBackupDisk || !DiskBackup::dir().empty(), kInvalidArgument,
             "a disk backup needs a directory: set one first (torch_budget.sleep.set_disk_backup_dir)", false);
  // Note [Discardable blocks]: a backup with holes is neither retained nor written to disk.
  TB_REQUIRE(discardable.empty() || (!retain && backup != kBackupDisk), kInvalidArgument,
             std::string("discardable blocks leave holes in the backup, which a ") +
                 (retain ? "retained" : "disk") + " backup cannot have: release without them, or with a " +
                 (retain ? "backup that is not retained" : "cpu or pinned backup"),
             false);
  auto lock = hold();
  if (!check_tag(tag, "release")) return false;
  const std::string name = "tag '" + tag_name(tag) + "' on device " + std::to_string(ctx_.device);
  TB_REQUIRE(tags_.live(tag), kState, name + " is already released: restore it first", false);
  // The tag's queued work must be done before its memory is copied or unmapped.
  const bool synced = sync_device(lock);
  // Checked again: a capture that began while the lock was released may be allocating in the tag's pools.
  if (!check_tag(tag, "release")) return false;
  TB_REQUIRE(synced, kState, "release of " + name + ": the device could not be synchronised", false);
  uses_.settle();
  TB_REQUIRE(tags_.live(tag), kState, name + " was released by another thread meanwhile", false);
  // Looked up after the synchronisation, under the lock the release keeps: the blocks stay as found.
  std::unordered_set<const Block*> discard;
  for (uintptr_t ptr : discardable) {
    const Block* b = live_.find(ptr);
    TB_REQUIRE(b != nullptr && b->allocated, kInvalidArgument,
               "release of " + name + ": discardable address " + std::to_string(ptr) +
                   " is not the start of a live allocation of this device",
               false);
    TB_REQUIRE(b->tag == tag && b->route == kRouteVmm && !b->segment->pool->graph_pool(), kInvalidArgument,
               "release of " + name + ": the allocation at discardable address " + std::to_string(ptr) + " is " +
                   (b->tag != tag ? "under tag '" + tag_name(b->tag) + "'"
                                  : std::string(b->route != kRouteVmm ? "off the vmm route" : "in a CUDA graph pool")) +
                   ", not one of the tag's own",
               false);
    discard.insert(b);
  }
  RelaxedCaptureMode relaxed(open_captures() > 0);
  return tags_.release(tag, static_cast<Backup>(backup), retain, name, discard);
}

bool DeviceAllocator::restore_tag(int tag) noexcept {
  auto lock = hold();
  if (!check_tag(tag, "restore")) return false;
  const std::string name = "tag '" + tag_name(tag) + "' on device " + std::to_string(ctx_.device);
  const int life = tags_.view(tag).life;
  TB_REQUIRE(life == kTagReleased, kState, name + " is not released (it is " + tag_life_name(life) + ")", false);
  RelaxedCaptureMode relaxed(open_captures() > 0);
  budget_.clear_refusal();
  size_t need = 0;
  if (tags_.restore(tag, &need)) return true;
  const ErrorCode code = last_error_code();
  const std::string why = last_error_message();
  const std::string head = "restore of " + name + " failed; the tag stays released with its backup, and a later "
                           "restore can succeed. ";
  if (code == kOutOfMemory) {
    bump(ledger_.num_ooms);
    // The lock was held since the restore began: the Budget's record is this restore's.
    set_error(kOutOfMemory, head + oom_text(need, kRouteVmm, tag, why, budget_.refused(), nullptr, /*retried=*/false));
  } else {
    set_error(code, head + why);
  }
  return false;
}

bool DeviceAllocator::retain_tag_backup(int tag, bool on) noexcept {
  auto lock = hold();
  TB_REQUIRE(tag > 0 && tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  return tags_.set_retain(tag, on, "tag '" + tag_name(tag) + "' on device " + std::to_string(ctx_.device));
}

bool DeviceAllocator::drop_tag_backup(int tag) noexcept {
  auto lock = hold();
  TB_REQUIRE(tag > 0 && tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  return tags_.drop_retained(tag, "tag '" + tag_name(tag) + "' on device " + std::to_string(ctx_.device));
}

TagView DeviceAllocator::tag_view(int tag) {
  auto lock = hold();
  return tags_.view(tag);
}

bool DeviceAllocator::backup_of(uintptr_t base, size_t offset, size_t bytes, bool view, std::vector<HostExtent>* spans,
                                std::shared_ptr<BackupSpace>* space, bool* found) {
  auto lock = hold();
  spans->clear();
  space->reset();
  Block* b = live_.find(base);
  *found = b != nullptr;
  if (b == nullptr) return true;
  TB_REQUIRE(offset <= b->size && bytes <= b->size - offset, kInvalidArgument,
             "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) + ") lie outside the block of " +
                 std::to_string(b->size) + " bytes at " + std::to_string(base),
             false);
  if (b->route != kRouteVmm) return true;  // only VMM memory is released, so only it has backups
  if (!tags_.backup_of(b->tag, b->born, base + offset, bytes, view, spans, space)) {
    // The refusal keeps its own code: a view over separate host pieces is not a tag's state.
    const ErrorCode code = last_error_code();
    set_error(code == kOk ? kState : code, "backup of tag '" + tag_name(b->tag) + "' on device " +
                                               std::to_string(ctx_.device) + ": " + last_error_message());
    return false;
  }
  return true;
}

int DeviceAllocator::pool_tag(const PoolId& id) {
  auto lock = hold();
  PrivatePool* p = graphs_.find(id);
  return p == nullptr ? -1 : p->tag;
}

bool DeviceAllocator::trim_tag(int tag, int64_t* returned) noexcept {
  *returned = 0;
  auto lock = hold();
  TB_REQUIRE(tag >= 0 && tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  // Its own cached memory, and the graph pools of the tag no graph holds any more (a graph's
  // private pool takes the tag of the region it was captured in), which a tag-less
  // empty_cache destroys too.
  const bool own = tags_.trimmable(tag);
  if (!own && !has_dead_pool_of(tag)) return true;  // nothing to trim
  auto no_capture = [&] {
    TB_REQUIRE(open_captures() == 0, kState,
               "trim of tag '" + tag_name(tag) + "' while a CUDA graph capture is open", false);
    return true;
  };
  if (!no_capture()) return false;
  // What this trim gave back is counted where it gives it back, with the lock held: the waits
  // below release it, and other threads' allocations and frees meanwhile are not this trim's.
  destroy_dead_pools(lock, /*all=*/false, /*may_wait=*/true, tag, returned);  // waits for their last replays
  if (own) {
    const std::vector<CUstream> dirty = tags_.dirty_streams(tag);
    if (!dirty.empty()) sync_streams(lock, dirty);
    // Checked again: unmapping is an unsafe call for a capture that began while the lock was released.
    if (!no_capture()) return false;
    const int64_t before = budget_.reserved();
    tags_.trim_clean(tag);
    *returned += before - budget_.reserved();
  }
  return true;
}

}  // namespace tb
