#include "tag_arenas.h"

#include <algorithm>

#include "error.h"
#include "route_vmm.h"

namespace tb {

void TagArenas::init(const DeviceContext& ctx, VmmRoute* vmm, BlockPool* untagged) {
  vmm_ = vmm;
  untagged_ = untagged;
  mover_ = std::make_unique<TagMover>(ctx, *vmm);
}

BlockPool* TagArenas::create_pool(int tag) {
  std::unique_ptr<BlockPool>& p = pools_[tag];
  if (!p) {
    p = std::make_unique<BlockPool>(vmm_, kRouteVmm, false, &store_, &clock_);
    p->set_owner({0, 0}, tag);
    p->set_adopt_clean(untagged_->adopts_clean(), untagged_->adoption_count());  // Note [Adopting clean blocks]
    vmm_->add_reuse_source(p.get());
  }
  return p.get();
}

std::vector<BlockPool*> TagArenas::own_pools() const {
  std::vector<BlockPool*> out;
  for (const auto& p : pools_)
    if (p) out.push_back(p.get());
  return out;
}

std::vector<BlockPool*> TagArenas::pools_of(int tag) const {
  std::vector<BlockPool*> out;
  if (pools_[tag]) out.push_back(pools_[tag].get());
  for (auto& [id, p] : graphs_.pools())
    if (p.tag == tag && p.blocks->route() == kRouteVmm) out.push_back(p.blocks.get());
  return out;
}

std::vector<bool> TagArenas::covered(const Segment& seg, const std::unordered_set<const Block*>& skip) const {
  const size_t g = vmm_->granule();
  // A captured graph may address any block of its pool, freed ones included.
  std::vector<bool> out(seg.granules.size(), seg.pool->graph_pool());
  if (seg.pool->graph_pool()) return out;
  for (const Block* b = seg.head; b != nullptr; b = b->next) {
    if (b->is_free() || skip.count(b) != 0) continue;
    const size_t lo = (b->ptr - seg.base) / g, hi = (b->ptr + b->size - 1 - seg.base) / g;
    for (size_t i = lo; i <= hi; ++i) out[i] = true;
  }
  // A run mapping goes only whole (Note [Run mappings]): needed whole when any part is.
  for (size_t h = 0; h < seg.span.size(); ++h) {
    if (seg.span[h] <= 1) continue;
    const auto first = out.begin() + static_cast<long>(h), end = first + seg.span[h];
    if (std::find(first, end, true) != end) std::fill(first, end, true);
  }
  return out;
}

std::vector<std::vector<bool>> TagArenas::still_needed(const TagState& st) const {
  std::vector<std::vector<bool>> out;
  const Segment* last = nullptr;
  std::vector<bool> cov;
  for (const Piece& p : st.pieces) {
    if (p.seg != last) {
      cov = covered(*p.seg);
      last = p.seg;
    }
    out.emplace_back(cov.begin() + static_cast<long>(p.first), cov.begin() + static_cast<long>(p.first + p.count));
  }
  return out;
}

bool TagArenas::release(int tag, Backup backup, bool retain, const std::string& name,
                        const std::unordered_set<const Block*>& discard) {
  // Checked after the owner's synchronisation: other threads may have allocated under the tag meanwhile.
  int shared = 0, waiting = 0;
  for (BlockPool* pool : pools_of(tag))
    for (const auto& seg : pool->segments())
      for (const Block* b = seg->head; b != nullptr; b = b->next) {
        shared += b->allocated && b->shared;
        waiting += !b->allocated && b->pending > 0;
      }
  // The owner synchronised its device and settled: a freed block still waiting is read by work
  // queued on another device's stream (record_stream), or was freed by another thread after the
  // synchronisation; unmapping would pull memory from under that work.
  TB_REQUIRE(waiting == 0, kState,
             name + " holds " + std::to_string(waiting) +
                 " freed allocation(s) still in use by work queued on the streams they were recorded on "
                 "(record_stream; a stream of another device, which the release does not wait for): release it "
                 "once that work is done",
             false);
  // Note [Sharing memory between processes]: a consumer maps the producer's physical memory;
  // released and restored, the producer would read and write new memory the consumer never sees.
  TB_REQUIRE(shared == 0, kState,
             name + " holds " + std::to_string(shared) +
                 " live allocation(s) shared with another process, whose mappings would keep the old memory "
                 "while this process restores new memory at the same addresses: release it once those tensors "
                 "are freed, or, while this process keeps them, once every consumer closed them and "
                 "torch_budget.sleep.end_sharing(tensors) said so",
             false);
  TB_REQUIRE(off_route_[tag] == 0, kState,
             name + " holds " + std::to_string(off_route_[tag]) +
                 " live allocation(s) on the pool or sync route, which cannot be released at fixed addresses; "
                 "allocate the tag's memory on the vmm route",
             false);

  const size_t g = vmm_->granule();
  const size_t per_piece = std::max<size_t>(1, TagMover::kPieceBytes / g);
  std::vector<Piece> pieces;
  int64_t dropped = 0;
  for (BlockPool* pool : pools_of(tag)) {
    for (const auto& seg : pool->segments()) {
      const std::vector<bool> cov = covered(*seg);
      const std::vector<bool> keep = discard.empty() ? cov : covered(*seg, discard);  // Note [Discardable blocks]
      for (size_t i = 0; i < seg->granules.size();) {
        if (seg->granules[i] == 0) {
          ++i;
        } else if (!cov[i]) {
          // Only free blocks here: nothing to keep. A run mapping goes whole, from its head.
          const size_t n = std::max<size_t>(1, seg->span[i]);
          if (vmm_->drop_granule(*seg, i)) dropped += static_cast<int64_t>(n * g);
          i += n;
        } else {
          // Pieces end at mapping boundaries: a piece is dropped once its copy is done.
          size_t j = i;
          while (j < seg->granules.size() && seg->granules[j] != 0 && cov[j]) ++j;
          // Note [Discardable blocks]: cut where whole mappings turn from kept to discarded (keep is
          // the same across each mapping, and i and j are mapping heads).
          for (size_t a = i; a < j;) {
            size_t b = a + 1;
            while (b < j && keep[b] == keep[a]) ++b;
            const size_t from = pieces.size();
            cut_pieces(seg.get(), a, b, per_piece, &pieces);
            for (size_t k = from; k < pieces.size(); ++k) pieces[k].discard = !keep[a];
            a = b;
          }
          i = j;
        }
      }
    }
  }
  vmm_->release_free_handles();
  TagState& st = state_[tag];
  st.id = tag;  // names its disk backup's files (Note [Disk backups])
  if (!st.kept.empty() && !kept_in_place(tag)) st.drop_backup();  // a retained layout whose segments are gone
  bool recovered = false;
  clock_.allow_requests(false);  // a recovery restore takes cached or clean memory, never asks for a sync
  if (!mover_->release(std::move(pieces), backup, retain, &st, &recovered)) {
    if (!recovered) st.life = kTagReleased;
    const std::string why = last_error_message();
    set_error(last_error_code() == kOk ? kDriverError : last_error_code(), "release of " + name + " failed: " + why);
    return false;
  }
  st.life = kTagReleased;
  st.last_device_bytes += dropped;
  return true;
}


bool TagArenas::restore(int tag, size_t* needed) {
  TagState& st = state_[tag];
  clock_.allow_requests(false);  // take cached or clean granules, never ask for a sync
  st.life = kTagRestoring;
  if (!mover_->restore(&st, still_needed(st))) {
    st.life = kTagReleased;
    const ErrorCode code = last_error_code() == kOk ? kDriverError : last_error_code();
    const std::string why = last_error_message();
    vmm_->release_free_handles();  // handles taken for the failed mappings go back too
    *needed = 0;
    for (const auto& v : still_needed(st))
      *needed += static_cast<size_t>(std::count(v.begin(), v.end(), true)) * vmm_->granule();
    set_error(code, why);
    return false;
  }
  st.pieces.clear();
  if (st.kept.empty()) st.drop_backup();  // else retained for the next release
  st.life = kTagLive;
  return true;
}

bool TagArenas::set_retain(int tag, bool on, const std::string& name) {
  TagState& st = state_[tag];
  TB_REQUIRE(st.life == kTagReleased, kState, name + " is not released: a restore's retention is set while released",
             false);
  TB_REQUIRE(!on || st.backup == kBackupCpu || st.backup == kBackupPinned, kInvalidArgument,
             name + " was released with backup " + backup_name(st.backup) + ": only a cpu or pinned backup can be "
             "retained",
             false);
  // Note [Discardable blocks]: a backup with holes cannot be kept for the next release (the one
  // release_tag refuses when asked with discardable blocks and retain at once).
  TB_REQUIRE(!on || std::none_of(st.pieces.begin(), st.pieces.end(), [](const Piece& p) { return p.discard; }),
             kInvalidArgument,
             name + " was released with discardable blocks, which leave holes in its backup: a backup with holes "
                    "cannot be retained; release without them to retain",
             false);
  st.retain = on;
  return true;
}

bool TagArenas::drop_retained(int tag, const std::string& name) {
  TagState& st = state_[tag];
  TB_REQUIRE(st.life == kTagLive, kState, name + " is released: its backup holds its contents until the restore",
             false);
  st.drop_backup();
  st.retain = false;
  return true;
}

bool TagArenas::backup_of(int tag, uint64_t born, uintptr_t ptr, size_t bytes, bool view,
                          std::vector<HostExtent>* spans, std::shared_ptr<BackupSpace>* space) {
  spans->clear();
  space->reset();
  if (vmm_ == nullptr || tag <= 0 || tag >= kMaxTags) return true;
  TagState& st = state_[tag];
  const bool readable = st.space != nullptr && (st.life == kTagReleased || !st.kept.empty());
  if (!readable) return true;
  if (st.life == kTagLive && !kept_in_place(tag)) {
    // A segment the retained backup describes went back to the driver: the backup no longer
    // matches the tag's memory (and its pieces point at segments that are gone).
    st.drop_backup();
    st.retain = false;
    return true;
  }
  // A block allocated after the restore that kept the backup is not in it, though its bytes may
  // lie where the backup holds those of a block freed since.
  if (st.life == kTagLive && born > st.kept_at) return true;
  if (!st.locate(ptr, bytes, vmm_->granule(), spans)) return false;
  if (view) {
    TB_REQUIRE(spans->size() <= 1, kNotAvailable,
               "the backup holds these " + std::to_string(bytes) + " bytes in " + std::to_string(spans->size()) +
                   " separate pieces of host memory: read a copy",
               false);
    // Counted under the lock, so a release running next sees the view (Note [Reading backups]).
    st.exposed = true;
    st.space->views.fetch_add(1);
  }
  *space = st.space;
  return true;
}

bool TagArenas::kept_in_place(int tag) const {
  // By serial too: a pointer alone could name a segment freed and another made at its address.
  std::vector<std::pair<const Segment*, uint64_t>> live;
  for (BlockPool* pool : pools_of(tag))
    for (const auto& seg : pool->segments()) live.emplace_back(seg.get(), seg->serial);
  for (const Piece& p : state_[tag].kept)
    if (std::find(live.begin(), live.end(), std::pair<const Segment*, uint64_t>(p.seg, p.serial)) == live.end())
      return false;
  return true;
}

TagView TagArenas::view(int tag) const {
  TagView v{};
  if (tag < 0 || tag >= kMaxTags) return v;
  const TagState& st = state_[tag];
  v.life = st.life;
  v.backup = st.life == kTagLive && st.last_device_bytes == 0 ? -1 : st.backup;
  if (vmm_) {
    const size_t g = vmm_->granule();
    for (BlockPool* pool : pools_of(tag))
      for (const auto& seg : pool->segments()) v.resident += static_cast<int64_t>(seg->mapped * g);
    // What the restore will map back: granules no live block covers any more (tensors freed while
    // the tag slept) are skipped by it, and their backup went with empty_cache.
    const std::vector<std::vector<bool>> needed = still_needed(st);
    for (size_t k = 0; k < st.pieces.size(); ++k) {
      const Piece& p = st.pieces[k];
      for (size_t i = 0; i < p.count; ++i)
        if (p.seg->granules[p.first + i] == 0 && needed[k][i]) v.released += static_cast<int64_t>(g);
    }
  }
  v.backup_bytes = static_cast<int64_t>(st.backup_bytes);
  v.last_device = st.last_device_bytes;
  v.last_backup = st.last_backup_bytes;
  v.retained = st.life == kTagLive && !st.kept.empty() ? 1 : 0;
  return v;
}

std::vector<CUstream> TagArenas::dirty_streams(int tag) const {
  std::vector<CUstream> dirty;
  if (!trimmable(tag)) return dirty;
  for (bool small : {false, true})
    for (const Block* b : pools_[tag]->free_set(small))
      if (!clock_.clean(b->stream, b->freed_at) && std::find(dirty.begin(), dirty.end(), b->stream) == dirty.end())
        dirty.push_back(b->stream);
  return dirty;
}

void TagArenas::trim_clean(int tag) {
  if (!trimmable(tag)) return;
  vmm_->release_clean(*pools_[tag]);
  vmm_->release_free_handles();
  drop_stale_backups();
}

// Note [Stale backups]
// A backup holds host memory (or files) for memory of its tag; torch_memory_saver frees a
// backup with the allocation it backs. Here the memory goes back to the driver in the cache's
// own time (empty_cache, a trim, an out-of-memory retry), and then:
// - a live tag's retained backup (Note [Retained backups]) that describes a granule no longer
//   mapped, or a segment gone, can never be taken by a release again (TagMover::reusable wants
//   the same pieces, every granule mapped): it is given back now, not at the next release;
// - a released tag none of whose pieces covers a live block any more (every tensor freed while
//   it slept) has nothing left to restore: its backup is given back and its pieces forgotten;
//   the tag stays released, and its restore maps and copies nothing.
// - a released tag with some tensors left gives back the host memory of the granules no live
//   block covers (BackupSpace::give_back: pinned ranges to the HostPool, the pages of a pageable
//   buffer to the system), unless a zero-copy view of the backup is alive. The restore maps and
//   copies only granules a block covers, and such a space, with holes, is never retained. Disk
//   backups keep their files until the restore.
int TagArenas::drop_stale_backups() {
  if (vmm_ == nullptr) return 0;
  int dropped = 0;
  for (int tag = 1; tag < kMaxTags; ++tag) {
    TagState& st = state_[tag];
    if (st.life == kTagLive && !st.kept.empty()) {
      bool in_place = kept_in_place(tag);  // first: a gone segment's granules are not to be read
      for (size_t k = 0; k < st.kept.size() && in_place; ++k)
        for (size_t i = st.kept[k].first; i < st.kept[k].first + st.kept[k].count && in_place; ++i)
          in_place = st.kept[k].seg->granules[i] != 0;
      if (in_place) continue;
      st.drop_backup();
      st.retain = false;
      ++dropped;
    } else if (st.life == kTagReleased && (st.space || !st.files.empty())) {
      const std::vector<std::vector<bool>> needed = still_needed(st);
      bool any = false;
      for (const std::vector<bool>& v : needed) any = any || std::find(v.begin(), v.end(), true) != v.end();
      if (!any) {
        st.pieces.clear();
        st.drop_backup();
        ++dropped;
      } else if (st.space && st.space->views.load() == 0) {
        const size_t g = vmm_->granule();
        size_t gone = 0;
        for (size_t k = 0; k < st.pieces.size(); ++k)
          for (size_t i = 0; i < st.pieces[k].count && !st.pieces[k].discard;) {
            size_t j = i;
            while (j < st.pieces[k].count && !needed[k][j]) ++j;
            if (j > i) gone += st.space->give_back(st.pieces[k].offset + i * g, j - i, g);
            i = j + 1;
          }
        st.backup_bytes -= std::min(st.backup_bytes, gone);
        dropped += gone > 0;
      }
    }
  }
  return dropped;
}

}  // namespace tb
