// The memory of each tag on one device: its own VMM pool, the graph pools created under
// it, and its sleep state (Note [Tag arenas], tag_sleep.h).
//
// Lock rule: guarded by the owning device's lock (DeviceAllocator::mu_), as is everything
// it points to. Nothing here waits for the device: release() expects the owner to have
// synchronised it, and trim_clean() to have synchronised the streams dirty_streams() named.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "block_cache.h"
#include "graph_pools.h"
#include "ledger.h"
#include "scope.h"
#include "stream_order.h"
#include "tag_sleep.h"

namespace tb {

class VmmRoute;

// A tag's state on one device.
struct TagView {
  int life;
  int backup;
  int64_t resident;      // device bytes mapped behind the tag, graph pools included
  int64_t released;      // bytes waiting for a restore
  int64_t backup_bytes;  // host bytes holding its backup
  int64_t last_device;   // device bytes the last release / restore moved
  int64_t last_backup;   // bytes it copied
  int64_t retained;      // 1: a live tag keeps its backup for the next release (Note [Retained backups])
};

class TagArenas {
 public:
  TagArenas(GraphPools& graphs, BlockStore& store, StreamClock& clock) : graphs_(graphs), store_(store), clock_(clock) {}
  // The device has VMM: `untagged` is its default VMM pool (tag 0's).
  void init(const DeviceContext& ctx, VmmRoute* vmm, BlockPool* untagged);

  bool live(int tag) const { return state_[tag].life == kTagLive; }
  // The VMM pool of `tag` (the default VMM pool for tag 0), created on first use.
  BlockPool* pool(int tag) {
    if (tag == 0) return untagged_;
    BlockPool* p = pools_[tag].get();
    return p != nullptr ? p : create_pool(tag);
  }
  // The VMM pool of `tag` if it exists (nullptr if not): a lookup that creates nothing.
  BlockPool* existing_pool(int tag) const { return tag == 0 ? untagged_ : pools_[tag].get(); }
  // Pools of tags 1.. that exist, live or not.
  std::vector<BlockPool*> own_pools() const;
  // Every pool holding the tag's VMM memory: its own pool and graph pools created under it.
  std::vector<BlockPool*> pools_of(int tag) const;

  // A live block of `tag` off the VMM route cannot be released: counted as it comes and goes.
  void charge(const Block& b) { if (b.route != kRouteVmm) ++off_route_[b.tag]; }
  void uncharge(const Block& b) { if (b.route != kRouteVmm) --off_route_[b.tag]; }

  // Releases `tag` (live, the device idle) with `backup` (`retain`: kept past the restore,
  // Note [Retained backups]); `discard`: live blocks of the tag's own pool whose contents need not
  // survive (Note [Discardable blocks]); `name` says which tag where, for messages. kState when it
  // cannot be released now.
  bool release(int tag, Backup backup, bool retain, const std::string& name,
               const std::unordered_set<const Block*>& discard = {});
  // Gives back the backup a live `tag` retained; false + kState when the tag is released.
  bool drop_retained(int tag, const std::string& name);
  // While `tag` is released with a cpu or pinned backup: whether its restore keeps the backup
  // (what the release asked, until changed here). false + kState otherwise.
  bool set_retain(int tag, bool on, const std::string& name);
  // Restores `tag`, released (the owner checked). On failure the tag stays released with
  // its backup; *needed gets the bytes the restore had to map.
  bool restore(int tag, size_t* needed);
  TagView view(int tag) const;
  // Note [Reading backups]: where the backup of bytes [ptr, ptr + bytes) of one live block of
  // `tag` (allocated at `born`, Block::born) waits, as spans of its host memory, and a
  // reference to that memory (*space null, no spans: the tag has no backup with contents now,
  // or none for that block). `view`: the caller hands out a zero-copy
  // view (the backup is exposed). false + kState when the backup lacks a part of the range.
  // With `view`, the view is counted in the space's views (tb_backup_view_end uncounts it), and
  // a range in more than one piece of host memory is refused (kNotAvailable).
  bool backup_of(int tag, uint64_t born, uintptr_t ptr, size_t bytes, bool view, std::vector<HostExtent>* spans,
                 std::shared_ptr<BackupSpace>* space);
  // Streams of the tag's own free blocks that are not clean yet; then, once the owner
  // synchronised them, gives the tag's clean cached memory back to the driver.
  bool trimmable(int tag) const { return vmm_ != nullptr && tag != 0 && pools_[tag] && live(tag); }
  std::vector<CUstream> dirty_streams(int tag) const;
  void trim_clean(int tag);
  // Note [Stale backups]: gives back each backup that no longer describes memory of its tag.
  // Called after memory went back to the driver; returns how many it gave back.
  int drop_stale_backups();

 private:
  // For each granule of `seg`: whether an allocated or waiting block not in `skip` covers it (every
  // granule of a graph pool; a run mapping whole when any of its granules). With `skip` the
  // discardable blocks of a release: the granules whose contents it keeps (Note [Discardable blocks]).
  std::vector<bool> covered(const Segment& seg, const std::unordered_set<const Block*>& skip = {}) const;
  std::vector<std::vector<bool>> still_needed(const TagState& st) const;
  // Whether every segment a live tag's retained backup describes is still one of its pools'.
  bool kept_in_place(int tag) const;

  GraphPools& graphs_;
  BlockStore& store_;
  StreamClock& clock_;
  VmmRoute* vmm_ = nullptr;  // nullptr: no VMM on this device, nothing to release
  BlockPool* untagged_ = nullptr;
  BlockPool* create_pool(int tag);  // pool()'s first use of `tag`
  std::unique_ptr<TagMover> mover_;
  std::unique_ptr<BlockPool> pools_[kMaxTags];  // VMM pools of tags 1..
  TagState state_[kMaxTags];
  int64_t off_route_[kMaxTags] = {};  // live tagged blocks on the pool / sync routes
};

}  // namespace tb
