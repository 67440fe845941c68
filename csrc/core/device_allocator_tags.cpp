// DeviceAllocator: release and restore of tags (Note [Tag arenas] in tag_sleep.h).
#include <algorithm>

#include "device_allocator.h"
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

std::vector<bool> DeviceAllocator::covered(const Segment& seg) const {
  const size_t g = vmm_->granule();
  // A captured graph may address any block of its pool, freed ones included.
  std::vector<bool> out(seg.granules.size(), seg.pool->graph_pool());
  if (seg.pool->graph_pool()) return out;
  for (const Block* b = seg.head; b != nullptr; b = b->next) {
    if (b->is_free()) continue;
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

std::vector<std::vector<bool>> DeviceAllocator::still_needed(const TagState& st) const {
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

bool DeviceAllocator::release_tag(int tag, int backup) {
  TB_REQUIRE(backup >= 0 && backup < kBackupModes, kInvalidArgument,
             "unknown backup mode " + std::to_string(backup) + ": none, memset, cpu or pinned", false);
  std::unique_lock<std::mutex> lock(mu_);
  if (!check_tag(tag, "release")) return false;
  const std::string name = "tag '" + tag_name(tag) + "' on device " + std::to_string(ctx_.device);
  TB_REQUIRE(tag_live(tag), kState, name + " is already released: restore it first", false);
  // The tag's queued work must be done before its memory is copied or unmapped.
  TB_REQUIRE(sync_device(lock), kState, "release of " + name + ": the device could not be synchronised", false);
  process_events();
  TB_REQUIRE(tag_live(tag), kState, name + " was released by another thread meanwhile", false);
  // Checked after the synchronisation: other threads may have allocated under the tag meanwhile.
  // Note [Sharing memory between processes]: a consumer maps the producer's physical memory;
  // released and restored, the producer would read and write new memory the consumer never sees.
  int shared = 0;
  for (BlockPool* pool : pools_of(tag))
    for (const auto& seg : pool->segments())
      for (const Block* b = seg->head; b != nullptr; b = b->next) shared += b->allocated && b->shared;
  TB_REQUIRE(shared == 0, kState,
             name + " holds " + std::to_string(shared) +
                 " live allocation(s) shared with another process, whose mappings would keep the old memory "
                 "while this process restores new memory at the same addresses: release it once the consumers "
                 "dropped those tensors (the producer frees them then)",
             false);
  TB_REQUIRE(off_route_[tag] == 0, kState,
             name + " holds " + std::to_string(off_route_[tag]) +
                 " live allocation(s) on the pool or sync route, which cannot be released at fixed addresses; "
                 "allocate the tag's memory on the vmm route",
             false);

  RelaxedCaptureMode relaxed(open_captures() > 0);

  const size_t g = vmm_->granule();
  const size_t per_piece = std::max<size_t>(1, TagMover::kPieceBytes / g);
  std::vector<Piece> pieces;
  int64_t dropped = 0;
  for (BlockPool* pool : pools_of(tag)) {
    for (const auto& seg : pool->segments()) {
      const std::vector<bool> cov = covered(*seg);
      for (size_t i = 0; i < seg->granules.size();) {
        if (seg->granules[i] == 0) {
          ++i;
        } else if (!cov[i]) {
          if (vmm_->drop_granule(*seg, i)) dropped += g;  // only free blocks here: nothing to keep
          ++i;
        } else {
          // Pieces end at mapping boundaries: a piece is dropped once its copy is done.
          size_t j = i;
          while (j < seg->granules.size() && seg->granules[j] != 0 && cov[j] &&
                 (j - i < per_piece || seg->span[j] == 0))
            ++j;
          pieces.push_back(Piece{seg.get(), i, j - i, 0});
          i = j;
        }
      }
    }
  }
  vmm_->release_free_handles();
  TagState& st = tags_[tag];
  bool recovered = false;
  clock_.allow_requests(false);  // a recovery restore takes cached or clean memory, never asks for a sync
  if (!mover_->release(std::move(pieces), static_cast<Backup>(backup), &st, &recovered)) {
    if (!recovered) st.life = kTagReleased;
    const std::string why = last_error_message();
    set_error(last_error_code() == kOk ? kDriverError : last_error_code(), "release of " + name + " failed: " + why);
    return false;
  }
  st.life = kTagReleased;
  st.last_device_bytes += dropped;
  return true;
}

bool DeviceAllocator::restore_tag(int tag) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!check_tag(tag, "restore")) return false;
  const std::string name = "tag '" + tag_name(tag) + "' on device " + std::to_string(ctx_.device);
  TagState& st = tags_[tag];
  TB_REQUIRE(st.life == kTagReleased, kState, name + " is not released (it is " + tag_life_name(st.life) + ")",
             false);
  RelaxedCaptureMode relaxed(open_captures() > 0);
  clock_.allow_requests(false);  // take cached or clean granules, never ask for a sync
  budget_.clear_refusal();
  st.life = kTagRestoring;
  const bool ok = mover_->restore(&st, still_needed(st));
  if (!ok) {
    st.life = kTagReleased;
    const ErrorCode code = last_error_code() == kOk ? kDriverError : last_error_code();
    const std::string why = last_error_message();
    vmm_->release_free_handles();  // handles taken for the failed mappings go back too
    size_t need = 0;
    for (const auto& v : still_needed(st))
      need += static_cast<size_t>(std::count(v.begin(), v.end(), true)) * vmm_->granule();
    const std::string head = "restore of " + name + " failed; the tag stays released with its backup, and a later "
                             "restore can succeed. ";
    if (code == kOutOfMemory) {
      bump(ledger_.num_ooms);
      set_error(kOutOfMemory, head + oom_text(need, kRouteVmm, tag, why));
    } else {
      set_error(code, head + why);
    }
    return false;
  }
  st.pieces.clear();
  st.drop_backup();
  st.life = kTagLive;
  return true;
}

TagView DeviceAllocator::tag_view(int tag) {
  std::lock_guard<std::mutex> lock(mu_);
  TagView v{};
  if (tag < 0 || tag >= kMaxTags) return v;
  const TagState& st = tags_[tag];
  v.life = st.life;
  v.backup = st.life == kTagLive && st.last_device_bytes == 0 ? -1 : st.backup;
  if (vmm_) {
    const size_t g = vmm_->granule();
    for (BlockPool* pool : pools_of(tag))
      for (const auto& seg : pool->segments()) v.resident += static_cast<int64_t>(seg->mapped * g);
    for (const Piece& p : st.pieces)
      for (size_t i = p.first; i < p.first + p.count; ++i)
        if (p.seg->granules[i] == 0) v.released += static_cast<int64_t>(g);
  }
  v.backup_bytes = static_cast<int64_t>(st.backup_bytes);
  v.last_device = st.last_device_bytes;
  v.last_backup = st.last_backup_bytes;
  return v;
}

int DeviceAllocator::pool_tag(const PoolId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  PrivatePool* p = graphs_.find(id);
  return p == nullptr ? -1 : p->tag;
}

bool DeviceAllocator::trim_tag(int tag, int64_t* returned) {
  *returned = 0;
  std::unique_lock<std::mutex> lock(mu_);
  TB_REQUIRE(tag >= 0 && tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  if (!vmm_ || !tag_pools_[tag] || tag == 0 || !tag_live(tag)) return true;  // nothing of its own to trim
  TB_REQUIRE(open_captures() == 0, kState, "trim of tag '" + tag_name(tag) + "' while a CUDA graph capture is open",
             false);
  BlockPool& pool = *tag_pools_[tag];
  std::vector<CUstream> dirty;
  for (bool small : {false, true})
    for (const Block* b : pool.free_set(small))
      if (!clock_.clean(b->stream, b->freed_at) && std::find(dirty.begin(), dirty.end(), b->stream) == dirty.end())
        dirty.push_back(b->stream);
  if (!dirty.empty()) sync_streams(lock, dirty);
  if (!tag_pools_[tag]) return true;
  const int64_t before = budget_.reserved();
  vmm_->release_clean(*tag_pools_[tag]);
  vmm_->release_free_handles();
  *returned = before - budget_.reserved();
  return true;
}

}  // namespace tb
